"""The service at the speed of its backend (issue 11): ``privalign serve`` in front of an
OpenAI-compatible server, against that server alone.

Run: ``.venv/bin/python benchmarks/bench_service_concurrency.py [--seconds 8] [--clients 1,4,16,64]``

- The backend: a fake OpenAI-compatible server (``fake_openai_app`` from tests/test_server.py;
  uvicorn on loopback, one process) that answers every call after a fixed 200 ms whatever the
  concurrency, with ``n`` choices.
- Direct: C clients send it chat completions with n = 8 (what the service asks for a PrivBoN n = 8
  query). Through the service: C clients send ``privalign serve`` (one process; backend openai pointed
  at the fake server, stub reward model, SQLite ledger with synchronous=FULL) PrivBoN n = 8 queries.
- Clients: one separate process running C asyncio tasks, each with its own keep-alive connection
  (httpx.AsyncClient), each sending its next request as soon as the last is answered, for --seconds.
- Reported: answered requests/s both ways and their ratio, p50/p99 latency, non-200 answers, and
  whether every answer is charged (the ledger's query count and epsilon spent over the run, against
  the 200 answers counted by the clients), and the CPU time ``privalign serve`` used per answer
  (user + system, from /proc). Then PrivITP n = 8: backend calls per request.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import ADMIN, CLIENT, Server, fake_openai_app, free_port  # noqa: E402

DELAY = 0.2
EPSILON = 0.001  # PrivBoN's pure epsilon per query: the budget below never binds
CONFIG = """
access_log = {access_log}
admin_keys = ["{admin}"]
max_inflight_per_tenant = 256
[clients.{client}]
tenant = "bench"
[generator]
backend = "openai"
base_url = "{url}"
model = "fake"
max_new_tokens = 8
[reward]
kind = "stub"
output_range = [0.0, 1.0]
sensitivity = 0.1
[mechanism]
name = "privbon"
n = 8
sigma_x = 0.5
sigma_z = 0.5
delta = 1e-8
[[budgets]]
name = "bench"
tenant = "bench"
epsilon_total = 1e9
delta_total = 0.9
"""


def _serve_fake(port: int):
    import uvicorn

    uvicorn.run(fake_openai_app(delay=DELAY, record=False), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _load(url: str, path: str, body: dict, clients: int, seconds: float, key: str | None, out_q):
    """C asyncio clients with keep-alive connections; puts (statuses, latencies, elapsed)."""
    import httpx

    async def main():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        statuses, latencies = [], []
        # one client (one keep-alive connection) per simulated user: httpx's shared pool slows down
        # with many connections in one client
        conns = [httpx.AsyncClient(base_url=url, headers=headers, timeout=60) for _ in range(clients)]
        try:
            await asyncio.gather(*(c.get("/stats" if key is None else "/healthz") for c in conns))  # connect
            t0 = time.perf_counter()
            end = t0 + seconds

            async def one(c):
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    try:
                        r = await c.post(path, json=body)
                        status = r.status_code
                    except httpx.HTTPError:
                        status = -1
                    latencies.append(time.perf_counter() - t)
                    statuses.append(status)

            await asyncio.gather(*(one(c) for c in conns))
            return statuses, latencies, time.perf_counter() - t0
        finally:
            for c in conns:
                await c.aclose()

    out_q.put(asyncio.run(main()))


def run_load(url, path, body, clients, seconds, key=None):
    q = mp.Queue()
    p = mp.Process(target=_load, args=(url, path, body, clients, seconds, key, q))
    p.start()
    statuses, latencies, elapsed = q.get()
    p.join()
    ok = [lat for s, lat in zip(statuses, latencies) if s == 200]
    return {"ok": len(ok), "rps": len(ok) / elapsed, "bad": sum(s != 200 for s in statuses),
            "bad5xx": sum(s >= 500 or s < 0 for s in statuses),
            "p50": float(np.percentile(ok, 50)) if ok else float("nan"),
            "p99": float(np.percentile(ok, 99)) if ok else float("nan")}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc; NaN elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def get(url, path, key=ADMIN):
    import httpx

    return httpx.get(url + path, headers={"Authorization": f"Bearer {key}"}, timeout=30).json()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--no-access-log", action="store_true", help="serve with access_log = false")
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; uptime before: {uptime}")
    port = free_port()
    fake = mp.Process(target=_serve_fake, args=(port,), daemon=True)
    fake.start()
    fake_url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while True:
        try:
            get(fake_url, "/stats")
            break
        except Exception:
            if time.time() > deadline:
                raise
            time.sleep(0.1)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    direct_body = {"model": "fake", "messages": msgs, "n": 8, "max_tokens": 8, "temperature": 1.0}
    with tempfile.TemporaryDirectory() as d:
        srv = Server(Path(d), CONFIG.format(admin=ADMIN, client=CLIENT, url=fake_url,
                                              access_log="false" if args.no_access_log else "true"))
        srv.start()
        try:
            print(f"\nPrivBoN n = 8, backend answers every call after {DELAY * 1e3:.0f} ms; {args.seconds:.0f} s per point")
            print("| clients | backend alone, req/s | through privalign serve, req/s | ratio | p50 | p99 "
                  "| non-200 (5xx) | answers = ledger queries | epsilon spent = answers x epsilon "
                  "| service CPU per answer |")
            print("|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
            svc_body = {"model": "fake", "messages": msgs,
                        "privalign": {"mechanism": "privbon", "n": 8, "epsilon": EPSILON}}
            for c in levels:
                direct = run_load(fake_url, "/v1/chat/completions", direct_body, c, args.seconds)
                before = get(srv.url, "/v1/budgets/bench")
                cpu0 = cpu_seconds(srv.proc.pid)
                svc = run_load(srv.url, "/v1/chat/completions", svc_body, c, args.seconds, key=CLIENT)
                cpu_ms = 1e3 * (cpu_seconds(srv.proc.pid) - cpu0) / max(svc["ok"], 1)
                after = get(srv.url, "/v1/budgets/bench")
                queries = after["queries"] - before["queries"]
                spent = after["epsilon_spent"] - before["epsilon_spent"]
                charged_ok = queries == svc["ok"] and abs(spent - svc["ok"] * EPSILON) <= 1e-9 * max(1, svc["ok"])
                print(f"| {c} | {direct['rps']:.1f} | {svc['rps']:.1f} | {svc['rps'] / direct['rps']:.0%} "
                      f"| {svc['p50'] * 1e3:.0f} ms (direct {direct['p50'] * 1e3:.0f}) "
                      f"| {svc['p99'] * 1e3:.0f} ms (direct {direct['p99'] * 1e3:.0f}) "
                      f"| {svc['bad']} ({svc['bad5xx']}); direct {direct['bad']} "
                      f"| {'yes' if queries == svc['ok'] else 'NO'} ({svc['ok']} / {queries}) "
                      f"| {'yes' if charged_ok else 'NO'} ({spent:.4f}) | {cpu_ms:.2f} ms |")
            c = 16
            calls0 = get(fake_url, "/stats")["calls"]
            itp_body = {"model": "fake", "messages": msgs, "privalign": {"mechanism": "privitp", "n": 8}}
            itp = run_load(srv.url, "/v1/chat/completions", itp_body, c, args.seconds, key=CLIENT)
            calls = get(fake_url, "/stats")["calls"] - calls0
            print(f"\nPrivITP n = 8 (sigma_x = sigma_z = 0.5, phase2_chunks = 2), {c} clients: {itp['rps']:.1f} req/s, "
                  f"p50 {itp['p50'] * 1e3:.0f} ms, p99 {itp['p99'] * 1e3:.0f} ms, non-200 {itp['bad']}, "
                  f"backend calls per request {calls / max(itp['ok'], 1):.2f} ({calls} calls / {itp['ok']} answers)")
        finally:
            srv.stop()
            fake.terminate()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()
    print(f"\nuptime after: {uptime}")


if __name__ == "__main__":
    main()
