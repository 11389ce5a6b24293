"""The full empirical privacy audit (200,000 runs per side) on each shipped policy-bt model.

Run: ``.venv/bin/python benchmarks/bench_audit.py [--runs 200000] [--pools results/pools]``

Needs each model's train pool with its recorded features (``make pools`` writes them to
results/pools/TASK-train.parquet; they are not shipped). For every shipped model with a train pool
present it runs the same audit as ``privalign audit --seed 0``, prints the wall time, checks every
private lower bound against its claim and the realised sensitivity against the certificate, and
compares the result with the shipped record ``src/privalign/data/TASK-audit.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from privalign.audit import audit
from privalign.cli._common import _train_pool
from privalign.rewards.policy_bt import PolicyBTReward

DATA = Path(__file__).resolve().parents[1] / "src" / "privalign" / "data"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200_000)
    ap.add_argument("--pools", type=Path, default=Path("results/pools"))
    args = ap.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    for model_path in sorted(DATA.glob("*-policy-bt.json")):
        task = model_path.name.removesuffix("-policy-bt.json")
        pool = args.pools / f"{task}-train.parquet"
        if not pool.exists():
            print(f"{task}: no train pool at {pool} (make pools), skipped")
            continue
        model = PolicyBTReward.load(model_path)
        p, raw = _train_pool(pool)
        t0 = time.perf_counter()
        res = audit(model, raw, p.columns["prompt_id"], p.columns["true_reward"], epsilon=1.0, delta=1e-5,
                    runs=args.runs, seed=0)
        wall = time.perf_counter() - t0
        ok = res["realised_sensitivity"] <= res["certified_sensitivity"] and all(
            r["epsilon_lower_bound"] <= r["claimed_epsilon"] for r in res["rows"] if r["mechanism"] != "bon")
        shipped = DATA / f"{task}-audit.json"
        same = None
        if shipped.exists() and args.runs == 200_000:
            rec = json.loads(shipped.read_text())
            # on the mechanisms the record holds (the capped PrivITP row, issue 31, runs last and came later)
            fresh = {r["mechanism"]: r["successes_D"] for r in res["rows"]}
            same = all(fresh.get(r["mechanism"]) == r["successes_D"] for r in rec["rows"])
        print(f"{task}: {wall:.0f} s, claims hold: {ok}, realised/certified sensitivity "
              f"{res['realised_sensitivity'] / res['certified_sensitivity']:.2f}, same as the shipped record: {same}")
        for r in res["rows"]:
            print(f"  {r['mechanism']:<17} claimed {float(r['claimed_epsilon']):<8.4g} lower bound "
                  f"{r['epsilon_lower_bound']:.3g}")


if __name__ == "__main__":
    main()
