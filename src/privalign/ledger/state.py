"""The ledger's values: a budget's state and the two refusals (no budget, not enough left)."""

from __future__ import annotations

from dataclasses import dataclass

from ..accounting.filter import Privacy
from ..accounting.zcdp import zcdp_epsilon


class BudgetExhausted(Exception):
    def __init__(self, name: str, epsilon_max: float, delta: float, remaining: Privacy, rho: float | None = None,
                 remaining_rho: float | None = None):
        self.name, self.epsilon_max, self.delta, self.remaining = name, epsilon_max, delta, remaining
        self.rho, self.remaining_rho = rho, remaining_rho
        if rho is not None:
            msg = (f"budget {name!r} cannot cover this query's rho={rho:.6g} (zcdp, epsilon_max={epsilon_max:.6g}); "
                   f"remaining rho={remaining_rho:.6g}")
        else:
            msg = (f"budget {name!r} cannot cover this query's worst case (epsilon_max={epsilon_max:.6g}, "
                   f"delta={delta:.3g}); remaining epsilon={remaining.epsilon:.6g}, delta={remaining.delta:.3g}")
        super().__init__(msg)


ZCDP_DELTA = ("zcdp: delta_total is fixed by the conversion of the rho spent to (epsilon, delta), not spent query "
              "by query: whatever is spent, the budget's guarantee is (epsilon_spent, delta_total)-DP")


class UnknownBudget(KeyError):
    pass


@dataclass(frozen=True)
class BudgetState:
    name: str
    tenant: str | None
    total: Privacy
    composition: str
    spent: Privacy
    reserved: Privacy
    queries: int
    refusals: int
    open: int
    rho_total: float | None = None
    spent_rho: float = 0.0
    reserved_rho: float = 0.0

    @property
    def zcdp(self) -> bool:
        return self.composition == "zcdp"

    def _converted(self, rho: float) -> Privacy:
        return Privacy(zcdp_epsilon(rho, self.total.delta), self.total.delta) if rho > 0 else Privacy(0.0, 0.0)

    @property
    def spent_privacy(self) -> Privacy:
        """The (epsilon, delta) spent: the sum of charges, or under zcdp the conversion of rho spent."""
        return self._converted(self.spent_rho) if self.zcdp else self.spent

    @property
    def remaining_rho(self) -> float | None:
        return max(self.rho_total - self.spent_rho - self.reserved_rho, 0.0) if self.zcdp else None

    @property
    def remaining(self) -> Privacy:
        if self.zcdp:
            used = self._converted(self.spent_rho + self.reserved_rho)
            return Privacy(max(self.total.epsilon - used.epsilon, 0.0),
                           self.total.delta if self.remaining_rho > 0 else 0.0)
        return Privacy(max(self.total.epsilon - self.spent.epsilon - self.reserved.epsilon, 0.0),
                       max(self.total.delta - self.spent.delta - self.reserved.delta, 0.0))

    def as_dict(self) -> dict:
        spent = self.spent_privacy
        out = {"name": self.name, "tenant": self.tenant, "composition": self.composition,
               "epsilon_total": self.total.epsilon, "delta_total": self.total.delta,
               "epsilon_spent": spent.epsilon, "delta_spent": spent.delta,
               "epsilon_reserved": self.reserved.epsilon, "delta_reserved": self.reserved.delta,
               "epsilon_remaining": self.remaining.epsilon, "delta_remaining": self.remaining.delta,
               "queries": self.queries, "refusals": self.refusals, "open_reservations": self.open}
        if self.zcdp:  # delta is the conversion's, fixed: shown once, with what it means (ZCDP_DELTA)
            out.update(delta_spent=None, delta_reserved=None, delta_remaining=None, delta_meaning=ZCDP_DELTA,
                       rho_total=self.rho_total, rho_spent=self.spent_rho, rho_reserved=self.reserved_rho,
                       rho_remaining=self.remaining_rho)
        return out


_COLS = ("name, tenant, epsilon_total, delta_total, composition, spent_epsilon, spent_delta, reserved_epsilon, "
         "reserved_delta, queries, refusals, open, rho_total, spent_rho, reserved_rho")


def _state(row) -> BudgetState:
    return BudgetState(row[0], row[1], Privacy(row[2], row[3]), row[4], Privacy(row[5], row[6]),
                       Privacy(row[7], row[8]), int(row[9]), int(row[10]), int(row[11]),
                       None if row[12] is None else float(row[12]), float(row[13]), float(row[14]))
