"""PrivITP accounting (paper Thm 4.1 and Alg. 2, with the SPEC's fixes).

Phase 1 releases lambda~ = lambda + N(0, sigma_X^2): a Gaussian mechanism with sensitivity Delta_r
(``itp_lambda`` computes lambda exactly). Phase 2 is pure ex-post DP. With
b = R_max + sigma_Z L - lambda~ (beta cancels) and u ~ Uniform[0, 1]:

    kappa(lambda~)  = log E_u Phi((lambda~ + b u - R_max + Delta)/sigma_Z) - log E_u Phi((lambda~ + b u - R_max)/sigma_Z)
    accept(lambda~) = log E_u Phi((Delta - lambda~ - b u)/sigma_Z)         - log E_u Phi((-lambda~ - b u)/sigma_Z)
    epsilon_2^post(t) = (t - 1) kappa + accept,   epsilon_2^post(fallback) = T kappa,

where T <= n is the number of Phase-2 rounds (``max_rounds``; T = n is the paper's mechanism, whose
fallback costs n kappa). Phase 1 still solves lambda on all n candidates, so only Phase 2 sees T,
and the worst case max_lambda~ max((T - 1) kappa + accept, T kappa) does not depend on n.

Writing tau = lambda~ + b u, tau is uniform on [lambda~, R_max + sigma_Z L], whose right end does not
move with lambda~. Since Phi is log-concave, kappa is a ratio of averages of a decreasing likelihood
ratio, so kappa is non-increasing in lambda~, and accept (an increasing ratio) is non-decreasing.
``privitp_epsilon_max`` uses this to bound the worst case rigorously from above.
"""

from __future__ import annotations

import math

import numpy as np

from .._special import log_mean_ndtr
from .._validation import check_count, check_delta, check_max_rounds, check_nonnegative, check_positive, check_rewards
from ._rounding import margin_up, ulp_up
from .gaussian import gaussian_mechanism_epsilon
from .zcdp import gaussian_rho, pure_dp_rho


def itp_lambda(rewards, beta: float) -> float:
    """Solve (1/n) sum_i relu((r_i - lambda)/beta) = 1 exactly (Huang et al. 2025).

    f(lambda) = sum_i relu(r_i - lambda) is convex, decreasing and piecewise linear, and the
    root lies in [mean(r) - beta, max(r) - beta]. Newton's method started at mean(r) - beta
    (left of the root) increases monotonically and stops exactly once the set of active
    candidates {r_i > lambda} no longer changes; because lambda only grows, inactive candidates
    are dropped for good, so the steps get cheaper. Each step is O(n) and a handful suffice on
    real score distributions; after 64 steps (adversarial inputs) it falls back to the
    O(n log n) sorted solution.
    """
    return solve_itp_lambda(check_rewards(rewards), check_positive("beta", beta))


def solve_itp_lambda(r: np.ndarray, beta: float) -> float:
    """``itp_lambda`` on validated input (finite 1-D float array, beta > 0)."""
    target = r.size * beta
    lam = float(r.sum()) / r.size - beta  # f(mean - beta) >= n beta: left of the root
    active = r.compress(r > lam)
    for _ in range(64):
        # Newton step on the linear piece of the current active set; if the candidates above the
        # new lambda are still exactly that set, lambda is the exact root.
        lam = (float(active.sum()) - target) / active.size
        kept = active.compress(active > lam)
        if kept.size == active.size or kept.size == 0:
            # (kept empty: n beta is below the resolution of the scores, so lambda rounds to max(r))
            return lam
        active = kept
    return _lambda_sorted(r, target)


def _lambda_sorted(r: np.ndarray, target: float) -> float:
    """The O(n log n) solution: sort descending; f at the k-th breakpoint is S_k - k r_(k+1)."""
    s = np.sort(r)[::-1]
    csum = np.cumsum(s)
    k = np.arange(1, s.size + 1)
    nxt = np.append(s[1:], -np.inf)
    kk = int(np.searchsorted(csum - k * nxt, target))  # first k with f(r_(k+1)) >= target
    return float((csum[kk] - target) / (kk + 1))


def default_truncation(n: int) -> float:
    """Default truncation L = sqrt(2 ln max(n, 2)) (an O(sqrt(log n)) choice inside the paper's O(log n))."""
    return math.sqrt(2.0 * math.log(max(check_count("n", n), 2)))


def _check_phase2(sigma_z, sensitivity, r_max, truncation):
    sigma_z = check_positive("sigma_z", sigma_z)
    delta_r = check_positive("sensitivity", sensitivity)
    r_max = check_positive("r_max", r_max)
    if delta_r > r_max:
        raise ValueError(f"sensitivity must not exceed r_max={r_max!r}, got {sensitivity!r}")
    return sigma_z, delta_r, r_max, check_nonnegative("truncation", truncation)


def _check_lambda_tilde(lambda_tilde, r_max: float) -> np.ndarray:
    lt = np.asarray(lambda_tilde, dtype=float)
    if not np.isfinite(lt).all() or (lt > r_max).any():
        raise ValueError(
            f"lambda_tilde must be finite and <= r_max={r_max!r} (PrivITP clips it to [-beta, r_max]); "
            f"got {lambda_tilde!r}"
        )
    return lt


