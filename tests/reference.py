"""Independent high-precision references (mpmath, 120 digits) for the accountant's tests.

Following the SPEC, the reference for E_u Phi(a + c u) is the closed form (Psi(a+c) - Psi(a))/c
evaluated with 120 digits, not general-purpose quadrature (which misjudges the far tails). The
power-mean integral of App. E is a smooth log-concave integrand, integrated with mpmath's
tanh-sinh quadrature on a grid of points centred on its peak.
"""

from __future__ import annotations

import mpmath as mp

DPS = 120


def _psi(z):
    return z * mp.ncdf(z) + mp.npdf(z)


def log_mean_ndtr(a, c):
    """log E_u Phi(a + c u), u ~ U[0, 1]."""
    with mp.workdps(DPS):
        a, c = mp.mpf(a), mp.mpf(c)
        if c == 0:
            return mp.log(mp.ncdf(a))
        if a > 0:  # 1 - E_u Phi(-a - c u): keeps the digits of a value within 1e-120 of 1
            return mp.log1p(-(_psi(-a) - _psi(-a - c)) / c)
        return mp.log((_psi(a + c) - _psi(a)) / c)


def privitp_terms(lam_t, sigma_z, delta_r, r_max, L):
    """(kappa, accept) of Thm 4.1."""
    with mp.workdps(DPS):
        lam_t, sz, d, R, L = (mp.mpf(x) for x in (lam_t, sigma_z, delta_r, r_max, L))
        b = R + sz * L - lam_t
        c = b / sz
        kappa = log_mean_ndtr((lam_t - R + d) / sz, c) - log_mean_ndtr((lam_t - R) / sz, c)
        accept = log_mean_ndtr((d - lam_t - b) / sz, c) - log_mean_ndtr((-lam_t - b) / sz, c)
        return kappa, accept


def log_gaussian_power_mean(m, k):
    """log E_z[Phi(z - m)^k], z ~ N(0, 1)."""
    with mp.workdps(40):
        m = mp.mpf(m)

        def g(z):
            return -z * z / 2 - mp.log(mp.sqrt(2 * mp.pi)) + k * mp.log(mp.ncdf(z - m))

        lo, hi = min(mp.mpf(-60), m - 60), max(mp.mpf(60), m + 60)
        for _ in range(200):  # bisection for the peak of the concave g
            mid = (lo + hi) / 2
            if mp.diff(g, mid) > 0:
                lo = mid
            else:
                hi = mid
        z0 = lo
        g0 = g(z0)
        w = 1 / mp.sqrt(-mp.diff(g, z0, 2))
        pts = [z0 + w * t for t in range(-60, 61)]
        return g0 + mp.log(mp.quad(lambda z: mp.exp(g(z) - g0), pts))


def gaussian_rnm_epsilon(sigma, delta_r, r_max, n):
    return (log_gaussian_power_mean((r_max - 2 * delta_r) / sigma, n - 1)
            - log_gaussian_power_mean(r_max / sigma, n - 1))


def gaussian_mechanism_epsilon(s, delta_r, delta):
    """Root of Balle & Wang's delta(eps) = delta, solved with 60 digits."""
    with mp.workdps(60):
        s, d, target = mp.mpf(s), mp.mpf(delta_r), mp.mpf(delta)

        def dlt(eps):
            return mp.ncdf(d / (2 * s) - eps * s / d) - mp.exp(eps) * mp.ncdf(-d / (2 * s) - eps * s / d)

        if dlt(0) <= target:
            return mp.mpf(0)
        lo, hi = mp.mpf(0), mp.mpf(1)
        while dlt(hi) > target:
            hi *= 2
        for _ in range(200):
            mid = (lo + hi) / 2
            if dlt(mid) > target:
                lo = mid
            else:
                hi = mid
        return hi
