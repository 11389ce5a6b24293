"""Zero-concentrated DP (zCDP): each query's rho, the conversion to (epsilon, delta), and its limit.

rho-zCDP (Bun & Steinke 2016): D_alpha(M(D) || M(D')) <= rho alpha for every alpha > 1. It composes
by adding rho's, also when every query's parameters are chosen adaptively from earlier answers, as
long as a filter stops the stream before the sum passes rho_total (a Renyi filter at every order:
Feldman & Zrnic 2021, Thm 3.1; Whitehouse, Ramdas, Rogers & Wu 2023, fully adaptive zCDP).

Per query, as privalign implements the mechanisms (sensitivity Delta_r on the declared range
mapped to [0, R_max], scores clipped to it: post-processing):

* Gumbel PrivBoN at epsilon = 2 Delta_r / sigma is the exponential mechanism with utility of
  sensitivity Delta_r; the log-ratio of any outcome's probabilities under D and D' is
  (r_D(i) - r_D'(i)) / sigma - log(Z_D / Z_D'), whose first term spans an interval of width
  2 Delta_r / sigma = epsilon: epsilon-bounded-range, hence epsilon^2 / 8-zCDP (Durfee & Rogers 2019;
  Cesar & Rogers 2021, Lemma 3.2). ``bounded_range_rho``.
* Any pure epsilon-DP mechanism is epsilon^2 / 2-zCDP (Bun & Steinke 2016, Prop. 1.4):
  Gaussian PrivBoN (its App. E epsilon), OpenDP's exact path, and PrivITP's Phase 2 at its worst
  case over lambda~ and t. ``pure_dp_rho``.
* A Gaussian mechanism of sensitivity Delta and scale sigma is Delta^2 / (2 sigma^2)-zCDP, with no
  delta (Bun & Steinke 2016, Prop. 1.6): PrivITP's Phase 1 (lambda~ = lambda + N(0, sigma_X^2),
  |lambda(D) - lambda(D')| <= Delta_r; the clip to [-beta, R_max] is post-processing).
  ``gaussian_rho``.

Conversion (Canonne, Kamath & Steinke 2020, Prop. 12 / Cor. 13; SPEC): rho-zCDP implies
(epsilon, delta)-DP for

    epsilon(rho, delta) = inf_{alpha > 1} alpha rho + (log(1/delta) + (alpha - 1) log(1 - 1/alpha)
                                                       - log alpha) / (alpha - 1).

Every alpha gives a valid epsilon, so the minimiser only needs to be close: the value at the
alpha found is what is reported, rounded up. Limit: the Gaussian mechanism is rho-zCDP with
mu = sqrt(2 rho) and exact profile delta(epsilon) = Phi(mu/2 - epsilon/mu) - e^epsilon
Phi(-mu/2 - epsilon/mu) (Balle & Wang 2018), so no valid conversion reports a smaller epsilon
(``gaussian_profile_epsilon``).
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

from .._validation import check_positive
from ._rounding import margin_up


def check_rho(rho, name: str = "rho") -> float:
    """rho >= 0 and finite (NaN, negative or infinite values name the argument)."""
    try:
        value = float(rho)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number >= 0, got {rho!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number >= 0, got {rho!r}")
    return value


def _check_conversion_delta(delta) -> float:
    try:
        value = float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"delta_total must lie in (0, 1) for zcdp, got {delta!r}") from None
    if not 0 < value < 1:
        raise ValueError(f"delta_total must lie in (0, 1) for zcdp (rho-zCDP has no (epsilon, 0) conversion), "
                         f"got {delta!r}")
    return value


def bounded_range_rho(epsilon: float) -> float:
    """epsilon-bounded-range (Gumbel PrivBoN, the exponential mechanism): rho = epsilon^2 / 8."""
    eps = check_positive("epsilon", epsilon)
    return margin_up(eps * eps / 8.0)


def pure_dp_rho(epsilon: float) -> float:
    """Pure epsilon-DP: rho = epsilon^2 / 2 (Bun & Steinke 2016, Prop. 1.4)."""
    eps = check_positive("epsilon", epsilon)
    return margin_up(eps * eps / 2.0)


def gaussian_rho(noise_scale: float, sensitivity: float) -> float:
    """The Gaussian mechanism: rho = Delta^2 / (2 sigma^2), no delta (Bun & Steinke 2016, Prop. 1.6)."""
    sigma = check_positive("noise_scale", noise_scale)
    delta_r = check_positive("sensitivity", sensitivity)
    return margin_up((delta_r / sigma) ** 2 / 2.0)


def _cks(alpha, rho: float, log_inv_delta: float):
    """The CKS bound at order alpha > 1 (vectorised)."""
    alpha = np.asarray(alpha, float)
    am1 = alpha - 1.0
    return alpha * rho + (log_inv_delta + am1 * np.log1p(-1.0 / alpha) - np.log(alpha)) / am1


def zcdp_epsilon(rho: float, delta: float) -> float:
    """The smallest epsilon that rho-zCDP gives at ``delta`` by the CKS conversion (module
    docstring), rounded up; 0 for rho = 0."""
    rho = check_rho(rho)
    delta = _check_conversion_delta(delta)
    if rho == 0:
        return 0.0
    L = -math.log(delta)
    # the minimiser is near 1 + sqrt(L / rho); search log(alpha - 1) on a wide grid, then refine
    t = np.linspace(-14.0, 30.0, 2201)
    vals = _cks(1.0 + np.exp(t), rho, L)
    k = int(np.nanargmin(vals))
    lo, hi = t[max(k - 1, 0)], t[min(k + 1, t.size - 1)]
    res = optimize.minimize_scalar(lambda x: float(_cks(1.0 + math.exp(x), rho, L)), bounds=(lo, hi),
                                   method="bounded", options={"xatol": 1e-12})
    best = min(float(res.fun), float(vals[k]))
    return max(margin_up(best), 0.0)


def zcdp_rho_total(epsilon_total: float, delta_total: float) -> float:
    """rho_total = sup{rho : zcdp_epsilon(rho, delta_total) <= epsilon_total}, from below: the value
    returned is one whose (rounded-up) conversion fits."""
    eps = check_positive("epsilon_total", epsilon_total)
    delta = _check_conversion_delta(delta_total)
    lo, hi = 0.0, eps  # epsilon(rho, delta) >= rho
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if zcdp_epsilon(mid, delta) <= eps:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return lo


def _log_gaussian_delta(eps: float, mu: float) -> float:
    """log delta(eps) of the Gaussian mechanism with mu = Delta / sigma (log space, stable tails)."""
    a = special.log_ndtr(mu / 2 - eps / mu)
    b = special.log_ndtr(-mu / 2 - eps / mu)
    d = eps + b - a
    return -math.inf if d >= 0 else a + math.log(-math.expm1(d))


def gaussian_profile_epsilon(rho: float, delta: float) -> float:
    """epsilon at ``delta`` of the Gaussian mechanism with rho = mu^2 / 2: the limit no conversion of
    rho-zCDP can go below (Balle & Wang 2018)."""
    rho = check_rho(rho)
    delta = _check_conversion_delta(delta)
    if rho == 0:
        return 0.0
    mu = math.sqrt(2 * rho)
    if _log_gaussian_delta(0.0, mu) <= math.log(delta):
        return 0.0
    lo, hi = 0.0, 1.0
    while _log_gaussian_delta(hi, mu) > math.log(delta):
        lo, hi = hi, 2 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if _log_gaussian_delta(mid, mu) > math.log(delta):
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-14 * hi:
            break
    return hi


def gaussian_profile_rho(epsilon_total: float, delta_total: float) -> float:
    """The largest rho at which the Gaussian mechanism meets (epsilon_total, delta_total): no rho_total
    derived by a valid conversion can exceed it."""
    eps = check_positive("epsilon_total", epsilon_total)
    delta = _check_conversion_delta(delta_total)
    lo, hi = 0.0, 4 * eps + 1.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if gaussian_profile_epsilon(mid, delta) <= eps:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return lo