def _terms(lt: np.ndarray, sigma_z: float, delta_r: float, r_max: float, L: float):
    b = r_max + sigma_z * L - lt
    c = b / sigma_z
    a = np.stack([(lt - r_max + delta_r) / sigma_z, (lt - r_max) / sigma_z,
                  (delta_r - lt - b) / sigma_z, (-lt - b) / sigma_z])
    m = log_mean_ndtr(a, np.broadcast_to(c, a.shape))  # one call: elementwise, as four calls
    kappa, accept = m[0] - m[1], m[2] - m[3]
    # where the tails defeat float64 (sigma_Z or Delta_r extreme) the terms are reported as infinite
    kappa, accept = np.where(np.isnan(kappa), np.inf, kappa), np.where(np.isnan(accept), np.inf, accept)
    return np.maximum(kappa, 0.0), np.maximum(accept, 0.0)


def privitp_phase2_terms(lambda_tilde, sigma_z: float, sensitivity: float, r_max: float,
                         truncation: float):
    """(kappa, accept) of Thm 4.1 for each lambda~ (vectorised), before rounding up."""
    sigma_z, delta_r, r_max, L = _check_phase2(sigma_z, sensitivity, r_max, truncation)
    return _terms(_check_lambda_tilde(lambda_tilde, r_max), sigma_z, delta_r, r_max, L)


def privitp_epsilon2(t, lambda_tilde, sigma_z: float, sensitivity: float, r_max: float,
                     truncation: float, n: int | None = None):
    """Ex-post Phase-2 cost epsilon_2^post: (t - 1) kappa + accept for acceptance at round t,
    n kappa for the fallback outcome (``t=None``, which needs ``n``). ``n`` is the number of Phase-2
    rounds: T for a capped mechanism (``max_rounds``), the batch size otherwise. Vectorised over t
    and lambda~ (broadcasting); rounded up.
    """
    sigma_z, delta_r, r_max, L = _check_phase2(sigma_z, sensitivity, r_max, truncation)
    lt = _check_lambda_tilde(lambda_tilde, r_max)
    kappa, accept = _terms(lt, sigma_z, delta_r, r_max, L)
    if t is None:
        if n is None:
            raise ValueError("n is required when t=None (the fallback outcome costs n * kappa)")
        return margin_up(check_count("n", n) * kappa)
    tt = np.asarray(t)
    if not np.issubdtype(tt.dtype, np.integer) or (tt < 1).any():
        raise ValueError(f"t must be an integer halting time >= 1 (or None for the fallback), got {t!r}")
    if n is not None and (tt > n).any():
        raise ValueError(f"t must not exceed n={n!r}; use t=None for the fallback outcome")
    return margin_up((tt - 1) * kappa + accept)


def _sup_monotone_sum(terms, lo: float, hi: float, rel_tol: float = 1e-8, refine: int = 16384,
                      rounds: int = 40) -> float:
    """A rigorous upper bound on S = sup_{x in [lo, hi]} dec(x) + inc(x), dec non-increasing and inc
    non-decreasing; ``terms(x)`` returns the arrays (dec(x), inc(x)).

    Proof. The cells [a_k, b_k] of a partition of [lo, hi] cover every x, and on its cell
    dec(x) <= dec(a_k) and inc(x) <= inc(b_k), so dec(x) + inc(x) <= U_k := dec(a_k) + inc(b_k);
    hence S <= max_k U_k. Refinement replaces a cell by sub-cells that cover it (it never drops
    one), so max_k U_k stays an upper bound after every round and only decreases. The value
    returned is max_k U_k over the final partition, which is also >= every evaluated
    dec(x) + inc(x). Each round splits the cells whose U_k exceeds the best evaluated value (at most
    the ``refine`` largest) into 8; the loop stops when max_k U_k is within ``rel_tol`` of that
    value, or after ``rounds`` rounds (the bound is then looser, never lower). ``rel_tol`` is only
    the tightness: the bound holds whatever it is. The callers round the result up by
    ``REL_MARGIN``, which covers floating-point error in evaluating dec and inc.
    """
    xs = np.linspace(lo, hi, 257)
    d, i = (np.asarray(v, float) for v in terms(xs))
    left, right, d_left, i_right = xs[:-1], xs[1:], d[:-1], i[1:]
    best = float(np.max(d + i))
    bound = math.inf
    for _ in range(rounds):
        cells = d_left + i_right
        bound = float(np.max(cells))
        if not math.isfinite(bound):
            return math.inf
        slack = rel_tol * max(abs(best), 1e-300)
        if bound - best <= slack:
            break
        open_ = np.flatnonzero(cells > best + slack)
        if open_.size > refine:
            open_ = open_[np.argpartition(cells[open_], -refine)[-refine:]]
        # 7 interior points per refined cell: 8 sub-cells each
        grid = left[open_, None] + (right[open_] - left[open_])[:, None] * (np.arange(9) / 8.0)[None, :]
        grid[:, 0], grid[:, -1] = left[open_], right[open_]
        d_in, i_in = (np.asarray(v, float).reshape(-1, 7) for v in terms(grid[:, 1:-1].ravel()))
        best = max(best, float(np.max(d_in + i_in)))
        sub_d = np.concatenate([d_left[open_, None], d_in], axis=1)    # dec at each sub-cell's left end
        sub_i = np.concatenate([i_in, i_right[open_, None]], axis=1)   # inc at each sub-cell's right end
        keep = np.ones(left.size, bool)
        keep[open_] = False
        left = np.concatenate([left[keep], grid[:, :-1].ravel()])
        right = np.concatenate([right[keep], grid[:, 1:].ravel()])
        d_left = np.concatenate([d_left[keep], sub_d.ravel()])
        i_right = np.concatenate([i_right[keep], sub_i.ravel()])
    else:
        bound = float(np.max(d_left + i_right))
    return max(bound, best)


