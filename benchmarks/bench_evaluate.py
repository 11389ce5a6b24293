"""The evaluation harness on one full paper configuration, against a naive research-script loop.

Run: ``.venv/bin/python benchmarks/bench_evaluate.py [--prompts 1319] [--samples 10000] [--workers N]``

Full grid: prompts x samples pool (default 1,319 x 10,000, the GSM8K test size), n in
{1, 2, ..., 4096}, 50 replicates, bon, privbon, itp, privitp, timed with one worker and with
``--workers`` (default: every usable core) in the same run; the two result arrays must be
identical. Reports wall times, their ratio and peak memory (the parent's, and the largest worker's,
whose resident set counts the pool pages it shares with the parent).
The baseline is the straightforward loop research scripts use (one ``np.random.choice`` and one
selection call per replicate, per prompt, per n), timed on a few prompts in the same run; the
speed-up is the ratio of the per-prompt times. (The paper's authors' own evaluation script is not
public: the paper names no code repository, so it cannot be timed here.)
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import time
from dataclasses import replace

import numpy as np

import privalign as pa
from privalign.evaluation import DEFAULT_N_GRID, EvalSettings, evaluate
from privalign.evaluation.parallel import usable_cores
from privalign.simulate import simulate


def naive_loop(pool, prompts, n_grid, replicates, sigma=0.5, beta=0.05):
    """One np.random.choice and one mechanism call per replicate, per prompt, per n."""
    lo, hi = float(pool.proxy.min()), float(pool.proxy.max())
    total = 0.0
    for k in prompts:
        x, y = pool.prompt(k)
        x = (x - lo) / (hi - lo)
        for n in n_grid:
            for _ in range(replicates):
                idx = np.random.choice(x.size, n)
                total += y[idx[pa.bon(x[idx]).index]]
                total += y[idx[pa.privbon(x[idx], noise_scale=sigma).index]]
                s = pa.itp(x[idx], beta=beta)
                total += y[np.random.randint(x.size)] if s.fallback else y[idx[s.index]]
                idx2 = np.random.choice(x.size, n)
                s = pa.privitp(x[idx], x[idx2], beta=beta, sigma_x=sigma / 2, sigma_z=sigma / 2, delta=1e-2)
                total += y[np.random.randint(x.size)] if s.fallback else y[idx2[s.index]]
    return total


def variance_ratio(pool, prompts=6, n=64, seeds=20, replicates=50):
    """Per-prompt variance of the accuracy estimate, plain MC / exact laws, at equal replicates."""
    sub = pool.subset(np.arange(prompts))
    out = {}
    for algo in ("privbon", "itp", "privitp"):
        est = {}
        for kind in ("exact", "mc"):
            runs = [evaluate(sub, EvalSettings(algorithms=(algo,), n_grid=(n,), replicates=replicates, seed=seed,
                                               estimator=kind)).per_prompt[0, 0, :, 0] for seed in range(seeds)]
            est[kind] = np.var(np.array(runs), axis=0, ddof=1).mean()
        out[algo] = est["mc"] / est["exact"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--samples", type=int, default=10_000)
    ap.add_argument("--baseline-prompts", type=int, default=2)
    ap.add_argument("--workers", type=int, default=usable_cores())
    args = ap.parse_args()

    load = os.getloadavg()
    t0 = time.perf_counter()
    pool = simulate("hackable", args.prompts, args.samples, seed=0).grouped()
    t_pool = time.perf_counter() - t0
    settings = EvalSettings(algorithms=("bon", "privbon", "itp", "privitp"), n_grid=DEFAULT_N_GRID, replicates=50)
    t0 = time.perf_counter()
    one = evaluate(pool, settings)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    many = evaluate(pool, replace(settings, workers=args.workers))
    t_eval = time.perf_counter() - t0
    identical = np.array_equal(one.per_prompt, many.per_prompt, equal_nan=True) and np.array_equal(one.base, many.base)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 ** 2
    child_gb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 ** 2

    sub = list(range(args.baseline_prompts))
    t0 = time.perf_counter()
    naive_loop(pool, sub, DEFAULT_N_GRID, settings.replicates)
    t_naive = (time.perf_counter() - t0) / len(sub)
    per_prompt = t_eval / args.prompts

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, numpy {np.__version__}")
    print(f"pool: {args.prompts} prompts x {args.samples} samples (simulated in {t_pool:.1f} s)")
    print(f"load average before the run: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; usable cores {usable_cores()}")
    print(f"full grid (n = 1..4096, 50 replicates, bon/privbon/itp/privitp): 1 worker {t_one:.1f} s, "
          f"{args.workers} workers {t_eval:.1f} s (x{t_one / t_eval:.2f}); results identical: {identical}")
    print(f"peak RSS: parent {peak_gb:.2f} GB, largest worker {child_gb:.2f} GB (shares the parent's pool pages)")
    print(f"per prompt: harness {per_prompt * 1e3:.1f} ms ({args.workers} workers; 1 worker "
          f"{t_one / args.prompts * 1e3:.1f} ms), naive loop {t_naive:.2f} s (on {len(sub)} prompts) -> speed-up "
          f"{t_naive / per_prompt:.1f}x ({args.workers} workers), {t_naive / (t_one / args.prompts):.1f}x (1 worker) "
          f"at equal replicates")
    if not identical:
        raise SystemExit("the results of 1 and several workers differ")
    ratios = variance_ratio(pool)
    print("variance of the per-prompt accuracy estimate, plain MC / exact laws, n = 64, 50 replicates: "
          + ", ".join(f"{a} {r:.1f}x" for a, r in ratios.items()))
    print("(the naive loop needs that many times more replicates for the same precision)")


if __name__ == "__main__":
    main()
