"""The release objective of ``rm train`` against the default (PrivBoN-tuned) choice (issue 28, item 1).

    .venv/bin/python benchmarks/release_tuned.py --task counting [--epsilon-w 3,10] [--delta 1e-6] \
        [--draws 60] [--select-folds 1,2] [--out rows.json]

Needs the task's train pool with features (``results/pools/<task>-train.parquet``: ``make
models-person`` generates it, or ``privalign generate --task T --split train --samples 32 --seed 1
--features --out ...``) and its test pool with features (``results/pools/<task>-test.parquet``, as
``make pools`` leaves it). With ``rm train``'s defaults (64 pairs per prompt, k = 16, seed 0) it
trains

- the default procedure's head ((q, c, lambda) for PrivBoN at epsilon 1 per query): the shipped
  person head, which the script checks it reproduces;
- for each epsilon_w, the release objective's head ((q, c, L, lambda) on the RELEASE_GRID for the
  5th percentile of BoN at n = 16 over 50 release draws, on validation prompts only), once per
  ``--select-folds`` value (1: one validation half scores, the default; 2: the score
  cross-fitted over both halves),

releases each at (epsilon_w, delta) 60 times (seeded) and reports BoN at n = 16 on the TEST
prompts: mean and 5th percentile over the draws, beside the exact head's BoN and the base policy,
and the share of the lift kept, measured both against the head's own BoN and against the shipped
head's. The test prompts choose nothing: they only measure. The last two columns are the chosen
candidate's validation estimate of the 5th percentile, and its ||w|| over the final head's (the
candidate is trained on one validation half, the final head on D).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from privalign.pipeline import pool_features
from privalign.pools import load_pool
from privalign.rewards.policy_bt import PolicyBTReward, train_policy_bt
from privalign.rewards.release import release_accuracy

POOLS = Path("results/pools")
DATA = Path("src/privalign/data")


def _pool(path: Path):
    p = load_pool(path)
    raw = pool_features(p, path)
    if raw is None:
        raise SystemExit(f"{path} has no recorded features ({path}.features.npz)")
    return p.columns["prompt_id"], p.columns["true_reward"], raw


def _num(v, spec: str) -> str:
    return "" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", required=True)
    ap.add_argument("--epsilon-w", default="3,10")
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--select-folds", default="1")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    pid, y, raw = _pool(POOLS / f"{a.task}-train.parquet")
    tp, ty, traw = _pool(POOLS / f"{a.task}-test.parquet")
    kw = dict(task=a.task, range_epsilon=0.0, pairs_per_prompt=64, pairs_per_person=16, seed=0)
    default, _ = train_policy_bt(raw, pid, y, **kw)
    shipped = PolicyBTReward.load(DATA / f"{a.task}-policy-bt-person.json")
    print(f"default procedure reproduces the shipped head: {np.allclose(default.w, shipped.w, atol=1e-6)}")
    ref = release_accuracy(default, traw, tp, ty, 1.0, a.delta, draws=1, rng=np.random.default_rng(0))
    lift = ref["bon"] - ref["base"]  # the shipped head's lift: no share of it when it is not positive

    def pct(v):
        return "n/a" if v is None else f"{v:.0%}"
    rows = []
    print("| epsilon_w | head | (q, c, L, lambda) | Delta_r | BoN exact | released: mean | p5 | share of own lift "
          "(mean, p5) | share of shipped head's lift (mean, p5) | train s | validation p5 | candidate / final ||w|| |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for eps in (float(e) for e in a.epsilon_w.split(",")):
        heads, seconds, norm_ratio = [("default", default)], {}, {}
        for folds in (int(f) for f in a.select_folds.split(",")):
            t0 = time.time()
            tuned, grid = train_policy_bt(raw, pid, y, objective="release", release_epsilon=eps,
                                          release_delta=a.delta, select_folds=folds, **kw)
            chosen = next(r for r in grid if (r["components"], r["c"], r["lp_clip"], r["lambda"]) == (
                tuned.meta["components"], tuned.meta["c"], tuned.feature_map.lp_clip, tuned.lam))
            norm_ratio[f"release-tuned, {folds} fold{'s' if folds > 1 else ''}"] = (
                chosen["selection_weight_norm"] / float(np.linalg.norm(tuned.w)))
            name = f"release-tuned, {folds} fold{'s' if folds > 1 else ''}"
            heads.append((name, tuned))
            seconds[name] = time.time() - t0
        for name, m in heads:
            r = release_accuracy(m, traw, tp, ty, eps, a.delta, draws=a.draws, rng=np.random.default_rng(0))
            row = {"task": a.task, "epsilon_w": eps, "delta_w": a.delta, "head": name,
                   "settings": [m.meta["components"], m.meta["c"], m.feature_map.lp_clip, m.lam],
                   "sensitivity": m.sensitivity, "bon": r["bon"], "base": r["base"], "mean": r["mean"], "p5": r["p5"],
                   "share_mean": r["share_mean"], "share_p5": r["share_p5"],
                   "shipped_share_mean": (r["mean"] - r["base"]) / lift if lift > 0 else None,
                   "shipped_share_p5": (r["p5"] - r["base"]) / lift if lift > 0 else None,
                   "selection_p5": m.meta.get("selection_release_p5"),
                   "selection_mean": m.meta.get("selection_release_mean"),
                   "train_seconds": seconds.get(name), "candidate_norm_ratio": norm_ratio.get(name)}
            rows.append(row)
            q, c, L, lam = row["settings"]
            print(f"| {eps:g} | {name} | ({q}, {c:g}, {L:g}, {lam:g}) | {m.sensitivity:.3g} | {r['bon']:.3f} | "
                  f"{r['mean']:.3f} | {r['p5']:.3f} | {pct(r['share_mean'])}, {pct(r['share_p5'])} | "
                  f"{pct(row['shipped_share_mean'])}, {pct(row['shipped_share_p5'])} | "
                  f"{_num(row['train_seconds'], '.0f')} | {_num(row['selection_p5'], '.3f')} | "
                  f"{_num(row['candidate_norm_ratio'], '.2f')} |", flush=True)
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
