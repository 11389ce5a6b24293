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
"""

from __future__ import annotations

import argparse
import http.client
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import STUB, Server, call, chat  # noqa: E402  (the tests' server harness)

from privalign.ledger import Ledger  # noqa: E402


def soak(clients: int, cycles: int, seconds: float, total: float, postgres: str | None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="privalign-soak-"))
    cfg = f"ledger_lease_s = 1.0\nmax_inflight_per_tenant = {clients}\n" + STUB.format(total=total)
    if postgres:
        import psycopg

        with psycopg.connect(postgres, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS events, budgets, owners")
    srv = Server(tmp, cfg, ledger_url=postgres)
    received, statuses, lock = [], Counter(), threading.Lock()
    for _ in range(cycles):
        srv.start()
        stop = threading.Event()

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
                    statuses[status] += 1
                    if status == 200:
                        received.append(body["privalign"]["request_id"])

        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
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
    charged = {c[0]: c for c in ledger.charges("acme-rm")}
    spent = math.fsum(c[2] for c in charged.values())
    return {"clients": clients, "cycles": cycles, "answers": len(received),
            "answers_charged": len(set(received) & set(charged)), "settlements": len(charged),
            "recovered": sum(1 for c in charged.values() if c[1] == "recover"),
            "5xx": sum(v for k, v in statuses.items() if isinstance(k, int) and k >= 500),
            "4xx": sum(v for k, v in statuses.items() if isinstance(k, int) and 400 <= k < 500),
            "cut": statuses["cut by the kill"], "epsilon_spent": spent, "epsilon_total": total,
            "open": ledger.budget("acme-rm").open, "ledger_check": ledger.check()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--total", type=float, default=1e6)
    ap.add_argument("--postgres", default=None)
    a = ap.parse_args()
    r = soak(a.clients, a.cycles, a.seconds, a.total, a.postgres)
    for k, v in r.items():
        print(f"{k:>16}: {v}")
    ok = (r["5xx"] == 0 and r["answers_charged"] == r["answers"] and r["epsilon_spent"] <= r["epsilon_total"]
          and r["open"] == 0 and not r["ledger_check"])
    print("soak:", "PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
