"""Thousands of free answers: ``privalign serve`` with a released head behind a fast backend (issue 28).

Run: ``.venv/bin/python benchmarks/bench_released_serve.py [--queries 2000] [--n 16] [--clients 8]``

- The head: the shipped person-unit counting head, released once by ``privalign rm release`` at
  (``--epsilon-w``, 1e-6) with the secure generator. Its scores need the SmolLM2 policy's features,
  so every candidate is teacher-forced through the real embedded policy (the reward's cost).
- The fast backend: the service's ``openai`` generator backend, pointed at an OpenAI-compatible
  server on loopback that answers at once (``tests/test_server.fake_openai_app``, the tests' fake
  upstream), standing in for a vLLM or hosted endpoint. The generator's own time is then ~0.
- The load: ``--clients`` threads of the stock ``openai`` client send ``--queries`` chat requests in
  all, ``mechanism`` released-bon at n = ``--n``.

Checks, then prints: every answer says ``epsilon_charged: 0``; the tenant's budget records every
query at 0 spent; the model budget holds the release exactly once (``gaussian-release``); the
ledger's integrity check is clean. And the throughput (answers/s) and the latency percentiles.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_server import ADMIN, CLIENT, FakeOpenAI, Server  # noqa: E402  (the tests' harness and fake upstream)

CONFIG = """
admin_keys = ["{admin}"]
[clients.{client}]
tenant = "default"
[generator]
backend = "openai"
base_url = "{url}"
model = "fast"
max_new_tokens = 8
[reward]
kind = "policy-bt"
path = "{public}"
[mechanism]
name = "released-bon"
n = {n}
[[budgets]]
name = "default"
epsilon_total = 1.0
delta_total = 1e-6
[model_budget]
epsilon_total = 20.0
delta_total = 1e-5
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--epsilon-w", type=float, default=10.0)
    a = ap.parse_args()
    from openai import OpenAI

    from privalign.ledger import Ledger

    tmp = Path(tempfile.mkdtemp(prefix="released-serve-"))
    head = resources.files("privalign") / "data" / "counting-policy-bt-person.json"
    subprocess.run([sys.executable, "-m", "privalign", "rm", "release", str(head), "--epsilon", str(a.epsilon_w),
                    "--delta", "1e-6", "--out", str(tmp / "public.json")], check=True, stdout=subprocess.DEVNULL)
    lat, bad, lock = [], [], threading.Lock()
    with FakeOpenAI(record=False) as fake:
        srv = Server(tmp, CONFIG.format(admin=ADMIN, client=CLIENT, url=fake.url, public=tmp / "public.json", n=a.n))
        srv.start(timeout=300)
        try:
            def worker(k: int) -> None:
                client = OpenAI(base_url=srv.url + "/v1", api_key=CLIENT, max_retries=0, timeout=120)
                for i in range(k, a.queries, a.clients):
                    t0 = time.perf_counter()
                    r = client.chat.completions.create(
                        model="fast", max_tokens=8, messages=[{"role": "user", "content": f"Count to {i % 9 + 2}."}])
                    block = r.model_extra["privalign"]
                    with lock:
                        lat.append(time.perf_counter() - t0)
                        if block["epsilon_charged"] != 0 or block["mechanism"] != "released-bon":
                            bad.append(block)

            start = time.perf_counter()
            threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
        finally:
            srv.stop()
    led = Ledger(str(srv.ledger_path))
    releases = [e for e in led.events("model") if e["kind"] == "release"]
    tenant = led.budget("default")
    assert not bad, bad[:3]
    assert len(lat) == a.queries and tenant.queries == a.queries and tenant.spent.epsilon == 0, tenant
    assert len(releases) == 1 and abs(releases[0]["epsilon"] - a.epsilon_w) < 1e-9, releases
    assert led.check() == [], led.check()
    q = statistics.quantiles(lat, n=100)
    print(f"{platform.processor() or platform.machine()}, {platform.python_version()}: {a.queries} answers "
          f"(released-bon, n = {a.n}, {a.clients} clients) in {wall:.1f} s = {a.queries / wall:.1f} answers/s; "
          f"latency p50 {q[49] * 1000:.0f} ms, p99 {q[98] * 1000:.0f} ms")
    print(f"every answer charged 0; tenant budget: {tenant.queries} queries, epsilon spent {tenant.spent.epsilon}; "
          f"model budget: one release at epsilon_w {releases[0]['epsilon']:g}; ledger check clean; "
          f"fake upstream calls {fake.stats['calls']}")


if __name__ == "__main__":
    main()
