"""The paper's experiment suite beyond the main curves (Section 5, App. F and G).

* ``ablation``: sweep one parameter (sigma for PrivBoN, beta for ITP/PrivITP), choose the best
  value on held-out prompts, report it on the rest (the paper's protocol).
* ``noise_sweep``: ITP versus PrivITP across total noise sigma at a fixed n.
* ``multi_query``: a stream of PrivITP queries under one budget, FSRC versus basic composition,
  over seeds and a sigma grid, with halting-time statistics (paper Fig. 1 bottom right, Fig. 13).
* ``budget_table``: epsilon per mechanism across noise levels (App. G.3).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from .. import accounting as A
from ..mechanisms import privitp
from ..pools import GroupedPool
from .harness import EvalSettings, evaluate, prepare

SIGMA_GRID = (0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
BETA_GRID = (0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5)


def split_prompts(n_prompts: int, heldout_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A seeded split into (held-out tuning prompts, evaluation prompts)."""
    if not 0 < heldout_fraction < 1:
        raise ValueError(f"heldout_fraction must lie in (0, 1), got {heldout_fraction!r}")
    perm = np.random.default_rng(seed).permutation(n_prompts)
    k = max(1, min(n_prompts - 1, int(round(heldout_fraction * n_prompts))))
    return np.sort(perm[:k]), np.sort(perm[k:])


def ablation(pool: GroupedPool, base: EvalSettings, algorithm: str, parameter: str, grid,
             n_ref: int = 64, heldout_fraction: float = 0.5) -> dict:
    """Sweep ``parameter`` over ``grid`` for ``algorithm`` at n = ``n_ref``.

    The best value (highest mean accuracy) is chosen on the held-out prompts and then evaluated on
    the remaining prompts; both curves are returned.
    """
    if pool.n_prompts < 2:
        raise ValueError("an ablation needs at least 2 prompts (held-out and evaluation)")
    held, rest = split_prompts(pool.n_prompts, heldout_fraction, base.seed)
    rows = []
    for split, prompts in (("heldout", held), ("eval", rest)):
        sub = pool.subset(prompts)
        for value in grid:
            s = replace(base, algorithms=(algorithm,), n_grid=(n_ref,), **{parameter: float(value)})
            if parameter == "sigma":
                s = replace(s, sigma_x=None, sigma_z=None)
            row = evaluate(sub, s).summary_rows()[0]
            rows.append({"algorithm": algorithm, "parameter": parameter, "value": float(value),
                         "split": split, "n": n_ref, "accuracy": row["accuracy"],
                         "accuracy_se": row["accuracy_se"], "lift": row["lift"], "lift_se": row["lift_se"],
                         "proxy_reward": row["proxy_reward"], "epsilon": row["epsilon"]})
    held_rows = [r for r in rows if r["split"] == "heldout"]
    best = max(held_rows, key=lambda r: r["accuracy"])["value"]
    return {"algorithm": algorithm, "parameter": parameter, "chosen": best, "n_ref": n_ref, "rows": rows,
            "heldout_prompts": len(held), "eval_prompts": len(rest)}


def noise_sweep(pool: GroupedPool, base: EvalSettings, sigmas=SIGMA_GRID, n: int = 64) -> list[dict]:
    """ITP (no noise) versus PrivITP with sigma_X = sigma_Z = sigma/2, at one n."""
    itp_row = evaluate(pool, replace(base, algorithms=("itp",), n_grid=(n,))).summary_rows()[0]
    rows = [{"algorithm": "itp", "sigma": 0.0, "n": n, "accuracy": itp_row["accuracy"],
             "accuracy_se": itp_row["accuracy_se"], "epsilon": math.inf}]
    for sigma in sigmas:
        r = evaluate(pool, replace(base, algorithms=("privitp",), n_grid=(n,), sigma=float(sigma),
                                   sigma_x=None, sigma_z=None)).summary_rows()[0]
        rows.append({"algorithm": "privitp", "sigma": float(sigma), "n": n, "accuracy": r["accuracy"],
                     "accuracy_se": r["accuracy_se"], "epsilon": r["epsilon"]})
    return rows


