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

import hashlib
import math
import os
import threading
import time
import uuid

import numpy as np

from .. import accounting as A
from ..accounting._rounding import snap_up
from ..backends.base import BackendError
from ..ledger import BudgetExhausted, Ledger
from ..rewards import RewardModel
from .config import ServiceConfig, prepare_ledger
from .deployment import configure
from .charges import charge_range_release, charge_release, check_unit, guarantee, reward_unit
from .errors import ApiError
from .metrics import ServiceMetrics
from .settlement import Settlement
from .startup import preflight
from .requests import RequestRules
from .selection import Selector


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


ZCDP_NOTE = ("zcdp: epsilon_charged is this query's epsilon alone; the budget is charged its rho_charged, and "
             "budget_remaining.epsilon is epsilon_total less the (epsilon, delta_total) conversion of all the rho spent "
             "and reserved so far, which grows like the square root of that sum: early queries lower it by more than "
             "their own epsilon, later ones by less (docs/accounting.md)")


def shown(x: float) -> float:
    """A privacy amount for display: 12 significant digits, so 1 - 1e-16 reads 1.0. The ledger keeps
    (and admits and charges with) the exact values; only responses are rounded."""
    return float(f"{x:.12g}") if math.isfinite(x) else x


def response_body(request_id, o, chosen, sel, generated, usage, token_lp, charged, cost, state) -> dict:
    """The answer and its ``privalign`` block: what was charged, and what the budget has left."""
    # usage: the prompt once, and every candidate generated for this answer (what the backend produced)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"text": chosen.text, "finish_reason": chosen.finish_reason or "stop", "usage": usage,
            "logprobs": token_lp, "privalign": {
        "request_id": request_id, "mechanism": o["mechanism"], "n": o["n"],
        **({"max_rounds": o["max_rounds"]} if "max_rounds" in o else {}),
        **({"noise_scale": o["noise_scale"], "temperature": o["temperature"]} if o["mechanism"] == "privbon" else {}),
        "candidates_generated": generated,
        "halting_time": sel.halting_time, "fallback": sel.fallback, "epsilon_charged": shown(charged),
        "delta_charged": shown(0.0 if state.zcdp else o["delta"]), "epsilon_max": shown(o["epsilon_max"]),
        "rho": None if o["event"].rho is None else shown(o["event"].rho),
        **({"rho_charged": shown(A.charge_rho(o["event"].rho, cost, o["epsilon_max"])), "accounting": ZCDP_NOTE}
           if state.zcdp else {}),
        "composition": state.composition, "budget": o["budget"],
        # zcdp: delta is the conversion's (fixed), not spent or left: epsilon and rho are what is left
        "budget_remaining": {"epsilon": shown(state.remaining.epsilon),
                             **({"rho": shown(state.remaining_rho)} if state.zcdp else
                                {"delta": shown(state.remaining.delta)})}}}


