"""The accountant against 100+-digit references: relative error < 1e-6, and never below."""

import itertools

import numpy as np
import pytest

import privalign.accounting as A
from privalign._special import log_gaussian_power_mean, log_mean_ndtr, log_psi

from . import reference as ref

REL = 1e-6


def assert_upper(value, exact, rel=REL):
    """value is an upper bound of the exact value and within ``rel`` of it."""
    exact = float(exact)
    assert value >= exact, f"under-reports: {value!r} < exact {exact!r}"
    assert value - exact <= rel * abs(exact), f"too loose: {value!r} vs exact {exact!r}"


def test_log_psi_matches_closed_form_in_all_regimes():
    import mpmath as mp
    zs = np.concatenate([-np.logspace(-3, 4, 120), np.logspace(-3, 3, 40), [0.0]])
    got = log_psi(zs)
    with mp.workdps(120):
        for z, g in zip(zs, got):
            exact = float(mp.log(mp.mpf(z) * mp.ncdf(z) + mp.npdf(z)))
            assert abs(g - exact) <= 1e-13 * max(1.0, abs(exact)), z


def test_log_mean_ndtr_tails():
    a = np.concatenate([-np.logspace(-4, 3, 30), [0.0], np.logspace(-4, 2.3, 15)])
    c = np.concatenate([[0.0, 1e-9, 1e-5], np.logspace(-3, 3, 15)])
    aa, cc = (x.ravel() for x in np.meshgrid(a, c))
    got = log_mean_ndtr(aa, cc)
    for x, y, g in zip(aa, cc, got):
        exact = float(ref.log_mean_ndtr(x, y))
        # relative accuracy of the log, or (where log E is ~0) absolute accuracy far below epsilon's scale
        assert abs(g - exact) <= 1e-12 * abs(exact) + 1e-15, (x, y, g, exact)


@pytest.mark.parametrize("m,k", [(0.0, 1), (-3.0, 100), (2.0, 4095), (50.0, 4095), (100.0, 4095),
                                 (-100.0, 15), (10.0, 99_999)])
def test_gaussian_power_mean(m, k):
    exact = float(ref.log_gaussian_power_mean(m, k))
    assert abs(log_gaussian_power_mean(m, k) - exact) <= 1e-11 * abs(exact)


def test_gumbel_epsilon_exact_and_rounded_up():
    for sigma, d in itertools.product([1e-3, 0.1, 0.3, 1.0, 7.0], [1e-3, 0.1, 1.0]):
        eps = A.gumbel_epsilon(sigma, d)
        from fractions import Fraction
        exact = 2 * Fraction(d) / Fraction(sigma)
        assert Fraction(eps) >= exact and eps <= float(exact) * (1 + 1e-15)
        assert Fraction(A.gumbel_noise_scale(eps, d)) >= 2 * Fraction(d) / Fraction(eps)


@pytest.mark.parametrize("s,d,delta", [(0.25, 1.0, 1e-2), (5.0, 1.0, 1e-5), (0.01, 1.0, 1e-6),
                                       (3.0, 0.1, 0.5), (1.0, 1.0, 1e-10), (100.0, 1.0, 1e-3)])
def test_gaussian_mechanism_epsilon(s, d, delta):
    exact = ref.gaussian_mechanism_epsilon(s, d, delta)
    got = A.gaussian_mechanism_epsilon(s, d, delta)
    if exact == 0:
        assert got == 0
    else:
        assert_upper(got, exact)
    # the inverse returns a scale at least as large as needed
    if got > 0:
        sigma = A.gaussian_mechanism_noise_scale(got, d, delta)
        assert ref.gaussian_mechanism_epsilon(sigma, d, delta) <= got
        assert sigma <= s * (1 + 1e-6)


@pytest.mark.parametrize("sigma,d,r_max,n", [(0.5, 1.0, 1.0, 16), (0.05, 0.1, 1.0, 4096),
                                             (0.01, 0.02, 1.0, 4096), (2.0, 1.0, 1.0, 2),
                                             (0.3, 0.5, 2.0, 100_000), (1e-3, 1e-3, 1.0, 64)])
