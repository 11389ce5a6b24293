"""The release study for every certified head of a large pool (issue 28, item 4).

    .venv/bin/python benchmarks/release_heads.py POOL.parquet HEAD.json [HEAD.json ...] \
        [--epsilon-w 0.1,0.3,1,3,10] [--delta 1e-6] [--draws 60] [--n 16] [--taus 0.003,0.01,0.03,0.1,0.3,1] [--seed 0] [--out rows.json] [--figure FOLDER]

POOL is a large pool of the heads' policy with recorded features (``privalign generate --samples
1024 --features``); each HEAD a certified policy-bt head (``rm train``: the shipped pair-unit head,
the person-unit heads on a subset of D's persons, the head trained on the other family's data).
The pool is scored with every head and their feature coordinates phi (``score_pool(...,
head_features=True)``), its prompts are split in half (``experiments.split_prompts``, seeded), and
for each head ``evaluation.release.release_study`` runs on the two halves:

- at n = ``--n``: the head released once at (epsilon_w, delta), then BoN (mean and 5th percentile
  over ``--draws`` release draws), against per-query Gumbel PrivBoN spending the same total over
  Q = 10, 100, 1,000 and 10,000 queries under zCDP;
- at n = 1 to 1,024: BoN and soft BoN on the released head, soft BoN's temperature chosen per
  epsilon_w on the held-out half from ``--taus`` (best mean at n = 1,024; not a privacy parameter;
  the grid goes two steps past ``reproduce``'s, up to tau = 1, near uniform choice);
- the smallest epsilon_w that keeps >= 90% of BoN's lift at n on average and >= 80% at the 5th
  percentile (60 draws, bisection on log epsilon_w).

Every number is measured on the test half. Prints two Markdown tables per head; ``--out`` writes
every row as JSON, and ``--figure`` one figure per head (``report.figures.release_vs_n``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from privalign.evaluation.experiments import split_prompts
from privalign.evaluation.release import release_study
from privalign.pipeline import score_pool
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import study_head

N_GRID = tuple(2 ** k for k in range(11))


def _peak_drop(rows: list[dict], selector: str, key: str) -> tuple[int, float, float]:
    """(n at the curve's peak, its value, the drop from the peak to the largest n) for one selector."""
    curve = sorted((r["n"], r[key]) for r in rows if r["selector"] == selector)
    n_peak, v_peak = max(curve, key=lambda t: t[1])
    return n_peak, v_peak, v_peak - curve[-1][1]


def _print_head(study: dict, seconds: float) -> None:
    h, n_ref = study["head"], study["n_ref"]
    base, bon = study["base"], study["bon"]
    print(f"\n#### {h['name']}: P = {h['persons']}, k = {h['pairs_per_person']}, Delta_r = {h['sensitivity']:.3g}, "
          f"d = {h['dim']}; exact BoN at {n_ref} {bon[n_ref]:.3f}, base {base:.3f} ({seconds:.0f} s)")
    sm = study["smallest"]
    at = sm["at"]
    print("smallest epsilon_w for 90% / 80% of the lift: " + (
        f"{sm['epsilon_w']:.3g} ({at['share_mean']:.0%} / {at['share_p5']:.0%})" if sm["met"] else
        ("none: the exact head has no lift" if at["share_mean"] is None else
         f"not met at {sm['bounds'][1]:g} ({at['share_mean']:.0%} / {at['share_p5']:.0%})")))
    qs = sorted({r["queries"] for r in study["queries"]})
    print(f"| epsilon_w | release then BoN at {n_ref}: mean +- se (p5) | " + " | ".join(f"per-query, Q = {q:,}" for q in qs) + " |")
    print("|---:|---|" + "---:|" * len(qs))
    for e in dict.fromkeys(r["epsilon_w"] for r in study["queries"]):
        rs = {r["queries"]: r for r in study["queries"] if r["epsilon_w"] == e}
        r0 = rs[qs[0]]
        se = r0["release_sd"] / study["draws"] ** 0.5
        print(f"| {e:g} | {r0['release_mean']:.3f} +- {se:.3f} ({r0['release_p5']:.3f}) | "
              + " | ".join(f"{rs[q]['per_query_accuracy']:.3f}" for q in qs) + " |")
    big = max(N_GRID)
    exact = sorted((r["n"], r["exact_head"]) for r in study["n"] if r["selector"] == "bon"
                   and r["epsilon_w"] == study["queries"][0]["epsilon_w"])
    n_ex, v_ex = max(exact, key=lambda t: t[1])
    print(f"exact head, BoN: peak {v_ex:.3f} at n = {n_ex}, {dict(exact)[big]:.3f} at n = {big:,}")
    print(f"| epsilon_w | BoN: n = 16 | BoN: peak (n) | BoN: n = {big:,} (p5) | soft BoN tau | soft: peak (n) | "
          f"soft: n = {big:,} (p5) |")
    print("|---:|---|---|---|---:|---|---|")
    for e in dict.fromkeys(r["epsilon_w"] for r in study["n"]):
        rows = [r for r in study["n"] if r["epsilon_w"] == e]
        at = {(r["selector"], r["n"]): r for r in rows}
        nb, vb, _ = _peak_drop(rows, "bon", "mean")
        ns, vs, _ = _peak_drop(rows, "soft", "mean")
        b, s = at[("bon", big)], at[("soft", big)]
        print(f"| {e:g} | {at[('bon', 16)]['mean']:.3f} | {vb:.3f} ({nb}) | {b['mean']:.3f} ({b['p5']:.3f}) | "
              f"{study['tau'][e]:g} | {vs:.3f} ({ns}) | {s['mean']:.3f} ({s['p5']:.3f}) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pool")
    ap.add_argument("heads", nargs="+")
    ap.add_argument("--epsilon-w", default="0.1,0.3,1,3,10")
    ap.add_argument("--delta", type=float, default=1e-6)
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--taus", default="0.003,0.01,0.03,0.1,0.3,1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    ap.add_argument("--figure", help="write one accuracy-against-n figure per head to this folder")
    a = ap.parse_args()
    t0 = time.perf_counter()
    models = [PolicyBTReward.load(h) for h in a.heads]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise SystemExit(f"the heads must have distinct names, got {names}")
    pool = score_pool(a.pool, models, head_features=True)
    ids = pool.grouped(names[0]).prompt_ids
    held, test = split_prompts(len(ids), 0.5, a.seed)
    print(f"pool {a.pool}: {len(ids)} prompts x {pool.n_rows // len(ids)}, {len(held)} held-out / {len(test)} test; "
          f"delta_w = {a.delta:g}, {a.draws} release draws; scored in {time.perf_counter() - t0:.0f} s")
    eps = tuple(float(v) for v in a.epsilon_w.split(",") if v)
    studies = []
    for path, m in zip(a.heads, models):
        t1 = time.perf_counter()
        study = release_study(pool, study_head(m), ids[held], ids[test], a.n, N_GRID, epsilons=eps,
                              taus=tuple(float(t) for t in a.taus.split(",") if t), delta_w=a.delta, draws=a.draws, seed=a.seed)
        _print_head(study, time.perf_counter() - t1)
        if a.figure:
            from privalign.report.figures import release_vs_n

            Path(a.figure).mkdir(parents=True, exist_ok=True)
            release_vs_n(study["n"], study["bon"], study["base"], Path(a.figure),
                         f"release-large-{Path(a.pool).stem}-{m.name}",
                         f"{m.name} (Delta_r {m.sensitivity:.3g}) released: BoN and soft BoN against n")
        studies.append({"path": path, **study, "tau": {str(k): v for k, v in study["tau"].items()}})
    if a.out:
        Path(a.out).write_text(json.dumps({"pool": a.pool, "studies": studies}, indent=1, default=float))
    print(f"\n{time.perf_counter() - t0:.0f} s in all")


if __name__ == "__main__":
    main()
