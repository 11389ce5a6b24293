"""Soak: many clients against `privalign serve`, killed with SIGKILL again and again.

Run: ``.venv/bin/python benchmarks/soak_service.py [--clients 64] [--cycles 20] [--seconds 2]
[--postgres URL]``

Each cycle starts a real uvicorn server on loopback (stub generator and reward model, so the
service and its ledger are what is exercised), lets ``--clients`` threads send PrivITP and PrivBoN
requests for ``--seconds``, then kills the server with SIGKILL mid-load. After the last cycle the
server is started once more (recovering the dead processes' reservations) and the ledger is
audited. Reported: answers received, refusals (4xx), server errors (5xx), requests cut by the
kill, every received answer charged or not, overspend, open reservations. Exits 1 on any 5xx,
uncharged answer, overspend or inconsistency.

``--fault-cycles K`` (SQLite, root: the ledger lives on a small tmpfs of its own) adds K cycles of a
real full disk under load: a filler file takes every free byte for ``--fault-seconds``, then is
removed. While the disk is full the service must answer 503 ``ledger_unavailable`` (or, for a
request caught between its reservation and its settlement, 500 ``ledger_error`` with the answer
withheld), and it must recover by itself: answers again within 5 s of the fault clearing, its
unsettled worst-case charges settled. Reported: fault windows, 503s, withheld answers, seconds to
recover.
"""

from __future__ import annotations

import argparse
import http.client
import math
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import STUB, Server, call, chat  # noqa: E402  (the tests' server harness)

from privalign.ledger import Ledger  # noqa: E402


def _fill(folder: Path) -> Path:
    """Take every free byte of the file system under ``folder`` (a real 'disk full')."""
    filler = folder / "filler"
    with open(filler, "wb") as fh:
        try:
            while True:
                fh.write(b"\0" * (1 << 16))
                fh.flush()
        except OSError:
            pass
    return filler


def soak(clients: int, cycles: int, seconds: float, total: float, postgres: str | None, fault_cycles: int = 0,
         fault_seconds: float = 2.0) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="privalign-soak-"))
    disk = None
    if fault_cycles:
        if postgres:
            raise SystemExit("--fault-cycles needs the SQLite ledger")
        disk = tmp / "disk"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)]).returncode:
            raise SystemExit("--fault-cycles needs root (a tmpfs of its own for the ledger)")
    cfg = f"ledger_lease_s = 1.0\nmax_inflight_per_tenant = {clients}\n" + STUB.format(total=total)
    if postgres:
        import psycopg

        with psycopg.connect(postgres, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS events, budgets, owners")
    srv = Server(tmp, cfg, ledger_url=postgres or (str(disk / "ledger.db") if disk else None))
    received, statuses, lock = [], Counter(), threading.Lock()
    faults = {"windows": 0, "503": 0, "withheld": 0, "recovery_s": []}

    def load(stop, record_faults=False):
        def client(i):
            ext = ({"mechanism": "privitp", "n": 6, "delta": 1e-7} if i % 2 else  # delta must not bind
                   {"mechanism": "privbon", "n": 6, "epsilon": 0.05})
            while not stop.is_set():
                try:
                    status, body = chat(srv.url, ext)
                except (OSError, ValueError, http.client.HTTPException):
                    with lock:
                        statuses["cut by the kill"] += 1
                    continue
                with lock:
                    kind = body.get("error", {}).get("type") if status != 200 else None
                    if record_faults and status == 503 and kind == "ledger_unavailable":
                        faults["503"] += 1
                    elif record_faults and status == 500 and kind == "ledger_error":
                        faults["withheld"] += 1
                    else:
                        statuses[status] += 1
                    if status == 200:
                        received.append(body["privalign"]["request_id"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        return threads

    for _ in range(fault_cycles):
        srv.start()
        stop = threading.Event()
        threads = load(stop, record_faults=True)
        time.sleep(seconds)
        filler = _fill(disk)
        faults["windows"] += 1
        time.sleep(fault_seconds)
        filler.unlink()
        t0, before = time.time(), len(received)
        while time.time() - t0 < 30:
            if len(received) > before and call(srv.url, "/healthz")[1].get("unsettled_reservations") == 0:
                break
            time.sleep(0.05)
        faults["recovery_s"].append(round(time.time() - t0, 2))
        time.sleep(seconds)
        srv.kill9()
        stop.set()
        for t in threads:
            t.join()
    for _ in range(cycles):
        srv.start()
        stop = threading.Event()
        threads = load(stop)
        time.sleep(seconds)
        srv.kill9()
        stop.set()
        for t in threads:
            t.join()
    srv.start()  # recovers the reservations of the killed processes
    deadline = time.time() + 15
    while call(srv.url, "/v1/budgets/acme-rm")[1]["open_reservations"] and time.time() < deadline:
        time.sleep(0.2)
    srv.stop()
    ledger = Ledger(postgres or str(srv.ledger_path))
    if disk is not None:  # the audit reads the ledger first; then the tmpfs goes
        import atexit

        atexit.register(subprocess.run, ["umount", "-l", str(disk)])
    charged = {c[0]: c for c in ledger.charges("acme-rm")}
    spent = math.fsum(c[2] for c in charged.values())
    return {"clients": clients, "cycles": cycles, "answers": len(received),
            "answers_charged": len(set(received) & set(charged)), "settlements": len(charged),
            "recovered": sum(1 for c in charged.values() if c[1] == "recover"),
            "5xx": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
            "4xx": sum(v for k, v in statuses.items() if isinstance(k, int) and 400 <= k < 500),
            "cut": statuses["cut by the kill"], "epsilon_spent": spent, "epsilon_total": total,
            "open": ledger.budget("acme-rm").open, "ledger_check": ledger.check(),
            "fault_windows": faults["windows"], "fault_503": faults["503"], "fault_withheld": faults["withheld"],
            "recovery_s": faults["recovery_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--total", type=float, default=1e6)
    ap.add_argument("--postgres", default=None)
    ap.add_argument("--fault-cycles", type=int, default=0, help="cycles of a real full disk under load (root)")
    ap.add_argument("--fault-seconds", type=float, default=2.0)
    a = ap.parse_args()
    r = soak(a.clients, a.cycles, a.seconds, a.total, a.postgres, a.fault_cycles, a.fault_seconds)
    for k, v in r.items():
        print(f"{k:>16}: {v}")
    ok = (r["5xx"] == 0 and r["answers_charged"] == r["answers"] and r["epsilon_spent"] <= r["epsilon_total"]
          and r["open"] == 0 and not r["ledger_check"] and all(x < 5 for x in r["recovery_s"])
          and (not r["fault_windows"] or r["fault_503"] > 0))
    print("soak:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
