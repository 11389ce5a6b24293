"""Selection laws batched over replicates: each row of ``x`` is one replicate's candidate set.

These are the Rao-Blackwellised estimators of the harness. They integrate out the selection noise
exactly for a given candidate set; the only noise left to average draw by draw is PrivITP's
lambda~.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from .._special import psi
from ..metrics import softmax_rows  # noqa: F401  (the laws' Gumbel row, shared with training)
from ..accounting.privitp import _check_lambda_tilde, _check_phase2, _terms


def gaussian_rows(x: np.ndarray, sigma: float, step: float = 0.1) -> np.ndarray:
    """PrivBoN with Gaussian noise (Prop. E.2), per row.

    With v = x / sigma and G(u) = sum_j log Phi(u - v_j):
    P(i) = int phi(u - v_i) / Phi(u - v_i) exp(G(u)) du, evaluated by the trapezoid rule on a
    uniform u-grid (exponentially accurate for this smooth, Gaussian-decaying integrand: a step of
    0.1 noise scales agrees with 0.05 to 2e-17) at cost O(n K) per row instead of O(n^2 K).

    Only the candidates within ``FAR`` = 24 noise scales of the row's best matter: one further
    below wins with probability at most Phi(-24 / sqrt 2) < 1e-63 (it must beat the best's noise),
    and is given 0; the integrand below u = v_max - 15 is at most Phi(-15) < 1e-50 of its mass, so
    the grid starts there. With the small noise of a certified head (sigma of a few hundredths of
    the range) a row of 1,024 candidates then costs a few of them, not all.
    """
    v = x / sigma
    out = np.zeros_like(v)
    for m in range(v.shape[0]):
        vm = v[m]
        top = vm.max()
        keep = np.flatnonzero(vm >= top - FAR)
        # equal scores (equal responses) have equal probabilities: integrate once per distinct value
        vk, inverse, count = np.unique(vm[keep], return_inverse=True, return_counts=True)
        u = np.arange(max(vk[0] - 9.0, top - 15.0), top + 9.0 + step, step)
        d = u[:, None] - vk[None, :]
        L = special.log_ndtr(d)  # log Phi(u - v_j): G's terms and each candidate's own divisor
        logw = (L @ count)[:, None] - L - 0.5 * d * d - 0.5 * math.log(2 * math.pi)
        p = np.exp(special.logsumexp(logw, axis=0))[inverse]
        out[m, keep] = p / p.sum()
    return out


FAR = 24.0  # noise scales below the best beyond which a candidate's Gaussian PrivBoN probability is 0


def lambda_rows(x: np.ndarray, beta: float, start: float | None = None) -> np.ndarray:
    """Exact ITP lambda per row: the root of sum_j (x_j - lambda)_+ = n beta (Eq. 5), by Newton's
    method on this convex, piecewise-linear function, batched over rows.

    Each step solves the linear piece of every row's current active set {x_j > lambda}; rows stop
    once their active set is stable, and then lambda = (sum of the active x - n beta) / k is exact.
    From the left the steps rise monotonically to the root; from the right the first step lands
    left of it. ``start`` (default: each row's mean less beta, which lies left of the root) only
    changes how many steps are needed: the root of the pool's own candidates, which every row's
    root estimates, saves about one step in four. A sorted solution backs up the rare rows that
    need more than 64 steps.
    """
    n = x.shape[1]
    target = n * beta
    lam = x.mean(axis=1) - beta if start is None else np.full(x.shape[0], float(start))
    prev = None
    for _ in range(64):
        active = (x > lam[:, None]).astype(float)  # as floats: the sums below run as dot products
        k = active.sum(axis=1)
        if prev is not None and np.array_equal(k, prev):
            return lam
        lam = (np.vecdot(x, active) - target) / np.maximum(k, 1.0)  # k = 0 (a start right of every x): a step far left
        prev = k
    return _lambda_rows_sorted(x, beta)


def _lambda_rows_sorted(x: np.ndarray, beta: float) -> np.ndarray:
    n = x.shape[1]
    s = -np.sort(-x, axis=1)
    csum = np.cumsum(s, axis=1)
    k = np.arange(1, n + 1)
    nxt = np.concatenate([s[:, 1:], np.full((s.shape[0], 1), -np.inf)], axis=1)
    kk = (csum - k * nxt >= n * beta).argmax(axis=1)  # first k with f(r_(k+1)) >= n beta
    return (csum[np.arange(s.shape[0]), kk] - n * beta) / (kk + 1)


def itp_acceptance_rows(x: np.ndarray, lam: np.ndarray, r_max: float) -> np.ndarray:
    """ITP's acceptance probability min(w/M, 1) = clip((r - lambda)/(R_max - lambda), 0, 1), per row
    (``lam`` has one entry per row, shape (rows, 1)); ``x`` already shifted to [0, r_max]."""
    return np.clip((x - lam) / (r_max - lam), 0.0, 1.0)


TAIL = 1e-17  # survival below which the rest of a sequential law is negligible in double precision


def sequential_lazy(n: int, rows: int, chunk, first: int = 64):
    """Sequential rejection sampling, examined lazily in growing chunks of candidates.

    ``chunk(start, stop, live)`` returns (pool indices, acceptance probabilities) of candidates
    start..stop-1 for the rows ``live`` (an index array). A row whose survival is below ``TAIL``
    is examined no further (its remaining mass, < 1e-17, is assigned to the fallback), and all
    stop after n candidates, so long candidate lists cost only the candidates that can matter, as
    in the mechanism itself.
    Returns (index chunks, law chunks, P(fallback) per row, E[halting time] per row); the chunks
    hold the rows that were live when they were examined (the live rows of each chunk are those of
    the previous one or fewer; the index and law chunks have matching shapes).
    """
    survive = np.ones(rows)
    halting = np.zeros(rows)
    idx_parts, law_parts = [], []
    live = np.arange(rows)
    start, width = 0, first
    while start < n and live.size:
        stop = min(n, start + width)
        idx, a = chunk(start, stop, live)
        s = survive[live]
        cp = np.cumprod(1.0 - a, axis=1)
        law = a * np.concatenate([s[:, None], s[:, None] * cp[:, :-1]], axis=1)
        idx_parts.append(idx)
        law_parts.append(law)
        halting[live] += law @ np.arange(start + 1, stop + 1)
        survive[live] = s * cp[:, -1]
        live = live[survive[live] > TAIL]
        start, width = stop, width * 2
    halting += survive * (n + 1)
    return idx_parts, law_parts, survive, halting


def privitp_lower(x: np.ndarray, sigma_z: float, r_max: float, truncation: float) -> np.ndarray:
    """Psi((r - r_max) / sigma_Z - L) per candidate: the lower end of PrivITP's acceptance integral
    (``privitp_acceptance_rows``), the same for every lambda~, so that it can be tabulated once per
    pool and n."""
    return psi((x - r_max) / sigma_z - truncation)


def privitp_acceptance_rows(x2: np.ndarray, lam_t: np.ndarray, sigma_z: float, r_max: float,
                            truncation: float, lower: np.ndarray | None = None) -> np.ndarray:
    """P(accept) = E_u Phi((r - lambda~ - b u)/sigma_Z), b = r_max + sigma_Z L - lambda~ per row.

    In closed form (Psi(hi) - Psi(lo)) / c with c = b / sigma_Z, hi = (r - lambda~) / sigma_Z and
    lo = hi - c = (r - r_max) / sigma_Z - L, which does not depend on lambda~: ``lower`` may hold
    Psi(lo) for these candidates, gathered from ``privitp_lower``'s table. For c below 1e-6
    (lambda~ = r_max with L = 0) it is Phi((hi + lo) / 2), with error O(c^2).
    """
    c = ((r_max + sigma_z * truncation - lam_t) / sigma_z)[:, None]
    hi = (x2 - lam_t[:, None]) / sigma_z
    if lower is None:
        lower = privitp_lower(x2, sigma_z, r_max, truncation)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (psi(hi) - lower) / c
    tiny = c[:, 0] <= 1e-6
    if tiny.any():
        out[tiny] = special.ndtr(hi[tiny] - 0.5 * c[tiny])
    return np.clip(out, 0.0, 1.0)


def privitp_epsilon2_rows(lam_t, accepted_halting, fallback, n, *, sigma_z, sensitivity, r_max, truncation):
    """E[epsilon_2^post] per row: sum_t P(t) ((t-1) kappa + accept) + P(fallback) n kappa.

    ``accepted_halting`` is sum_t P(t) t over accepted outcomes only. ``n`` and ``truncation`` may
    be arrays (one value per row), so that one call serves every n of a prompt: each element is
    computed exactly as by ``accounting.privitp_phase2_terms``.
    """
    L = np.asarray(truncation, dtype=float)
    sigma_z, delta_r, r_max, _ = _check_phase2(sigma_z, sensitivity, r_max, float(L.min()))
    kappa, accept = _terms(_check_lambda_tilde(lam_t, r_max), sigma_z, delta_r, r_max, L)
    accepted = 1.0 - fallback
    return kappa * (accepted_halting - accepted) + accept * accepted + fallback * n * kappa


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


def bon_exact_columns(x: np.ndarray, values: np.ndarray, n_grid) -> np.ndarray:
    """``bon_exact`` with replacement for D score vectors at once: x has shape (S, D) (one column per
    score vector of the same S samples), ``values`` shape (S,); returns (len(n_grid), D).

    Per column, sample i with c_lt(i) scores below its own and c_le(i) at or below it is BoN's choice
    with probability ((c_le / S)^n - (c_lt / S)^n) / (c_le - c_lt): its tie group's mass, shared
    uniformly. Sorting each column once gives both counts (the first and last sorted position of
    each tie group)."""
    x = np.asarray(x, float)
    S = x.shape[0]
    order = np.argsort(x, axis=0, kind="stable")
    xs = np.take_along_axis(x, order, axis=0)
    ys = np.asarray(values, float)[order]
    pos = np.arange(S)[:, None]
    differs = xs[1:] != xs[:-1]
    starts = np.concatenate([np.ones((1, x.shape[1]), bool), differs])
    ends = np.concatenate([differs, np.ones((1, x.shape[1]), bool)])
    c_lt = np.maximum.accumulate(np.where(starts, pos, -1), axis=0).astype(float)
    c_le = np.minimum.accumulate(np.where(ends, pos, S)[::-1], axis=0)[::-1] + 1.0
    out = np.empty((len(tuple(n_grid)), x.shape[1]))
    for j, n in enumerate(n_grid):
        p = (np.exp(n * (np.log(c_le) - math.log(S))) - np.where(c_lt > 0, np.exp(
            n * (np.log(np.maximum(c_lt, 1.0)) - math.log(S))), 0.0)) / (c_le - c_lt)
        out[j] = (p * ys).sum(axis=0)
    return out
