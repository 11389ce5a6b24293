"""Service configuration (TOML), validated with pydantic.

```toml
ledger = "privalign-ledger.db"          # SQLite path (relative: to this file's folder), or a postgresql:// URL
admin_keys = ["change-me-admin"]           # without a config file, random keys are generated and printed
max_n = 64
max_prompt_chars = 4000
max_messages = 64
max_inflight_per_tenant = 16             # one tenant's requests in flight; more get 429 + Retry-After
# max_tokens_cap = 8                     # largest max_tokens a request may ask for (default: generator.max_new_tokens)

[clients.change-me-client]              # API key -> tenant
tenant = "default"

[generator]
backend = "transformers"                # transformers | llamacpp | vllm | openai | stub
model = "smollm2"
max_new_tokens = 8
temperature = 1.0
batch_max = 64                          # embedded (transformers, llamacpp): concurrent requests' samples
batch_wait_ms = 5                       #   merged into one batch of up to batch_max, waiting <= batch_wait_ms
# dtype = "auto"                        # transformers: auto (checkpoint's on a GPU, float32 on CPU) | bfloat16 | float16 | float32
# device = "cuda"                       # transformers: default CUDA when present, else cpu
# max_concurrency = 64                  # backend calls at once (default: openai/stub 64, embedded batch_max)
# max_queue = 128                       # admitted requests waiting beyond those; then 503 + Retry-After
# base_url = "http://127.0.0.1:8001"    # openai: the server, and optionally
# api_key_env = "OPENAI_API_KEY"        #   (or api_key = "..."), chat = true, timeout = 600,
# max_retries = 3, max_n_per_request = 8, extra_body = {top_p = 1.0}

[reward]
kind = "minilm-bt"                      # minilm-bt | policy-bt | hf | vllm | http | stub
path = "arithmetic-minilm-bt.json"
output_range = [-3.72, 3.72]            # declared before seeing data; scores are clipped to it
sensitivity = 0.4                       # Delta_r in score units (default: the range's width)
# dtype = "bfloat16"                    # policy-bt (its policy) and hf: what the reward's model computes in
# trust_remote_code = true              # hf: run the checkpoint's own code (ArmoRM); off by default
# batch_size = 64                       # hf: rows per forward pass; vllm (path = the server's URL): texts per call

[mechanism]
name = "privbon"                        # privbon | privitp (default privbon: pure epsilon 1 per query)
privbon_noise = "gumbel"                # gumbel | exact (OpenDP's exact sampler, the secure extra)
n = 16
epsilon = 1.0                           # privbon: pure epsilon (or give noise_scale)
beta = 0.05                             # privitp, in score units
sigma_x = 1.0
sigma_z = 1.0
delta = 1e-8                            # privitp, per query: far below 1 / (people in the data)
phase2_chunks = 2                       # privitp: backend calls for Phase 2 (the first joins Phase 1's)
max_rounds = 16                         # privitp: Phase 2 examines at most T = min(max_rounds, n) candidates
# max_rounds_max = 64                   # privitp: the largest T a request may ask (default: max_rounds)

[[budgets]]
name = "default"
tenant = "default"
epsilon_total = 10.0                    # e.g. 10 PrivBoN answers at epsilon 1 (docs/deploy.md)
delta_total = 1e-6                      # below 1 / (people in the data); 100 PrivITP queries at 1e-8
composition = "fsrc"
```
"""

from __future__ import annotations

import os
import secrets
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class _Section(BaseModel):
    """A config section: unknown keys are errors (a typo must not silently leave a default in force)."""

    model_config = ConfigDict(extra="forbid")


