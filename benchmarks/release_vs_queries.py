"""Release once, then BoN, against per-query Gumbel PrivBoN spending the same total (issue 28, item 4).

    .venv/bin/python benchmarks/release_vs_queries.py HEAD.json POOL.parquet \
        [--epsilon-w 0.1,0.3,1] [--queries 10,100,1000,10000] [--n 16] [--draws 60] [--delta 1e-6] \
        [--out rows.json] [--figure FOLDER]

HEAD is a certified policy-bt head at the person unit (``rm train``), POOL a pool of its policy with
recorded features (``privalign featurize``). For each total epsilon_w and each workload of Q
queries:

- release: the head released once at (epsilon_w, delta), then BoN at n for any number of
  queries; BoN's exact law given the released scores, averaged over ``--draws`` release draws,
  with the 5th percentile (a deployment lives with one draw). It does not depend on Q.
- per-query: Gumbel PrivBoN at the largest epsilon per query for which the zCDP filter admits
  exactly Q queries within (epsilon_w, delta) (``plan --queries``), its accuracy by the harness's
  exact law on the head's own scores, with the head's Delta_r and its declared range.

Prints a Markdown table (accuracy; base policy and exact BoN for scale) and, with ``--out``,
writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from privalign.accounting import planner
from privalign.evaluation.planning import accuracy_at, plan_base, reference_accuracies
from privalign.pipeline import pool_features, score_pool
from privalign.pools import load_pool
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import release_accuracy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("pool")
    ap.add_argument("--epsilon-w", default="0.1,0.3,1")
    ap.add_argument("--queries", default="10,100,1000,10000")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--figure", help="write the figure (accuracy against Q, one line per mode) to this folder")
    a = ap.parse_args()
    head = PolicyBTReward.load(a.head)
    head.name = "study-head"
    with tempfile.TemporaryDirectory() as tmp:  # score a copy with the head (the recorded features)
        pool_path = Path(tmp) / "pool.parquet"
        shutil.copy(a.pool, pool_path)
        shutil.copy(a.pool + ".features.npz", str(pool_path) + ".features.npz")
        pool = score_pool(pool_path, [head])
        raw = pool_features(pool, pool_path)
    base, desc = plan_base(pool, "study-head")
    refs = reference_accuracies(pool, base, a.n)
    pid, y = pool.columns["prompt_id"], pool.columns["true_reward"]
    rows = []
    eps_w = [float(e) for e in a.epsilon_w.split(",")]
    queries = [int(q) for q in a.queries.split(",")]
    for e in eps_w:
        rel = release_accuracy(head, raw, pid, y, e, a.delta, a.n, a.draws, np.random.default_rng(a.seed))
        for q in queries:
            eq = planner.plan_epsilons(e, a.delta, q, "privbon", n=a.n, sensitivity=desc["sensitivity"])["zcdp"]
            acc = accuracy_at(pool, base, "privbon", eq, a.n)
            rows.append({"epsilon_w": e, "queries": q, "release_mean": rel["mean"], "release_p5": rel["p5"],
                         "per_query_epsilon": eq, "per_query_accuracy": acc})
    print(f"head {a.head}: P = {head.meta.get('persons')}, k = {head.k}, Delta_r = {head.sensitivity:.3g} "
          f"({desc['sensitivity']:.3g} of the declared range); n = {a.n}; BoN {refs['bon']:.3f}, "
          f"base {refs['base']:.3f}; delta = {a.delta:g}, {a.draws} release draws")
    print("| epsilon_w (total) | Q | release then BoN: mean / 5th pct | per-query PrivBoN (zCDP): epsilon each | accuracy | better |")
    print("|---:|---:|---|---:|---:|---|")
    for r in rows:
        acc = r["per_query_accuracy"]
        better = "release" if acc is None or r["release_p5"] >= acc else (
            "per-query" if r["release_mean"] < acc else "release on average, per-query at the 5th pct")
        eq = "-" if r["per_query_epsilon"] is None else f"{r['per_query_epsilon']:.4g}"
        print(f"| {r['epsilon_w']:g} | {r['queries']} | {r['release_mean']:.3f} / {r['release_p5']:.3f} | {eq} | "
              f"{'-' if acc is None else f'{acc:.3f}'} | {better} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"head": a.head, "pool": a.pool, "bon": refs["bon"], "base": refs["base"],
                                           "rows": rows}, indent=1))
    if a.figure:
        from privalign.report.figures import release_vs_queries

        Path(a.figure).mkdir(parents=True, exist_ok=True)
        release_vs_queries(rows, refs["bon"], refs["base"], Path(a.figure), f"release_vs_queries-{Path(a.head).stem}",
                           f"{Path(a.head).stem}: release once vs per-query noise, delta {a.delta:g}")


if __name__ == "__main__":
    main()
