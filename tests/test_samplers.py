"""Samplers against their exact laws: chi-square goodness of fit with fixed seeds.

Each test draws N selections and rejects at p < 1e-3. A correct sampler passes (the seeds are
fixed, so the outcome is deterministic); the power checks show that the same test rejects a
subtly wrong sampler, e.g. PrivITP reusing its Phase-1 batch in Phase 2.
"""

import numpy as np
import pytest
from scipy import stats

import privalign as pa
from privalign import theory

N = 30_000
ALPHA = 1e-3


def frequencies(draws, k):
    return np.bincount(np.asarray(draws), minlength=k)


def chi2_pvalue(counts, probs):
    probs = np.asarray(probs, float)
    expected = probs * counts.sum()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a zero-probability outcome occurred"
    # pool cells with small expectation so that the chi-square approximation holds (>= 5 each)
    order = np.argsort(expected[keep])
    e, c = expected[keep][order], counts[keep][order]
    pooled_e, pooled_c, acc_e, acc_c = [], [], 0.0, 0
    for ei, ci in zip(e, c):
        acc_e += ei
        acc_c += ci
        if acc_e >= 5:
            pooled_e.append(acc_e)
            pooled_c.append(acc_c)
            acc_e, acc_c = 0.0, 0
    if acc_e > 0:
        pooled_e[-1] += acc_e
        pooled_c[-1] += acc_c
    return stats.chisquare(pooled_c, pooled_e).pvalue


def outcome(sel):
    """Index, with the fallback as the last category n (halting time n + 1)."""
    return sel.n if sel.fallback else sel.index


REWARDS = np.array([0.05, 0.9, 0.42, 0.88, 0.3, 0.61, 0.87, 0.12])


def test_gumbel_max_follows_softmax():
    rng = np.random.default_rng(1)
    sigma = 0.15
    draws = [pa.privbon(REWARDS, noise_scale=sigma, rng=rng).index for _ in range(N)]
    assert chi2_pvalue(frequencies(draws, REWARDS.size), theory.privbon_law(REWARDS, sigma)) > ALPHA
    # power: the law at a 15% larger temperature is rejected
    assert chi2_pvalue(frequencies(draws, REWARDS.size), theory.privbon_law(REWARDS, 1.15 * sigma)) < ALPHA


def test_gaussian_noisy_max_follows_probit_law():
    rng = np.random.default_rng(2)
    sigma = 0.2
    draws = [pa.privbon(REWARDS, noise_scale=sigma, noise="gaussian", rng=rng).index for _ in range(N)]
    law = theory.privbon_law(REWARDS, sigma, noise="gaussian")
    assert chi2_pvalue(frequencies(draws, REWARDS.size), law) > ALPHA
    # power: the softmax law at the same scale is a different law and is rejected
    assert chi2_pvalue(frequencies(draws, REWARDS.size), theory.privbon_law(REWARDS, sigma)) < ALPHA


def test_bon_breaks_ties_uniformly():
    rng = np.random.default_rng(3)
    r = np.array([0.2, 0.9, 0.9, 0.1, 0.9])
    draws = [pa.bon(r, rng=rng).index for _ in range(6000)]
    assert chi2_pvalue(frequencies(draws, r.size), theory.bon_law(r)) > ALPHA


@pytest.mark.parametrize("beta", [0.02, 0.1, 0.5])
def test_itp_selection_and_halting_time_follow_sequential_law(beta):
    rng = np.random.default_rng(4)
    sels = [pa.itp(REWARDS, beta=beta, rng=rng) for _ in range(N)]
    probs, fallback = theory.itp_law(REWARDS, beta)
    law = np.append(probs, fallback)
    assert chi2_pvalue(frequencies([outcome(s) for s in sels], REWARDS.size + 1), law) > ALPHA
    halting = np.array([s.halting_time for s in sels])
    assert np.array_equal(halting, [outcome(s) + 1 for s in sels])  # t = index + 1, fallback n + 1


PHASE1 = np.array([0.8, 0.1, 0.75, 0.3, 0.9, 0.2, 0.5, 0.65])
PHASE2 = np.array([0.3, 0.95, 0.1, 0.7, 0.2, 0.85, 0.4, 0.6])
PRIVITP = dict(beta=0.1, sigma_x=0.1, sigma_z=0.15, delta=1e-2)


def privitp_counts(phase1, phase2, seed):
    rng = np.random.default_rng(seed)
    return frequencies([outcome(pa.privitp(phase1, phase2, rng=rng, **PRIVITP)) for _ in range(N)],
                       PHASE2.size + 1)


def marginal_law(phase1, phase2):
    kw = {k: v for k, v in PRIVITP.items() if k != "delta"}
    probs, fallback = theory.privitp_marginal_law(phase1, phase2, **kw)
    return np.append(probs, fallback)


def test_privitp_follows_its_two_batch_law():
    assert chi2_pvalue(privitp_counts(PHASE1, PHASE2, 5), marginal_law(PHASE1, PHASE2)) > ALPHA


def test_privitp_test_detects_phase1_batch_reuse():
    # An implementation that reuses the Phase-1 batch in Phase 2 behaves like privitp(PHASE1, PHASE1).
    buggy = privitp_counts(PHASE1, PHASE1, 5)
    assert chi2_pvalue(buggy, marginal_law(PHASE1, PHASE2)) < ALPHA


def test_privitp_generates_phase2_candidates_lazily():
    rng = np.random.default_rng(6)
    pool = np.random.default_rng(7).random(10_000)
    for _ in range(200):
        calls = []

        def next_reward():
            calls.append(1)
            return float(pool[len(calls)])

        sel = pa.privitp(PHASE1, next_reward, rng=rng, **PRIVITP)
        assert len(calls) == (PHASE1.size if sel.fallback else sel.halting_time)


def test_privitp_epsilon_is_the_ex_post_cost():
    rng = np.random.default_rng(8)
    from privalign import accounting as A
    L = A.default_truncation(PHASE1.size)
    eps_max = A.privitp_epsilon_max(PHASE1.size, PRIVITP["beta"], PRIVITP["sigma_x"], PRIVITP["sigma_z"],
                                    PRIVITP["delta"], 1.0, 1.0, L)
    for _ in range(300):
        s = pa.privitp(PHASE1, PHASE2, rng=rng, **PRIVITP)
        eps1 = A.gaussian_mechanism_epsilon(PRIVITP["sigma_x"], 1.0, PRIVITP["delta"])
        t = None if s.fallback else s.halting_time
        eps2 = float(A.privitp_epsilon2(t, s.lambda_tilde, PRIVITP["sigma_z"], 1.0, 1.0, L, n=PHASE1.size))
        assert s.epsilon >= eps1 + eps2 and s.epsilon <= (eps1 + eps2) * (1 + 1e-12)
        assert s.epsilon <= eps_max and s.delta == PRIVITP["delta"]
        assert -PRIVITP["beta"] <= s.lambda_tilde <= 1.0