class GeneratorConfig(_Section):
    backend: Literal["transformers", "llamacpp", "vllm", "openai", "stub"] = "transformers"
    model: str = "smollm2"
    base_url: str | None = None
    max_new_tokens: int = Field(8, ge=1, le=4096)
    temperature: float = Field(1.0, gt=0)
    # embedded backends (transformers, llamacpp): concurrent requests are merged into one batched
    # call of up to batch_max sequences, collected for at most batch_wait_ms (backends/batching.py)
    batch_max: int = Field(64, ge=1)
    batch_wait_ms: float = Field(5.0, ge=0)
    # transformers backend: the dtype the model computes in (auto: the checkpoint's on a GPU,
    # float32 on the CPU) and its device (default: CUDA when present)
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    device: str | None = None
    batch_size: int | None = Field(None, ge=1)  # rows decoded at once (default: the device's; devices.auto_batch_size)
    # backend calls in flight at once (default: what the backend declares; openai and stub 64, the
    # embedded ones batch_max, vllm 1) and requests admitted beyond them to wait; past both, 503 + Retry-After
    max_concurrency: int | None = Field(None, ge=1)
    max_queue: int = Field(128, ge=0)
    # openai backend only
    api_key: str | None = None
    api_key_env: str | None = None              # or the name of the environment variable holding it
    chat: bool = True                           # /v1/chat/completions (else /v1/completions)
    timeout: float = Field(600.0, gt=0)         # seconds per call
    max_retries: int = Field(3, ge=0)           # on 429, 5xx and connection errors, with back-off
    max_n_per_request: int | None = Field(None, ge=1)  # the server's cap on n: larger k is split
    extra_body: dict = Field(default_factory=dict)     # merged into every request body

    @model_validator(mode="after")
    def _openai_only(self):
        if self.api_key is not None and self.api_key_env is not None:
            raise ValueError("give generator.api_key or generator.api_key_env, not both")
        return self

    @model_validator(mode="after")
    def _torch_only(self):
        if (self.dtype, self.device, self.batch_size) != (None, None, None) and self.backend != "transformers":
            raise ValueError(f"dtype, device and batch_size apply to the transformers backend, not {self.backend!r}")
        return self


class RewardConfig(_Section):
    kind: Literal["minilm-bt", "policy-bt", "hf", "vllm", "http", "stub"] = "minilm-bt"
    path: str | None = None
    output_range: tuple[float, float] | None = None
    sensitivity: float | None = Field(None, gt=0)
    # policy-bt (its policy) and hf: the dtype the reward's model computes in
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = None
    # hf: let the checkpoint's own modelling code run (ArmoRM and other custom reward models)
    trust_remote_code: bool = False
    # hf: rows per forward pass (default: from the device); vllm: texts per classify call
    batch_size: int | None = Field(None, gt=0)
    # merge concurrent requests' scoring into one call (default: every kind but the stub)
    batch: bool | None = None
    # stub only, for fault drills and tests: scoring raises ValueError on a prompt containing this text
    fail_marker: str | None = None
    # policy-bt: serve a legacy pair-unit head (its certificate counts each pair as a person): the
    # guarantee is then per pair, not per person, and the banner and /v1/budgets say so
    allow_pair_unit: bool = False

    @field_validator("output_range")
    @classmethod
    def _range(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"output_range must satisfy lo < hi, got {v}")
        return v

    @model_validator(mode="after")
    def _dtype_applies(self):
        if self.dtype is not None and self.kind not in ("policy-bt", "hf"):
            raise ValueError(f"dtype applies to the policy-bt and hf reward kinds, not {self.kind!r}")
        if self.trust_remote_code and self.kind != "hf":
            raise ValueError(f"trust_remote_code applies to the hf reward kind, not {self.kind!r}")
        if self.batch_size is not None and self.kind not in ("hf", "vllm"):
            raise ValueError(f"batch_size applies to the hf and vllm reward kinds, not {self.kind!r}")
        return self


