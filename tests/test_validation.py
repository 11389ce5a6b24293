"""Bad input gets a ValueError that names the argument; nothing random is drawn before."""

import math

import numpy as np
import pytest

import privalign as pa
import privalign.accounting as A

R = [0.1, 0.5, 0.9]
P = dict(beta=0.1, sigma_x=0.2, sigma_z=0.2, delta=1e-3)

CASES = [
    (lambda: pa.bon([0.1, math.nan]), "rewards"),
    (lambda: pa.bon([]), "rewards"),
    (lambda: pa.bon([[0.1, 0.2]]), "rewards"),
    (lambda: pa.privbon([0.1, math.inf], epsilon=1.0), "rewards"),
    (lambda: pa.privbon(R), "epsilon"),
    (lambda: pa.privbon(R, epsilon=1.0, noise_scale=1.0), "epsilon"),
    (lambda: pa.privbon(R, epsilon=0.0), "epsilon"),
    (lambda: pa.privbon(R, epsilon=-1.0), "epsilon"),
    (lambda: pa.privbon(R, noise_scale=0.0), "noise_scale"),
    (lambda: pa.privbon(R, noise_scale=-2.0, noise="gaussian"), "noise_scale"),
    (lambda: pa.privbon(R, epsilon=1.0, noise="laplace"), "noise"),
    (lambda: pa.privbon(R, epsilon=1.0, reward_range=(1.0, 1.0)), "reward_range"),
    (lambda: pa.privbon(R, epsilon=1.0, reward_range=(2.0, 0.0)), "reward_range"),
    (lambda: pa.privbon(R, epsilon=1.0, sensitivity=0.0), "sensitivity"),
    (lambda: pa.privbon(R, epsilon=1.0, sensitivity=2.0), "sensitivity"),
    (lambda: pa.privbon(R, epsilon=1.0, rng=42), "rng"),
    (lambda: pa.itp(R, beta=0.0), "beta"),
    (lambda: pa.itp(R, beta=-0.1), "beta"),
    (lambda: pa.itp([], beta=0.1), "rewards"),
    (lambda: pa.privitp(R, R, **{**P, "delta": 0.0}), "delta"),
    (lambda: pa.privitp(R, R, **{**P, "delta": 1.0}), "delta"),
    (lambda: pa.privitp(R, R, **{**P, "sigma_x": 0.0}), "sigma_x"),
    (lambda: pa.privitp(R, R, **{**P, "sigma_z": -1.0}), "sigma_z"),
    (lambda: pa.privitp(R, R, **{**P, "beta": 0.0}), "beta"),
    (lambda: pa.privitp(R, R, **P, truncation=-1.0), "truncation"),
    (lambda: pa.privitp([math.nan], R, **P), "phase1_rewards"),
    (lambda: pa.privitp(R, [0.1, math.nan, 0.3], **P), "phase2"),
    (lambda: pa.privitp(R, [0.1], **P), "phase2"),
    (lambda: pa.privitp(R, "abc", **P), "phase2"),
    (lambda: pa.privitp(R, lambda: "high", **P, rng=np.random.default_rng(0)), "phase2"),
    (lambda: pa.privitp(R, lambda: math.nan, **P, rng=np.random.default_rng(0)), "phase2"),
    (lambda: A.gumbel_epsilon(0.0, 1.0), "noise_scale"),
    (lambda: A.gumbel_noise_scale(0.0, 1.0), "epsilon"),
    (lambda: A.gaussian_mechanism_epsilon(1.0, 1.0, 1.5), "delta"),
    (lambda: A.gaussian_mechanism_epsilon(1.0, 1.0, 1e-3, method="exact"), "method"),
    (lambda: A.gaussian_mechanism_epsilon(0.1, 1.0, 1e-3, method="classic"), "classic"),
    (lambda: A.gaussian_mechanism_noise_scale(2.0, 1.0, 1e-3, method="classic"), "classic"),
    (lambda: A.gaussian_rnm_epsilon(1.0, 2.0, 1.0, 4), "sensitivity"),
    (lambda: A.gaussian_rnm_epsilon(1.0, 1.0, 1.0, 0), "n"),
    (lambda: A.privitp_epsilon2(None, 0.5, 0.1, 1.0, 1.0, 2.0), "n"),
    (lambda: A.privitp_epsilon2(0, 0.5, 0.1, 1.0, 1.0, 2.0), "t"),
    (lambda: A.privitp_epsilon2(5, 0.5, 0.1, 1.0, 1.0, 2.0, n=4), "t"),
    (lambda: A.privitp_epsilon2(1, 1.5, 0.1, 1.0, 1.0, 2.0), "lambda_tilde"),
    (lambda: A.privitp_epsilon_max(16, 0.05, 0.2, 0.2, 0.0, 1.0, 1.0), "delta"),
    (lambda: A.itp_lambda([0.1], 0.0), "beta"),
    (lambda: A.PrivacyFilter(0.0), "epsilon_total"),
    (lambda: A.PrivacyFilter(1.0, composition="advanced"), "composition"),
    (lambda: A.PrivacyFilter(1.0).charge(-0.1), "epsilon"),
    (lambda: A.PrivacyFilter(1.0).charge(0.5, epsilon_max=-0.2), "epsilon_max"),
]


@pytest.mark.parametrize("call,name", CASES)
def test_bad_input_raises_value_error_naming_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


def test_scores_outside_the_range_are_clipped_and_counted():
    s = pa.privbon([-3.0, 0.5, 7.0], epsilon=1.0, rng=np.random.default_rng(0))
    assert s.n_clipped == 2
    s = pa.itp([-3.0, 0.5, 7.0], beta=0.1, rng=np.random.default_rng(0))
    assert s.n_clipped == 2
