"""Service configuration (TOML), validated with pydantic.

```toml
ledger = "privalign-ledger.db"          # SQLite path, or a postgresql:// URL for several replicas
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

[reward]
kind = "minilm-bt"                      # minilm-bt | hf | http | stub
path = "arithmetic-minilm-bt.json"
output_range = [-3.72, 3.72]            # declared before seeing data; scores are clipped to it
sensitivity = 0.4                       # Delta_r in score units (default: the range's width)

[mechanism]
name = "privitp"                        # privbon | privitp
privbon_noise = "gumbel"                # gumbel | exact (OpenDP's exact sampler, the secure extra)
n = 16
epsilon = 1.0                           # privbon: pure epsilon (or give noise_scale)
beta = 0.05                             # privitp, in score units
sigma_x = 1.0
sigma_z = 1.0
delta = 0.01

[[budgets]]
name = "default"
tenant = "default"
epsilon_total = 50.0
delta_total = 0.5
composition = "fsrc"
```
"""

from __future__ import annotations

import secrets
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator


class GeneratorConfig(BaseModel):
    backend: Literal["transformers", "llamacpp", "vllm", "openai", "stub"] = "transformers"
    model: str = "smollm2"
    base_url: str | None = None
    max_new_tokens: int = Field(8, ge=1, le=4096)
    temperature: float = Field(1.0, gt=0)


class RewardConfig(BaseModel):
    kind: Literal["minilm-bt", "hf", "http", "stub"] = "minilm-bt"
    path: str | None = None
    output_range: tuple[float, float] | None = None
    sensitivity: float | None = Field(None, gt=0)

    @field_validator("output_range")
    @classmethod
    def _range(cls, v):
        if v is not None and not v[0] < v[1]:
            raise ValueError(f"output_range must satisfy lo < hi, got {v}")
        return v


class MechanismConfig(BaseModel):
    name: Literal["privbon", "privitp"] = "privitp"
    # privbon's sampler: "gumbel" (softmax law, fast) or "exact" (OpenDP's exact report-noisy-max,
    # permute-and-flip law, no floating-point noise; the same epsilon = 2 Delta_r / sigma)
    privbon_noise: Literal["gumbel", "exact"] = "gumbel"
    n: int = Field(16, ge=1)
    epsilon: float | None = Field(1.0, gt=0)
    noise_scale: float | None = Field(None, gt=0)
    beta: float = Field(0.05, gt=0)
    sigma_x: float = Field(1.0, gt=0)
    sigma_z: float = Field(1.0, gt=0)
    delta: float = Field(1e-2, gt=0, lt=1)


class BudgetConfig(BaseModel):
    name: str
    tenant: str = "default"
    epsilon_total: float = Field(gt=0)
    delta_total: float = Field(0.5, ge=0, lt=1)
    composition: Literal["fsrc", "basic"] = "fsrc"


class ClientConfig(BaseModel):
    tenant: str


class ServiceConfig(BaseModel):
    ledger: str = "privalign-ledger.db"
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
    budgets: list[BudgetConfig] = Field(default_factory=lambda: [BudgetConfig(name="default", epsilon_total=50.0)])

    @property
    def token_cap(self) -> int:
        return self.max_tokens_cap or self.generator.max_new_tokens

    @model_validator(mode="after")
    def _keys(self):
        overlap = set(self.admin_keys) & set(self.clients)
        if overlap:
            raise ValueError("admin and client API keys must be distinct")
        return self


def load_config(path: str | Path | None) -> ServiceConfig:
    if path is None:
        return ServiceConfig()
    with open(path, "rb") as fh:
        return ServiceConfig.model_validate(tomllib.load(fh))