class MechanismConfig(_Section):
    # released-bon: (soft) BoN on a head released once under DP (``rm release``): 0 per query
    name: Literal["privbon", "privitp", "released-bon"] = "privbon"
    # released-bon's soft-BoN temperature (0: BoN), and privbon's noise floor: sigma = max(2 Delta_r /
    # epsilon, temperature), in score units, charged the epsilon it spends, 2 Delta_r / sigma (the same
    # thing: Gumbel-max at scale sigma is soft BoN at temperature sigma). Choose it without reading D.
    temperature: float = Field(0.0, ge=0)
    # the largest privalign.temperature a request may ask (default: any)
    temperature_max: float | None = Field(None, ge=0)
    # privbon's sampler: "gumbel" (softmax law, fast) or "exact" (OpenDP's exact report-noisy-max,
    # permute-and-flip law, no floating-point noise; the same epsilon = 2 Delta_r / sigma)
    privbon_noise: Literal["gumbel", "exact"] = "gumbel"
    n: int = Field(16, ge=1)
    epsilon: float | None = Field(1.0, gt=0)
    noise_scale: float | None = Field(None, gt=0)
    beta: float = Field(0.05, gt=0)
    sigma_x: float = Field(1.0, gt=0)
    sigma_z: float = Field(1.0, gt=0)
    delta: float = Field(1e-8, gt=0, lt=1)
    # privitp: Phase 2's n candidates are generated in at most this many backend calls (the first
    # rides with Phase 1's call); 1 = all at once, n = one at a time (docs/deploy.md)
    phase2_chunks: int = Field(2, ge=1)
    # privitp: Phase 2 examines at most T = min(max_rounds, n) candidates, so the worst case per query
    # does not grow with n (docs/accounting.md, "Capping Phase 2"); 16 from the large-n evidence
    # (docs/experiments.md). A request may ask for its own T up to max_rounds_max (default max_rounds).
    max_rounds: int = Field(16, ge=1)
    max_rounds_max: int | None = Field(None, ge=1)
    # the most one request may cost (its worst-case epsilon, and delta), whatever its privalign options:
    # a request above it is a 400 and charges nothing. Default: what a request with this section's
    # options may cost (at any n up to max_n, either mechanism), so only less noise is refused
    epsilon_max: float | None = Field(None, gt=0)
    delta_max: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _rounds_bound(self):
        if self.max_rounds_max is not None and self.max_rounds_max < self.max_rounds:
            raise ValueError(f"max_rounds_max must be >= max_rounds={self.max_rounds}, got {self.max_rounds_max!r}")
        if self.temperature_max is not None and self.temperature > self.temperature_max:
            raise ValueError(f"temperature must be <= temperature_max={self.temperature_max}, got {self.temperature!r}")
        return self


class BudgetConfig(_Section):
    name: str
    tenant: str = "default"
    epsilon_total: float = Field(gt=0)
    delta_total: float = Field(1e-6, ge=0, lt=1)
    # fsrc | basic | zcdp (rho against the rho_total that (epsilon_total, delta_total) allows; docs/accounting.md)
    composition: Literal["fsrc", "basic", "zcdp"] = "fsrc"
    # this budget's own per-request ceiling, below [mechanism] epsilon_max / delta_max (the lower one holds)
    epsilon_max: float | None = Field(None, gt=0)
    delta_max: float | None = Field(None, gt=0, lt=1)

    @model_validator(mode="after")
    def _zcdp_needs_a_delta(self):
        if self.composition == "zcdp" and self.delta_total <= 0:
            raise ValueError(f"budget {self.name!r}: delta_total must be > 0 for zcdp (rho-zCDP has no (epsilon, 0) "
                             f"conversion), got {self.delta_total!r}")
        return self


class ModelBudgetConfig(_Section):
    """The deployment-wide budget on the reward model's preference data D: every query, whatever its
    tenant, is charged here too, so a person in D gets this guarantee from the whole service."""

    name: str = "model"
    epsilon_total: float = Field(gt=0)
    delta_total: float = Field(1e-6, ge=0, lt=1)
    composition: Literal["fsrc", "basic", "zcdp"] = "fsrc"

    @model_validator(mode="after")
    def _zcdp_needs_a_delta(self):
        if self.composition == "zcdp" and self.delta_total <= 0:
            raise ValueError(f"model_budget: delta_total must be > 0 for zcdp, got {self.delta_total!r}")
        return self


