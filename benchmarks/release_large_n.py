"""A released head at large n: BoN and soft BoN with w~ = w + N(0, sigma^2 I), n = 1 to 1,024 (issue 28).

    .venv/bin/python benchmarks/release_large_n.py HEAD.json POOL.parquet \
        [--epsilon-w 1,3,10] [--delta 1e-6] [--draws 20] [--temperatures 0.01,0.03] [--sets 8] [--out rows.json]

HEAD is a certified policy-bt head at the person unit; POOL a large pool of its policy with recorded
features (``privalign generate --samples 1024 --features``). For each release budget epsilon_w, each
of ``--draws`` release draws w~ scores every response once (phi . w~), and then:

- BoN at each n: its exact law given those scores (``evaluation.laws.bon_exact``, n drawn with
  replacement from each prompt's samples);
- soft BoN at temperature tau (in units of the head's declared output range, as PrivBoN's sigma on
  [0, 1]): the exact softmax law on ``--sets`` seeded candidate sets of n per prompt.

Every selection with w~ is post-processing of the one release, so neither n nor the number of
queries adds to epsilon_w. Prints a Markdown table (mean over draws and its 5th percentile) beside BoN
with the exact head and the base policy; ``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from privalign.evaluation.release import selection_curves
from privalign.pipeline import pool_features
from privalign.pools import load_pool
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import check_release, release_noise_scale

N_GRID = tuple(2 ** k for k in range(11))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("head")
    ap.add_argument("pool")
    ap.add_argument("--epsilon-w", default="1,3,10")
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--draws", type=int, default=20)
    ap.add_argument("--temperatures", default="0.01,0.03")
    ap.add_argument("--sets", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args()
    t0 = time.perf_counter()
    head = PolicyBTReward.load(a.head)
    pool = load_pool(a.pool)
    raw = pool_features(pool, Path(a.pool))
    phi = head.feature_map(raw)
    pid = np.asarray(pool.columns["prompt_id"], str)
    y = np.asarray(pool.columns["true_reward"], float)
    groups = [np.flatnonzero(pid == p) for p in np.unique(pid)]
    taus = [float(t) for t in a.temperatures.split(",") if t]
    rng = np.random.default_rng(a.seed)

    def curves(scores: np.ndarray) -> dict:
        """Accuracy per (selector, n), averaged over prompts, for one score vector."""
        c = selection_curves(scores, groups, y, N_GRID, taus, head.output_range, rng, a.sets)
        return {(k[0] if k[0] == "bon" else f"soft tau={k[0][1]:g}", k[1]): v for k, v in c.items()}

    exact = curves(phi @ head.w)
    base = float(np.mean([y[r].mean() for r in groups]))
    rows = []
    for e in (float(v) for v in a.epsilon_w.split(",")):
        eps, dlt = check_release(head, e, a.delta)
        sigma = release_noise_scale(head, eps, dlt)
        draws = [curves(phi @ (head.w + sigma * rng.standard_normal(head.w.size))) for _ in range(a.draws)]
        for key in exact:
            acc = np.array([d[key] for d in draws])
            rows.append({"epsilon_w": e, "delta_w": dlt, "sigma": sigma, "selector": key[0], "n": key[1],
                         "mean": float(acc.mean()), "p5": float(np.percentile(acc, 5)), "exact_head": exact[key]})
    print(f"head {a.head}: P = {head.meta.get('persons')}, k = {head.k}, Delta_r = {head.sensitivity:.3g}; pool "
          f"{a.pool}: {len(groups)} prompts x {groups[0].size}; base {base:.3f}; delta_w = {a.delta:g}, "
          f"{a.draws} release draws, {a.sets} candidate sets per prompt for soft BoN; {time.perf_counter() - t0:.0f} s")
    sel = list(dict.fromkeys(r["selector"] for r in rows))
    print("| epsilon_w | selector | " + " | ".join(f"n = {n}" for n in N_GRID) + " |")
    print("|---|---|" + "---:|" * len(N_GRID))
    for s in sel:
        print(f"| exact head | {s} | " + " | ".join(f"{exact[(s, n)]:.3f}" for n in N_GRID) + " |")
    for e in dict.fromkeys(r["epsilon_w"] for r in rows):
        for s in sel:
            rs = {r["n"]: r for r in rows if r["epsilon_w"] == e and r["selector"] == s}
            print(f"| {e:g} | {s} | " + " | ".join(f"{rs[n]['mean']:.3f} ({rs[n]['p5']:.3f})" for n in N_GRID) + " |")
    if a.out:
        Path(a.out).write_text(json.dumps({"head": a.head, "pool": a.pool, "base": base, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
