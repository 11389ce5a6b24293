"""PrivBoN's noise floor on the shipped large pools (issue 51, item 4): every certified head to n = 1,024.

    PYTHONPATH=src .venv/bin/python benchmarks/noise_floor_large.py --task counting [--epsilon 1] \
        [--replicates 50] [--workers 2] [--out rows.json]

For each certified reward model of the task's large pool, the prompts are split as the large-n study
splits them (``experiments.split_prompts(P, 0.5, seed)``), the scores mapped to [0, 1] by the head's
declared range, Delta_r its certified sensitivity. Gumbel PrivBoN at ``--epsilon`` per query runs at
the minimum noise and at sigma = max(2 Delta_r / epsilon, tau), tau chosen per n on the held-out
prompts from ``private.TEMPERATURE_GRID`` (``private.tune_temperature``); the test prompts only
measure (every tau over the whole n grid, so tau = 0 is the minimum-noise run itself). BoN is the
exact law. ``epsilon_star`` is 2 Delta_r / tau at the largest n when the floor binds there: above it,
every epsilon per query selects the same way and spends the same.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

from privalign.evaluation import EvalSettings, evaluate
from privalign.evaluation import private as P
from privalign.evaluation.experiments import split_prompts
from privalign.evaluation.large_n import LARGE_N, certified_rewards
from privalign.evaluation.reward_info import declared_reward
from privalign.evaluation.suite import large_pool


def one_head(pool, name: str, a) -> dict:
    s = replace(declared_reward(pool, EvalSettings(reward=name, replicates=a.replicates, seed=a.seed,
                                                   workers=a.workers)), n_grid=LARGE_N).check()
    grouped = pool.grouped(name)
    held_idx, test_idx = split_prompts(grouped.n_prompts, 0.5, s.seed)
    held, test = grouped.subset(held_idx), grouped.subset(test_idx)
    floors, _ = P.tune_temperature(held, s, a.epsilon, LARGE_N)
    bon = {r["n"]: r["accuracy"] for r in evaluate(test, replace(s, algorithms=("bon",))).summary_rows()}
    at = {}
    for tau in P.TEMPERATURE_GRID:
        st = replace(s, algorithms=("privbon",), epsilon=a.epsilon, temperature=tau)
        at.update({(tau, r["n"]): r for r in evaluate(test, st).summary_rows()})
    rows = [{"n": n, "bon": bon[n], "privbon_min_noise": at[0.0, n]["accuracy"], "tau": floors[n]["temperature"],
             "sigma": at[floors[n]["temperature"], n]["sigma"],
             "epsilon_spent": at[floors[n]["temperature"], n]["epsilon_spent"],
             "privbon_tuned": at[floors[n]["temperature"], n]["accuracy"],
             "privbon_tuned_se": at[floors[n]["temperature"], n]["accuracy_se"]} for n in LARGE_N]
    last = rows[-1]
    minimum = at[0.0, LARGE_N[-1]]["sigma"]
    return {"reward": name, "sensitivity": s.sensitivity, "min_sigma": minimum, "rows": rows,
            "epsilon_star": (2 * s.sensitivity / last["sigma"]) if last["sigma"] > minimum else None,
            "base": at[0.0, 1]["base_accuracy"], "prompts": [len(held_idx), len(test_idx)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="counting")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--replicates", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    pool, label = large_pool(a.task)
    heads = []
    for name in certified_rewards(pool):
        h = one_head(pool, name, a)
        heads.append(h)
        by = {r["n"]: r for r in h["rows"]}
        spent = sorted({round(r["epsilon_spent"], 3) for r in h["rows"] if r["n"] >= 64})
        print(f"| {name} | {h['sensitivity']:.3g} | {h['min_sigma']:.3g} | "
              + " | ".join(f"{by[n]['bon']:.3f} / {by[n]['privbon_min_noise']:.3f} / {by[n]['privbon_tuned']:.3f} "
                           f"(tau {by[n]['tau']:g}, eps {by[n]['epsilon_spent']:.3g})" for n in (64, 1024))
              + f" | {', '.join(map(str, spent))} | "
              + (f"{h['epsilon_star']:.3g}" if h["epsilon_star"] else "not reached") + " |", flush=True)
    print(f"({label}, {heads[0]['prompts'][0]} held-out and {heads[0]['prompts'][1]} test prompts, "
          f"epsilon {a.epsilon} per query, {time.time() - t0:.0f} s)")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "heads": heads}, f, indent=1, default=float)


if __name__ == "__main__":
    main()
