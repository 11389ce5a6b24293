"""Cross-request batching (issue 11): the service with its embedded models, 1 client against C.

Run: ``HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/bench_service_batching.py [--clients 8] [--requests 6]``

- The service in-process (``Service``, no HTTP: the models dominate), with the embedded
  SmolLM2-135M-Instruct generator (transformers) and the shipped certified MiniLM Bradley-Terry
  reward model (``build_reward``'s default), a SQLite ledger, PrivBoN n = 8, max_tokens = 8.
  Prompts: the arithmetic task's test problems (different lengths, so batches are left-padded).
- Clients are threads, each sending its next request as soon as the last is answered.
- Configurations, measured in the same run on the same loaded model: 1 client (2 x ``--requests``
  requests); C clients (``--requests`` each) with cross-request batching (the default,
  ``batch_max = 64``, ``batch_wait_ms = 5``); and, unless ``--skip-unbatched``, C clients with
  batching off (``batch_max = 1``: one request's generate call at a time, as before issue 11).
  They alternate for ``--rounds`` rounds, so a change in the machine's load hits all of them.
- Reported: answered requests/s, the ratio against 1 client, p50/p99 latency, the batched
  generate calls made, and ``uptime`` load before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def run(svc, prompts, clients: int, per_client: int):
    """C threads x per_client PrivBoN queries: (requests/s, latencies in s)."""
    lat: list[float] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)

    def client(c):
        barrier.wait()
        for j in range(per_client):
            msgs = prompts[(c * per_client + j) % len(prompts)]
            t0 = time.perf_counter()
            svc.answer(msgs, {"mechanism": "privbon", "n": 8, "epsilon": 1.0}, "default", max_tokens=8)
            with lock:
                lat.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return len(lat) / (time.perf_counter() - t0), np.array(lat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=6, help="requests per client (1 client: 2x this many)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--skip-unbatched", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from privalign.backends.batching import BatchingGenerator
    from privalign.server.app import Service
    from privalign.server.config import ServiceConfig
    from privalign.tasks import get_task

    def load():
        return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
          f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"load before: {load()}")
    task = get_task("arithmetic")
    prompts = [task.messages(p) for p in task.load("test", 64)]
    with tempfile.TemporaryDirectory() as d:
        cfg = ServiceConfig.model_validate({"ledger": str(Path(d) / "l.db"), "generator": {"max_new_tokens": 8},
                                            "max_inflight_per_tenant": 64,
                                            "budgets": [{"name": "default", "epsilon_total": 1e9}]})
        svc = Service(cfg)  # batching on: the defaults
        batched = svc.generator
        assert isinstance(batched, BatchingGenerator)
        unbatched = BatchingGenerator(batched.generator, max_batch=1, max_wait_ms=0)  # the same model
        svc.answer(prompts[0], {"mechanism": "privbon", "n": 8}, "default")  # warm-up (loads the embedder)
        import torch

        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        configs = [("1 client", batched, 1, 2 * args.requests),
                   (f"{args.clients} clients, batched (batch_max 64, batch_wait_ms 5)", batched, args.clients,
                    args.requests)]
        if not args.skip_unbatched:
            configs.append((f"{args.clients} clients, unbatched (batch_max 1)", unbatched, args.clients,
                            args.requests))
        stats = {name: {"n": 0, "s": 0.0, "lat": [], "calls": 0, "rps": []} for name, *_ in configs}
        for _ in range(args.rounds):  # the configurations alternate, so a change in load hits them all
            for name, gen, clients, per_client in configs:
                svc.generator = gen
                calls0 = gen.batcher.batches
                rps, lat = run(svc, prompts, clients, per_client)
                st = stats[name]
                st["n"] += len(lat)
                st["s"] += len(lat) / rps
                st["lat"] += lat.tolist()
                st["calls"] += gen.batcher.batches - calls0
                st["rps"].append(rps)
        svc.close()
    print(f"load after: {load()}")
    base = stats["1 client"]
    print(f"\n{args.rounds} rounds; requests/s over all rounds; per-round ratios in brackets\n")
    print("| clients | requests | answered requests/s | vs 1 client | p50 latency | p99 latency | generate calls |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, st in stats.items():
        rps = st["n"] / st["s"]
        ratios = ", ".join(f"{r / b:.2f}" for r, b in zip(st["rps"], base["rps"]))
        print(f"| {name} | {st['n']} | {rps:.2f} | {rps / (base['n'] / base['s']):.2f}x ({ratios}) "
              f"| {np.percentile(st['lat'], 50):.2f} s | {np.percentile(st['lat'], 99):.2f} s | {st['calls']} |")

if __name__ == "__main__":
    main()
