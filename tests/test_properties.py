"""Property tests (hypothesis): invariances, monotonicity, limits, and the lambda equation."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import privalign as pa
import privalign.accounting as A
from privalign import theory

inner = arrays(float, st.integers(1, 40), elements=st.floats(0.2, 0.7))
wide = arrays(float, st.integers(1, 300), elements=st.floats(-50, 50))
FAST = settings(max_examples=60, deadline=None)


# dyadic rewards and shifts (multiples of 1/64): r + c is exact, so ties are neither created nor broken
dyadic = arrays(float, st.integers(1, 40), elements=st.integers(13, 45).map(lambda k: k / 64))


@FAST
@given(dyadic, st.integers(-12, 19).map(lambda k: k / 64), st.floats(0.01, 3.0))
def test_shift_inside_range_leaves_bon_and_privbon_laws_unchanged(r, c, sigma):
    rr = r + c  # stays inside [0, 1]
    assert np.array_equal(theory.bon_law(r), theory.bon_law(rr))
    assert np.allclose(theory.privbon_law(r, sigma, reward_range=(0, 1)),
                       theory.privbon_law(rr, sigma, reward_range=(0, 1)), rtol=1e-9, atol=1e-12)


@FAST
@given(inner, st.floats(-0.2, 0.3), st.integers(0, 2**32 - 1))
def test_shift_leaves_the_sampled_privbon_choice_unchanged(r, c, seed):
    sigma = 0.2
    a = pa.privbon(r, noise_scale=sigma, rng=np.random.default_rng(seed)).index
    b = pa.privbon(r + c, noise_scale=sigma, rng=np.random.default_rng(seed)).index
    # same noise, shifted scores: the same choice (a flip would need two noisy scores to agree
    # to within rounding, an event of probability ~1e-15)
    assert a == b


@FAST
@given(st.floats(1e-3, 10), st.floats(1e-3, 10), st.floats(1e-3, 1.0))
def test_epsilon_decreases_in_noise_scale(s1, s2, d):
    lo, hi = sorted((s1, s2))
    assert A.gumbel_epsilon(lo, d) >= A.gumbel_epsilon(hi, d)
    assert A.gaussian_mechanism_epsilon(lo, d, 1e-5) >= A.gaussian_mechanism_epsilon(hi, d, 1e-5)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 3), st.floats(0.05, 3), st.integers(2, 512))
def test_gaussian_rnm_epsilon_decreases_in_noise_scale(s1, s2, n):
    lo, hi = sorted((s1, s2))
    assert A.gaussian_rnm_epsilon(lo, 0.5, 1.0, n) >= A.gaussian_rnm_epsilon(hi, 0.5, 1.0, n)


@FAST
@given(st.floats(0.01, 2), st.floats(0.01, 2), st.floats(-0.1, 1.0), st.integers(1, 64))
def test_epsilon2_monotone_in_t_and_in_sigma_z(s1, s2, lam, n):
    L = A.default_truncation(n)
    t = np.arange(1, n + 1)
    e = A.privitp_epsilon2(t, lam, s1, 1.0, 1.0, L)
    assert np.all(np.diff(e) >= 0)
    assert A.privitp_epsilon2(None, lam, s1, 1.0, 1.0, L, n=n) >= 0
    lo, hi = sorted((s1, s2))
    # monotone up to the function's relative accuracy (~1e-12): sigma_z one ulp apart must not fail
    e_lo, e_hi = A.privitp_epsilon2(t, lam, lo, 1.0, 1.0, L), A.privitp_epsilon2(t, lam, hi, 1.0, 1.0, L)
    assert np.all(e_lo >= e_hi * (1 - 1e-10))


@FAST
@given(st.floats(0.01, 2), st.integers(1, 4096), st.floats(0.01, 1.0))
def test_kappa_and_accept_are_monotone_in_lambda_tilde(sigma_z, n, d):
    # privitp_epsilon_max's rigorous bound relies on these two monotonicities
    lam = np.linspace(-0.5, 1.0, 301)
    kappa, accept = A.privitp_phase2_terms(lam, sigma_z, d, 1.0, A.default_truncation(n))
    assert np.all(np.diff(kappa) <= 1e-12 * (1 + kappa[:-1]))
    assert np.all(np.diff(accept) >= -1e-12 * (1 + accept[:-1]))


@FAST
@given(arrays(float, st.integers(2, 30), elements=st.floats(0, 1), unique=True), st.integers(0, 2**32 - 1))
def test_privbon_tends_to_bon_as_noise_vanishes(r, seed):
    gap = np.min(np.diff(np.sort(r)))
    if gap < 1e-6:
        return
    sigma = gap / 200
    assert np.allclose(theory.privbon_law(r, sigma), theory.bon_law(r), atol=1e-40 + np.exp(-150))
    assert pa.privbon(r, noise_scale=sigma, rng=np.random.default_rng(seed)).index == int(np.argmax(r))
    with pytest.raises(ValueError, match="R/sigma"):  # the float normal sampler's support is too narrow
        pa.privbon(r, noise_scale=sigma / 10, noise="gaussian", rng=np.random.default_rng(seed))


@settings(max_examples=200, deadline=None)
@given(wide, st.floats(1e-6, 100))
def test_itp_lambda_solves_its_equation_to_machine_precision(r, beta):
    lam = A.itp_lambda(r, beta)
    residual = np.mean(np.maximum((r - lam) / beta, 0.0)) - 1.0
    scale = 1.0 + (np.max(np.abs(r)) + abs(lam)) / beta
    assert abs(residual) <= 8 * np.finfo(float).eps * scale * np.sqrt(r.size)
    assert r.mean() - beta - 1e-9 * scale * beta <= lam <= r.max() - beta + 1e-9 * scale * beta


def test_itp_lambda_newton_and_sorted_solutions_agree():
    from privalign.accounting.privitp import _lambda_sorted
    rng = np.random.default_rng(0)
    for _ in range(200):
        r = rng.standard_normal(rng.integers(1, 500)) ** 3
        beta = 10 ** rng.uniform(-4, 1)
        assert np.isclose(A.itp_lambda(r, beta), _lambda_sorted(r, r.size * beta), rtol=1e-12, atol=1e-12)


def test_regression_extreme_small_gaussian_noise():
    # found by hypothesis: sigma ~ 5e-10 made log phi - log Phi cancel catastrophically (overflow)
    # and the quadrature meaningless; both are handled, and epsilon stays monotone in sigma
    for r in ([0.0, 1e-6], [0.0, 1.0, 1e-6]):
        with pytest.raises(ValueError, match="infinite privacy loss"):  # refused: beyond the sampler's support
            pa.privbon(r, noise_scale=5e-10, noise="gaussian", rng=np.random.default_rng(0))
    eps = [A.gaussian_rnm_epsilon(s, 1.0, 1.0, 3) for s in (5e-10, 1e-7, 1e-5, 1e-3, 1e-1)]
    assert all(a > b for a, b in zip(eps, eps[1:]))
    # extreme regime: log I(m) ~ -k m^2 / (2 (k + 1)) at m = R/sigma = 2e9, k = 2, and log I(-m) ~ 0
    assert abs(eps[0] / (4 / 3 * 1e18) - 1) < 1e-6


def test_gaussian_privbon_is_refused_beyond_the_float_samplers_support():
    """numpy's normal sampler returns |z| <= 12.2258, so on a range R with R/sigma > 24.45 an index can be
    possible on one input and impossible on its neighbour (infinite loss): the mechanism refuses."""
    from privalign.accounting.gaussian import SAMPLER_NORMAL_BOUND

    assert abs(SAMPLER_NORMAL_BOUND - 12.2258) < 1e-4
    rng = np.random.default_rng(0)
    assert abs(rng.standard_normal(10**6)).max() < SAMPLER_NORMAL_BOUND
    edge = 1.0 / (2 * SAMPLER_NORMAL_BOUND)
    assert pa.privbon([0.0, 1.0], noise_scale=edge * 1.0001, noise="gaussian", rng=rng).noise_scale > edge
    with pytest.raises(ValueError, match="noise_scale >= 0.0409"):
        pa.privbon([0.0, 1.0], noise_scale=edge * 0.9999, noise="gaussian", rng=rng)
    # the case (epsilon 1, n = 2, Delta/R = 1e-3 calibrates R/sigma = 31.6): calibration stops at the
    # floor, and the selection reports the lower epsilon it achieves there
    sel = pa.privbon([0.0, 1.0], epsilon=1.0, sensitivity=1e-3, noise="gaussian", rng=rng)
    assert sel.noise_scale == pytest.approx(edge) and sel.noise_scale >= edge and sel.epsilon < 1.0
    assert sel.epsilon == A.gaussian_rnm_epsilon(sel.noise_scale, 1e-3, 1.0, 2)
    assert A.privbon_noise_scale(1.0, 1e-3, noise="gaussian", n=2, r_max=1.0) == sel.noise_scale
    assert pa.privbon([0.5], noise_scale=1e-9, noise="gaussian", rng=rng).index == 0  # one candidate: no noise