class ClientConfig(_Section):
    tenant: str


class ServiceConfig(_Section):
    ledger: str = "privalign-ledger.db"
    access_log: bool = True                    # one line per request on stderr (logger privalign.access)
    # score one dummy pair at start, so every model is loaded before the port opens (/healthz then means ready)
    warm_up: bool = True
    # the model name requests must use (default: generator.model, "stub" for the stub backend) and aliases
    model_name: str | None = None
    model_aliases: list[str] = Field(default_factory=list)
    ledger_synchronous: Literal["FULL", "NORMAL"] = "FULL"
    ledger_lease_s: float = Field(30.0, gt=0)  # a process silent this long is dead; its reservations are recovered
    # no well-known default keys: a config without keys gets fresh random ones (``privalign serve`` prints them)
    admin_keys: list[str] = Field(default_factory=lambda: ["admin-" + secrets.token_urlsafe(18)])
    clients: dict[str, ClientConfig] = Field(
        default_factory=lambda: {"client-" + secrets.token_urlsafe(18): ClientConfig(tenant="default")})
    max_n: int = Field(64, ge=1)
    max_prompt_chars: int = Field(4000, ge=1)
    max_messages: int = Field(64, ge=1)
    max_tokens_cap: int | None = Field(None, ge=1)  # default: generator.max_new_tokens
    # requests of one tenant in flight at once; more are refused (429, Retry-After, nothing charged), so
    # one client cannot occupy every worker thread. With max_n and max_tokens_cap this bounds its work.
    max_inflight_per_tenant: int = Field(16, ge=1)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    mechanism: MechanismConfig = Field(default_factory=MechanismConfig)
    budgets: list[BudgetConfig] = Field(default_factory=lambda: [BudgetConfig(name="default", epsilon_total=10.0)])
    model_budget: ModelBudgetConfig | None = None

    @model_validator(mode="after")
    def _model_budget_name(self):
        if self.model_budget is not None and self.model_budget.name in {b.name for b in self.budgets}:
            raise ValueError(f"model_budget.name {self.model_budget.name!r} is also a tenant budget's name")
        return self

    @property
    def served_model_name(self) -> str:
        if self.model_name:
            return self.model_name
        return "stub" if self.generator.backend == "stub" else self.generator.model

    @property
    def token_cap(self) -> int:
        return self.max_tokens_cap or self.generator.max_new_tokens

    @model_validator(mode="after")
    def _keys(self):
        overlap = set(self.admin_keys) & set(self.clients)
        if overlap:
            raise ValueError("admin and client API keys must be distinct")
        return self


def _section_at(loc) -> type[BaseModel] | None:
    """The config section (model class) that holds the key at ``loc`` (a pydantic error location)."""
    import typing

    def is_model(t):
        return isinstance(t, type) and issubclass(t, BaseModel)

    model: object = ServiceConfig
    for part in loc[:-1]:
        if is_model(model):
            field = model.model_fields.get(str(part))
            if field is None:
                return None
            model = field.annotation
        else:  # list[X] or dict[str, X]: this part is an index or a key
            args = [a for a in typing.get_args(model) if is_model(a)]
            model = args[0] if args else None
        if not is_model(model) and not typing.get_origin(model) in (list, dict):  # X | None
            args = [a for a in typing.get_args(model) if is_model(a)]
            model = args[0] if args else model
    return model if is_model(model) else None


