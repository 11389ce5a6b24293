"""A durable privacy ledger: the privacy filter's rule inside database transactions.

Every budget guards one reward model / private data set. Charging has two steps:

1. ``reserve``: before generation, in one transaction, admit the query's worst case
   (epsilon_max, delta) under the filter rule (``accounting.filter.admits``), or refuse.
2. ``settle``: after selection, in one transaction, charge the realised cost
   (``accounting.filter.charge_amount``: ex-post under FSRC, the worst case under basic
   composition; ``charge_rho``: the query's rho under zCDP) and release the rest of the
   reservation.

Each reservation records the query's privacy event (mechanism, parameters as JSON, epsilon_max,
delta, rho) and each settlement the realised epsilon, so a budget can be re-accounted under another
composition (``account``, ``privalign ledger account``). A zcdp budget admits by rho against its
rho_total (the largest rho whose conversion fits its (epsilon_total, delta_total)).

The record is append-only: one ``events`` row per reservation, settlement or recovery, never
updated or deleted. Per-budget counters are updated in the same transactions, so admission does
not scan the history; ``check`` recomputes them from the events. ``recover`` (run at start-up)
settles every reservation whose request died at its worst case: it is never refunded, since the
candidates may have been observed.

Back ends share schema and logic: SQLite (a path; WAL mode, ``synchronous=FULL``, ``BEGIN
IMMEDIATE``, safe across threads and processes on one machine) and PostgreSQL (a
``postgresql://`` URL; ``SELECT ... FOR UPDATE`` row locks, for several replicas on several
machines).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from .accounting.events import PrivacyEvent, account
from .accounting.filter import (
    COMPOSITIONS,
    Privacy,
    admits,
    admits_rho,
    budget_rho_total,
    charge_amount,
    charge_rho,
    query_rho,
)
from .accounting.zcdp import check_rho, pure_dp_rho, zcdp_epsilon

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS budgets (
        name TEXT PRIMARY KEY, tenant TEXT, epsilon_total DOUBLE PRECISION NOT NULL,
        delta_total DOUBLE PRECISION NOT NULL, composition TEXT NOT NULL,
        spent_epsilon DOUBLE PRECISION NOT NULL DEFAULT 0, spent_delta DOUBLE PRECISION NOT NULL DEFAULT 0,
        reserved_epsilon DOUBLE PRECISION NOT NULL DEFAULT 0, reserved_delta DOUBLE PRECISION NOT NULL DEFAULT 0,
        queries BIGINT NOT NULL DEFAULT 0, refusals BIGINT NOT NULL DEFAULT 0, open BIGINT NOT NULL DEFAULT 0,
        rho_total DOUBLE PRECISION, spent_rho DOUBLE PRECISION NOT NULL DEFAULT 0,
        reserved_rho DOUBLE PRECISION NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS events (
        id {serial}, budget TEXT NOT NULL, kind TEXT NOT NULL, reservation BIGINT, request_id TEXT, owner TEXT,
        epsilon DOUBLE PRECISION NOT NULL, delta DOUBLE PRECISION NOT NULL,
        epsilon_max DOUBLE PRECISION NOT NULL, created DOUBLE PRECISION NOT NULL,
        rho DOUBLE PRECISION, mechanism TEXT, params TEXT, realised DOUBLE PRECISION)""",
    "CREATE UNIQUE INDEX IF NOT EXISTS events_one_settlement ON events (reservation)",
    "CREATE TABLE IF NOT EXISTS owners (owner TEXT PRIMARY KEY, heartbeat DOUBLE PRECISION NOT NULL)",
    "CREATE INDEX IF NOT EXISTS events_budget ON events (budget, kind)",
]

