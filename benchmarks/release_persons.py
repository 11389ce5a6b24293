"""The release against the number of persons (issue 49, items 2-4): heads trained by ``rm train
--preferences`` on seeded subsets of one deployment's persons, each released at every epsilon_w, then
BoN and soft BoN at n on a test pool, beside what the planner predicts from one head.

    .venv/bin/python benchmarks/release_persons.py POOL.parquet HEAD.json [HEAD.json ...] \
        [--epsilon-w 0.3,1,3] [--delta 1e-6] [--draws 60] [--n 16] [--planner-head HEAD.json] \
        [--out rows.json] [--figure FOLDER]

POOL is a test pool of the heads' policy with its raw features beside it (``POOL.features.npz``: the
shipped counting pool, ``privalign featurize``); each HEAD a person-unit head of the same deployment
at a different P (``rm train --preferences ... --max-persons P --name ...``: distinct names). The
pool's prompts are split in half (``experiments.split_prompts``, seeded): soft BoN's temperature is
chosen on one half, and every number is measured on the other (``evaluation.release.release_study``,
``--draws`` release draws at each epsilon_w, delta_w = ``--delta``).

The planner's prediction (``rewards.release.release_accuracy`` with ``persons`` = P': the release's
noise at P' persons, w held fixed) is drawn from ``--planner-head`` (default: the head with the fewest
persons, what a team that has only those would be told) and from the head with the most persons.
Prints a Markdown table; ``--out`` writes every row as JSON and ``--figure`` the figure
``release-persons.png`` (``report.figures.release_persons``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from privalign.evaluation.experiments import split_prompts
from privalign.evaluation.release import release_study
from privalign.pipeline import score_pool
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import release_accuracy, study_head

PLANNER_GRID = (125, 250, 500, 1000, 2000, 4000, 8000, 16000)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pool")
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--epsilon-w", default="0.3,1,3")
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--taus", default="0.003,0.01,0.03,0.1,0.3,1")
    ap.add_argument("--planner-head", help="the head whose w the planner holds fixed (default: fewest persons)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--figure")
    a = ap.parse_args()
    t0 = time.perf_counter()
    models = sorted((PolicyBTReward.load(h) for h in a.heads), key=lambda m: m.persons)
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise SystemExit(f"the heads must have distinct names, got {names}")
    planners = [PolicyBTReward.load(a.planner_head) if a.planner_head else models[0], models[-1]]
    pool = score_pool(a.pool, list({m.name: m for m in models + planners}.values()), head_features=True)
    ids = pool.grouped(names[0]).prompt_ids
    held, test = split_prompts(len(ids), 0.5, a.seed)
    eps = tuple(float(v) for v in a.epsilon_w.split(",") if v)
    n_grid = tuple(sorted({1, 2, 4, 8, a.n, 32, 64}))
    print(f"pool {a.pool}: {len(ids)} prompts, {len(held)} held-out / {len(test)} test; n = {a.n}, delta_w = "
          f"{a.delta:g}, {a.draws} release draws")
    rows = []
    for m in models:
        s = release_study(pool, study_head(m), ids[held], ids[test], a.n, n_grid, epsilons=eps,
                          taus=tuple(float(t) for t in a.taus.split(",") if t), queries=(1,), delta_w=a.delta,
                          draws=a.draws, seed=a.seed)
        lift = s["bon"][a.n] - s["base"]
        for q in s["queries"]:
            soft = next(r for r in s["n"] if r["epsilon_w"] == q["epsilon_w"] and r["selector"] == "soft"
                        and r["n"] == a.n) if s["tau"].get(q["epsilon_w"]) else None
            rows.append({"kind": "measured", "head": m.name, "persons": m.persons, "epsilon_w": q["epsilon_w"],
                         "delta_w": a.delta, "sigma": q["sigma"], "base": s["base"], "bon": s["bon"][a.n],
                         "mean": q["release_mean"], "p5": q["release_p5"], "sd": q["release_sd"],
                         "share_mean": (q["release_mean"] - s["base"]) / lift if lift > 0 else None,
                         "share_p5": (q["release_p5"] - s["base"]) / lift if lift > 0 else None,
                         "soft_tau": s["tau"].get(q["epsilon_w"]), "soft_mean": soft and soft["mean"],
                         "soft_p5": soft and soft["p5"], "lam": m.lam, "sensitivity": m.sensitivity})
    pid = np.asarray(pool.columns["prompt_id"], str)
    on_test = np.isin(pid, ids[test])
    for p in dict.fromkeys(planners):
        phi = pool.head_features(p.name)[on_test]
        for e in eps:
            for n_persons in PLANNER_GRID:
                r = release_accuracy(p, None, pid[on_test], np.asarray(pool.columns["true_reward"])[on_test], e,
                                     a.delta, a.n, a.draws, np.random.default_rng(a.seed), persons=n_persons, phi=phi)
                rows.append({"kind": "planned", "head": p.name, "from_persons": p.persons, "persons": n_persons,
                             "epsilon_w": e, "delta_w": a.delta, "sigma": r["sigma"], "mean": r["mean"], "p5": r["p5"],
                             "share_mean": r["share_mean"], "share_p5": r["share_p5"]})
    _print(rows, a.n)
    if a.out:
        Path(a.out).write_text(json.dumps({"pool": a.pool, "n": a.n, "rows": rows}, indent=1, default=float))
    if a.figure:
        from privalign.report.figures import release_persons

        Path(a.figure).mkdir(parents=True, exist_ok=True)
        release_persons(rows, Path(a.figure), "release-persons",
                        f"released head, BoN at n = {a.n}: share of the exact head's lift kept against persons")
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


def _pct(v) -> str:
    return "-" if v is None else f"{v:.0%}"


def _print(rows: list[dict], n: int) -> None:
    print(f"\n| persons P | lambda | Delta_r | exact BoN at {n} (base) | epsilon_w | released BoN: mean (p5) | "
          f"share kept: mean / p5 | soft BoN: tau, mean (p5) |")
    print("|---:|---:|---:|---|---:|---|---|---|")
    for r in (r for r in rows if r["kind"] == "measured"):
        soft = "-" if r["soft_tau"] is None else f"{r['soft_tau']:g}, {r['soft_mean']:.3f} ({r['soft_p5']:.3f})"
        print(f"| {r['persons']:,} | {r['lam']:g} | {r['sensitivity']:.3g} | {r['bon']:.3f} ({r['base']:.3f}) | "
              f"{r['epsilon_w']:g} | {r['mean']:.3f} ({r['p5']:.3f}) | {_pct(r['share_mean'])} / "
              f"{_pct(r['share_p5'])} | {soft} |")
    print("\nplanner (w held fixed): share kept, mean / p5")
    heads = list(dict.fromkeys((r["head"], r["from_persons"]) for r in rows if r["kind"] == "planned"))
    for head, own in heads:
        print(f"\nfrom {head} (P = {own:,}):\n\n| epsilon_w | " + " | ".join(f"P' = {p:,}" for p in PLANNER_GRID) + " |")
        print("|---:|" + "---|" * len(PLANNER_GRID))
        for e in dict.fromkeys(r["epsilon_w"] for r in rows if r["kind"] == "planned"):
            rs = {r["persons"]: r for r in rows if r["kind"] == "planned" and r["head"] == head and r["epsilon_w"] == e}
            print(f"| {e:g} | " + " | ".join(f"{_pct(rs[p]['share_mean'])} / {_pct(rs[p]['share_p5'])}"
                                             for p in PLANNER_GRID) + " |")


if __name__ == "__main__":
    main()
