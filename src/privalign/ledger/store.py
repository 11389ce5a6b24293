"""Where the ledger's records live: SQLite or PostgreSQL, with one transaction per operation.

``Store`` owns the connections (one per thread), the schema and its migrations, transactions that
leave nothing open when they fail (``_tx``), and SQLite's group commit (``_run``). It knows nothing
of budgets: ``Ledger`` (``ledger.budgets``) puts the privacy filter's rule inside its transactions.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from contextlib import contextmanager

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
    # a deployment's settings, recorded once by the first process to configure it (``Ledger.settle_setting``)
    "CREATE TABLE IF NOT EXISTS settings (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
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


class Store:
    """A SQLite path (WAL mode, ``BEGIN IMMEDIATE``) or a ``postgresql://`` URL (row locks)."""

    def __init__(self, url: str, synchronous: str = "FULL"):
        """Open (and create or migrate the schema of) a SQLite path or a ``postgresql://`` URL."""
        self.url = str(url)
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

    def close(self):
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None