def _phase2_worst(n: int, beta: float, sigma_z: float, delta_r: float, r_max: float, L: float) -> float:
    """max over lambda~ in [-beta, R_max] of max(eps_2^post(n), n kappa), before rounding, for n
    Phase-2 rounds (T when capped: t <= T, and the fallback follows round T)."""

    def terms(x):
        kappa, accept = _terms(np.asarray(x), sigma_z, delta_r, r_max, L)
        return (n - 1) * kappa, accept

    worst_t_n = _sup_monotone_sum(terms, -beta, r_max)
    worst_fallback = n * float(_terms(np.array([-beta]), sigma_z, delta_r, r_max, L)[0][0])  # kappa is non-increasing
    return max(worst_t_n, worst_fallback)


def _rounds_and_truncation(n, max_rounds, truncation) -> tuple[int, float]:
    """(T, L): T = max_rounds (n when None); L defaults to sqrt(2 ln T), following T, not n."""
    T = check_max_rounds(max_rounds, check_count("n", n))
    return T, default_truncation(T) if truncation is None else truncation


def privitp_epsilon_max(n: int, beta: float, sigma_x: float, sigma_z: float, delta: float,
                        sensitivity: float, r_max: float, truncation: float | None = None,
                        method: str = "analytic", max_rounds: int | None = None) -> float:
    """Worst-case per-query epsilon, known before the query runs (SPEC), with T = ``max_rounds``
    Phase-2 rounds (default T = n):

        epsilon_max = epsilon_1 + max over lambda~ in [-beta, R_max] of max(eps_2^post(T), T kappa).

    It depends on n only through T (docs/accounting.md, "Capping Phase 2").
    """
    n, L = _rounds_and_truncation(n, max_rounds, truncation)
    beta = check_positive("beta", beta)
    sigma_z, delta_r, r_max, L = _check_phase2(sigma_z, sensitivity, r_max, L)
    eps1 = gaussian_mechanism_epsilon(sigma_x, delta_r, check_delta(delta), method=method)
    # a realised cost is ulp_up(epsilon_1 + margin_up(epsilon_2)), its epsilon_2 evaluated within 1e-12
    # of the exact value, and so is the supremum here: a second margin (and one ulp) on top keeps
    # every realised cost below the declared worst case, float differences between the two
    # evaluations included (a property test found one 2e-13 above it with a single margin)
    return ulp_up(margin_up(margin_up(eps1 + _phase2_worst(n, beta, sigma_z, delta_r, r_max, L))))


def privitp_epsilon2_max(n: int, beta: float, sigma_z: float, sensitivity: float, r_max: float,
                         truncation: float | None = None, max_rounds: int | None = None) -> float:
    """Phase 2's pure worst case alone: max over lambda~ and t <= T of eps_2^post (fallback included)."""
    n, L = _rounds_and_truncation(n, max_rounds, truncation)
    beta = check_positive("beta", beta)
    sigma_z, delta_r, r_max, L = _check_phase2(sigma_z, sensitivity, r_max, L)
    return ulp_up(margin_up(margin_up(_phase2_worst(n, beta, sigma_z, delta_r, r_max, L))))  # as epsilon_max


def privitp_rho(n: int, beta: float, sigma_x: float, sigma_z: float, sensitivity: float, r_max: float,
                truncation: float | None = None, max_rounds: int | None = None) -> float:
    """PrivITP's zCDP parameter: Phase 1 is a Gaussian mechanism (Delta_r^2 / (2 sigma_X^2), no delta)
    and Phase 2, given lambda~, is pure epsilon_2max-DP (epsilon_2max^2 / 2); zCDP composes
    adaptively, so rho = Delta_r^2 / (2 sigma_X^2) + epsilon_2max^2 / 2 (``accounting.zcdp``)."""
    eps2 = privitp_epsilon2_max(n, beta, sigma_z, sensitivity, r_max, truncation, max_rounds)
    if not math.isfinite(eps2):
        return math.inf
    return margin_up(gaussian_rho(sigma_x, sensitivity) + (pure_dp_rho(eps2) if eps2 > 0 else 0.0))
