"""Every start-up check, before the ledger is opened or created (issue 50): a refused start writes
nothing. The checks that need only the config and the reward model come first; those that need what
an existing ledger holds (a budget's tenant, the recorded model budget, an earlier release of the
same head, what a budget has left) read it and change nothing. A ledger that does not exist yet is
checked against the config's totals, and is not created."""

from __future__ import annotations

import math
from pathlib import Path

from .. import accounting as A
from ..accounting.filter import Privacy
from ..ledger import Ledger, UnknownBudget
from ..ledger.state import BudgetExhausted, BudgetState
from .charges import range_key, release_event, release_key
from .config import ServiceConfig, is_url


def check_release_config(cfg: ServiceConfig, reward) -> None:
    """A released head serves only as released-bon, with a model budget; released-bon needs one."""
    released = bool(getattr(reward, "released", False))
    if cfg.mechanism.name == "released-bon" and not released:
        raise ValueError(f"[mechanism] name = 'released-bon' needs a released head (privalign rm release), got "
                         f"the reward model {getattr(reward, 'name', type(reward).__name__)!r}")
    if released and cfg.mechanism.name != "released-bon":
        raise ValueError(f"a released head serves with [mechanism] name = 'released-bon' (its queries are "
                         f"post-processing), got {cfg.mechanism.name!r}: per-query noise is for the exact head")
    if released and cfg.model_budget is None:
        raise ValueError("a released head needs a [model_budget], where its one-time cost is recorded once")


def check_range(reward) -> None:
    if getattr(reward, "released", False) or reward.output_range is None:
        return
    lo, hi = reward.output_range
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError("the reward model needs a finite declared output_range in the config")


def open_existing(cfg: ServiceConfig) -> Ledger | None:
    """The ledger when it exists (a PostgreSQL URL always does), else None: nothing is created."""
    if not is_url(cfg.ledger) and not Path(cfg.ledger).is_file():
        return None
    return Ledger(cfg.ledger, synchronous=cfg.ledger_synchronous, lease=cfg.ledger_lease_s)


def _budget(ledger: Ledger | None, cfg: ServiceConfig, name: str) -> BudgetState | None:
    """The model budget as the ledger holds it, or as the config would create it."""
    if ledger is not None:
        try:
            return ledger.budget(name)
        except UnknownBudget:
            pass
    mb = cfg.model_budget
    if mb is None:
        return None
    zero = Privacy(0.0, 0.0)
    return BudgetState(name, None, Privacy(mb.epsilon_total, mb.delta_total), mb.composition, zero, zero, 0, 0, 0,
                       A.budget_rho_total(mb.composition, mb.epsilon_total, mb.delta_total))


def _fits(s: BudgetState, event: A.PrivacyEvent) -> None:
    """Raise BudgetExhausted, as ``Ledger.charge_once`` would, when ``event`` does not fit."""
    if s.zcdp:
        rho = A.query_rho(event.epsilon, event.delta, event.rho)
        if not A.admits_rho(s.spent_rho, s.reserved_rho, s.rho_total, rho):
            raise BudgetExhausted(s.name, event.epsilon, event.delta, s.remaining, rho, s.remaining_rho)
    elif not A.admits(s.spent, s.reserved, s.total, event.epsilon, event.delta):
        raise BudgetExhausted(s.name, event.epsilon, event.delta, s.remaining)


def _charged(ledger: Ledger | None, name: str, key: str | None = None, prefix: str | None = None) -> set[str]:
    """The one-time charges recorded in budget ``name``: the one keyed ``key``, or all under ``prefix``."""
    if ledger is None:
        return set()
    try:
        ids = {str(e["request_id"]) for e in ledger.events(name) if e["kind"] == "release"}
    except UnknownBudget:
        return set()
    return {i for i in ids if i == key or (prefix is not None and i.startswith(prefix))}


def check_one_time_charges(ledger: Ledger | None, cfg: ServiceConfig, reward) -> None:
    """A second release of the same head into the model budget, or a one-time charge (a head's
    release, a reward model's range release) that the model budget cannot cover."""
    mb = (ledger.setting("model_budget") if ledger is not None else None) or (
        cfg.model_budget.name if cfg.model_budget is not None else None)
    if mb is None:
        return
    if getattr(reward, "released", False):
        g, key = reward.release, release_key(reward)
        others = _charged(ledger, mb, prefix=f"release:{g['head_id']}:") - {key}
        if others:
            raise ValueError(f"head {g['head_id']} was already released into the model budget {mb!r} (release "
                             f"{sorted(others)[0].split(':')[2]}); releasing it again ({reward.release_id}) would "
                             "spend epsilon_w twice: serve the first release's file")
        event, what = release_event(reward), (f"the head's one-time release (epsilon {g['epsilon']:g}, delta "
                                              f"{g['delta']:g})")
    else:
        release = float(getattr(reward, "range_epsilon", 0.0) or 0.0)
        if release <= 0:
            return
        key, event = range_key(reward), A.pure_event(release, "range-release")
        what = f"the reward model's one-time range release (epsilon {release:g})"
    if _charged(ledger, mb, key=key):
        return  # charged before: nothing more to cover
    state = _budget(ledger, cfg, mb)
    try:
        if state is not None:
            _fits(state, event)
    except BudgetExhausted as e:
        raise ValueError(f"the model budget {mb!r} cannot cover {what}: {e}") from None


def check_deployment(ledger: Ledger | None, cfg: ServiceConfig) -> None:
    """What ``deployment.configure`` would refuse, found by reading the ledger only."""
    if ledger is None:
        return
    for i, b in enumerate(cfg.budgets):
        try:
            held = ledger.budget(b.name)
        except UnknownBudget:
            continue
        if held.tenant != b.tenant:
            raise ValueError(f"budgets[{i}]: budget {b.name!r} belongs to tenant {held.tenant!r} in the ledger "
                             f"{ledger.url}, the config says {b.tenant!r}; a budget's tenant never changes")
    recorded = ledger.setting("model_budget")
    if cfg.model_budget is not None and recorded is not None and recorded != cfg.model_budget.name:
        raise ValueError(f"model_budget.name: the ledger {ledger.url} records the model budget {recorded!r}, the "
                         f"config says {cfg.model_budget.name!r}; use the ledger's name or another ledger")


def preflight(cfg: ServiceConfig, reward) -> None:
    """Every start-up check, in order; ValueError (one line) on the first that fails. Writes nothing."""
    check_release_config(cfg, reward)
    check_range(reward)
    ledger = open_existing(cfg)
    try:
        check_deployment(ledger, cfg)
        check_one_time_charges(ledger, cfg, reward)
    finally:
        if ledger is not None:
            ledger.close()


def cheap_reward(cfg: ServiceConfig):
    """The reward model as far as the checks need it, without loading a network: a released head
    (its file, no policy attached), else whether it is released and its declared range (the
    service checks the loaded model again before it opens the ledger)."""
    from types import SimpleNamespace

    r = cfg.reward
    if r.kind == "policy-bt" and r.path:
        from ..rewards import _file_kind
        from ..rewards.release import RELEASED_KIND, ReleasedHead

        if _file_kind(r.path) == RELEASED_KIND:
            return ReleasedHead.load(r.path)
    declared = tuple(r.output_range) if r.output_range is not None else (0.0, 1.0) if r.kind == "stub" else None
    return SimpleNamespace(name=r.kind, released=False, output_range=declared)
