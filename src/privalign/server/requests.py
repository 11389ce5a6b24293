"""A request's options, conventions and validation, before anything is reserved: the chat messages
within the caps, max_tokens / temperature / logprobs, and the ``privalign`` block resolved into a
mechanism, its noise, its worst-case privacy event and the budget it is charged to. Every refusal is
an ``ApiError`` (4xx) that charges nothing."""

from __future__ import annotations

import dataclasses
import functools
import math

from .. import accounting as A
from .._validation import check_max_rounds
from ..accounting._rounding import snap_up
from ..ledger import Ledger, UnknownBudget
from .config import ServiceConfig
from .errors import ApiError

PRIVALIGN_OPTIONS = frozenset({"mechanism", "n", "epsilon", "noise_scale", "beta", "sigma_x", "sigma_z", "budget",
                               "delta", "max_rounds", "temperature"})
POSITIVE = ("epsilon", "noise_scale", "beta", "sigma_x", "sigma_z", "delta")


@functools.lru_cache(maxsize=1024)
def _privitp_event(n, beta, sigma_x, sigma_z, delta, sensitivity, r_max, max_rounds) -> A.PrivacyEvent:
    """PrivITP's event (worst case, delta, rho) with T = ``max_rounds`` Phase-2 rounds, cached: the
    worst case takes milliseconds to compute."""
    return A.privitp_event(n, beta, sigma_x, sigma_z, delta, sensitivity, r_max, max_rounds=max_rounds)


def check_ceiling(ceiling: tuple[float, float], own: tuple, o: dict, ext: dict) -> None:
    """The per-request ceiling (epsilon_max, delta_max): the mechanism's, or the budget's ``own`` where
    lower; a 400 that names it, before anything is reserved, so nothing is charged."""
    for i, (key, asked) in enumerate((("epsilon", o["epsilon_max"]), ("delta", o["delta"]))):
        cap, where = ceiling[i], f"[mechanism] {key}_max"
        if own[i] is not None and own[i] < cap:
            cap, where = own[i], f"budget {o['budget']!r}'s {key}_max"
        if asked > cap * (1 + 1e-9):
            param = next((f"privalign.{k}" for k in (key, "noise_scale", "sigma_x", "sigma_z", "beta") if k in ext),
                         "privalign")
            raise ApiError(400, "invalid_request", f"this query's worst-case {key} {asked:.6g} is over the "
                                                   f"per-request ceiling {key}_max = {cap:g} ({where}); nothing "
                                                   "was charged: ask for less (more noise)", param=param)


def default_ceiling(rules) -> dict[str, tuple[float, float]]:
    """``RequestRules``' default per-request ceiling: per mechanism, [mechanism] epsilon_max and delta_max, else the most a request of that
    mechanism with the configured options may cost (privbon: without a noise floor), at n = max_n
    and the most Phase-2 rounds a request may ask for: only less noise than configured is refused."""
    d = rules.cfg.mechanism
    rounds = min(d.max_rounds if d.max_rounds_max is None else d.max_rounds_max, rules.cfg.max_n)
    out = {}
    # privbon at no noise floor: the configured epsilon itself (a floor only spends less)
    for ext in ({"mechanism": "privbon", "temperature": 0.0}, {"mechanism": "privitp", "max_rounds": rounds}):
        eps = d.epsilon_max
        if eps is None:
            o = rules._checked({**ext, "n": rules.cfg.max_n})
            try:
                rules._mechanism(o, ext)
                eps = o["epsilon_max"]
            except ValueError:
                eps = math.inf
        out[ext["mechanism"]] = (eps, d.delta if d.delta_max is None else d.delta_max)
    return out


