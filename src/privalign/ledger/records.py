"""Reading the ledger's record: budgets and their states, deployment settings, every settled
query (``charges``, ``history``), re-accounting under every composition (``account``), the raw
events, and a consistency check of the counters against the events (``check``)."""

from __future__ import annotations

import json
import math

from ..accounting.events import PrivacyEvent, account
from ..accounting.filter import COMPOSITIONS
from ..accounting.zcdp import pure_dp_rho
from .state import _COLS, BudgetState, UnknownBudget, _state
from .store import Store


class LedgerRecords(Store):
    """The read side of the ledger (and ``_lock``, the read that locks a budget's row)."""

    def _lock(self, cur, name: str):
        cur.execute(self._q(f"SELECT {_COLS} FROM budgets WHERE name = ?" + (" FOR UPDATE" if self.postgres else "")),
                    (name,))
        row = cur.fetchone()
        if row is None:
            raise UnknownBudget(name)
        return _state(row)

    def setting(self, key: str):
        """A deployment setting recorded in the ledger (JSON), or None when none is."""
        cur = self._conn().cursor()
        cur.execute(self._q("SELECT value FROM settings WHERE key = ?"), (key,))
        row = cur.fetchone()
        return None if row is None else json.loads(row[0])

    def budget(self, name: str) -> BudgetState:
        cur = self._conn().cursor()
        cur.execute(self._q(f"SELECT {_COLS} FROM budgets WHERE name = ?"), (name,))
        row = cur.fetchone()
        if row is None:
            raise UnknownBudget(name)
        return _state(row)

    def budgets(self, tenant: str | None = None) -> list[BudgetState]:
        cur = self._conn().cursor()
        if tenant is None:
            cur.execute(f"SELECT {_COLS} FROM budgets ORDER BY name")
        else:
            cur.execute(self._q(f"SELECT {_COLS} FROM budgets WHERE tenant = ? ORDER BY name"), (tenant,))
        return [_state(r) for r in cur.fetchall()]

    def charges(self, name: str) -> list[tuple]:
        """(request_id, kind, epsilon charged, delta) of every settled query of a budget."""
        cur = self._conn().cursor()
        cur.execute(self._q("SELECT request_id, kind, epsilon, delta FROM events WHERE budget = ? AND kind != 'reserve' "
                            "ORDER BY id"), (name,))
        return cur.fetchall()

    def history(self, name: str) -> list[tuple[PrivacyEvent, float | None, str]]:
        """Every settled query of a budget, oldest first: (its event, the realised epsilon or None for a
        worst-case settlement, the settlement's kind)."""
        cur = self._conn().cursor()
        cur.execute(self._q("SELECT s.mechanism, s.epsilon_max, s.delta, r.rho, s.params, s.realised, s.kind "
                            "FROM events s JOIN events r ON r.id = s.reservation WHERE s.budget = ? "
                            "AND s.kind != 'reserve' ORDER BY s.id"), (name,))
        return [(PrivacyEvent.from_record(m, e, d, rho, p), realised, kind)
                for m, e, d, rho, p, realised, kind in cur.fetchall()]

    def account(self, name: str) -> dict:
        """Re-account a budget's history under every composition (``accounting.events.account``).
        Settlements recorded before rho was (pre-migration rows) count as epsilon_max^2 / 2 when they
        were pure (delta = 0); with any other, zcdp's total is unknown."""
        state = self.budget(name)
        charges, derived = [], 0
        for ev, realised, _ in self.history(name):
            if ev.rho is None and ev.delta == 0:
                ev = PrivacyEvent(ev.mechanism, ev.epsilon, 0.0, pure_dp_rho(ev.epsilon) if ev.epsilon > 0 else 0.0,
                                  ev.params)
                derived += 1
            charges.append((ev, realised))
        out = {c: account(charges, c, state.total.delta if state.total.delta > 0 else None) for c in COMPOSITIONS}
        out["zcdp"]["derived_rho"] = derived
        return {"budget": state.as_dict(), "accounts": out}

    def events(self, name: str, request_id: str | None = None, since: float | None = None,
               until: float | None = None) -> list[dict]:
        """A budget's recorded events, oldest first (reservations, settlements, recoveries), each as
        a dict: id, kind, request_id, time (epoch seconds), epsilon charged, delta, epsilon_max, rho,
        mechanism, realised epsilon; only those of ``request_id`` and within [since, until] if given.
        Raises ``UnknownBudget`` for a budget the ledger does not hold."""
        self.budget(name)
        sql, args = ("SELECT id, kind, request_id, created, epsilon, delta, epsilon_max, rho, mechanism, realised, "
                     "reservation FROM events WHERE budget = ?"), [name]
        for clause, value in (("request_id = ?", request_id), ("created >= ?", since), ("created <= ?", until)):
            if value is not None:
                sql += f" AND {clause}"
                args.append(value)
        cur = self._conn().cursor()
        cur.execute(self._q(sql + " ORDER BY id"), tuple(args))
        keys = ("id", "kind", "request_id", "time", "epsilon", "delta", "epsilon_max", "rho", "mechanism", "realised",
                "reservation")
        return [dict(zip(keys, row)) for row in cur.fetchall()]

    def check(self) -> list[str]:
        """Recompute every budget from its events; return the inconsistencies found (none: [])."""
        problems = []
        for s in self.budgets():
            cur = self._conn().cursor()
            cur.execute(self._q("SELECT kind, epsilon, delta, epsilon_max, reservation, id, rho FROM events "
                                "WHERE budget = ?"), (s.name,))
            rows = cur.fetchall()
            settled = [r for r in rows if r[0] != "reserve"]
            settled_ids = {r[4] for r in settled}
            open_ = [r for r in rows if r[0] == "reserve" and r[5] not in settled_ids]
            spent = math.fsum(r[1] for r in settled)
            reserved = math.fsum(r[3] for r in open_)
            if not math.isclose(spent, s.spent.epsilon, rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"{s.name}: counters say spent {s.spent.epsilon}, events say {spent}")
            if len(open_) != s.open or not math.isclose(reserved, s.reserved.epsilon, rel_tol=1e-9, abs_tol=1e-9):
                problems.append(f"{s.name}: {s.open} open reservations by counter, {len(open_)} by events")
            if s.zcdp:
                spent_rho = math.fsum(r[6] or 0.0 for r in settled)
                reserved_rho = math.fsum(r[6] or 0.0 for r in open_)
                if not math.isclose(spent_rho, s.spent_rho, rel_tol=1e-9, abs_tol=1e-12):
                    problems.append(f"{s.name}: counters say rho spent {s.spent_rho}, events say {spent_rho}")
                if spent_rho + reserved_rho > s.rho_total * (1 + 1e-12):
                    problems.append(f"{s.name}: rho spent {spent_rho} + reserved {reserved_rho} exceeds rho_total "
                                    f"{s.rho_total}")
            elif spent + reserved > s.total.epsilon * (1 + 1e-12):
                problems.append(f"{s.name}: spent {spent} + reserved {reserved} exceeds the total {s.total.epsilon}")
            if len(settled) != s.queries:
                problems.append(f"{s.name}: {s.queries} queries by counter, {len(settled)} settlements")
        return problems
