"""What the service charges once, not per query, and the guarantee the deployment gives: a released
head's one-time cost, the reward model's one-time range release (each recorded once in the model
budget, across restarts and replicas), and the guarantee a person in the preference data gets."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from .. import accounting as A
from ..ledger import BudgetExhausted, Ledger


def release_event(head) -> A.PrivacyEvent:
    """A released head's one-time cost (epsilon_w, delta_w; rho = Delta_r^2 / (2 sigma^2))."""
    g = head.release
    return A.PrivacyEvent("gaussian-release", float(g["epsilon"]), float(g["delta"]),
                          rho=(float(g["sensitivity"]) / float(g["sigma"])) ** 2 / 2,
                          params=(("sensitivity", float(g["sensitivity"])), ("sigma", float(g["sigma"]))))


def release_key(head) -> str:
    return f"release:{head.release['head_id']}:{head.release_id}"


def range_key(reward) -> str:
    return f"range-release:{_fingerprint(reward)}"


def charge_release(ledger: Ledger, head, mb: str) -> bool:
    """Record a released head's one-time cost in the model budget, once per release across restarts
    and replicas (``startup.preflight`` has refused a second release of the same head, a released
    head served any other way, and a release the model budget cannot cover)."""
    try:
        return ledger.charge_once(mb, release_key(head), release_event(head))
    except BudgetExhausted as e:  # another replica charged the budget in between
        g = head.release
        raise ValueError(f"the model budget {mb!r} cannot cover the head's one-time release (epsilon "
                         f"{g['epsilon']:g}, delta {g['delta']:g}): {e}") from None


def charge_range_release(ledger: Ledger, reward, model_budget: str) -> bool:
    """The reward model's one-time private range release (its ``range_epsilon``), charged once per
    model into the model budget; False when there is none or it was charged before."""
    release = float(getattr(reward, "range_epsilon", 0.0) or 0.0)
    if release <= 0:
        return False
    try:
        return ledger.charge_once(model_budget, range_key(reward),
                                  A.pure_event(release, "range-release"))
    except BudgetExhausted as e:
        raise ValueError(f"the model budget {model_budget!r} cannot cover the reward model's one-time "
                         f"range release (epsilon {release:g}): {e}") from None


def _fingerprint(model) -> str:
    """A served reward model's identity, for charging its one-time range release once."""
    w = getattr(model, "w", None)
    body = json.dumps({"name": getattr(model, "name", None), "range": list(model.output_range),
                       "w": None if w is None else np.asarray(w, float).round(12).tolist()})
    return hashlib.sha256(body.encode()).hexdigest()[:16]


SUBJECTS = {
    "person": "a person in the reward model's preference data (unit: a person, all of their preference pairs)",
    "pair": "one preference pair of the reward model's data (the head's unit is a pair, each counted as its own "
            "person: a person who gave several pairs is protected less, up to k times the epsilon)",
    "declared": "a person in the preference data, at the sensitivity Delta_r this config declares (not certified "
                "by privalign: the unit is whatever that Delta_r bounds)"}


def reward_unit(reward) -> str:
    """The unit of privacy of a served reward model: ``person`` (a person-unit policy-bt head or its
    release), ``pair`` (a legacy pair-unit head; minilm-bt, whose pairs are each their own
    contributor), or ``declared`` (hf, http, stub: the config's Delta_r, not certified)."""
    reward = getattr(reward, "model", reward)  # a BatchingReward's wrapped model
    if getattr(reward, "released", False):
        return str(reward.release.get("unit", "person"))
    unit = getattr(reward, "unit", None)
    if unit in ("person", "pair"):
        return unit
    return "pair" if hasattr(reward, "k") and hasattr(reward, "lam") else "declared"


def file_unit(kind: str, path: str | None) -> str:
    """``reward_unit`` read from a reward model's file without loading it (the start-up checks and the
    banner run before any model is built)."""
    if kind == "minilm-bt":
        return "pair"
    if kind != "policy-bt" or not path:
        return "declared"
    try:
        body = json.loads(open(path).read())
    except (OSError, ValueError):
        return "declared"  # load_reward reports the file itself
    if body.get("kind") == "policy-bt-released":
        return str(body.get("guarantee", {}).get("unit", "person"))
    return str(((body.get("meta") or {}).get("procedure") or {}).get("unit", "pair"))


def check_unit(cfg: ServiceConfig, unit: str) -> None:
    """A pair-unit policy-bt head is served only with ``[reward] allow_pair_unit = true`` (its
    certificate counts each pair as a person, which under-states one person's effect)."""
    if cfg.reward.kind == "policy-bt" and unit == "pair" and not cfg.reward.allow_pair_unit:
        raise ValueError(f"the reward model {cfg.reward.path} is a pair-unit head: its certificate counts each "
                         "preference pair as its own person, so the guarantee would be per pair, not per person; "
                         "serve a person-unit head (e.g. counting-policy-bt-person.json), or opt in with [reward] "
                         "allow_pair_unit = true")


def guarantee(ledger: Ledger, reward, released: bool, model_budget: str | None) -> dict:
    """The guarantee the unit of the reward model's preference data D (``reward_unit``: a person,
    or a pair for a legacy head) gets from the whole deployment: the model budget's, or without one,
    the sum over every budget. The statement names the unit."""
    unit = reward_unit(reward)
    out = _guarantee(ledger, reward, released, model_budget)
    out["unit"] = unit
    out["statement"] = out["statement"].replace("a person in the preference data", SUBJECTS[unit])
    return out


def _guarantee(ledger: Ledger, reward, released: bool, model_budget: str | None) -> dict:
    release = float(getattr(reward, "range_epsilon", 0.0) or 0.0)
    if released:
        g = reward.release
        b = ledger.budget(model_budget)
        return {"model_budget": b.name, "epsilon": b.total.epsilon, "delta": b.total.delta,
                "composition": b.composition, "released_head": {
                    "epsilon": g["epsilon"], "delta": g["delta"], "release_id": reward.release_id,
                    "query_epsilon": 0.0},
                "statement": f"the reward model was released once at ({g['epsilon']:g}, {g['delta']:g})-DP, "
                             f"recorded once in the model budget {b.name!r}; every answer is post-processing of "
                             "that release and costs 0, so a person in the preference data has "
                             f"({g['epsilon']:g}, {g['delta']:g})-DP from these answers, however many"}
    if model_budget:
        b = ledger.budget(model_budget)
        return {"model_budget": b.name, "epsilon": b.total.epsilon, "delta": b.total.delta,
                "composition": b.composition, "range_release_epsilon": release,
                "statement": f"every answer to every tenant is charged to the model budget {b.name!r} (the "
                             f"reward model's one-time range release, epsilon {release:g}, included): a person "
                             f"in the preference data has ({b.total.epsilon:g}, {b.total.delta:g})-DP over "
                             "the deployment's life"}
    budgets = [b for b in ledger.budgets()]
    eps = math.fsum(b.total.epsilon for b in budgets) + release
    delta = math.fsum(b.total.delta for b in budgets)
    return {"model_budget": None, "epsilon": eps, "delta": delta, "range_release_epsilon": release,
            "statement": f"no model budget: the {len(budgets)} budgets' totals add up, so a person in the "
                         f"preference data has only ({eps:g}, {delta:g})-DP (the sum over all tenants, the "
                         "range release included), and more with every budget created; configure "
                         "[model_budget] for one deployment-wide limit"}
