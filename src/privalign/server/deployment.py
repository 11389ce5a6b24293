"""The ledger as the deployment's single source of truth (issue 30).

The first process to configure a ledger records there which budget is the model budget (charged
by every query of every tenant) and which budget each tenant's queries charge by default; budgets
are created with the config's totals. Every later process, a restart or another replica, reads
those settings from the ledger instead of trusting its own config:

* a config without ``[model_budget]`` adopts the ledger's model budget (and says so), so no replica
  can answer uncharged to it; a config naming a *different* model budget refuses to start, with a
  one-line error that names both;
* a budget whose totals or composition in the config differ from the ledger's (raised through
  ``POST /v1/budgets``, say) keeps the ledger's, and says so; a budget whose tenant differs refuses
  to start (a budget's tenant never changes);
* a tenant's default budget is the one recorded first; a config that lists another first says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ledger import Ledger, UnknownBudget
from .config import ServiceConfig


@dataclass
class Deployment:
    model_budget: str | None
    tenant_budget: dict[str, str]         # tenant -> the budget its queries charge by default
    notes: list[str] = field(default_factory=list)  # where the ledger's settings overrode the config's


def _ensure(ledger: Ledger, name: str, total: float, delta: float, composition: str, tenant: str | None,
            where: str, notes: list[str]) -> None:
    """Create the budget with the config's values, or keep the ledger's and note any difference."""
    try:
        b = ledger.budget(name)
    except UnknownBudget:
        ledger.set_budget(name, total, delta, composition, tenant)
        return
    if b.tenant != tenant:
        raise ValueError(f"{where}: budget {name!r} belongs to tenant {b.tenant!r} in the ledger {ledger.url}, the "
                         f"config says {tenant!r}; a budget's tenant never changes")
    if (b.total.epsilon, b.total.delta, b.composition) != (total, delta, composition):
        notes.append(f"budget {name!r}: the ledger holds epsilon {b.total.epsilon:g}, delta {b.total.delta:g}, "
                     f"{b.composition} (the config says {total:g}, {delta:g}, {composition}); the ledger's is used")


def configure(ledger: Ledger, cfg: ServiceConfig) -> Deployment:
    """Record the config's deployment settings in a fresh ledger, or read (and check the config
    against) those already recorded. Raises ValueError, one line naming the difference, where the
    config cannot be served from this ledger."""
    notes: list[str] = []
    for i, b in enumerate(cfg.budgets):
        _ensure(ledger, b.name, b.epsilon_total, b.delta_total, b.composition, b.tenant, f"budgets[{i}]", notes)
    mb = cfg.model_budget
    recorded = ledger.setting("model_budget")
    if mb is not None:
        if recorded is None:
            _ensure(ledger, mb.name, mb.epsilon_total, mb.delta_total, mb.composition, None, "model_budget", notes)
            recorded = ledger.settle_setting("model_budget", mb.name)  # a replica starting at once may win
        if recorded != mb.name:
            raise ValueError(f"model_budget.name: the ledger {ledger.url} records the model budget {recorded!r}, the "
                             f"config says {mb.name!r}; use the ledger's name or another ledger")
        _ensure(ledger, mb.name, mb.epsilon_total, mb.delta_total, mb.composition, None, "model_budget", notes)
    elif recorded is not None:
        notes.append(f"model budget {recorded!r} adopted from the ledger (this config has no [model_budget]): every "
                     "query is charged to it")
    tenant_budget: dict[str, str] = {}
    for b in cfg.budgets:
        if b.tenant in tenant_budget:
            continue
        stored = ledger.settle_setting(f"tenant_budget:{b.tenant}", b.name)
        if stored != b.name:
            try:
                ledger.budget(stored)
            except UnknownBudget:
                stored = b.name
            else:
                notes.append(f"tenant {b.tenant!r}: its queries charge {stored!r} by default, as first recorded in "
                             f"the ledger (this config lists {b.name!r} first)")
        tenant_budget[b.tenant] = stored
    return Deployment(recorded, tenant_budget, notes)
