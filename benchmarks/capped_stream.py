"""How many PrivITP queries one budget serves, capped (T = 16) and uncapped, at n = 16 and n = 1,024,
under basic composition, FSRC and zCDP (issue 31, item 3).

Each query is a real prompt of the shipped large pool (cycled in a seeded order), answered by the
mechanism at epsilon_max = 1 per query (its worst case, re-calibrated at each (n, T)), charged to a
privacy filter of (epsilon_total, delta_total); beta and the phase split are fixed (not tuned), so the
query counts, not the accuracies, are the point.

    .venv/bin/python benchmarks/capped_stream.py --task counting --reward policy-bt-m300 --seeds 5
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from privalign.evaluation import EvalSettings
from privalign.evaluation.private import stream
from privalign.evaluation.reward_info import declared_reward
from privalign.evaluation.suite import large_pool


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="counting")
    ap.add_argument("--reward", default="policy-bt")
    ap.add_argument("--epsilon", type=float, default=1.0, help="PrivITP's worst case per query")
    ap.add_argument("--epsilon-total", type=float, default=20.0)
    ap.add_argument("--delta-total", type=float, default=1e-3)
    ap.add_argument("--delta", type=float, default=1e-6, help="PrivITP's Phase-1 delta per query")
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    a = ap.parse_args(argv)
    pool, _ = large_pool(a.task)
    grouped = pool.grouped()
    out = []
    for n, T in ((16, 16), (1024, 16), (1024, None)):
        base = declared_reward(pool, EvalSettings(reward=a.reward, delta=a.delta, beta=a.beta, max_rounds=T, seed=0))
        t0 = time.perf_counter()
        rows = stream(grouped, base, {a.epsilon: {"privitp": {"beta": a.beta, "phase1_fraction": 0.5}}},
                      epsilon_max=a.epsilon, n=n, epsilon_total=a.epsilon_total, delta_total=a.delta_total,
                      seeds=a.seeds, privbon_epsilon=None)
        for comp in ("basic", "fsrc", "zcdp"):
            rs = [r for r in rows if r["composition"] == comp]
            q = np.array([r["queries"] for r in rs], float)
            out.append({"n": n, "max_rounds": T if T is not None else n, "composition": comp,
                        "queries_mean": float(q.mean()), "queries_min": int(q.min()), "queries_max": int(q.max()),
                        "epsilon_max": rs[0]["epsilon_max"], "mean_charge": float(np.mean([r["mean_charge"] for r in rs])),
                        "mean_halting_time": float(np.mean([r["mean_halting_time"] for r in rs])),
                        "accuracy": float(np.mean([r["accuracy"] for r in rs])), "seconds": time.perf_counter() - t0})
            print(json.dumps(out[-1]))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "rows": out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
