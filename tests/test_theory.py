"""Theory: the paper's worked numbers, limits and bounds."""

import math

import numpy as np
import pytest

from privalign import theory


def test_epsilon_star_worked_example():
    # Section 3.1: eps_RM = 0.35, Delta_r = 0.1, C = 2 gives epsilon* ~ 0.8
    assert theory.epsilon_star(0.1, 2.0, 0.35) == pytest.approx(0.808, abs=1e-3)


def test_sigma_star_balances_bias_and_overoptimisation():
    c, e = 2.0, 0.35
    s = theory.sigma_star(c, e)
    grid = np.linspace(0.01, 2, 20001)
    first_two = grid * c + e * e / grid
    assert grid[np.argmin(first_two)] == pytest.approx(s, abs=1e-3)
    assert s * c + e * e / s + math.sqrt(c) * e == pytest.approx(3 * math.sqrt(c * e * e))


def test_beta_star_balances_eq5():
    c, e, r, s = 2.0, 0.3, 1.0, 0.1
    b = theory.beta_star(c, e, r, s)
    grid = np.linspace(0.01, 3, 30001)
    assert grid[np.argmin(grid * c + (e * e + r * s) / grid)] == pytest.approx(b, abs=1e-3)


def test_eq3_is_eq2_at_the_privacy_mandated_noise():
    eps, d, c, e = 1.5, 0.1, 2.0, 0.35
    sigma = 2 * d / eps
    eq2 = theory.privbon_regret_bound(sigma, c, e, 1.0, 10**9) - 1.0 * math.exp(
        (1 + e * math.sqrt(math.log(10**9))) / sigma) / math.sqrt(10**9)
    assert theory.privbon_private_regret_bound(eps, d, c, e) == pytest.approx(eq2)


def test_prop36_limits():
    assert theory.privbon_win_rate_limit(0.5, 0.5) == pytest.approx(0.7602, abs=1e-4)
    assert theory.privbon_hacking_gap_limit(0.5, 0.25) == pytest.approx(1.0)
    assert theory.bon_win_rate(4) == 0.8


def test_tilted_policy_is_softmax_for_uniform_base():
    r = np.array([0.1, 0.4, 0.9])
    assert np.allclose(theory.tilted_policy(np.ones(3) / 3, r, 0.3), theory.privbon_law(r, 0.3))


def test_sequential_law_sums_to_one():
    p, f = theory.sequential_law([0.2, 0.0, 1.0, 0.5])
    assert np.allclose(p, [0.2, 0.0, 0.8, 0.0]) and f == 0.0


def test_privitp_acceptance_tends_to_itp_when_noise_vanishes():
    r = np.array([0.2, 0.5, 0.8, 0.95])
    lam = 0.6
    acc = theory.privitp_acceptance(r, lam, 1e-6, truncation=0.0)
    assert np.allclose(acc, np.maximum(r - lam, 0) / (1 - lam), atol=1e-5)