class Service:
    """Everything but HTTP: usable directly, and wrapped by ``create_app``."""

    def __init__(self, cfg: ServiceConfig, generator=None, reward: RewardModel | None = None):
        self.cfg = cfg
        self.reward = reward or build_reward(cfg)
        check_unit(cfg, reward_unit(self.reward))  # a pair-unit head only with the opt-in
        self.generator = generator or build_generator(cfg)
        preflight(cfg, self.reward)  # every start-up check, before the ledger is opened or created
        prepare_ledger(cfg.ledger)  # its folder, created only now
        self.ledger = Ledger(cfg.ledger, synchronous=cfg.ledger_synchronous, lease=cfg.ledger_lease_s)
        self.ledger.heartbeat()
        self.settlement = Settlement(self.ledger, cfg.ledger_lease_s)  # heartbeat, recovery, retried settlements
        self.deployment = configure(self.ledger, cfg)  # the ledger's settings win over this config's
        # the answer's per-token log-probabilities under the policy (OpenAI's logprobs), where the
        # backend computes them (transformers): the policy does not read D, so they are post-processing
        self.token_logprobs = getattr(getattr(self.generator, "generator", self.generator), "token_logprobs", None)
        self.model_budget = self.deployment.model_budget
        self.release_charged = False
        self.released = bool(getattr(self.reward, "released", False))
        if self.released:
            self.release_charged = charge_release(self.ledger, self.reward, self.model_budget)
        elif self.model_budget is not None:
            self.release_charged = charge_range_release(self.ledger, self.reward, self.model_budget)
        lo, hi = self.reward.output_range
        if self.released:  # BoN reads only the order of the scores: no range, no per-query sensitivity
            lo, hi = -math.inf, math.inf
        self.range = (lo, hi)
        self.sensitivity = None if self.released else self.reward.sensitivity or (hi - lo)
        self.requests = RequestRules(cfg, self.ledger, self.deployment.tenant_budget, self.model_budget, self.released,
                                     self.sensitivity, self.range, self.token_logprobs is not None)
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
        self._admission = threading.BoundedSemaphore(self.max_concurrency + self.max_queue)
        self.selector = Selector(cfg, self.generator, self.reward, self.sensitivity, self.range, self.max_concurrency)
        self.ledger_timings: list[float] = []  # seconds in ledger transactions per answered query
        self._slots: dict[str | None, threading.BoundedSemaphore] = {}
        # the names a request's "model" may carry (the first is the served name): anything else is a 404
        self.model_names = (cfg.served_model_name, *cfg.model_aliases)
        self.metrics = ServiceMetrics(self.ledger, self.generator, self.reward)
        self.registry = self.metrics.registry

    def guarantee(self) -> dict:
        """The guarantee a person in the reward model's preference data gets (``charges.guarantee``)."""
        return guarantee(self.ledger, self.reward, self.released, self.model_budget)

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @ledger.setter
    def ledger(self, ledger: Ledger) -> None:
        """The parts that charge, settle and report share the service's ledger, whichever is set."""
        self._ledger = ledger
        for part in (getattr(self, "settlement", None), getattr(self, "requests", None),
                     getattr(getattr(self, "metrics", None), "collector", None)):
            if part is not None:
                part.ledger = ledger

    @property
    def recovered(self) -> int:
        """Reservations of dead processes this process recovered at their worst case (never refunded)."""
        return self.settlement.recovered

    @property
    def _pending(self) -> set:
        return self.settlement.pending

    @property
    def backend_calls(self) -> int:
        """generate() calls made (diagnostics, tests, benchmarks)."""
        return self.selector.backend_calls

    def close(self):
        self.settlement.stop()

    # ------------------------------------------------------------------ auth
    def caller(self, key: str | None) -> tuple[str, str | None]:
        """('admin', None) or ('client', tenant); 401 otherwise."""
        if key in self.cfg.admin_keys:
            return "admin", None
        if key in self.cfg.clients:
            return "client", self.cfg.clients[key].tenant
        raise ApiError(401, "unauthorized", "missing or unknown API key (Authorization: Bearer KEY)")

    def options(self, ext: dict | None, tenant: str | None) -> dict:
        """A request's ``privalign`` block resolved (``requests.RequestRules.options``)."""
        return self.requests.options(ext, tenant)

    # ------------------------------------------------------------------ one query
    def answer(self, messages: list[dict], ext: dict | None, tenant: str | None, max_tokens: int | None = None,
               temperature: float | None = None, stop: tuple[str, ...] = (), logprobs: int | None = None) -> dict:
        """One query: validate, reserve, generate (every candidate cut at ``stop``), score, select, settle.
        ``logprobs`` (None: not asked) returns the answer's per-token log-probabilities under the policy
        with that many alternatives each (``token_logprobs``); asking a backend without them is a 400."""
        t0 = time.perf_counter()
        messages = self.requests.check_messages(messages)
        self.requests.check_sampling(max_tokens, temperature, logprobs)
        o = self.requests.options(ext, tenant)
        o["stop"], o["tenant"], o["logprobs"] = tuple(stop), tenant, logprobs
        slot = self._slots.setdefault(tenant, threading.BoundedSemaphore(self.cfg.max_inflight_per_tenant))
        if not slot.acquire(blocking=False):
            raise ApiError(429, "too_many_requests", f"this tenant already has {self.cfg.max_inflight_per_tenant} "
                                                     "requests in flight; retry shortly (nothing was charged)",
                           retry_after=1)
        try:
            if not self._admission.acquire(blocking=False):  # back-pressure, before anything is reserved
                self.metrics.overloaded.inc()
                raise ApiError(503, "overloaded", f"the service has {self.max_concurrency} backend calls in flight "
                                                  f"and {self.max_queue} requests waiting; retry shortly (nothing "
                                                  "was charged)", retry_after=1)
            try:
                return self._answer(messages, o, max_tokens, temperature, t0)
            finally:
                self._admission.release()
        finally:
            slot.release()

    def _reserve(self, o: dict, request_id: str) -> list[int]:
        """Reserve the query's worst case in its budget and the model budget, all or none: 429 when a
        budget cannot cover it, 503 when the ledger cannot record it (nothing reserved either way)."""
        try:
            names = [o["budget"]] + ([self.model_budget] if self.model_budget else [])
            return self.ledger.reserve_all(names, request_id=request_id, event=o["event"])  # all or none
        except BudgetExhausted as e:
            self.metrics.refusals.labels(o["budget"]).inc()
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
            self.metrics.ledger_faults.inc()
            raise ApiError(503, "ledger_unavailable", f"the privacy ledger cannot record charges now "
                                                      f"({type(e).__name__}); nothing was charged, retry shortly",
                           retry_after=1) from None

    def _answer(self, messages, o, max_tokens, temperature, t0) -> dict:
        request_id = uuid.uuid4().hex
        t_l = time.perf_counter()
        rid = self._reserve(o, request_id)
        ledger_s = time.perf_counter() - t_l
        try:
            usage = {"prompt_tokens": 0, "completion_tokens": 0}
            chosen, sel, generated = self.selector.select(messages, o, max_tokens, temperature, usage)
            token_lp = None if o["logprobs"] is None else self.token_logprobs(
                messages, chosen.text, top=o["logprobs"], temperature=temperature or self.cfg.generator.temperature)
        except BaseException as e:
            # generation or scoring failed after the reservation: charge the worst case (never refund)
            self.settlement.worst_case(rid)
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
            self.settlement.worst_case(rid)  # the answer is withheld, but its candidates were scored
            raise ApiError(500, "ledger_error", f"the charge could not be recorded ({type(e).__name__}); the "
                                                f"answer is withheld and the worst case charged") from None
        ledger_s += time.perf_counter() - t_l
        self.metrics.ledger_seconds.observe(ledger_s)
        if len(self.ledger_timings) < 1_000_000:
            self.ledger_timings.append(ledger_s)
        queries, epsilon = self.metrics.children(o["budget"], o["mechanism"])
        queries.inc()
        epsilon.inc(charged)
        self.metrics.candidates.inc(generated)
        self.metrics.latency.observe(time.perf_counter() - t0)
        return response_body(request_id, o, chosen, sel, generated, usage, token_lp, charged, cost, state)
