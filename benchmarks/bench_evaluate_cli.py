"""``privalign evaluate`` end to end from the command line on the full grid (issue 19).

Run: ``.venv/bin/python benchmarks/bench_evaluate_cli.py [--prompts 1319] [--samples 10000]``

Writes a simulated pool of prompts x samples (default 1,319 x 10,000, 13.2 million rows, the
GSM8K test size) to Parquet, then times, in the same run: the command
``privalign evaluate POOL --algorithms bon,privbon,itp,privitp --n 1,2,...,4096 --replicates 50``
(loading, validation, grouping, the harness on every usable core, writing tables and figures) and,
for the breakdown, ``load_pool`` with validation, ``Pool.grouped`` and the harness alone
(``evaluation.evaluate``) in this process. The target is <= 25 s end to end on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from privalign.evaluation import DEFAULT_N_GRID, EvalSettings, evaluate
from privalign.evaluation.parallel import usable_cores
from privalign.pools import load_pool
from privalign.simulate import simulate


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=1319)
    ap.add_argument("--samples", type=int, default=10_000)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="privalign-bench-"))
    path = tmp / "pool.parquet"
    simulate("hackable", a.prompts, a.samples, seed=0).save(path)
    cmd = [str(Path(sys.executable).with_name("privalign")), "evaluate", str(path), "--algorithms",
           "bon,privbon,itp,privitp", "--n", "1,2,...,4096", "--replicates", "50", "--seed", "0",
           "--out", str(tmp / "run")]
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cli = time.perf_counter() - t
    t = time.perf_counter()
    pool = load_pool(path)
    t_load = time.perf_counter() - t
    t = time.perf_counter()
    grouped = pool.grouped()
    t_group = time.perf_counter() - t
    t = time.perf_counter()
    evaluate(grouped, EvalSettings(algorithms=("bon", "privbon", "itp", "privitp"), n_grid=DEFAULT_N_GRID,
                                   replicates=50, seed=0, workers=None))
    t_harness = time.perf_counter() - t
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores ({usable_cores()} usable)")
    print(f"pool: {a.prompts} x {a.samples} = {pool.n_rows:,} rows")
    print(f"privalign evaluate end to end: {cli:.1f} s (target <= 25 s)")
    print(f"  in this process: load_pool + validate {t_load:.1f} s, grouped {t_group:.1f} s, harness {t_harness:.1f} s")


if __name__ == "__main__":
    main()
