"""Special functions for the accountant, accurate deep in the Gaussian tails.

* ``log_psi(z)``: log Psi(z) with Psi(z) = z Phi(z) + phi(z) = int_{-inf}^z Phi(s) ds.
* ``log_mean_ndtr(a, c)``: log E_u Phi(a + c u), u ~ Uniform[0, 1], c >= 0, via the closed form
  (Psi(a + c) - Psi(a)) / c (SPEC, "Privacy accounting").
* ``psi(z)``: Psi(z) itself, in linear space (the harness's acceptance probabilities).
* ``log_gaussian_power_mean(m, k)``: log E_z[Phi(z - m)^k], z ~ N(0, 1) (paper eq. (26)).

All are evaluated in log space so that values near 1e-300 and below keep full relative
precision; the tests compare them with 100-digit mpmath evaluations.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import optimize, special

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)
_SQRT_PI_2 = math.sqrt(math.pi / 2)
_SQRT_2_PI = math.sqrt(2 / math.pi)

# 1 - x R(x) = x^-2 sum_k (-1)^k (2k+1)!! x^-2k for the Mills ratio R (asymptotic, alternating:
# the error is below the first omitted term, < 2e-18 relative at x >= 10 with 30 terms).
_ASYMP_COEFS = np.array(
    [(-1) ** k * float(np.prod(np.arange(1, 2 * k + 2, 2, dtype=float))) for k in range(30)]
)
_ASYMP_SWITCH = 10.0


def log_phi(z):
    """log of the standard normal density."""
    z = np.asarray(z, dtype=float)
    return -0.5 * z * z - _LOG_SQRT_2PI


def log_psi(z):
    """log Psi(z), Psi(z) = z Phi(z) + phi(z), stable for z << 0 (Psi ~ phi(z)/z^2 there)."""
    z = np.asarray(z, dtype=float)
    out = np.empty_like(z)
    pos = z >= 0
    mid = (~pos) & (z > -_ASYMP_SWITCH)
    far = z <= -_ASYMP_SWITCH
    if pos.any():
        zp = z[pos]
        out[pos] = np.log(zp * special.ndtr(zp) + np.exp(log_phi(zp)))
    if mid.any():
        x = -z[mid]
        # Psi(-x) = phi(x) (1 - x R(x)),  R(x) = sqrt(pi/2) erfcx(x / sqrt 2); relative error ~ eps x^2.
        one_minus = 1.0 - x * _SQRT_PI_2 * special.erfcx(x / math.sqrt(2))
        out[mid] = log_phi(x) + np.log(one_minus)
    if far.any():
        x = -z[far]
        v = 1.0 / (x * x)
        series = np.polynomial.polynomial.polyval(v, _ASYMP_COEFS)
        out[far] = log_phi(x) + np.log(v) + np.log(series)
    return out


def _log_diff_exp(la, lb):
    """log(exp(la) - exp(lb)) for la >= lb."""
    with np.errstate(divide="ignore"):
        return la + np.log(-np.expm1(lb - la))


def log_mean_ndtr(a, c):
    """log E_u Phi(a + c u) for u ~ Uniform[0, 1] and c >= 0 (broadcasting).

    Closed form (Psi(a + c) - Psi(a)) / c, split by regime:
    * c (1 + |a + c/2|) < 1e-3: Taylor at the midpoint m, Phi(m) + c^2/24 Phi''(m); the next
      term is below 1e-15 relative there.
    * a + c <= 0 (lower tail): log-space difference of log Psi.
    * a >= 0 (upper region): 1 - (Psi(-a) - Psi(-a - c)) / c, using Psi(z) - Psi(-z) = z.
    * otherwise the interval straddles 0, Psi(a + c) >= phi(0), and the direct difference is exact
      to ~eps / c.
    """
    a, c = np.broadcast_arrays(np.asarray(a, dtype=float), np.asarray(c, dtype=float))
    shape = a.shape
    a = a.ravel().copy()
    c = c.ravel().copy()
    out = np.empty_like(a)
    m = a + 0.5 * c
    small = c * (1.0 + np.abs(m)) < 1e-3
    lower = (~small) & (a + c <= 0)
    upper = (~small) & (a >= 0) & ~lower
    middle = ~(small | lower | upper)
    if small.any():
        ms, cs = m[small], c[small]
        lphi = special.log_ndtr(ms)
        ratio = np.exp(log_phi(ms) - lphi)  # phi / Phi
        out[small] = lphi + np.log1p(-(cs * cs / 24.0) * ms * ratio)
    if lower.any():
        al, cl = a[lower], c[lower]
        out[lower] = _log_diff_exp(log_psi(al + cl), log_psi(al)) - np.log(cl)
    if upper.any():
        au, cu = a[upper], c[upper]
        lp_a = log_psi(-au)
        diff = np.exp(_log_diff_exp(lp_a, log_psi(-au - cu)))
        out[upper] = np.log1p(-diff / cu)
    if middle.any():
        am, cm = a[middle], c[middle]
        psi_hi = (am + cm) * special.ndtr(am + cm) + np.exp(log_phi(am + cm))
        out[middle] = np.log(psi_hi - np.exp(log_psi(am))) - np.log(cm)
    return out.reshape(shape)


# Gauss-Legendre nodes for the power-mean integral: 16 panels x 48 nodes.
_GL_X, _GL_W = np.polynomial.legendre.leggauss(48)
_PANELS = 16
_DROP = 75.0  # integrate where the log-integrand is within 75 nats (1e-33) of its peak


_EXTREME = 1e12  # |log-integrand| beyond which its rounding noise (~eps |g|) defeats quadrature


def log_gaussian_power_mean(m: float, k: int, side: str = "upper") -> float:
    """log E_z[Phi(z - m)^k], z ~ N(0, 1), for k >= 0 (paper App. E, eq. (26)).

    The log-integrand g(z) = log phi(z) + k log Phi(z - m) is strictly concave. We find its peak,
    the two points where it has fallen by 75 nats, and integrate exp(g - g_max) with composite
    Gauss-Legendre there; log-concavity bounds the neglected tails by e^-75 times the peak.

    When |g| at the peak exceeds 1e12 (noise so small that epsilon is astronomically large), g's
    rounding error exceeds the integrand's width. Then we use the rigorous bounds that follow from
    -(1 + k) <= g'' <= -1 (log phi gives -1; the inverse Mills ratio's derivative lies in (-1, 0)):
    g* + log(2 pi / (1 + k))/2 <= log E <= g* + log(2 pi)/2, returning the ``side`` requested.
    """
    if k == 0:
        return 0.0

    def g(z):
        return log_phi(z) + k * special.log_ndtr(np.asarray(z, dtype=float) - m)

    def dg(z):
        # inverse Mills ratio phi(y)/Phi(y) = sqrt(2/pi) / erfcx(-y/sqrt 2): no cancellation even at
        # |y| ~ 1e9, where log phi - log Phi would subtract two numbers of size 1e18
        return -z + k * _SQRT_2_PI / float(special.erfcx(-(z - m) / math.sqrt(2)))

    lo, hi = -1.0, 1.0
    while dg(lo) <= 0:
        lo = 2 * lo - 1
    while dg(hi) >= 0:
        hi = 2 * hi + 1
    z_star = optimize.brentq(dg, lo, hi, xtol=1e-14, rtol=1e-15, maxiter=500)
    g_star = float(g(z_star))
    if abs(g_star) > _EXTREME:
        if side not in ("upper", "lower"):
            raise ValueError(f"side must be 'upper' or 'lower', got {side!r}")
        return g_star + 0.5 * math.log(2 * math.pi / (1.0 if side == "upper" else 1.0 + k))

    def edge(direction: float) -> float:
        step = 1.0
        while g(z_star + direction * step) > g_star - _DROP:
            step *= 2
        return optimize.brentq(lambda z: float(g(z)) - (g_star - _DROP), z_star,
                               z_star + direction * step, xtol=1e-12)

    z_left, z_right = edge(-1.0), edge(1.0)
    # Panels split at the peak so that each side is resolved separately.
    left = np.linspace(z_left, z_star, _PANELS // 2 + 1)
    right = np.linspace(z_star, z_right, _PANELS // 2 + 1)
    bounds = np.concatenate([left, right[1:]])
    a, b = bounds[:-1, None], bounds[1:, None]
    nodes = 0.5 * (b - a) * _GL_X[None, :] + 0.5 * (a + b)
    weights = 0.5 * (b - a) * _GL_W[None, :]
    vals = g(nodes.ravel()) + np.log(weights.ravel())
    return float(special.logsumexp(vals))


_INV_SQRT_2PI = 1.0 / math.sqrt(2 * math.pi)


def psi(z):
    """Psi(z) = z Phi(z) + phi(z) in linear space, for probabilities: a difference of two values
    divided by c gives E_u Phi(a + c u) = (Psi(a + c) - Psi(a)) / c to ~1e-15 absolute (not
    relative: use ``log_psi`` and ``log_mean_ndtr`` for privacy losses), at a fraction of their cost."""
    z = np.asarray(z, dtype=float)
    return z * special.ndtr(z) + _INV_SQRT_2PI * np.exp(-0.5 * z * z)
