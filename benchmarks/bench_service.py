"""The service: throughput and ledger overhead with stub backends, and latency with the real models.

Run: ``.venv/bin/python benchmarks/bench_service.py [--postgres URL] [--real]``

1. HTTP throughput: a real uvicorn server (one process) on loopback with the stub generator and
   reward model (so the service itself is measured), n = 16, PrivBoN and PrivITP, the SQLite ledger
   (``synchronous=FULL``), and PostgreSQL when ``--postgres`` is given. Load comes from client
   processes with keep-alive connections on the same 2-core machine.
2. Ledger overhead per answered query (reserve + settle, both durable), p50/p99, measured in-process.
3. ``--real``: end-to-end latency with the embedded SmolLM2 + certified MiniLM reward model for
   n in {4, 16, 64}, and PrivITP's candidates generated against n + E[t] and 2n.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import CLIENT, STUB, Server  # noqa: E402  (the same server harness as the tests)


def _client(url, seconds, mechanism, out_q):
    import httpx

    body = {"model": "stub", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "privalign": {"mechanism": mechanism, "n": 16, "epsilon": 0.001,
                          **({"delta": 1e-8} if mechanism == "privitp" else {})}}  # delta must not bind
    ok = 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {CLIENT}"}, timeout=30) as c:
        end = time.time() + seconds
        while time.time() < end:
            r = c.post("/v1/chat/completions", json=body)
            ok += r.status_code == 200
    out_q.put(ok)


WRK_SCRIPT = """wrk.method = "POST"
wrk.body = '{"model":"stub","messages":[{"role":"user","content":"What is 2 + 2?"}],"privalign":%s}'
wrk.headers["Content-Type"] = "application/json"
wrk.headers["Authorization"] = "Bearer %s"
"""


def _wrk(url: str, mechanism: str, seconds: float) -> tuple[float, int]:
    """wrk (Debian's package), 2 threads x 16 connections: (requests/s, non-2xx responses)."""
    import json
    import re
    import subprocess

    ext = {"mechanism": mechanism, "n": 16, "epsilon": 0.001, **({"delta": 1e-8} if mechanism == "privitp" else {})}
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(WRK_SCRIPT % (json.dumps(ext), CLIENT))
    out = subprocess.run(["wrk", "-t2", "-c16", f"-d{int(seconds)}s", "-s", fh.name, url + "/v1/chat/completions"],
                         capture_output=True, text=True).stdout
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)), int(bad.group(1)) if bad else 0


def http_throughput(ledger_url: str | None, mechanism: str, clients=6, seconds=8.0) -> float:
    import shutil

    with tempfile.TemporaryDirectory() as d:
        srv = Server(Path(d), STUB.format(total=1e9))
        if ledger_url:
            srv.config.write_text(srv.config.read_text().replace(f'ledger = "{srv.ledger_path}"', f'ledger = "{ledger_url}"'))
        srv.start()
        try:
            if shutil.which("wrk"):
                rps, bad = _wrk(srv.url, mechanism, seconds)
                if bad:
                    raise RuntimeError(f"{bad} requests failed")
                return rps
            q = mp.Queue()
            procs = [mp.Process(target=_client, args=(srv.url, seconds, mechanism, q)) for _ in range(clients)]
            t0 = time.time()
            for p in procs:
                p.start()
            total = sum(q.get() for _ in procs)
            for p in procs:
                p.join()
            return total / (time.time() - t0)
        finally:
            srv.stop()


def ledger_overhead(ledger_url: str, requests=3000, threads=4) -> tuple[float, float]:
    from privalign.server.app import Service
    from privalign.server.config import ServiceConfig

    cfg = ServiceConfig.model_validate({"ledger": ledger_url, "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
                                        "budgets": [{"name": "default", "epsilon_total": 1e9, "delta_total": 0.9}]})
    svc = Service(cfg)
    msgs = [{"role": "user", "content": "hi"}]

    def work():
        for _ in range(requests // threads):
            svc.answer(msgs, {"mechanism": "privitp", "n": 16, "delta": 1e-8}, "default")

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    ms = np.array(svc.ledger_timings) * 1e3
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


def real_models(requests=6):
    from privalign.server.app import Service
    from privalign.server.config import ServiceConfig

    with tempfile.TemporaryDirectory() as d:
        cfg = ServiceConfig.model_validate({"ledger": str(Path(d) / "l.db"), "generator": {"max_new_tokens": 8},
                                            "budgets": [{"name": "default", "epsilon_total": 1e9, "delta_total": 0.9}]})
        svc = Service(cfg)
        from privalign.tasks import get_task

        task = get_task("arithmetic")
        probs = task.load("test", requests)
        rows = []
        for n in (4, 16, 64):
            for mech in ("privbon", "privitp"):
                lat, gen, halt = [], [], []
                for p in probs:
                    t0 = time.perf_counter()
                    out = svc.answer(task.messages(p), {"mechanism": mech, "n": n, "epsilon": 1.0}, "default")
                    lat.append(time.perf_counter() - t0)
                    gen.append(out["privalign"]["candidates_generated"])
                    halt.append(out["privalign"]["halting_time"] or 0)
                rows.append((n, mech, statistics.mean(lat), statistics.mean(gen), statistics.mean(halt)))
        return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--postgres", default=os.environ.get("PRIVALIGN_TEST_POSTGRES"))
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--skip-http", action="store_true", help="only the ledger (and --real) measurements")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    backends = [("SQLite (WAL, synchronous=FULL)", None)] + ([("PostgreSQL 15", args.postgres)] if args.postgres else [])
    print("| ledger | mechanism | answered requests/s (n = 16, stub models; load: wrk 2 threads x 16 connections) |")
    print("|---|---|---:|")
    for name, url in ([] if args.skip_http else backends):
        if url:
            import psycopg

            with psycopg.connect(url, autocommit=True) as c:
                c.execute("DROP TABLE IF EXISTS events, budgets, owners")
        for mech in ("privbon", "privitp"):
            print(f"| {name} | {mech} | {http_throughput(url, mech):.0f} |")
    print("\n| ledger | clients (threads) | reserve + settle per answered query, p50 | p99 |")
    print("|---|---:|---:|---:|")
    for name, url in backends:
        for threads in (1, 4):
            if url:
                import psycopg

                with psycopg.connect(url, autocommit=True) as c:
                    c.execute("DROP TABLE IF EXISTS events, budgets, owners")
                p50, p99 = ledger_overhead(url, threads=threads)
            else:
                with tempfile.TemporaryDirectory() as d:
                    p50, p99 = ledger_overhead(str(Path(d) / "l.db"), threads=threads)
            print(f"| {name} | {threads} | {p50:.2f} ms | {p99:.2f} ms |")
    if args.real:
        print("\n| n | mechanism | mean latency | candidates generated | mean halting time |")
        print("|---:|---|---:|---:|---:|")
        for n, mech, lat, gen, halt in real_models():
            print(f"| {n} | {mech} | {lat:.2f} s | {gen:.1f} (2n = {2 * n}) | {halt:.1f} |")


if __name__ == "__main__":
    main()
