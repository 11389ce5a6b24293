"""The private Best-of-N service: OpenAI-compatible endpoints over a durable privacy ledger.

POST /v1/chat/completions and /v1/completions answer with the selected response. privalign's
options ride in the request body under ``privalign`` (the stock ``openai`` client sends them with
``extra_body={"privalign": {...}}``):

    {"mechanism": "privbon" | "privitp", "n": 16, "epsilon": 1.0, "noise_scale": ..., "beta": 0.05,
     "sigma_x": ..., "sigma_z": ..., "max_rounds": 16, "budget": "default"}

Each request: validate (4xx, nothing charged) -> reserve the worst case in the ledger (429 when
the budget cannot cover it) -> generate and score candidates -> select -> settle the realised cost
(durable) -> respond. The response carries a ``privalign`` block: mechanism, n, candidates
generated, halting time, epsilon charged, budget remaining.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import threading
import time
import uuid

import numpy as np

from .. import accounting as A
from .. import mechanisms as M
from .._validation import check_max_rounds
from ..accounting._rounding import snap_up
from ..backends.base import BackendError
from ..ledger import BudgetExhausted, Ledger, UnknownBudget
from ..rewards import RewardModel, score_checked
from .config import ServiceConfig
from .deployment import configure
from .errors import ApiError
from .openai_params import cut_at_stop


class StubGenerator:
    """A fast fake language model for measuring the service itself (``backend = "stub"``)."""

    name = "stub"
    max_concurrency = 64  # thread-safe

    def generate(self, messages, k, *, max_new_tokens=8, temperature=1.0, seed=None):
        from ..backends.base import Generation

        raw = os.urandom(4 * k).hex()  # one system call for the whole batch
        words = sum(len(m["content"].split()) for m in messages)  # the stub's "tokens" are words
        # "length" when the cap is below the stub's 3 tokens, as a real model cut at max_new_tokens
        return [Generation(f"candidate {raw[8 * i:8 * i + 8]}", min(3, max_new_tokens), None, prompt_tokens=words,
                           finish_reason="length" if max_new_tokens < 3 else "stop") for i in range(k)]


class StubReward(RewardModel):
    """A deterministic score in [0, 1] from a hash of the text (``kind = "stub"``); with
    ``fail_marker`` it raises on a prompt that contains it (fault drills and tests)."""

    name = "stub"
    output_range = (0.0, 1.0)

    def __init__(self, fail_marker: str | None = None):
        self.fail_marker = fail_marker

    def score(self, prompts, responses):
        if self.fail_marker and any(self.fail_marker in p for p in prompts):
            raise ValueError(f"the stub reward model refuses prompts containing {self.fail_marker!r}")
        return np.array([int.from_bytes(hashlib.blake2b(r.encode(), digest_size=4).digest(), "big") / 2**32
                         for r in responses])


def build_generator(cfg: ServiceConfig):
    g = cfg.generator
    if g.backend == "stub":
        return StubGenerator()
    from ..backends import make_generator

    options = {}
    if g.backend == "openai":
        api_key = g.api_key
        if g.api_key_env is not None:
            api_key = os.environ.get(g.api_key_env)
            if not api_key:
                raise ValueError(f"generator.api_key_env: the environment variable {g.api_key_env} is not set")
        options = {"api_key": api_key, "chat": g.chat, "timeout": g.timeout, "max_retries": g.max_retries,
                   "max_n_per_request": g.max_n_per_request, "extra_body": g.extra_body,
                   "max_concurrency": g.max_concurrency or 64}
    if g.backend == "transformers":
        options = {k: v for k, v in (("dtype", g.dtype), ("device", g.device), ("batch_size", g.batch_size))
                   if v is not None}
    generator = make_generator(g.backend, g.model, g.base_url or "http://127.0.0.1:8001", **options)
    if g.backend in ("transformers", "llamacpp"):  # embedded: concurrent requests share batched decoding
        from ..backends.batching import BatchingGenerator

        generator = BatchingGenerator(generator, max_batch=g.batch_max, max_wait_ms=g.batch_wait_ms)
    return generator


def build_reward(cfg: ServiceConfig) -> RewardModel:
    """The configured reward model (``pipeline.load_reward``), with the config's declared output range
    and sensitivity applied on top; concurrent requests' scoring calls are merged into one call
    (``BatchingReward``, with the generator's ``batch_max`` and ``batch_wait_ms``)."""
    r = cfg.reward
    if r.kind == "stub":
        model = StubReward(r.fail_marker)
    else:
        from importlib import resources

        from ..pipeline import load_reward

        path = r.path
        if r.kind == "minilm-bt" and path is None:  # the embedded default model pair
            path = str(resources.files("privalign") / "data" / "arithmetic-minilm-bt.json")
        model = load_reward(f"{r.kind}:{path}", dtype=r.dtype, trust_remote_code=r.trust_remote_code,
                            batch_size=r.batch_size)
    if r.output_range is not None:
        model.output_range = tuple(r.output_range)
    if r.sensitivity is not None:
        model.sensitivity = r.sensitivity
    if r.batch if r.batch is not None else r.kind != "stub":
        from ..backends.batching import BatchingReward

        model = BatchingReward(model, max_batch=cfg.generator.batch_max, max_wait_ms=cfg.generator.batch_wait_ms)
    return model


def _fingerprint(model) -> str:
    """A served reward model's identity, for charging its one-time range release once."""
    w = getattr(model, "w", None)
    body = json.dumps({"name": getattr(model, "name", None), "range": list(model.output_range),
                       "w": None if w is None else np.asarray(w, float).round(12).tolist()})
    return hashlib.sha256(body.encode()).hexdigest()[:16]


ZCDP_NOTE = ("zcdp: epsilon_charged is this query's epsilon alone; the budget is charged its rho_charged, and "
             "budget_remaining.epsilon is epsilon_total less the (epsilon, delta_total) conversion of all the rho spent "
             "and reserved so far, which grows like the square root of that sum: early queries lower it by more than "
             "their own epsilon, later ones by less (docs/accounting.md)")


def shown(x: float) -> float:
    """A privacy amount for display: 12 significant digits, so 1 - 1e-16 reads 1.0. The ledger keeps
    (and admits and charges with) the exact values; only responses are rounded."""
    return float(f"{x:.12g}") if math.isfinite(x) else x


@functools.lru_cache(maxsize=1024)
def _privitp_event(n, beta, sigma_x, sigma_z, delta, sensitivity, r_max, max_rounds) -> A.PrivacyEvent:
    """PrivITP's event (worst case, delta, rho) with T = ``max_rounds`` Phase-2 rounds, cached: the
    worst case takes milliseconds to compute."""
    return A.privitp_event(n, beta, sigma_x, sigma_z, delta, sensitivity, r_max, max_rounds=max_rounds)


class LedgerCollector:
    """Prometheus gauges read from the ledger at each scrape, so /metrics says exactly what
    /v1/budgets says, whichever replica charged: per budget its epsilon and delta total, spent,
    reserved and remaining, and under zcdp its rho."""

    FIELDS = ("epsilon_total", "epsilon_spent", "epsilon_reserved", "epsilon_remaining", "delta_total",
              "delta_spent", "delta_remaining", "rho_total", "rho_spent", "rho_reserved", "rho_remaining")

    def __init__(self, ledger: Ledger):
        self.ledger = ledger

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        families = {f: GaugeMetricFamily(f"privalign_budget_{f}", f"the budget's {f.replace('_', ' ')} (ledger)",
                                         labels=["budget"]) for f in self.FIELDS}
        try:
            states = self.ledger.budgets()
        except Exception:  # the ledger is failing: no gauges this scrape (the request counters still answer)
            states = []
        for b in states:
            d = b.as_dict()
            for f, family in families.items():
                if d.get(f) is not None:
                    family.add_metric([b.name], float(d[f]))
        yield from families.values()


class Service:
    """Everything but HTTP: usable directly, and wrapped by ``create_app``."""

    def __init__(self, cfg: ServiceConfig, generator=None, reward: RewardModel | None = None):
        self.cfg = cfg
        self.ledger = Ledger(cfg.ledger, synchronous=cfg.ledger_synchronous, lease=cfg.ledger_lease_s)
        self.ledger.heartbeat()
        self.recovered = self.ledger.recover()  # reservations of dead processes (never refunded)
        self._stop = threading.Event()
        self._pending: set[int] = set()  # reservations whose worst-case settlement failed: retried
        self._pending_lock = threading.Lock()
        threading.Thread(target=self._keepalive, daemon=True).start()
        self.deployment = configure(self.ledger, cfg)  # the ledger's settings win over this config's
        self.generator = generator or build_generator(cfg)
        # the answer's per-token log-probabilities under the policy (OpenAI's logprobs), where the
        # backend computes them (transformers): the policy does not read D, so they are post-processing
        self.token_logprobs = getattr(getattr(self.generator, "generator", self.generator), "token_logprobs", None)
        self.reward = reward or build_reward(cfg)
        self.model_budget = self.deployment.model_budget
        self.release_charged = False
        self.released = bool(getattr(self.reward, "released", False))
        if self.released or cfg.mechanism.name == "released-bon":
            self.release_charged = self._charge_release()
        elif self.model_budget is not None:
            release = float(getattr(self.reward, "range_epsilon", 0.0) or 0.0)
            if release > 0:  # the one-time private range release, charged once per model
                try:
                    self.release_charged = self.ledger.charge_once(
                        self.model_budget, f"range-release:{_fingerprint(self.reward)}",
                        A.pure_event(release, "range-release"))
                except BudgetExhausted as e:
                    raise ValueError(f"the model budget {self.model_budget!r} cannot cover the reward model's one-time "
                                     f"range release (epsilon {release:g}): {e}") from None
        lo, hi = self.reward.output_range
        if self.released:  # BoN reads only the order of the scores: no range, no per-query sensitivity
            lo, hi = -math.inf, math.inf
        elif not (math.isfinite(lo) and math.isfinite(hi)):
            raise ValueError("the reward model needs a finite declared output_range in the config")
        self.range = (lo, hi)
        self.sensitivity = None if self.released else self.reward.sensitivity or (hi - lo)
        if cfg.warm_up:  # lazily loaded models (the embedder, policy-bt's base model) load now, before the port opens
            try:
                self.reward.score(["warm-up"], ["warm-up"])
            except Exception:  # a model that cannot score this dummy pair has still loaded; requests will tell
                pass
        # backend calls in flight at once: what the config says, else what the generator declares it
        # takes (thread-safe ones: openai, stub, the batching wrapper), else 1 (embedded models, vLLM's
        # offline engine: not thread-safe). Requests admitted: those plus max_queue waiting; more are
        # refused with 503 + Retry-After before anything is reserved.
        self.max_concurrency = int(cfg.generator.max_concurrency or getattr(self.generator, "max_concurrency", 1) or 1)
        self.max_queue = cfg.generator.max_queue
        self._backend_slots = threading.BoundedSemaphore(self.max_concurrency)
        self._admission = threading.BoundedSemaphore(self.max_concurrency + self.max_queue)
        self.backend_calls = 0  # generate() calls made (diagnostics, tests, benchmarks)
        self._count_lock = threading.Lock()
        self.ledger_timings: list[float] = []  # seconds in ledger transactions per answered query
        self._tenant_of: dict[str, tuple] = {}
        self._slots: dict[str | None, threading.BoundedSemaphore] = {}
        # the names a request's "model" may carry (the first is the served name): anything else is a 404
        self.model_names = (cfg.served_model_name, *cfg.model_aliases)
        self._init_metrics()

    def _charge_release(self) -> bool:
        """Record a released head's one-time cost (epsilon_w, delta_w; rho = Delta_r^2 / (2 sigma^2))
        in the model budget, once per release across restarts and replicas; refuse a second release
        of the same head into the same model budget, and a released head served any other way."""
        head, mb = self.reward, self.model_budget
        if not getattr(head, "released", False):
            raise ValueError(f"[mechanism] name = 'released-bon' needs a released head (privalign rm release), got "
                             f"the reward model {getattr(head, 'name', type(head).__name__)!r}")
        if self.cfg.mechanism.name != "released-bon":
            raise ValueError(f"a released head serves with [mechanism] name = 'released-bon' (its queries are "
                             f"post-processing), got {self.cfg.mechanism.name!r}: per-query noise is for the exact head")
        if mb is None:
            raise ValueError("a released head needs a [model_budget], where its one-time cost is recorded once")
        g = head.release
        prefix = f"release:{g['head_id']}:"
        others = {e["request_id"] for e in self.ledger.events(mb) if e["kind"] == "release"
                  and str(e["request_id"]).startswith(prefix) and e["request_id"] != prefix + head.release_id}
        if others:
            raise ValueError(f"head {g['head_id']} was already released into the model budget {mb!r} (release "
                             f"{sorted(others)[0].split(':')[2]}); releasing it again ({head.release_id}) would "
                             "spend epsilon_w twice: serve the first release's file")
        event = A.PrivacyEvent("gaussian-release", float(g["epsilon"]), float(g["delta"]),
                               rho=(float(g["sensitivity"]) / float(g["sigma"])) ** 2 / 2,
                               params=(("sensitivity", float(g["sensitivity"])), ("sigma", float(g["sigma"]))))
        try:
            return self.ledger.charge_once(mb, prefix + head.release_id, event)
        except BudgetExhausted as e:
            raise ValueError(f"the model budget {mb!r} cannot cover the head's one-time release (epsilon "
                             f"{g['epsilon']:g}, delta {g['delta']:g}): {e}") from None

    def guarantee(self) -> dict:
        """The guarantee a person in the reward model's preference data D gets from the whole
        deployment: the model budget's, or without one, the sum over every budget."""
        release = float(getattr(self.reward, "range_epsilon", 0.0) or 0.0)
        if self.released:
            g = self.reward.release
            b = self.ledger.budget(self.model_budget)
            return {"model_budget": b.name, "epsilon": b.total.epsilon, "delta": b.total.delta,
                    "composition": b.composition, "released_head": {
                        "epsilon": g["epsilon"], "delta": g["delta"], "release_id": self.reward.release_id,
                        "query_epsilon": 0.0},
                    "statement": f"the reward model was released once at ({g['epsilon']:g}, {g['delta']:g})-DP, "
                                 f"recorded once in the model budget {b.name!r}; every answer is post-processing of "
                                 "that release and costs 0, so a person in the preference data has "
                                 f"({g['epsilon']:g}, {g['delta']:g})-DP from these answers, however many"}
        if self.model_budget:
            b = self.ledger.budget(self.model_budget)
            return {"model_budget": b.name, "epsilon": b.total.epsilon, "delta": b.total.delta,
                    "composition": b.composition, "range_release_epsilon": release,
                    "statement": f"every answer to every tenant is charged to the model budget {b.name!r} (the "
                                 f"reward model's one-time range release, epsilon {release:g}, included): a person "
                                 f"in the preference data has ({b.total.epsilon:g}, {b.total.delta:g})-DP over "
                                 "the deployment's life"}
        budgets = [b for b in self.ledger.budgets()]
        eps = math.fsum(b.total.epsilon for b in budgets) + release
        delta = math.fsum(b.total.delta for b in budgets)
        return {"model_budget": None, "epsilon": eps, "delta": delta, "range_release_epsilon": release,
                "statement": f"no model budget: the {len(budgets)} budgets' totals add up, so a person in the "
                             f"preference data has only ({eps:g}, {delta:g})-DP (the sum over all tenants, the "
                             "range release included), and more with every budget created; configure "
                             "[model_budget] for one deployment-wide limit"}

    def _keepalive(self):
        """Heartbeat, recover the reservations of processes whose lease has expired, and settle (at
        their worst case) this process's reservations whose settlement failed while the database
        was failing, as soon as it works again."""
        beat = self.cfg.ledger_lease_s / 3
        last = time.monotonic()
        while not self._stop.wait(min(beat, 1.0)):
            self._settle_pending()
            if time.monotonic() - last < beat:
                continue
            last = time.monotonic()
            try:
                self.ledger.heartbeat()
                self.recovered += self.ledger.recover()
            except Exception:  # a transient database error must not kill the heartbeat
                pass

    def _settle_pending(self) -> None:
        with self._pending_lock:
            pending = sorted(self._pending)
        for rid in pending:
            try:
                self.ledger.settle_all(rid, None)
            except Exception as e:
                if "unique" not in str(e).lower() and "Integrity" not in type(e).__name__:
                    continue  # still failing: try again on the next tick
                # already settled (its first settlement did commit): nothing is owed
            with self._pending_lock:
                self._pending.discard(rid)

    def close(self):
        self._stop.set()

    def _init_metrics(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.m_queries = Counter("privalign_queries", "answered queries", ["budget", "mechanism"], registry=self.registry)
        self.m_refusals = Counter("privalign_refusals", "queries refused for lack of budget", ["budget"],
                                  registry=self.registry)
        # the sum of answered queries' epsilon_charged; what a budget has spent (under zcdp the conversion
        # of its rho, not this sum) is privalign_budget_epsilon_spent, read from the ledger at each scrape
        self.m_epsilon = Counter("privalign_epsilon_charged", "sum of answered queries' epsilon_charged (this "
                                 "process)", ["budget"], registry=self.registry)
        self.registry.register(LedgerCollector(self.ledger))
        self.m_candidates = Counter("privalign_candidates_generated", "candidates generated", registry=self.registry)
        self.m_latency = Histogram("privalign_request_seconds", "latency of answered queries", registry=self.registry,
                                   buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30))
        self._metric_children: dict = {}
        self.m_overloaded = Counter("privalign_overloaded", "requests refused (503) because the backend's "
                                    "queue was full", registry=self.registry)
        self.m_ledger = Histogram("privalign_ledger_seconds", "time in ledger transactions", registry=self.registry,
                                  buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1))
        self.m_ledger_faults = Counter("privalign_ledger_unavailable", "requests refused (503) because the "
                                       "ledger could not reserve", registry=self.registry)
        for part, label in ((self.generator, "generate"), (self.reward, "score")):
            batcher = getattr(part, "batcher", None)
            if batcher is not None:  # merged calls that failed and were rerun member by member (issue 22)
                Gauge(f"privalign_{label}_batch_retried", f"{label} calls rerun alone after their merged call "
                      "failed", registry=self.registry).set_function(lambda b=batcher: b.retried)
                Gauge(f"privalign_{label}_batches", f"batched {label} calls that succeeded",
                      registry=self.registry).set_function(lambda b=batcher: b.batches)

    def _children(self, budget: str, mechanism: str):
        """The labelled metric children of a (budget, mechanism), bound once."""
        key = (budget, mechanism)
        if key not in self._metric_children:
            self._metric_children[key] = (self.m_queries.labels(budget, mechanism), self.m_epsilon.labels(budget))
        return self._metric_children[key]

    # ------------------------------------------------------------------ auth
    def caller(self, key: str | None) -> tuple[str, str | None]:
        """('admin', None) or ('client', tenant); 401 otherwise."""
        if key in self.cfg.admin_keys:
            return "admin", None
        if key in self.cfg.clients:
            return "client", self.cfg.clients[key].tenant
        raise ApiError(401, "unauthorized", "missing or unknown API key (Authorization: Bearer KEY)")

    # ------------------------------------------------------------------ options
    def options(self, ext: dict | None, tenant: str | None) -> dict:
        d = self.cfg.mechanism
        ext = dict(ext or {})
        unknown = set(ext) - {"mechanism", "n", "epsilon", "noise_scale", "beta", "sigma_x", "sigma_z", "budget", "delta",
                              "max_rounds"}
        if unknown:
            raise ApiError(400, "invalid_request", f"unknown privalign option(s): {sorted(unknown)}")
        mech = ext.get("mechanism", d.name)
        allowed = ("released-bon",) if self.released else ("privbon", "privitp")
        if mech not in allowed:
            raise ApiError(400, "invalid_request", f"privalign.mechanism must be {' or '.join(map(repr, allowed))} "
                                                   f"with this reward model, got {mech!r}")
        n = ext.get("n", d.n)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= self.cfg.max_n:
            raise ApiError(400, "invalid_request", f"privalign.n must be an integer in [1, {self.cfg.max_n}], got {n!r}")
        o = {"mechanism": mech, "n": n}
        for key in ("epsilon", "noise_scale", "beta", "sigma_x", "sigma_z", "delta"):
            v = ext.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ApiError(400, "invalid_request", f"privalign.{key} must be a positive number, got {v!r}")
        if "delta" in ext and not ext["delta"] < 1:
            raise ApiError(400, "invalid_request", f"privalign.delta must lie in (0, 1), got {ext['delta']!r}")
        o.update(beta=ext.get("beta", d.beta), sigma_x=ext.get("sigma_x", d.sigma_x), sigma_z=ext.get("sigma_z", d.sigma_z),
                 delta=ext.get("delta", d.delta))
        if mech == "privitp":
            o["max_rounds"] = self._max_rounds(ext.get("max_rounds"), n)
        elif "max_rounds" in ext:
            raise ApiError(400, "invalid_request", f"privalign.max_rounds applies to privitp only, not {mech!r}")
        if mech == "privbon" and "epsilon" in ext and "noise_scale" in ext:
            raise ApiError(400, "invalid_request", "give privalign.epsilon or privalign.noise_scale, not both")
        if mech == "released-bon":
            for key in ("epsilon", "noise_scale", "beta", "sigma_x", "sigma_z", "delta"):
                if key in ext:
                    raise ApiError(400, "invalid_request", f"privalign.{key} has no meaning for released-bon: its "
                                                           "queries cost 0 (the head was released once)")
            o["temperature"] = d.temperature
            o["event"] = A.PrivacyEvent("released-bon", 0.0, 0.0, rho=0.0, params=(("temperature", d.temperature),))
            o["epsilon_max"], o["delta"] = 0.0, 0.0
        try:
            if mech == "released-bon":
                pass
            elif mech == "privbon":
                if "noise_scale" in ext:
                    o["noise_scale"] = ext["noise_scale"]
                else:
                    eps = ext.get("epsilon", d.epsilon)
                    o["noise_scale"] = d.noise_scale if eps is None else A.gumbel_noise_scale(eps, self.sensitivity)
                o["event"] = A.privbon_event(o["noise_scale"], self.sensitivity, noise=self.cfg.mechanism.privbon_noise)
                o["epsilon_max"], o["delta"] = o["event"].epsilon, 0.0
            else:
                # reserved on the same 2^-20 grid as the ex-post charge, so snapping never lifts a charge
                # above its reservation; a realised cost above it is still charged in full (the filter's rule)
                event = _privitp_event(n, o["beta"], o["sigma_x"], o["sigma_z"], o["delta"], self.sensitivity,
                                       self.range[1] - self.range[0], o["max_rounds"])
                eps_max = snap_up(event.epsilon) if math.isfinite(event.epsilon) else event.epsilon
                o["event"] = dataclasses.replace(event, epsilon=eps_max)
                o["epsilon_max"] = eps_max
        except ValueError as e:  # e.g. epsilon = 1e-320: the noise it needs overflows
            raise ApiError(400, "invalid_request", f"privalign options cannot be served: {e}") from None
        if not math.isfinite(o["epsilon_max"]):
            raise ApiError(400, "invalid_request", "this setting's worst-case epsilon is unbounded (the noise is too "
                                                   "small to account for); use more noise", epsilon_max="inf")
        budget = ext.get("budget")
        if budget is None:  # the tenant's default, as recorded in the ledger (deployment.py)
            budget = (self.deployment.tenant_budget.get(tenant) if tenant is not None else
                      next(iter(self.deployment.tenant_budget.values()), None))
            if budget is None:
                raise ApiError(403, "forbidden", "no budget is configured for this client's tenant")
        if budget == self.model_budget:
            raise ApiError(400, "invalid_request", f"{budget!r} is the model budget: every query is charged to it "
                                                   "beside its tenant's budget; name a tenant budget")
        owner = self._tenant_of.get(budget)
        if owner is None:  # a budget's tenant never changes once it exists: cache it
            try:
                owner = self._tenant_of[budget] = (self.ledger.budget(budget).tenant,)
            except UnknownBudget:
                raise ApiError(404, "not_found", f"unknown budget {budget!r}") from None
        if tenant is not None and owner[0] != tenant:  # the same answer as for a budget that does not exist
            raise ApiError(404, "not_found", f"unknown budget {budget!r}")
        o["budget"] = budget
        return o

    def _max_rounds(self, asked, n: int) -> int:
        """PrivITP's T for a request: the operator's max_rounds capped at n, or the request's own
        1 <= T <= min(n, max_rounds_max)."""
        d = self.cfg.mechanism
        if asked is None:
            return min(d.max_rounds, n)
        bound = d.max_rounds if d.max_rounds_max is None else d.max_rounds_max
        try:
            check_max_rounds(asked, n)  # the mechanism's own rule: an integer in [1, n]
        except ValueError as e:
            raise ApiError(400, "invalid_request", f"privalign.{e}") from None
        if asked > bound:
            raise ApiError(400, "invalid_request", f"privalign.max_rounds must not exceed this service's "
                                                   f"max_rounds_max={bound}, got {asked!r}")
        return asked

    # ------------------------------------------------------------------ one query
    def answer(self, messages: list[dict], ext: dict | None, tenant: str | None, max_tokens: int | None = None,
               temperature: float | None = None, stop: tuple[str, ...] = (), logprobs: int | None = None) -> dict:
        """One query: validate, reserve, generate (every candidate cut at ``stop``), score, select, settle.
        ``logprobs`` (None: not asked) returns the answer's per-token log-probabilities under the policy
        with that many alternatives each (``token_logprobs``); asking a backend without them is a 400."""
        t0 = time.perf_counter()
        messages = self.check_messages(messages)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ApiError(400, "invalid_request", f"max_tokens must be a positive integer, got {max_tokens!r}")
        if max_tokens is not None and max_tokens > self.cfg.token_cap:
            raise ApiError(400, "invalid_request", f"max_tokens={max_tokens} is over this service's cap of "
                                                   f"{self.cfg.token_cap} (max_tokens_cap in the config)")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 0 < temperature <= 2):
            raise ApiError(400, "invalid_request", f"temperature must lie in (0, 2] (the candidates are samples of "
                                                   f"the policy), got {temperature!r}")
        if logprobs is not None and self.token_logprobs is None:
            raise ApiError(400, "invalid_request", f"logprobs: the {self.cfg.generator.backend} backend does not return "
                                                   "per-token log-probabilities; leave logprobs out", param="logprobs")
        o = self.options(ext, tenant)
        o["stop"], o["tenant"], o["logprobs"] = tuple(stop), tenant, logprobs
        slot = self._slots.setdefault(tenant, threading.BoundedSemaphore(self.cfg.max_inflight_per_tenant))
        if not slot.acquire(blocking=False):
            raise ApiError(429, "too_many_requests", f"this tenant already has {self.cfg.max_inflight_per_tenant} "
                                                     "requests in flight; retry shortly (nothing was charged)",
                           retry_after=1)
        try:
            if not self._admission.acquire(blocking=False):  # back-pressure, before anything is reserved
                self.m_overloaded.inc()
                raise ApiError(503, "overloaded", f"the service has {self.max_concurrency} backend calls in flight "
                                                  f"and {self.max_queue} requests waiting; retry shortly (nothing "
                                                  "was charged)", retry_after=1)
            try:
                return self._answer(messages, o, max_tokens, temperature, t0)
            finally:
                self._admission.release()
        finally:
            slot.release()

    def _answer(self, messages, o, max_tokens, temperature, t0) -> dict:
        request_id = uuid.uuid4().hex
        t_l = time.perf_counter()
        try:
            names = [o["budget"]] + ([self.model_budget] if self.model_budget else [])
            rid = self.ledger.reserve_all(names, request_id=request_id, event=o["event"])  # all or none
        except BudgetExhausted as e:
            self.m_refusals.labels(o["budget"]).inc()
            if e.name == self.model_budget and o["tenant"] is not None:  # only admins see the model budget
                raise ApiError(429, "budget_exhausted", "the deployment's limit on the reward model's data cannot "
                                                        "cover this query (nothing was charged); ask the operator",
                               budget=o["budget"], epsilon_max=o["epsilon_max"]) from None
            extra = {} if e.rho is None else {"rho": e.rho, "rho_remaining": e.remaining_rho}
            raise ApiError(429, "budget_exhausted", str(e), budget=e.name, epsilon_max=o["epsilon_max"],
                           epsilon_remaining=e.remaining.epsilon, **extra) from None
        except ValueError as e:  # e.g. a query with no zCDP bound on a zcdp budget: nothing was reserved
            raise ApiError(400, "invalid_request", str(e)) from None
        except Exception as e:  # the database failed (full disk, I/O error, connection lost): nothing reserved
            self.m_ledger_faults.inc()
            raise ApiError(503, "ledger_unavailable", f"the privacy ledger cannot record charges now "
                                                      f"({type(e).__name__}); nothing was charged, retry shortly",
                           retry_after=1) from None
        ledger_s = time.perf_counter() - t_l
        try:
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            chosen, sel, generated = self._select(messages, o, max_tokens, temperature, usage)
            token_lp = None if o["logprobs"] is None else self.token_logprobs(
                messages, chosen.text, top=o["logprobs"], temperature=temperature or self.cfg.generator.temperature)
        except BaseException as e:
            # generation or scoring failed after the reservation: charge the worst case (never refund)
            self._settle_worst_case(rid)
            if isinstance(e, (ValueError, BackendError)):
                raise ApiError(502, "backend_error", f"the reward model or generator failed: {e}") from None
            if isinstance(e, Exception):
                raise ApiError(500, "internal_error", f"the query failed after its worst case was reserved "
                                                      f"(charged): {type(e).__name__}") from None
            raise
        t_l = time.perf_counter()
        try:
            # the ex-post cost is snapped up to a 2^-20 grid before it is recorded or released, so the
            # response and the budget's remaining epsilon carry no low bits of PrivITP's noisy threshold
            cost = snap_up(sel.epsilon) if o["mechanism"] == "privitp" else sel.epsilon
            charged, state = self.ledger.settle_all(rid, cost)[0]  # durable before the response leaves
        except Exception as e:
            self._settle_worst_case(rid)  # the answer is withheld, but its candidates were scored
            raise ApiError(500, "ledger_error", f"the charge could not be recorded ({type(e).__name__}); the "
                                                f"answer is withheld and the worst case charged") from None
        ledger_s += time.perf_counter() - t_l
        self.m_ledger.observe(ledger_s)
        if len(self.ledger_timings) < 1_000_000:
            self.ledger_timings.append(ledger_s)
        queries, epsilon = self._children(o["budget"], o["mechanism"])
        queries.inc()
        epsilon.inc(charged)
        self.m_candidates.inc(generated)
        self.m_latency.observe(time.perf_counter() - t0)
        # usage: the prompt once, and every candidate generated for this answer (what the backend produced)
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return {"text": chosen.text, "finish_reason": chosen.finish_reason or "stop", "usage": usage,
                "logprobs": token_lp, "privalign": {
            "request_id": request_id, "mechanism": o["mechanism"], "n": o["n"],
            **({"max_rounds": o["max_rounds"]} if "max_rounds" in o else {}), "candidates_generated": generated,
            "halting_time": sel.halting_time, "fallback": sel.fallback, "epsilon_charged": shown(charged),
            "delta_charged": shown(0.0 if state.zcdp else o["delta"]), "epsilon_max": shown(o["epsilon_max"]),
            "rho": None if o["event"].rho is None else shown(o["event"].rho),
            **({"rho_charged": shown(A.charge_rho(o["event"].rho, cost, o["epsilon_max"])), "accounting": ZCDP_NOTE}
               if state.zcdp else {}),
            "composition": state.composition, "budget": o["budget"],
            "budget_remaining": {"epsilon": shown(state.remaining.epsilon), "delta": shown(state.remaining.delta),
                                 **({"rho": shown(state.remaining_rho)} if state.zcdp else {})}}}

    def _settle_worst_case(self, rid: list[int]) -> None:
        """Charge a reservation's worst case; if even that fails (the database is failing), the
        reservation stays open (held, so the budget cannot be overspent), and the keep-alive thread
        settles it as soon as the database works again (or, should this process die first, another
        process recovers it at its worst case once the lease lapses)."""
        try:
            self.ledger.settle_all(rid, None)
        except Exception:
            with self._pending_lock:
                self._pending.add(tuple(rid))

    def check_messages(self, messages) -> list[dict]:
        """OpenAI chat messages, content a string or a list of text parts, within the caps."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "invalid_request", "messages must be a non-empty list of {role, content}")
        if len(messages) > self.cfg.max_messages:
            raise ApiError(400, "invalid_request", f"{len(messages)} messages, over the cap of {self.cfg.max_messages}")
        out = []
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m.get("role"):
                raise ApiError(400, "invalid_request", "messages must be a non-empty list of {role, content}")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise ApiError(400, "invalid_request", "only text content parts ({type: text, text}) are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise ApiError(400, "invalid_request", "message content must be a string or a list of text parts")
            out.append({"role": m["role"], "content": content})
        if not out[-1]["content"].strip():  # nothing to answer: refused before anything is reserved
            raise ApiError(400, "invalid_request", "the last message's content is empty or blank")
        chars = sum(len(m["content"]) for m in out)
        if chars > self.cfg.max_prompt_chars:
            raise ApiError(400, "invalid_request", f"prompt has {chars} characters, over the cap of "
                                                   f"{self.cfg.max_prompt_chars}")
        return out

    def _generate(self, messages, k, max_tokens, temperature=None, usage: dict | None = None, stop=()):
        """One backend call; at most ``max_concurrency`` of them run at once (the others wait here).
        ``usage`` (prompt_tokens, completion_tokens) is updated with what the backend reports. Every
        candidate is cut at the first of the ``stop`` strings (finish_reason "stop") before anything
        scores it."""
        with self._backend_slots:
            with self._count_lock:
                self.backend_calls += 1
            out = self.generator.generate(messages, k, max_new_tokens=max_tokens or self.cfg.generator.max_new_tokens,
                                          temperature=temperature or self.cfg.generator.temperature)
        if stop:
            out = [g if not cut else dataclasses.replace(g, text=text, finish_reason="stop")
                   for g, (text, cut) in ((g, cut_at_stop(g.text, stop)) for g in out)]
        if usage is not None:
            usage["completion_tokens"] += sum(max(g.n_tokens, 0) for g in out)
            if not usage["prompt_tokens"] and out and out[0].prompt_tokens:
                usage["prompt_tokens"] = out[0].prompt_tokens
        return out

    def _scores(self, messages, texts):
        prompt = messages[-1]["content"]
        return score_checked(self.reward, [prompt] * len(texts), texts).scores

    def _select(self, messages, o, max_tokens, temperature=None, usage: dict | None = None):
        """Generate, score and select. Returns (the selected Generation, selection, candidates generated).

        PrivITP's Phase 2 (at most T = ``max_rounds`` rounds) is generated in chunks: at most
        ``phase2_chunks`` backend calls of c = ceil(T / phase2_chunks) candidates, each chunk scored in
        one reward call. The first chunk rides with Phase 1's call (n + c samples of the same prompt);
        the last carries one extra sample, kept unscored for the fallback's fresh base-policy draw. So a
        query makes at most ``phase2_chunks`` backend calls and generates at most n + t + c (+ 1)
        candidates.

        Why this is sound (the privacy analysis is unchanged): every candidate is an independent draw
        of the base policy, which does not depend on the private data, whichever call produced it.
        ``privitp`` reads Phase 2's rewards strictly in order through ``next_reward`` and stops at the
        first acceptance; a chunk member after the accepted one has its reward computed but never
        read, and its text is never returned, so the selected text, the halting time and the charge
        have exactly the law of the one-at-a-time mechanism. The fallback text is a sample whose reward
        is never computed, drawn independently of all examined candidates, as the mechanism requires.
        ``candidates_generated`` reports every sample generated, a function of the halting time alone
        (which the response reports anyway).
        """
        n = o["n"]
        if o["mechanism"] == "released-bon":  # post-processing of the released head: no noise, no charge
            first = self._generate(messages, n, max_tokens, temperature, usage, o["stop"])
            sel = M.soft_bon(self._scores(messages, [g.text for g in first]), temperature=o["temperature"])
            return first[sel.index], dataclasses.replace(sel, mechanism="released-bon", epsilon=0.0), n
        if o["mechanism"] == "privbon":
            first = self._generate(messages, n, max_tokens, temperature, usage, o["stop"])
            r1 = self._scores(messages, [g.text for g in first])
            sel = M.privbon(r1, noise_scale=o["noise_scale"], sensitivity=self.sensitivity, reward_range=self.range,
                            noise=self.cfg.mechanism.privbon_noise)
            return first[sel.index], sel, n
        T = o["max_rounds"]
        c = -(-T // min(self.cfg.mechanism.phase2_chunks, T))  # Phase 2's chunk size, ceil(T / chunks)
        phase2: list = []            # Phase-2 candidates (Generations), in the order the mechanism examines them
        rewards: list[float] = []    # their rewards
        generated, fallback, examined = 0, None, 0

        def draw(k1: int, k2: int):
            """One backend call: k1 Phase-1 and k2 Phase-2 candidates (plus the fallback's draw when this
            chunk completes Phase 2), scored in one reward call; returns the Phase-1 scores."""
            nonlocal generated, fallback
            last = len(phase2) + k2 == T
            gens = self._generate(messages, k1 + k2 + last, max_tokens, temperature, usage, o["stop"])
            generated += len(gens)
            if last:
                fallback = gens[k1 + k2]  # never scored
            scores = self._scores(messages, [g.text for g in gens[:k1 + k2]])
            phase2.extend(gens[k1:k1 + k2])
            rewards.extend(float(r) for r in scores[k1:])
            return scores[:k1]

        r1 = draw(n, min(c, T))

        def next_reward():  # strictly in order; the next chunk only once every earlier one is examined
            nonlocal examined
            if examined == len(rewards):
                draw(0, min(c, T - len(phase2)))
            examined += 1
            return rewards[examined - 1]

        sel = M.privitp(r1, next_reward, beta=o["beta"], sigma_x=o["sigma_x"], sigma_z=o["sigma_z"], delta=o["delta"],
                        sensitivity=self.sensitivity, reward_range=self.range, max_rounds=T)
        if sel.fallback:  # every candidate was examined, so the last chunk, with the fallback's draw, was made
            return fallback, sel, generated
        return phase2[sel.index], sel, generated
