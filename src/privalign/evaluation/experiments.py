"""The paper's experiment suite beyond the main curves (Section 5, App. F and G).

* ``ablation``: sweep one parameter (sigma for PrivBoN, beta for ITP/PrivITP), choose the best
  value on held-out prompts, report it on the rest (the paper's protocol).
* ``noise_sweep``: ITP versus PrivITP across total noise sigma at a fixed n.

The experiments at a fixed privacy level (tuning under a worst-case epsilon, curves, the FSRC
stream) are in ``evaluation.private``.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ..pools import GroupedPool
from .harness import EvalSettings
from .parallel import evaluate

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