class RequestRules:
    """The service's rules for one request, fixed at start-up: the config, the reward model's range
    and per-query sensitivity (None for a released head), and the budgets as the ledger holds them."""

    def __init__(self, cfg: ServiceConfig, ledger: Ledger, tenant_budget: dict, model_budget: str | None,
                 released: bool, sensitivity: float | None, reward_range: tuple[float, float], has_logprobs: bool):
        self.cfg, self.ledger, self.tenant_budget, self.model_budget = cfg, ledger, tenant_budget, model_budget
        self.released, self.sensitivity, self.range, self.has_logprobs = released, sensitivity, reward_range, has_logprobs
        self._tenant_of: dict[str, tuple] = {}
        self.ceiling = None if released else default_ceiling(self)
        self._own_ceiling = {b.name: (b.epsilon_max, b.delta_max) for b in cfg.budgets}

    def check_sampling(self, max_tokens, temperature, logprobs) -> None:
        """max_tokens a positive integer within the cap, temperature in (0, 2], logprobs only where the
        backend computes them."""
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
            raise ApiError(400, "invalid_request", f"max_tokens must be a positive integer, got {max_tokens!r}")
        if max_tokens is not None and max_tokens > self.cfg.token_cap:
            raise ApiError(400, "invalid_request", f"max_tokens={max_tokens} is over this service's cap of "
                                                   f"{self.cfg.token_cap} (max_tokens_cap in the config)")
        if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                        or not 0 < temperature <= 2):
            raise ApiError(400, "invalid_request", f"temperature must lie in (0, 2] (the candidates are samples of "
                                                   f"the policy), got {temperature!r}")
        if logprobs is not None and not self.has_logprobs:
            raise ApiError(400, "invalid_request", f"logprobs: the {self.cfg.generator.backend} backend does not return "
                                                   "per-token log-probabilities; leave logprobs out", param="logprobs")

    def check_messages(self, messages) -> list[dict]:
        """OpenAI chat messages, content a string or a list of text parts, within the caps."""
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "invalid_request", "messages must be a non-empty list of {role, content}")
        if len(messages) > self.cfg.max_messages:
            raise ApiError(400, "invalid_request", f"{len(messages)} messages, over the cap of {self.cfg.max_messages}")
        out = [self._message(m) for m in messages]
        if not out[-1]["content"].strip():  # nothing to answer: refused before anything is reserved
            raise ApiError(400, "invalid_request", "the last message's content is empty or blank")
        chars = sum(len(m["content"]) for m in out)
        if chars > self.cfg.max_prompt_chars:
            raise ApiError(400, "invalid_request", f"prompt has {chars} characters, over the cap of "
                                                   f"{self.cfg.max_prompt_chars}")
        return out

    @staticmethod
    def _message(m) -> dict:
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
        return {"role": m["role"], "content": content}

    def options(self, ext: dict | None, tenant: str | None) -> dict:
        """The ``privalign`` block resolved: mechanism, n, its noise, its worst-case ``event`` and
        ``epsilon_max``, and the ``budget`` it is charged to."""
        ext = dict(ext or {})
        o = self._checked(ext)
        try:
            self._mechanism(o, ext)
        except ValueError as e:  # e.g. epsilon = 1e-320: the noise it needs overflows
            raise ApiError(400, "invalid_request", f"privalign options cannot be served: {e}") from None
        if not math.isfinite(o["epsilon_max"]):
            raise ApiError(400, "invalid_request", "this setting's worst-case epsilon is unbounded (the noise is too "
                                                   "small to account for); use more noise", epsilon_max="inf")
        o["budget"] = self._budget(ext.get("budget"), tenant)
        if self.ceiling is not None:
            check_ceiling(self.ceiling[o["mechanism"]], self._own_ceiling.get(o["budget"], (None, None)), o, ext)
        return o

    def _checked(self, ext: dict) -> dict:
        """The options' types and ranges; returns mechanism, n, beta, sigma_x, sigma_z, delta (and T)."""
        d = self.cfg.mechanism
        unknown = set(ext) - PRIVALIGN_OPTIONS
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
        for key in POSITIVE:
            v = ext.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
                raise ApiError(400, "invalid_request", f"privalign.{key} must be a positive number, got {v!r}")
        if "delta" in ext and not ext["delta"] < 1:
            raise ApiError(400, "invalid_request", f"privalign.delta must lie in (0, 1), got {ext['delta']!r}")
        o = {"mechanism": mech, "n": n, "beta": ext.get("beta", d.beta), "sigma_x": ext.get("sigma_x", d.sigma_x),
             "sigma_z": ext.get("sigma_z", d.sigma_z), "delta": ext.get("delta", d.delta)}
        if mech == "privitp":
            o["max_rounds"] = self._max_rounds(ext.get("max_rounds"), n)
        elif "max_rounds" in ext:
            raise ApiError(400, "invalid_request", f"privalign.max_rounds applies to privitp only, not {mech!r}")
        o["temperature"] = self._temperature(ext.get("temperature"), mech)
        if mech == "privbon" and "epsilon" in ext and "noise_scale" in ext:
            raise ApiError(400, "invalid_request", "give privalign.epsilon or privalign.noise_scale, not both")
        if mech == "released-bon":
            for key in POSITIVE:
                if key in ext:
                    raise ApiError(400, "invalid_request", f"privalign.{key} has no meaning for released-bon: its "
                                                           "queries cost 0 (the head was released once)")
        return o

    def _mechanism(self, o: dict, ext: dict) -> None:
        """The mechanism's noise and its worst-case event: released-bon costs 0; PrivBoN's event from
        its Gumbel (or Gaussian) noise; PrivITP's reserved on the 2^-20 grid of its ex-post charge."""
        d = self.cfg.mechanism
        if o["mechanism"] == "released-bon":
            o["event"] = A.PrivacyEvent("released-bon", 0.0, 0.0, rho=0.0, params=(("temperature", o["temperature"]),))
            o["epsilon_max"], o["delta"] = 0.0, 0.0
        elif o["mechanism"] == "privbon":
            if "noise_scale" in ext:
                o["noise_scale"] = ext["noise_scale"]
            else:
                eps = ext.get("epsilon", d.epsilon)
                o["noise_scale"] = d.noise_scale if eps is None else A.gumbel_noise_scale(eps, self.sensitivity)
            # the noise floor: more noise than epsilon needs is charged what it spends, 2 Delta_r / sigma
            o["noise_scale"] = max(o["noise_scale"], o["temperature"])
            o["event"] = A.privbon_event(o["noise_scale"], self.sensitivity, noise=d.privbon_noise)
            o["epsilon_max"], o["delta"] = o["event"].epsilon, 0.0
        else:
            # reserved on the same 2^-20 grid as the ex-post charge, so snapping never lifts a charge
            # above its reservation; a realised cost above it is still charged in full (the filter's rule)
            event = _privitp_event(o["n"], o["beta"], o["sigma_x"], o["sigma_z"], o["delta"], self.sensitivity,
                                   self.range[1] - self.range[0], o["max_rounds"])
            eps_max = snap_up(event.epsilon) if math.isfinite(event.epsilon) else event.epsilon
            o["event"] = dataclasses.replace(event, epsilon=eps_max)
            o["epsilon_max"] = eps_max

    def _budget(self, budget: str | None, tenant: str | None) -> str:
        """The tenant budget a query is charged to: the one named (the caller's own), else the
        tenant's default as recorded in the ledger; never the model budget."""
        if budget is None:  # the tenant's default, as recorded in the ledger (deployment.py)
            budget = (self.tenant_budget.get(tenant) if tenant is not None else
                      next(iter(self.tenant_budget.values()), None))
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
        return budget

    def _temperature(self, asked, mech: str) -> float:
        """privbon's noise floor / released-bon's soft-BoN temperature: the request's own (a finite
        number >= 0, at most the operator's temperature_max) or the config's; privitp has none."""
        d = self.cfg.mechanism
        if asked is None:
            return d.temperature if mech != "privitp" else 0.0
        if mech == "privitp":
            raise ApiError(400, "invalid_request", "privalign.temperature applies to privbon and released-bon, "
                                                   "not 'privitp'")
        if isinstance(asked, bool) or not isinstance(asked, (int, float)) or not math.isfinite(asked) or asked < 0:
            raise ApiError(400, "invalid_request", f"privalign.temperature must be a number >= 0, got {asked!r}")
        if d.temperature_max is not None and asked > d.temperature_max:
            raise ApiError(400, "invalid_request", f"privalign.temperature must not exceed this service's "
                                                   f"temperature_max={d.temperature_max}, got {asked!r}")
        return float(asked)

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
