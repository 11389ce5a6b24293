"""The durable ledger on a real SQLite file and a real PostgreSQL server (started by .ci/run)."""

import math
import multiprocessing as mp
import os
import time

import pytest

from privalign.ledger import BudgetExhausted, Ledger, UnknownBudget

PG = os.environ.get("PRIVALIGN_TEST_POSTGRES")


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "ledger.db")
    if not PG:
        pytest.skip("PRIVALIGN_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
    import psycopg

    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS events, budgets")
    return PG


def test_two_step_charging_fsrc_and_basic(url):
    led = Ledger(url)
    led.set_budget("f", 10.0, 0.1, "fsrc", tenant="t")
    led.set_budget("b", 10.0, 0.1, "basic", tenant="t")
    for name, expect in (("f", 0.5), ("b", 2.0)):
        rid = led.reserve(name, 2.0, 0.01, "req-" + name)
        held = led.budget(name)
        assert held.reserved == (2.0, 0.01) and held.open == 1
        assert led.settle(rid, 0.5) == expect
        after = led.budget(name)
        assert after.spent == (expect, 0.01) and after.reserved == (0.0, 0.0) and after.queries == 1
        with pytest.raises(Exception):
            led.settle(rid, 0.1)  # a reservation is settled once
    # an ex-post cost above the worst case cannot happen with privalign's accountant; if a caller's
    # mechanism reports one, the answer exists, so it is charged in full (never refused after the fact)
    assert led.settle(led.reserve("f", 1.0, 0.0), 1.5) == 1.5
    assert led.budget("f").spent.epsilon == 2.0 and led.budget("f").open == 0


def test_refusal_spends_nothing_and_totals_only_grow(url):
    led = Ledger(url)
    led.set_budget("x", 1.0, 0.0)
    led.settle(led.reserve("x", 0.6, 0.0), 0.6)
    before = led.budget("x")
    with pytest.raises(BudgetExhausted):
        led.reserve("x", 0.5, 0.0)
    after = led.budget("x")
    assert (after.spent, after.reserved, after.queries, after.refusals) == (before.spent, before.reserved, 1, 1)
    with pytest.raises(ValueError, match="raised"):
        led.set_budget("x", 0.5)
    with pytest.raises(ValueError, match="composition"):
        led.set_budget("x", 2.0, 0.0, "basic")
    assert led.set_budget("x", 2.0).total.epsilon == 2.0
    led.reserve("x", 0.5, 0.0)
    with pytest.raises(UnknownBudget):
        led.reserve("nope", 0.1, 0.0)


def test_recovery_settles_dead_requests_at_their_worst_case(url):
    led = Ledger(url)
    led.set_budget("r", 5.0, 0.5)
    led.reserve("r", 1.5, 0.01, "dead-1")
    led.reserve("r", 0.5, 0.01, "dead-2")
    led.close()
    again = Ledger(url, lease=0.5)  # a new process after a crash
    assert again.recover() == 2  # the dead process never heartbeat: its reservations are recovered at once
    alive = Ledger(url, lease=60)
    alive.heartbeat()
    alive.reserve("r", 0.25, 0.0, "live")
    assert again.recover() == 0  # a live process's reservation is left alone
    time.sleep(0.6)  # the live process stops heartbeating: past the 0.5 s lease it counts as dead
    assert Ledger(url, lease=0.5).recover() == 1
    s = again.budget("r")
    assert s.spent.epsilon == pytest.approx(2.25) and s.open == 0 and s.queries == 3
    assert {c[0]: c[2] for c in again.charges("r")} == {"dead-1": 1.5, "dead-2": 0.5, "live": 0.25}
    assert again.check() == []


def _hammer(url, n, seed):
    import numpy as np

    led = Ledger(url)
    rng = np.random.default_rng(seed)
    ok = 0
    for _ in range(n):
        try:
            rid = led.reserve("shared", float(rng.uniform(0.05, 0.2)), 1e-4)
            led.settle(rid, float(rng.uniform(0.0, 0.05)))
            ok += 1
        except BudgetExhausted:
            pass
    return ok


def test_processes_hammering_one_budget_never_overspend(url):
    Ledger(url).set_budget("shared", 3.0, 0.9)
    with mp.get_context("spawn").Pool(4) as pool:
        answered = sum(pool.starmap(_hammer, [(url, 120, s) for s in range(4)]))
    led = Ledger(url)
    charges = led.charges("shared")
    assert len(charges) == answered > 0
    assert math.fsum(c[2] for c in charges) <= 3.0
    assert led.check() == []
    assert led.budget("shared").remaining.epsilon < 0.2  # it stopped only when a worst case no longer fit


def test_restart_recovers_a_killed_process_at_once_without_waiting_for_its_lease(tmp_path):
    """Same host, dead pid: provably gone, so its reservation is settled (at its worst case) by the
    next process to start, though its heartbeat is recent and the lease is a minute long."""
    import subprocess
    import sys

    db = str(tmp_path / "ledger.db")
    Ledger(db).set_budget("r", 5.0, 0.5)
    child = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom privalign.ledger import Ledger\n"
        f"led = Ledger({db!r}, lease=60)\nled.heartbeat()\nled.reserve('r', 1.25, 0.0, 'in-flight')\n"
        "print('reserved', flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "reserved"
    live = Ledger(db, lease=60)
    assert live.recover() == 0  # its owner is alive: left alone
    child.kill()
    child.wait()
    assert Ledger(db, lease=60).recover() == 1
    s = live.budget("r")
    assert s.spent.epsilon == 1.25 and s.open == 0 and live.charges("r")[0][1] == "recover"


def run_together(target, k: int | None = None, args=None) -> None:
    """Run ``target`` in k threads (or one per tuple of ``args``), all started, then all joined."""
    import threading

    threads = [threading.Thread(target=target, args=a) for a in (args if args is not None else [()] * k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_replicas_starting_together_on_an_empty_postgres_database():
    if not PG:
        pytest.skip("PRIVALIGN_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
    import threading

    import psycopg

    with psycopg.connect(PG, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS events, budgets, owners")
    errors, barrier = [], threading.Barrier(8)

    def start():
        try:
            barrier.wait()
            Ledger(PG)
        except Exception as e:  # noqa: BLE001 - any failure is the bug
            errors.append(e)

    run_together(start, 8)
    assert errors == []


def test_group_commit_keeps_every_operation_alone_in_its_outcome(tmp_path):
    """SQLite group commit: concurrent threads' reserve and settle operations share transactions;
    a failing one (a second settlement) is undone alone, and a transaction that fails to commit
    fails every operation in it (no result is reported for anything not committed)."""
    import sqlite3
    import threading
    from contextlib import contextmanager

    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("g", 1000.0, 0.5)
    barrier, lock = threading.Barrier(32), threading.Lock()
    outcomes, rids = [], []

    def worker():
        barrier.wait()
        for j in range(10):
            rid = led.reserve("g", 1.0, 0.001)
            led.settle(rid, 0.5)
            with lock:
                rids.append(rid)
            if j % 5 == 0:
                try:
                    led.settle(rid, 0.5)
                    outcome = "settled twice"
                except sqlite3.IntegrityError:
                    outcome = "refused"
                with lock:
                    outcomes.append(outcome)

    run_together(worker, 32)
    assert outcomes == ["refused"] * 64 and len(set(rids)) == 320
    state = led.budget("g")
    assert state.queries == 320 and state.open == 0 and math.isclose(state.spent.epsilon, 160.0)
    assert led.check() == []

    rids = [led.reserve("g", 1.0, 0.001) for _ in range(16)]
    real_tx = led._tx

    @contextmanager
    def failing_commit(durable=True):
        with real_tx(durable) as cur:
            yield cur
            raise OSError("disk I/O error")  # before COMMIT: the transaction is rolled back

    led._tx = failing_commit
    errors = []

    def settle(rid):
        try:
            led.settle(rid, 0.5)
        except OSError as e:
            errors.append(e)

    run_together(settle, args=[(rid,) for rid in rids])
    led._tx = real_tx
    assert len(errors) == 16  # every settlement of a failed transaction fails
    state = led.budget("g")
    assert state.queries == 320 and state.open == 16 and math.isclose(state.spent.epsilon, 160.0)
    assert [led.settle(rid, 0.5) for rid in rids] == [0.5] * 16 and led.check() == []
