"""The ledger's rule: budgets, reservations and settlements under the privacy filter, each one
transaction of the store (``ledger.store``). The package docstring (``privalign.ledger``) describes
the two-step charge, the append-only record and recovery."""

from __future__ import annotations

import json
import math
import os
import socket
import time
import uuid

from ..accounting.events import PrivacyEvent, account
from ..accounting.filter import (
    COMPOSITIONS,
    Privacy,
    admits,
    admits_rho,
    budget_rho_total,
    charge_amount,
    charge_rho,
    query_rho,
)
from ..accounting.zcdp import check_rho, pure_dp_rho
from .state import _COLS, BudgetExhausted, BudgetState, UnknownBudget, _state
from .store import Store


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


class Ledger(Store):
    """Open with a SQLite path or a ``postgresql://`` URL."""

    def __init__(self, url: str, synchronous: str = "FULL", lease: float = 30.0):
        """``lease``: seconds after its last heartbeat when a process counts as dead, so that its open
        reservations may be recovered (settled at their worst case) by another process."""
        self.lease = lease
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        super().__init__(url, synchronous)

    def _lock(self, cur, name: str):
        cur.execute(self._q(f"SELECT {_COLS} FROM budgets WHERE name = ?" + (" FOR UPDATE" if self.postgres else "")),
                    (name,))
        row = cur.fetchone()
        if row is None:
            raise UnknownBudget(name)
        return _state(row)

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
    def setting(self, key: str):
        """A deployment setting recorded in the ledger (JSON), or None when none is."""
        cur = self._conn().cursor()
        cur.execute(self._q("SELECT value FROM settings WHERE key = ?"), (key,))
        row = cur.fetchone()
        return None if row is None else json.loads(row[0])

    def settle_setting(self, key: str, value):
        """Record ``value`` (JSON) under ``key`` unless a value is already recorded; return the
        recorded one. The first process to configure a deployment decides; every later one reads."""
        with self._tx() as cur:
            cur.execute(self._q("INSERT INTO settings (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING"),
                        (key, json.dumps(value, sort_keys=True)))
            cur.execute(self._q("SELECT value FROM settings WHERE key = ?"), (key,))
            return json.loads(cur.fetchone()[0])

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
            rids = []
            for n in names:
                cur.execute(self._q("INSERT INTO events (budget, kind, request_id, owner, epsilon, delta, epsilon_max, "
                                    "created, rho, mechanism, params) VALUES (?, 'reserve', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                                    + (" RETURNING id" if self.postgres else "")),
                            (n, request_id, self.owner, epsilon_max, delta, epsilon_max, time.time(), rhos[n],
                             mechanism, params))
                rids.append(cur.fetchone()[0] if self.postgres else cur.lastrowid)
                cur.execute(self._q("UPDATE budgets SET reserved_epsilon = reserved_epsilon + ?, "
                                    "reserved_delta = reserved_delta + ?, reserved_rho = reserved_rho + ?, "
                                    "open = open + 1 WHERE name = ?"),
                            (epsilon_max, delta, rhos[n] or 0.0, n))
            return rids

        rids = self._run(op, durable=False)
        if isinstance(rids, BudgetExhausted):  # the refusal is counted (committed); nothing is held
            raise rids
        return rids

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
            cur.execute(self._q("INSERT INTO events (budget, kind, request_id, owner, epsilon, delta, epsilon_max, "
                                "created, rho, mechanism, params) VALUES (?, 'reserve', ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                                + (" RETURNING id" if self.postgres else "")),
                        (name, key, self.owner, event.epsilon, event.delta, event.epsilon, time.time(), rho,
                         event.mechanism, event.to_json()))
            rid = cur.fetchone()[0] if self.postgres else cur.lastrowid
            cur.execute(self._q("UPDATE budgets SET reserved_epsilon = reserved_epsilon + ?, reserved_delta = "
                                "reserved_delta + ?, reserved_rho = reserved_rho + ?, open = open + 1 WHERE name = ?"),
                        (event.epsilon, event.delta, rho or 0.0, name))
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