# columns added after the first release: (table, column, type); ``Ledger`` adds any that an existing
# database lacks (rows written before them have rho, mechanism, params and realised NULL)
MIGRATIONS = [
    ("budgets", "rho_total", "DOUBLE PRECISION"),
    ("budgets", "spent_rho", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
    ("budgets", "reserved_rho", "DOUBLE PRECISION NOT NULL DEFAULT 0"),
    ("events", "rho", "DOUBLE PRECISION"),
    ("events", "mechanism", "TEXT"),
    ("events", "params", "TEXT"),
    ("events", "realised", "DOUBLE PRECISION"),
]


_NO_LOCK = contextlib.nullcontext()


class _Op:
    """One operation waiting for the group commit."""

    __slots__ = ("done", "durable", "error", "op", "result")

    def __init__(self, op, durable: bool):
        self.op, self.durable, self.done, self.result, self.error = op, durable, False, None, None


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
        if self.zcdp:
            out.update(rho_total=self.rho_total, rho_spent=self.spent_rho, rho_reserved=self.reserved_rho,
                       rho_remaining=self.remaining_rho)
        return out


_COLS = ("name, tenant, epsilon_total, delta_total, composition, spent_epsilon, spent_delta, reserved_epsilon, "
         "reserved_delta, queries, refusals, open, rho_total, spent_rho, reserved_rho")


def _state(row) -> BudgetState:
    return BudgetState(row[0], row[1], Privacy(row[2], row[3]), row[4], Privacy(row[5], row[6]),
                       Privacy(row[7], row[8]), int(row[9]), int(row[10]), int(row[11]),
                       None if row[12] is None else float(row[12]), float(row[13]), float(row[14]))


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


class Ledger:
    """Open with a SQLite path or a ``postgresql://`` URL."""

    def __init__(self, url: str, synchronous: str = "FULL", lease: float = 30.0):
        """``lease``: seconds after its last heartbeat when a process counts as dead, so that its open
        reservations may be recovered (settled at their worst case) by another process."""
        self.url = str(url)
        self.lease = lease
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.postgres = self.url.startswith(("postgresql://", "postgres://"))
        self.p = "%s" if self.postgres else "?"
        self._local = threading.local()
        self._write_lock = threading.Lock()
        self._batch: list[_Op] = []  # SQLite group commit (``_run``)
        self._batch_cond = threading.Condition()
        self._combining = False
        self.synchronous = synchronous
        with self._tx() as cur:
            if self.postgres:
                # replicas starting together on an empty database: CREATE TABLE IF NOT EXISTS is not safe
                # against itself in PostgreSQL (unique violation in pg_type), so take a transaction-level
                # advisory lock first; it is released at commit
                cur.execute("SELECT pg_advisory_xact_lock(7351902214)")
            for stmt in SCHEMA:
                cur.execute(stmt.format(serial="BIGSERIAL PRIMARY KEY" if self.postgres
                                        else "INTEGER PRIMARY KEY AUTOINCREMENT"))
            self._migrate(cur)

    def _migrate(self, cur) -> None:
        """Add the columns of ``MIGRATIONS`` that an existing database lacks (in the same transaction)."""
        # ALTER TABLE only where a column is missing: on PostgreSQL it takes an exclusive lock even when
        # the column exists, which would deadlock with replicas already serving
        for table, column, kind in MIGRATIONS:
            if self.postgres:
                cur.execute("SELECT 1 FROM information_schema.columns WHERE table_schema = current_schema() "
                            "AND table_name = %s AND column_name = %s", (table, column))
                if cur.fetchone() is None:
                    cur.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {kind}")
            else:
                cur.execute(f"PRAGMA table_info({table})")
                if column not in {r[1] for r in cur.fetchall()}:
                    cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")

    # ------------------------------------------------------------------ connections and transactions
    def _conn(self):
        conn = getattr(self._local, "conn", None)
        if conn is None:
            if self.postgres:
                import psycopg

                conn = psycopg.connect(self.url, autocommit=True)
            else:
                conn = sqlite3.connect(self.url, timeout=60.0, isolation_level=None, check_same_thread=False)
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={self.synchronous}")
                conn.execute("PRAGMA busy_timeout=60000")
                self._local.sync_mode = self.synchronous
            self._local.conn = conn
        return conn

    @contextmanager
    def _tx(self, durable: bool = True):
        """One transaction. ``durable=False`` commits without waiting for the disk; it is used only
        for reservations: the settlement that must precede any answer commits durably, and that
        flush also persists every earlier commit (SQLite's WAL and PostgreSQL's WAL are sequential).
        A reservation lost to a power failure therefore belongs to a request that was never answered;
        a killed process loses nothing, since committed data is in the OS's page cache."""
        conn = self._conn()
        cur = conn.cursor()
        if not self.postgres:
            mode = self.synchronous if durable else "NORMAL"
            if getattr(self._local, "sync_mode", None) != mode:  # a PRAGMA only when the mode changes
                cur.execute(f"PRAGMA synchronous={mode}")
                self._local.sync_mode = mode
        # SQLite admits one writer at a time and makes waiters sleep in growing steps (up to 100 ms);
        # threads of this process queue on a mutex instead, so only other processes use the busy wait.
        lock = self._write_lock if not self.postgres else _NO_LOCK
        with lock:
            try:
                cur.execute("BEGIN" if self.postgres else "BEGIN IMMEDIATE")
                if self.postgres and not durable:
                    cur.execute("SET LOCAL synchronous_commit = off")
                yield cur
                cur.execute("COMMIT")
            except BaseException:
                # BEGIN, the body or COMMIT itself failed (a full disk, an I/O error, a dropped
                # connection): leave no transaction open, or every later one on this connection fails
                # and other processes wait on its lock
                self._reset(conn)
                raise

    def _reset(self, conn) -> None:
        """Roll back whatever transaction ``conn`` has open; if even that fails, close it, so that the
        next operation of this thread opens a fresh connection."""
        if not self.postgres and not getattr(conn, "in_transaction", True):
            return  # nothing open (BEGIN itself failed)
        try:
            conn.cursor().execute("ROLLBACK")
            return
        except Exception:
            pass
        try:
            conn.close()
        except Exception:
            pass
        self._local.conn = None  # _tx runs on this thread's connection: the next operation opens a new one

    def _run(self, op, durable: bool = True):
        """``op(cur)`` in a transaction; returns its result or raises its exception.

        SQLite: group commit. Threads that arrive while a transaction is being written queue their
        operations; the next of them to run takes every queued operation and runs them all, in
        order, in one transaction (each in its own savepoint, so one that raises is undone alone),
        with one commit and, if any of them is durable, one fsync. Nobody gets a result before the
        commit returns, and if the commit fails every operation of the batch fails: a result is
        never reported for an operation that was not committed. Without it, concurrent requests'
        reserve and settle transactions pass the write lock from thread to thread one at a time,
        each paying its own commit and waking its own thread (docs/benchmarks.md, issue 11).
        PostgreSQL: one transaction per operation (its row locks already let replicas interleave).
        """
        if self.postgres:
            with self._tx(durable) as cur:
                return op(cur)
        item = _Op(op, durable)
        with self._batch_cond:
            self._batch.append(item)
            while not item.done and self._combining:
                self._batch_cond.wait()
            if not item.done:
                self._combining = True
                batch, self._batch = self._batch, []
        if not item.done:
            try:
                self._run_batch(batch)
            finally:
                with self._batch_cond:
                    self._combining = False
                    self._batch_cond.notify_all()
        if item.error is not None:
            raise item.error
        return item.result

    def _run_batch(self, batch: list[_Op]) -> None:
        """Run queued operations in one SQLite transaction (see ``_run``)."""
        try:
            with self._tx(durable=any(o.durable for o in batch)) as cur:
                if len(batch) == 1:
                    batch[0].result = batch[0].op(cur)  # an exception rolls the transaction back and reaches it
                else:
                    for o in batch:
                        cur.execute("SAVEPOINT op")
                        try:
                            o.result = o.op(cur)
                        except Exception as e:  # this operation alone is undone; the others go on
                            cur.execute("ROLLBACK TO op")
                            o.result, o.error = None, e
                        cur.execute("RELEASE op")
        except BaseException as e:  # BEGIN or COMMIT failed (or an exception in a lone operation)
            for o in batch:
                if o.error is None:
                    o.result, o.error = None, e
            if not isinstance(e, Exception):
                raise
        finally:
            for o in batch:
                o.done = True

    def _q(self, sql: str) -> str:
        return sql.replace("?", self.p)

    def _lock(self, cur, name: str):
        cur.execute(self._q(f"SELECT {_COLS} FROM budgets WHERE name = ?" + (" FOR UPDATE" if self.postgres else "")),
                    (name,))
        row = cur.fetchone()
        if row is None:
            raise UnknownBudget(name)
        return _state(row)

    def close(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

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