def test_gaussian_rnm_epsilon(sigma, d, r_max, n):
    assert_upper(A.gaussian_rnm_epsilon(sigma, d, r_max, n), ref.gaussian_rnm_epsilon(sigma, d, r_max, n))


# Grid over the tails: tiny sigma_Z, lambda~ at both edges, n up to 4096.
GRID = list(itertools.product(
    [0.02, 0.1, 0.5, 2.0],                 # sigma_z
    [1.0, 0.1],                            # sensitivity
    [-0.05, 0.0, 0.3, 0.97, 1.0],          # lambda~ (R_max = 1, beta = 0.05)
    [1, 16, 4096],                         # n
))


@pytest.mark.parametrize("sigma_z,d,lam,n", GRID)
def test_privitp_epsilon2_matches_reference(sigma_z, d, lam, n):
    L = A.default_truncation(n)
    kappa, accept = ref.privitp_terms(lam, sigma_z, d, 1.0, L)
    for t in sorted({t for t in (1, 2, n) if t <= n}):
        assert_upper(float(A.privitp_epsilon2(t, lam, sigma_z, d, 1.0, L, n=n)), (t - 1) * kappa + accept)
    assert_upper(float(A.privitp_epsilon2(None, lam, sigma_z, d, 1.0, L, n=n)), n * kappa)


@pytest.mark.parametrize("n,sigma_z,d", [(16, 0.25, 1.0), (4096, 0.02, 0.1), (2, 1.0, 1.0), (256, 0.05, 1.0)])
def test_privitp_epsilon_max_is_tight_upper_bound(n, sigma_z, d):
    beta, sigma_x, delta = 0.05, 0.25, 1e-2
    L = A.default_truncation(n)
    eps_max = A.privitp_epsilon_max(n, beta, sigma_x, sigma_z, delta, d, 1.0, L)
    eps1 = float(ref.gaussian_mechanism_epsilon(sigma_x, d, delta))
    # brute force: the worst case over a dense lambda~ grid, each point from the 120-digit reference
    lams = np.linspace(-beta, 1.0, 161)
    worst = 0.0
    for lam in lams:
        kappa, accept = ref.privitp_terms(lam, sigma_z, d, 1.0, L)
        worst = max(worst, float(max((n - 1) * kappa + accept, n * kappa)))
    assert eps_max >= eps1 + worst
    # the refinement closes the gap to the true supremum far below the grid's resolution
    dense = np.linspace(-beta, 1.0, 20001)
    kap, acc = A.privitp_phase2_terms(dense, sigma_z, d, 1.0, L)
    assert eps_max <= (eps1 + max(np.max((n - 1) * kap + acc), n * kap[0])) * (1 + REL)


@pytest.mark.parametrize("eps,n", [(0.5, 2), (1.0, 16), (4.0, 4096)])
def test_noise_calibrations_meet_their_target_tightly(eps, n):
    s = A.privbon_noise_scale(eps, 1.0, noise="gaussian", n=n, r_max=1.0)
    assert A.gaussian_rnm_epsilon(s, 1.0, 1.0, n) <= eps
    assert A.gaussian_rnm_epsilon(s * (1 - 1e-6), 1.0, 1.0, n) > eps * (1 - 1e-5)
    assert A.privbon_noise_scale(eps, 1.0) == A.gumbel_noise_scale(eps, 1.0)
    sx, sz = A.privitp_noise_scales(8 * eps, 1e-2, n, 0.05, 1.0, 1.0)
    assert A.gaussian_mechanism_epsilon(sx, 1.0, 1e-2) <= 4 * eps
    eps_max = A.privitp_epsilon_max(n, 0.05, sx, sz, 1e-2, 1.0, 1.0)
    assert 8 * eps * (1 - 1e-6) <= eps_max * (1 + 1e-6) and eps_max <= 8 * eps
