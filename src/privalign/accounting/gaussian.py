"""Gaussian noise: the scalar Gaussian mechanism (PrivITP Phase 1) and Gaussian report-noisy-max
(PrivBoN with ``noise="gaussian"``, paper App. E).

Gaussian mechanism, exact ("analytic", Balle & Wang 2018, Thm 8): releasing f + N(0, s^2) with
L2 sensitivity Delta is (epsilon, delta)-DP iff

    delta >= Phi(Delta/(2s) - epsilon s/Delta) - e^epsilon Phi(-Delta/(2s) - epsilon s/Delta).

"classic" is the paper's epsilon_1 = Delta sqrt(2 ln(1.25/delta)) / s (Dwork & Roth Thm A.1),
a valid guarantee only for epsilon <= 1; it raises elsewhere.

Gaussian report-noisy-max over n scores in [0, R_max] (paper eq. (26)):

    epsilon = log E_z[Phi(z - (R_max - 2 Delta)/sigma)^(n-1)] - log E_z[Phi(z - R_max/sigma)^(n-1)].
"""

from __future__ import annotations

import functools
import math

import numpy as np
from scipy import special

from .._special import log_gaussian_power_mean
from .._validation import check_count, check_delta, check_positive
from ._rounding import margin_up, smallest_scale

_METHODS = ("analytic", "classic")


def _check_method(method: str) -> str:
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    return method


def _log_delta_analytic(eps: float, s: float, delta_r: float) -> float:
    """log of the smallest delta for which N(0, s^2) noise is (eps, delta)-DP (Balle & Wang)."""
    a = delta_r / (2 * s)
    b = eps * s / delta_r
    l1 = float(special.log_ndtr(a - b))
    l2 = eps + float(special.log_ndtr(-a - b))
    if l2 >= l1:
        return -math.inf
    return l1 + math.log(-math.expm1(l2 - l1))


def _bisect_up(pred, lo: float, hi: float, rel_tol: float = 1e-14) -> float:
    """Smallest x in (lo, hi] with pred(x) true, returned from above (pred(hi) must hold)."""
    for _ in range(400):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi


def gaussian_mechanism_epsilon(noise_scale: float, sensitivity: float, delta: float,
                               method: str = "analytic") -> float:
    """epsilon of the Gaussian mechanism with std ``noise_scale`` at the given ``delta``."""
    s = check_positive("noise_scale", noise_scale)
    delta_r = check_positive("sensitivity", sensitivity)
    delta = check_delta(delta)
    if _check_method(method) == "classic":
        return margin_up(_classic_valid(_classic_constant(delta_r, delta) / s))
    return _analytic_epsilon(s, delta_r, delta)


def _classic_constant(delta_r: float, delta: float) -> float:
    """Dwork & Roth's epsilon * sigma = Delta sqrt(2 ln(1.25/delta))."""
    return delta_r * math.sqrt(2 * math.log(1.25 / delta))


def _classic_valid(eps: float) -> float:
    if eps > 1:
        raise ValueError(
            f"method='classic' is only a valid guarantee for epsilon <= 1 (Dwork & Roth Thm A.1), got "
            f"epsilon={eps:.4g}; use method='analytic' (or, for a given noise, more noise)"
        )
    return eps


@functools.lru_cache(maxsize=4096)
def _analytic_epsilon(s: float, delta_r: float, delta: float) -> float:
    log_target = math.log(delta)
    if _log_delta_analytic(0.0, s, delta_r) <= log_target:
        return 0.0

    def ok(eps):
        return _log_delta_analytic(eps, s, delta_r) <= log_target

    hi = 1.0
    while not ok(hi):
        hi *= 2
        if hi > _EPS_CEILING:
            # the noise is so small that epsilon exceeds 1e300: report it as unbounded (never less)
            return math.inf
    return margin_up(_bisect_up(ok, 0.0, hi))


_EPS_CEILING = 1e300


def gaussian_mechanism_noise_scale(epsilon: float, sensitivity: float, delta: float,
                                   method: str = "analytic") -> float:
    """Smallest Gaussian std giving (epsilon, delta)-DP for a query of the given sensitivity."""
    eps = check_positive("epsilon", epsilon)
    delta_r = check_positive("sensitivity", sensitivity)
    delta = check_delta(delta)
    if _check_method(method) == "classic":
        return margin_up(_classic_constant(delta_r, delta) / _classic_valid(eps))
    log_target = math.log(delta)
    return margin_up(smallest_scale(lambda s: _log_delta_analytic(eps, s, delta_r) <= log_target, delta_r,
                                    target=f"epsilon={epsilon!r}, delta={delta!r}"))