def multi_query(pool: GroupedPool, base: EvalSettings, sigmas=(0.5, 1.0, 2.0, 4.0), seeds: int = 10,
                n: int = 16, beta: float = 0.05, epsilon_total: float = 50.0, delta: float = 1e-2,
                sensitivity: float = 1.0, max_queries: int = 100_000) -> list[dict]:
    """Answer a stream of prompts with the real PrivITP mechanism under a total budget.

    Each query picks the next prompt of a seeded shuffle, draws two independent batches of n from
    its pool and charges the realised ex-post epsilon (FSRC) or epsilon_max (basic). The stream
    stops at the first query whose worst case no longer fits. As in the paper, Delta_r = R_max
    (``sensitivity=1`` in units of the range). delta_total is just below 1; since every query
    spends delta and deltas add, no stream can exceed floor((1 - 1e-9) / delta) - 1 = 98 to 99
    queries at delta = 0.01, whatever epsilon allows.
    """
    prep = prepare(pool, base)
    rows = []
    for sigma in sigmas:
        sx = sz = sigma / 2
        L = A.default_truncation(n)
        eps_max = A.privitp_epsilon_max(n, beta, sx, sz, delta, sensitivity, 1.0, L)
        for comp in A.COMPOSITIONS:
            for seed in range(seeds):
                rng = np.random.default_rng([base.seed, seed])
                order = rng.permutation(pool.n_prompts)
                f = A.PrivacyFilter(epsilon_total, 1 - 1e-9, comp)
                halting, eps = [], []
                while f.can_run(eps_max, delta) and f.queries < max_queries:
                    x, _ = prep.prompt(int(order[f.queries % order.size]))
                    b1, b2 = x[rng.integers(0, x.size, n)], x[rng.integers(0, x.size, n)]
                    sel = privitp(b1, b2, beta=beta, sigma_x=sx, sigma_z=sz, delta=delta, truncation=L,
                                  sensitivity=sensitivity, reward_range=(0.0, 1.0), rng=rng)
                    f.charge(sel.epsilon, delta, epsilon_max=eps_max)
                    halting.append(sel.halting_time)
                    eps.append(sel.epsilon)
                rows.append({"sigma": float(sigma), "composition": comp, "seed": seed, "queries": f.queries,
                             "epsilon_max": eps_max, "epsilon_spent": f.spent.epsilon,
                             "mean_epsilon": float(np.mean(eps)) if eps else math.nan,
                             "mean_halting_time": float(np.mean(halting)) if halting else math.nan,
                             "median_halting_time": float(np.median(halting)) if halting else math.nan,
                             "fallback_rate": float(np.mean(np.array(halting) == n + 1)) if halting else math.nan})
    return rows


def summarise_multi_query(rows: list[dict]) -> list[dict]:
    out = []
    for sigma in sorted({r["sigma"] for r in rows}):
        for comp in A.COMPOSITIONS:
            q = np.array([r["queries"] for r in rows if r["sigma"] == sigma and r["composition"] == comp], float)
            t = [r["mean_halting_time"] for r in rows if r["sigma"] == sigma and r["composition"] == comp]
            out.append({"sigma": sigma, "composition": comp, "queries_mean": float(q.mean()),
                        "queries_se": float(q.std(ddof=1) / math.sqrt(q.size)) if q.size > 1 else 0.0,
                        "mean_halting_time": float(np.nanmean(t)), "seeds": int(q.size)})
    return out


def budget_table(sigmas=(0.25, 0.5, 1.0, 2.0, 4.0), n: int = 16, beta: float = 0.05, delta: float = 1e-2,
                 sensitivity: float = 1.0, r_max: float = 1.0, mean_halting: dict | None = None) -> list[dict]:
    """Epsilon per mechanism across noise levels (App. G.3: Delta_r = R_max, delta = 1e-2, n = 16).

    PrivITP uses sigma_X = sigma_Z = sigma/2; its ex-post cost is shown at the worst-case lambda~
    for the mean halting time ``mean_halting[sigma]`` when given (as in the paper's table).
    """
    rows = []
    for sigma in sigmas:
        sx = sz = sigma / 2
        L = A.default_truncation(n)
        eps1 = A.gaussian_mechanism_epsilon(sx, sensitivity, delta)
        try:
            eps1_classic = A.gaussian_mechanism_epsilon(sx, sensitivity, delta, method="classic")
        except ValueError:
            eps1_classic = math.nan
        row = {"sigma": sigma, "privbon_gumbel": A.gumbel_epsilon(sigma, sensitivity),
               "privbon_gaussian": A.gaussian_rnm_epsilon(sigma, sensitivity, r_max, n),
               "privitp_epsilon_1": eps1, "privitp_epsilon_1_classic": eps1_classic,
               "privitp_epsilon_max": A.privitp_epsilon_max(n, beta, sx, sz, delta, sensitivity, r_max, L)}
        if mean_halting and sigma in mean_halting:
            t = max(1, min(n, int(round(mean_halting[sigma]))))
            lams = np.linspace(-beta, r_max, 2001)
            row["mean_halting_time"] = mean_halting[sigma]
            row["privitp_expost_at_mean_t"] = eps1 + float(np.max(A.privitp_epsilon2(t, lams, sz, sensitivity, r_max, L)))
        rows.append(row)
    return rows
