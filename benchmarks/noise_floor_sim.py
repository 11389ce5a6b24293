"""PrivBoN's noise floor in the hackable simulation world (issue 51's simulation result).

    PYTHONPATH=src .venv/bin/python benchmarks/noise_floor_sim.py [--prompts 200] [--samples 2048] \
        [--delta-r 0.003] [--epsilon 1] [--replicates 50] [--workers 2] [--out rows.json]

A hackable world (``privalign simulate hackable``'s defaults: base accuracy 0.3, margin 1, proxy
noise 0.2 on correct and 0.6 on wrong answers) is split into held-out and test prompts (half each,
seeded). At each n, Gumbel PrivBoN at epsilon per query runs at the minimum noise sigma = 2 Delta_r /
epsilon and at sigma = max(2 Delta_r / epsilon, tau), tau chosen on the held-out prompts from
``evaluation.private.TEMPERATURE_GRID`` (``private.tune_temperature``); the test prompts only measure.
Delta_r is in units of the reward range (the harness's default: the pool's observed min and max,
mapped to [0, 1]). Accuracies are the exact laws' means over ``--replicates`` candidate draws per
prompt. ``queries_x`` is how many more queries the same budget answers: epsilon / epsilon spent.
"""

from __future__ import annotations

import argparse
import json
import time

from privalign.evaluation import EvalSettings, evaluate
from privalign.evaluation import private as P
from privalign.evaluation.experiments import split_prompts
from privalign.simulate import simulate

N_GRID = tuple(2 ** k for k in range(11))  # 1 .. 1,024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--delta-r", type=float, default=0.003)
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--replicates", type=int, default=50)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    pool = simulate("hackable", a.prompts, a.samples, seed=a.seed).grouped()
    held_idx, test_idx = split_prompts(pool.n_prompts, 0.5, a.seed)
    held, test = pool.subset(held_idx), pool.subset(test_idx)
    base = EvalSettings(n_grid=N_GRID, replicates=a.replicates, sensitivity=a.delta_r, seed=a.seed,
                        workers=a.workers)
    floors, _ = P.tune_temperature(held, base, a.epsilon, N_GRID)
    bon = {r["n"]: r for r in evaluate(test, EvalSettings(**{**base.__dict__, "algorithms": ("bon",)})).summary_rows()}
    # every floor over the whole n grid, as on the held-out prompts (tau = 0 is the minimum-noise run)
    at = {}
    for tau in P.TEMPERATURE_GRID:
        s = EvalSettings(**{**base.__dict__, "algorithms": ("privbon",), "epsilon": a.epsilon, "temperature": tau})
        at.update({(tau, r["n"]): r for r in evaluate(test, s).summary_rows()})
    rows = []
    for n in N_GRID:
        c = floors[n]
        t = at[c["temperature"], n]
        rows.append({"n": n, "bon": bon[n]["accuracy"], "privbon_min_noise": at[0.0, n]["accuracy"],
                     "min_sigma": at[0.0, n]["sigma"], "tau": c["temperature"], "sigma": t["sigma"],
                     "epsilon_spent": t["epsilon_spent"], "privbon_tuned": t["accuracy"],
                     "privbon_tuned_se": t["accuracy_se"], "heldout": c["heldout_accuracy"],
                     "queries_x": a.epsilon / t["epsilon_spent"], "base": t["base_accuracy"]})
    print(f"hackable world, {a.prompts} prompts ({len(held_idx)} held-out, {len(test_idx)} test) x {a.samples} "
          f"samples, Delta_r = {a.delta_r} of the range, epsilon = {a.epsilon} per query, "
          f"{a.replicates} replicates; base accuracy {rows[0]['base']:.3f}")
    print("| n | BoN | PrivBoN, minimum noise | tau (held-out) | sigma | epsilon spent | PrivBoN, tuned floor "
          "| queries x |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['n']:,} | {r['bon']:.3f} | {r['privbon_min_noise']:.3f} | {r['tau']:g} | {r['sigma']:.3g} "
              f"| {r['epsilon_spent']:.3f} | {r['privbon_tuned']:.3f} +- {r['privbon_tuned_se']:.3f} "
              f"| {r['queries_x']:.1f} |")
    print(f"({time.time() - t0:.0f} s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