def _check_rnm(sensitivity, r_max, n):
    delta_r = check_positive("sensitivity", sensitivity)
    r_max = check_positive("r_max", r_max)
    if delta_r > r_max:
        raise ValueError(f"sensitivity must not exceed r_max={r_max!r}, got {sensitivity!r}")
    return delta_r, r_max, check_count("n", n)


@functools.lru_cache(maxsize=4096)
def _rnm_epsilon_raw(sigma: float, delta_r: float, r_max: float, n: int) -> float:
    # numerator from above, denominator from below (they differ only in the extreme regime)
    return (log_gaussian_power_mean((r_max - 2 * delta_r) / sigma, n - 1, side="upper")
            - log_gaussian_power_mean(r_max / sigma, n - 1, side="lower"))


def gaussian_rnm_epsilon(noise_scale: float, sensitivity: float, r_max: float, n: int) -> float:
    """Pure epsilon of Gaussian report-noisy-max over ``n`` scores in [0, r_max] (eq. (26))."""
    sigma = check_positive("noise_scale", noise_scale)
    delta_r, r_max, n = _check_rnm(sensitivity, r_max, n)
    if not r_max / sigma < _RATIO_CEILING:
        return math.inf  # epsilon ~ (R_max / sigma)^2 / 2 > 1e300: unbounded in float64, never under-reported
    return margin_up(max(_rnm_epsilon_raw(sigma, delta_r, r_max, n), 0.0))


_RATIO_CEILING = 1e150

# numpy's Generator.standard_normal (ziggurat, 256 layers, any bit generator) returns |z| <= r + x
# with tail draws x = -log1p(-u) / r accepted only when 2 y > x^2, y = -log1p(-u') <= 53 ln 2:
# |z| <= r + sqrt(2 * 53 ln 2), r = 3.654152885361009 (the last layer's edge). An index whose gap
# to the best score exceeds 2 sigma |z|_max is never selected, so where the declared range allows
# such gaps (R / sigma > 2 |z|_max) two neighbouring inputs can differ in whether an index is
# possible at all: an infinite privacy loss, which no pure epsilon covers.
SAMPLER_NORMAL_BOUND = 3.654152885361009 + math.sqrt(2 * 53 * math.log(2))  # 12.2258...


def gaussian_sampler_floor(r_max: float) -> float:
    """The smallest Gaussian noise scale the float sampler supports on a range of width ``r_max``:
    r_max / (2 * SAMPLER_NORMAL_BOUND), rounded up."""
    return r_max * (1 + 1e-12) / (2 * SAMPLER_NORMAL_BOUND)


def check_gaussian_sampler_support(noise_scale: float, r_max: float) -> None:
    """Refuse Gaussian report-noisy-max where the float sampler's bounded support breaks pure DP:
    ``r_max / noise_scale > 2 * SAMPLER_NORMAL_BOUND`` (about 24.45)."""
    if r_max / noise_scale > 2 * SAMPLER_NORMAL_BOUND:
        raise ValueError(
            f"noise_scale={noise_scale!r} is too small for Gaussian noise on a reward range of width {r_max!r}: "
            f"R/sigma = {r_max / noise_scale:.4g} exceeds {2 * SAMPLER_NORMAL_BOUND:.4g}, twice the bound of "
            f"numpy's normal sampler (|z| <= {SAMPLER_NORMAL_BOUND:.4f}), so some neighbouring inputs have an "
            f"infinite privacy loss; use noise='gumbel' or 'exact', or noise_scale >= "
            f"{gaussian_sampler_floor(r_max):.4g}")


def gaussian_rnm_noise_scale(epsilon: float, sensitivity: float, r_max: float, n: int) -> float:
    """Smallest Gaussian std for which report-noisy-max over ``n`` scores is ``epsilon``-DP.

    epsilon(sigma) decreases in sigma; we bisect in log sigma and return the upper end.
    """
    eps = check_positive("epsilon", epsilon)
    delta_r, r_max, n = _check_rnm(sensitivity, r_max, n)
    if n == 1:
        return 0.0 + np.finfo(float).tiny  # one candidate: selection reveals nothing

    start = 2 * delta_r / eps
    if not math.isfinite(start):
        raise ValueError(f"epsilon={epsilon!r} is too small for sensitivity={sensitivity!r}: the noise scale "
                         "overflows float64")
    return smallest_scale(lambda sigma: margin_up(_rnm_epsilon_raw(sigma, delta_r, r_max, n)) <= eps,
                          start, target=f"epsilon={epsilon!r}")