def config_error_message(e: ValidationError) -> str:
    """A pydantic error as one line: "field: problem (got value)" per error; an unknown key is named
    with its section and the nearest known key."""
    import difflib

    parts = []
    for x in e.errors():
        where = ".".join(map(str, x["loc"])) or "config"
        if x["type"] == "extra_forbidden":
            section = _section_at(x["loc"])
            known = sorted(section.model_fields) if section else []
            near = difflib.get_close_matches(str(x["loc"][-1]), known, n=1)
            head = ".".join(map(str, x["loc"][:-1]))
            parts.append(f"unknown key {x['loc'][-1]!r}" + (f" in [{head}]" if head else "")
                         + (f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(known)}"))
        else:
            parts.append(f"{where}: {x['msg']} (got {x.get('input')!r})")
    return "; ".join(parts)


def resolve_model_path(path: str, config_dir: Path | None) -> str:
    """A reward model file named in a config: as given if absolute; else relative to the config
    file's folder, then the working directory, then privalign's shipped data (``counting-policy-bt.json``)."""
    from importlib import resources

    p = Path(path).expanduser()
    if p.is_absolute():
        tried = [p]
    else:
        tried = ([config_dir / p] if config_dir else []) + [Path.cwd() / p,
                                                             Path(str(resources.files("privalign") / "data")) / p]
        tried = list(dict.fromkeys(t.resolve() for t in tried))  # a config beside the working directory: once
    for candidate in tried:
        if candidate.is_file():
            return str(candidate)
    raise ValueError(f"reward.path: no file {path!r} (looked in {', '.join(str(t.parent) for t in tried)})")


def is_url(ledger: str) -> bool:
    return ledger.startswith(("postgresql://", "postgres://"))


def resolve_ledger_path(ledger: str, config_dir: Path | None) -> str:
    """A SQLite ledger path as an absolute path: relative paths are relative to the config file's
    folder (the working directory without a config file), like every path in a config. URLs are kept."""
    if is_url(ledger):
        return ledger
    p = Path(ledger).expanduser()
    return str(p if p.is_absolute() else (config_dir or Path.cwd()) / p)


def check_ledger_path(ledger: str) -> None:
    """A ValueError (one line, naming the path and why) when a SQLite ledger could not be opened:
    a folder, a folder that cannot be created, a file or folder this user cannot write. Creates nothing."""
    if is_url(ledger):
        return
    path = Path(ledger)
    if path.is_dir():
        raise ValueError(f"ledger: {path} is a folder; name a file in it, e.g. {path / 'privalign-ledger.db'}")
    folder = path.parent
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"ledger: cannot create the folder {folder} for {path} ({existing} is a file)")
    if existing != folder and not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"ledger: cannot create the folder {folder} for {path} ({existing} is not writable by "
                         "this user)")
    if existing == folder and (not os.access(folder, os.W_OK | os.X_OK)
                               or (path.exists() and not os.access(path, os.R_OK | os.W_OK))):
        raise ValueError(f"ledger: {path if path.exists() else folder} is not writable by this user")


def prepare_ledger(ledger: str) -> None:
    """Make sure a SQLite ledger can be opened: its folder is created if missing; a ValueError names
    the path and why not otherwise (one line, before the service opens anything)."""
    check_ledger_path(ledger)
    if is_url(ledger):
        return
    folder = Path(ledger).parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"ledger: cannot create the folder {folder} for {ledger} ({e.strerror or type(e).__name__})") \
            from None


def load_config(path: str | Path | None) -> ServiceConfig:
    """Read and check a TOML config. Every path in it is resolved relative to the config file's
    folder: the ledger (made absolute), and reward model files (``resolve_model_path``, which also
    looks in the working directory and privalign's shipped data). Nothing is created here."""
    if path is None:
        cfg = ServiceConfig()
        cfg.ledger = resolve_ledger_path(cfg.ledger, None)
        return cfg
    with open(path, "rb") as fh:
        cfg = ServiceConfig.model_validate(tomllib.load(fh))
    config_dir = Path(path).resolve().parent
    cfg.ledger = resolve_ledger_path(cfg.ledger, config_dir)
    if cfg.reward.kind in ("minilm-bt", "policy-bt") and cfg.reward.path:
        cfg.reward.path = resolve_model_path(cfg.reward.path, config_dir)
    return cfg
