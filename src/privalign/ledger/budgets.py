"""The ledger's rule: budgets, and reservations under the privacy filter (the first step of a
charge; ``settlements`` the second, ``records`` the reading), each one transaction of the store
(``ledger.store``); recovery of dead processes' reservations. The package docstring (``privalign.ledger``) describes
the two-step charge, the append-only record and recovery."""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid

from ..accounting.events import PrivacyEvent
from ..accounting.filter import COMPOSITIONS, admits, admits_rho, budget_rho_total, query_rho
from ..accounting.zcdp import check_rho, pure_dp_rho
from .settlements import Settlements
from .state import BudgetExhausted, BudgetState, UnknownBudget


def _provably_dead(owner: str | None) -> bool:
    """An owner ``host:pid:tag`` that ran on this host under a pid that no longer exists. (A reused
    pid looks alive: recovery then waits for the lease, the safe direction.)"""
    host, _, rest = (owner or "").partition(":")
    pid = rest.partition(":")[0]
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


class Ledger(Settlements):
    """Open with a SQLite path or a ``postgresql://`` URL."""

    def __init__(self, url: str, synchronous: str = "FULL", lease: float = 30.0):
        """``lease``: seconds after its last heartbeat when a process counts as dead, so that its open
        reservations may be recovered (settled at their worst case) by another process."""
        self.lease = lease
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        super().__init__(url, synchronous)

    # ------------------------------------------------------------------ budgets
    def set_budget(self, name: str, epsilon_total: float, delta_total: float = 0.0, composition: str = "fsrc",
                   tenant: str | None = None) -> BudgetState:
        """Create a budget, or raise an existing one (a total can only grow). Its composition can
        change only while it has no charge and no open reservation."""
        if composition not in COMPOSITIONS:
            raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
        if not (epsilon_total > 0 and math.isfinite(epsilon_total)) or not (0 <= delta_total < 1):
            raise ValueError(f"need epsilon_total > 0 and 0 <= delta_total < 1, got {epsilon_total!r}, {delta_total!r}")
        rho_total = budget_rho_total(composition, epsilon_total, delta_total)  # zcdp with delta_total 0: ValueError
        with self._tx() as cur:
            try:
                state = self._lock(cur, name)
            except UnknownBudget:
                cur.execute(self._q("INSERT INTO budgets (name, tenant, epsilon_total, delta_total, composition, "
                                    "rho_total) VALUES (?, ?, ?, ?, ?, ?)"),
                            (name, tenant, epsilon_total, delta_total, composition, rho_total))
                return self._lock(cur, name)
            if composition != state.composition and (state.queries or state.open):
                raise ValueError(f"budget {name!r} uses {state.composition!r} composition and has charges; it cannot "
                                 f"change to {composition!r}")
            if epsilon_total < state.total.epsilon or delta_total < state.total.delta:
                raise ValueError(f"budget {name!r} can only be raised (now epsilon={state.total.epsilon}, "
                                 f"delta={state.total.delta})")
            cur.execute(self._q("UPDATE budgets SET epsilon_total = ?, delta_total = ?, composition = ?, rho_total = ? "
                                "WHERE name = ?"), (epsilon_total, delta_total, composition, rho_total, name))
            return self._lock(cur, name)

    # ------------------------------------------------------------------ deployment settings
    def settle_setting(self, key: str, value):
        """Record ``value`` (JSON) under ``key`` unless a value is already recorded; return the
        recorded one. The first process to configure a deployment decides; every later one reads."""
        with self._tx() as cur:
            cur.execute(self._q("INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"),
                        (key, json.dumps(value, sort_keys=True)))
            cur.execute(self._q("SELECT value FROM settings WHERE key = ?"), (key,))
            return json.loads(cur.fetchone()[0])

    # ------------------------------------------------------------------ the two steps
    def reserve(self, name: str, epsilon_max: float = 0.0, delta: float = 0.0, request_id: str | None = None, *,
                rho: float | None = None, event: PrivacyEvent | None = None) -> int:
        """Hold the worst case, or raise ``BudgetExhausted`` (only the refusal counter changes).
        ``event`` (``accounting.events``) gives the query's epsilon_max, delta, rho, mechanism and
        parameters at once; a zcdp budget needs a rho (a pure query without one costs epsilon^2 / 2)."""
        return self.reserve_all([name], epsilon_max, delta, request_id, rho=rho, event=event)[0]

    def reserve_all(self, names, epsilon_max: float = 0.0, delta: float = 0.0, request_id: str | None = None, *,
                    rho: float | None = None, event: PrivacyEvent | None = None) -> list[int]:
        """``reserve`` on several budgets at once, atomically: the query is held on every one of them
        (one reservation each, in the order of ``names``) or on none, refused with ``BudgetExhausted``
        naming the first budget it does not fit (a tenant's budget and the deployment's model budget)."""
        mechanism, params = "query", None
        if event is not None:
            epsilon_max, delta, rho, mechanism, params = (event.epsilon, event.delta, event.rho, event.mechanism,
                                                          event.to_json())
        if not (epsilon_max >= 0 and math.isfinite(epsilon_max)) or not (0 <= delta < 1):
            raise ValueError(f"invalid worst case epsilon_max={epsilon_max!r}, delta={delta!r}")
        if rho is not None:
            rho = check_rho(rho)
        elif delta == 0:
            rho = pure_dp_rho(epsilon_max) if epsilon_max > 0 else 0.0  # any pure epsilon-DP query
        names = list(names)
        if len(set(names)) != len(names):
            raise ValueError(f"a query cannot be reserved twice on one budget: {names}")
        request_id = request_id or uuid.uuid4().hex

        def op(cur):
            # lock the budgets' rows in one global order (sorted names), so concurrent queries never deadlock
            states = {n: self._lock(cur, n) for n in sorted(names)}
            rhos = {}
            for n in names:
                s = states[n]
                if s.zcdp:
                    rhos[n] = query_rho(epsilon_max, delta, rho)  # ValueError: no zCDP bound (rolled back)
                    fits = admits_rho(s.spent_rho, s.reserved_rho, s.rho_total, rhos[n])
                else:
                    rhos[n] = rho
                    fits = admits(s.spent, s.reserved, s.total, epsilon_max, delta)
                if not fits:
                    cur.execute(self._q("UPDATE budgets SET refusals = refusals + 1 WHERE name = ?"), (n,))
                    return BudgetExhausted(n, epsilon_max, delta, s.remaining, rhos[n] if s.zcdp else None,
                                           s.remaining_rho)
            return [self._insert_reservation(cur, n, request_id, epsilon_max, delta, rhos[n], mechanism, params)
                    for n in names]

        rids = self._run(op, durable=False)
        if isinstance(rids, BudgetExhausted):  # the refusal is counted (committed); nothing is held
            raise rids
        return rids

    def charge_once(self, name: str, key: str, event: PrivacyEvent) -> bool:
        """Charge ``event`` to a budget once for ``key`` (a one-time release: the reward model's
        private output range), atomically; True if charged now, False if it already was. Refuses
        with ``BudgetExhausted`` when it does not fit. Safe when replicas start together."""
        def op(cur):
            s = self._lock(cur, name)  # serialises concurrent starts: the second sees the first's charge
            cur.execute(self._q("SELECT 1 FROM events WHERE budget = ? AND request_id = ? AND kind = 'release'"),
                        (name, key))
            if cur.fetchone() is not None:
                return False
            rho = query_rho(event.epsilon, event.delta, event.rho) if s.zcdp else event.rho
            fits = (admits_rho(s.spent_rho, s.reserved_rho, s.rho_total, rho) if s.zcdp
                    else admits(s.spent, s.reserved, s.total, event.epsilon, event.delta))
            if not fits:
                return BudgetExhausted(name, event.epsilon, event.delta, s.remaining, rho if s.zcdp else None,
                                       s.remaining_rho)
            rid = self._insert_reservation(cur, name, key, event.epsilon, event.delta, rho, event.mechanism,
                                           event.to_json())
            s = self._lock(cur, name)
            self._settle_one(cur, rid, (name, key, event.delta, event.epsilon, rho, event.mechanism,
                                        event.to_json()), s, None, "release")
            return True

        out = self._run(op, durable=True)
        if isinstance(out, BudgetExhausted):
            raise out
        return out

    def heartbeat(self) -> None:
        """Record that this process is alive (its reservations are not to be recovered)."""
        with self._tx() as cur:
            cur.execute(self._q("DELETE FROM owners WHERE owner = ?"), (self.owner,))
            cur.execute(self._q("INSERT INTO owners (owner, heartbeat) VALUES (?, ?)"), (self.owner, time.time()))

    def recover(self, lease: float | None = None) -> int:
        """Settle, at their worst case, the open reservations of processes that are dead: whose last
        heartbeat is older than ``lease`` seconds (or that never sent one), or that ran on this host
        under a pid that no longer exists (provably gone: no need to wait for the lease). Never
        refunds: their candidates may have been observed. Safe to run while other processes serve."""
        lease = self.lease if lease is None else lease
        cur = self._conn().cursor()
        cur.execute(self._q("SELECT r.id, r.owner, o.heartbeat FROM events r LEFT JOIN owners o ON o.owner = r.owner "
                            "WHERE r.kind = 'reserve' AND (r.owner IS NULL OR r.owner != ?) "
                            "AND NOT EXISTS (SELECT 1 FROM events s WHERE s.reservation = r.id)"), (self.owner,))
        cutoff = time.time() - lease
        recovered = 0
        for rid, owner, heartbeat in cur.fetchall():
            if heartbeat is not None and heartbeat >= cutoff and not _provably_dead(owner):
                continue
            try:
                self.settle(rid, None, kind="recover")
                recovered += 1
            except Exception:  # settled meanwhile by its owner or another recoverer: nothing to do
                pass
        return recovered

