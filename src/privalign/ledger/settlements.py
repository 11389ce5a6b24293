"""The second step of a charge: settling reservations to the realised cost (or the worst case),
atomically, one query's reservations together; and recording a reservation (the first step's row)."""

from __future__ import annotations

import time

from ..accounting.filter import Privacy, charge_amount, charge_rho
from .records import LedgerRecords
from .state import BudgetState


class Settlements(LedgerRecords):
    """Reservations recorded and settled; ``owner`` (this process) is set by ``Ledger``."""

    owner: str

    def _insert_reservation(self, cur, name: str, request_id: str, epsilon_max: float, delta: float, rho,
                            mechanism: str, params) -> int:
        """Record a reservation of the worst case on a budget and hold it in its counters; its id."""
        cur.execute(self._q("INSERT INTO events (budget, kind, request_id, owner, epsilon, delta, epsilon_max, "
                            "created, rho, mechanism, params) VALUES (?, 'reserve', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                            + (" RETURNING id" if self.postgres else "")),
                    (name, request_id, self.owner, epsilon_max, delta, epsilon_max, time.time(), rho, mechanism, params))
        rid = cur.fetchone()[0] if self.postgres else cur.lastrowid
        cur.execute(self._q("UPDATE budgets SET reserved_epsilon = reserved_epsilon + ?, "
                            "reserved_delta = reserved_delta + ?, reserved_rho = reserved_rho + ?, "
                            "open = open + 1 WHERE name = ?"),
                    (epsilon_max, delta, rho or 0.0, name))
        return rid

    def settle(self, reservation: int, epsilon: float | None = None, kind: str = "settle") -> float:
        """Charge the realised cost (``None``: the worst case) and release the rest, atomically.
        Returns the epsilon charged (under zcdp: the query's epsilon; its rho is in ``settle_state``)."""
        return self.settle_state(reservation, epsilon, kind)[0]

    def settle_state(self, reservation: int, epsilon: float | None = None, kind: str = "settle"
                     ) -> tuple[float, BudgetState]:
        """``settle``, also returning the budget's state right after the charge."""
        return self.settle_all([reservation], epsilon, kind)[0]

    def settle_all(self, reservations, epsilon: float | None = None, kind: str = "settle"
                   ) -> list[tuple[float, BudgetState]]:
        """``settle_state`` for several reservations of one query (``reserve_all``), atomically: all
        are charged, or (the transaction fails) none is. Results in the order given."""
        reservations = list(reservations)

        def op(cur):
            rows = {}
            for rid in reservations:
                cur.execute(self._q("SELECT budget, request_id, delta, epsilon_max, rho, mechanism, params FROM events "
                                    "WHERE id = ? AND kind = 'reserve'"), (rid,))
                row = cur.fetchone()
                if row is None:
                    raise KeyError(f"no reservation {rid}")
                rows[rid] = row
            states = {n: self._lock(cur, n) for n in sorted({r[0] for r in rows.values()})}  # global lock order
            return [self._settle_one(cur, rid, rows[rid], states[rows[rid][0]], epsilon, kind) for rid in reservations]

        return self._run(op, durable=True)

    def _settle_one(self, cur, reservation, row, s: BudgetState, epsilon, kind) -> tuple[float, BudgetState]:
        name, request_id, delta, eps_max, rho, mechanism, params = row
        realised = eps_max if epsilon is None else float(epsilon)
        amount = charge_amount("basic" if s.zcdp else s.composition, realised, eps_max)
        rho_charged = None if rho is None else charge_rho(float(rho), realised, eps_max)
        # the unique index on events(reservation) makes a second settlement fail
        cur.execute(self._q("INSERT INTO events (budget, kind, reservation, request_id, epsilon, delta, epsilon_max, "
                            "created, rho, mechanism, params, realised) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
                    (name, kind, reservation, request_id, amount, delta, eps_max, time.time(), rho_charged,
                     mechanism, params, None if epsilon is None else realised))
        clamp = "GREATEST" if self.postgres else "MAX"
        cur.execute(self._q(f"UPDATE budgets SET spent_epsilon = spent_epsilon + ?, spent_delta = spent_delta + ?, "
                            f"reserved_epsilon = {clamp}(reserved_epsilon - ?, 0), "
                            f"reserved_delta = {clamp}(reserved_delta - ?, 0), "
                            f"spent_rho = spent_rho + ?, reserved_rho = {clamp}(reserved_rho - ?, 0), "
                            f"queries = queries + 1, open = open - 1 WHERE name = ?"),
                    (amount, delta, eps_max, delta, rho_charged or 0.0, rho or 0.0, name))
        return amount, BudgetState(s.name, s.tenant, s.total, s.composition,
                                   Privacy(s.spent.epsilon + amount, s.spent.delta + delta),
                                   Privacy(max(s.reserved.epsilon - eps_max, 0.0), max(s.reserved.delta - delta, 0.0)),
                                   s.queries + 1, s.refusals, s.open - 1, s.rho_total,
                                   s.spent_rho + (rho_charged or 0.0), max(s.reserved_rho - (rho or 0.0), 0.0))
