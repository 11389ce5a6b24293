"""Large pools (issue 20): the shared-prefix sampler against today's ``privalign generate``.

Run: ``.venv/bin/python benchmarks/bench_sampler.py [--prompts 3] [--samples 1024]``

For the counting and arithmetic-mix test prompts, samples per second with policy features
recorded (what ``make pools`` and ``make pools-large`` generate), measured in the same run on the
same loaded model:

- ``loop`` (today's ``privalign generate``): 64 samples per prompt, one batch of 64 rows with the
  prompt's KV cache copied into every row, as the shipped 64-sample pools were built;
- ``shared``: ``--samples`` per prompt, 1024 rows at a time against one copy of the prompt's cache,
  ended rows leaving the batch (``backends/shared_prefix.py``).

The two alternate prompt by prompt, so a change in the machine's load hits both. Reported:
samples/s, tokens/s, the ratio, and ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import time

import torch

from privalign.backends.transformers_backend import TransformersGenerator
from privalign.pipeline import _prompt_seed
from privalign.tasks import get_task


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--samples", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1024)
    a = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    loop = TransformersGenerator("smollm2")
    shared = TransformersGenerator("smollm2", sampler="shared", batch_size=a.batch_size)
    shared.model = loop.model  # the same weights in memory
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}; "
          f"before: {load}")
    print("| task | sampler | samples per prompt | samples/s | tokens/s | mean tokens |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for name in ("counting", "arithmetic-mix"):
        t = get_task(name)
        problems = t.load("test", a.prompts)
        acc = {"loop": [0, 0, 0.0], "shared": [0, 0, 0.0]}
        for i, p in enumerate(problems):
            for label, gen, k in (("loop", loop, 64), ("shared", shared, a.samples)):
                t0 = time.perf_counter()
                out = gen.generate(t.messages(p), k, max_new_tokens=t.max_new_tokens, seed=_prompt_seed(0, i),
                                   features=True)
                acc[label][2] += time.perf_counter() - t0
                acc[label][0] += len(out)
                acc[label][1] += sum(g.n_tokens for g in out)
        rate = {}
        for label, (n, toks, secs) in acc.items():
            rate[label] = n / secs
            k = 64 if label == "loop" else a.samples
            print(f"| {name} | {label} | {k} | {n / secs:.1f} | {toks / secs:.0f} | {toks / n:.2f} |")
        ratios.append((name, rate["shared"] / rate["loop"]))
    for name, r in ratios:
        print(f"{name}: shared / loop = {r:.2f}x samples per second")
    print(f"# after: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")


if __name__ == "__main__":
    main()
