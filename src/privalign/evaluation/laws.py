"""Selection laws batched over replicates: each row of ``x`` is one replicate's candidate set.

These are the Rao-Blackwellised estimators of the harness. They integrate out the selection noise
exactly for a given candidate set; the only noise left to average draw by draw is PrivITP's
lambda~.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from .._special import log_mean_ndtr
from ..accounting.privitp import privitp_phase2_terms


def softmax_rows(x: np.ndarray, sigma: float) -> np.ndarray:
    """PrivBoN with Gumbel noise: softmax(x / sigma) per row (Prop. 3.2)."""
    return special.softmax(x / sigma, axis=1)


def gaussian_rows(x: np.ndarray, sigma: float, step: float = 0.05) -> np.ndarray:
    """PrivBoN with Gaussian noise (Prop. E.2), per row.

    With v = x / sigma and G(u) = sum_j log Phi(u - v_j):
    P(i) = int phi(u - v_i) / Phi(u - v_i) exp(G(u)) du, evaluated by the trapezoid rule on a
    uniform u-grid (exponentially accurate for this smooth, Gaussian-decaying integrand) at cost
    O(n K) per row instead of O(n^2 K).
    """
    v = x / sigma
    out = np.empty_like(v)
    for m in range(v.shape[0]):
        vm = v[m]
        u = np.arange(vm.min() - 9.0, vm.max() + 9.0 + step, step)
        G = np.zeros_like(u)
        for chunk in np.array_split(vm, max(1, vm.size // 512)):
            G += special.log_ndtr(u[:, None] - chunk[None, :]).sum(axis=1)
        d = u[:, None] - vm[None, :]
        logw = -0.5 * d * d - 0.5 * math.log(2 * math.pi) - special.log_ndtr(d) + G[:, None]
        p = np.exp(special.logsumexp(logw, axis=0))
        out[m] = p / p.sum()
    return out


def lambda_rows(x: np.ndarray, beta: float) -> np.ndarray:
    """Exact ITP lambda per row (sorted solution, vectorised over rows)."""
    n = x.shape[1]
    s = -np.sort(-x, axis=1)
    csum = np.cumsum(s, axis=1)
    k = np.arange(1, n + 1)
    nxt = np.concatenate([s[:, 1:], np.full((s.shape[0], 1), -np.inf)], axis=1)
    ok = csum - k * nxt >= n * beta
    kk = ok.argmax(axis=1)  # first k with f(r_(k+1)) >= n beta (always exists: last is +inf)
    return (csum[np.arange(s.shape[0]), kk] - n * beta) / (kk + 1)


def sequential_rows(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Law of sequential rejection sampling per row: (P(accept at i), P(fallback))."""
    survive = np.cumprod(1.0 - a, axis=1)
    before = np.concatenate([np.ones((a.shape[0], 1)), survive[:, :-1]], axis=1)
    return a * before, survive[:, -1]


def itp_rows(x: np.ndarray, beta: float, r_max: float):
    """ITP law per row; ``x`` already shifted to [0, r_max]."""
    lam = lambda_rows(x, beta)[:, None]
    a = np.clip((x - lam) / (r_max - lam), 0.0, 1.0)
    return sequential_rows(a)


def privitp_rows(x1: np.ndarray, x2: np.ndarray, *, beta: float, sigma_x: float, sigma_z: float,
                 r_max: float, truncation: float, sensitivity: float, rng: np.random.Generator):
    """PrivITP per row: lambda~ drawn once per replicate (draw by draw), then the exact Phase-2 law.

    Returns (P(accept at i), P(fallback), expected ex-post epsilon_2 given lambda~).
    """
    lam = lambda_rows(x1, beta)
    lam_t = np.clip(lam + sigma_x * rng.standard_normal(lam.size), -beta, r_max)
    b = (r_max + sigma_z * truncation - lam_t)[:, None]
    a = np.exp(log_mean_ndtr((x2 - lam_t[:, None] - b) / sigma_z, b / sigma_z))
    law, fallback = sequential_rows(a)
    kappa, accept = privitp_phase2_terms(lam_t, sigma_z, sensitivity, r_max, truncation)
    n = x2.shape[1]
    t_minus_1 = np.arange(n)
    eps2 = (law * (t_minus_1[None, :] * kappa[:, None] + accept[:, None])).sum(axis=1) + fallback * n * kappa
    return law, fallback, eps2


def bon_exact(x: np.ndarray, values: np.ndarray, n_grid, replace: bool = True) -> np.ndarray:
    """E[values of BoN's choice] for drawing n of the pool's S samples, for each n in ``n_grid``.

    Closed form: sort by x and group ties (ties are broken uniformly, so a group contributes its
    mean). With replacement P(max in groups <= g) = (c_g / S)^n; without replacement
    C(c_g, n) / C(S, n). ``values`` has shape (S, k); returns (len(n_grid), k).
    """
    S = x.size
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.flatnonzero(np.r_[True, xs[1:] != xs[:-1]])
    counts = np.diff(np.r_[starts, S])
    c = np.cumsum(counts).astype(float)
    group_mean = np.add.reduceat(values[order], starts, axis=0) / counts[:, None]
    out = np.empty((len(n_grid), values.shape[1]))
    for j, n in enumerate(n_grid):
        if replace:
            cdf = np.exp(n * (np.log(c) - math.log(S)))
        else:
            with np.errstate(invalid="ignore"):
                logc = special.gammaln(c + 1) - special.gammaln(c - n + 1) - special.gammaln(n + 1)
                cdf = np.where(c >= n, np.exp(logc - (special.gammaln(S + 1) - special.gammaln(S - n + 1)
                                                     - special.gammaln(n + 1))), 0.0)
        p = np.diff(np.r_[0.0, cdf])
        out[j] = p @ group_mean
    return out
