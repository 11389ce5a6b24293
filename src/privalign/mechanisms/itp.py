"""Inference-time pessimism (Huang et al. 2025) and its private version PrivITP (paper Alg. 2)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from numbers import Real

import numpy as np

from .._validation import (
    as_generator,
    check_delta,
    check_max_rounds,
    check_nonnegative,
    check_positive,
    check_reward_range,
    check_sensitivity,
    prepare_rewards,
)
from ..accounting._rounding import ulp_up
from ..accounting.gaussian import gaussian_mechanism_epsilon
from ..accounting.privitp import default_truncation, privitp_epsilon2, solve_itp_lambda
from .selection import Selection


def _first_acceptance(r: np.ndarray, lam: float, scale: float, gen: np.random.Generator) -> int | None:
    """Sequential rejection sampling with acceptance probabilities min(relu(r_i - lam)/scale, 1):
    the first i with U_i < p_i. Probabilities and uniforms are computed in growing chunks, which
    has exactly the law of one uniform per round. ``None`` if no candidate is accepted."""
    start, chunk = 0, 32
    while start < r.size:
        stop = min(start + chunk, r.size)
        p = (r[start:stop] - lam) / scale
        hits = np.flatnonzero(gen.random(stop - start) < p)
        if hits.size:
            return start + int(hits[0])
        start, chunk = stop, chunk * 4
    return None


def itp(rewards, *, beta: float, reward_range=(0.0, 1.0),
        rng: np.random.Generator | None = None) -> Selection:
    """chi^2-pessimistic rejection sampling over one batch (Huang et al. 2025). Not private.

    Solve (1/n) sum_i relu((r_i - lambda)/beta) = 1, then for i = 1..n accept candidate i with
    probability min(w_i / M, 1), w_i = relu((r_i - lambda)/beta), M = (R_max - lambda)/beta. If
    none is accepted the result is a fallback: return a fresh draw from the base policy.
    """
    r, r_max, n_clipped = prepare_rewards(rewards, reward_range)
    beta = check_positive("beta", beta)
    lam = solve_itp_lambda(r, beta)  # lam <= max(r) - beta < R_max, so M > 0
    # w_i / M = (r_i - lam)/(R_max - lam) <= 1; a negative value never beats a uniform
    hit = _first_acceptance(r, lam, r_max - lam, as_generator(rng))
    n = r.size
    return Selection(index=hit, mechanism="itp", epsilon=math.inf, fallback=hit is None,
                     halting_time=n + 1 if hit is None else hit + 1, n=n, lambda_=lam,
                     n_clipped=n_clipped)


def _phase2_source(phase2, T: int, lo: float, hi: float) -> Callable[[int], float]:
    """Reward of the i-th Phase-2 candidate, clipped and shifted to [0, R_max]."""
    if callable(phase2):
        def from_callable(i: int) -> float:
            v = phase2()
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (Real, np.number)) \
                    or not math.isfinite(float(v)):
                raise ValueError(f"phase2 must return a finite number, got {v!r} for candidate {i + 1}")
            return min(max(float(v), lo), hi) - lo
        return from_callable
    if isinstance(phase2, (str, bytes)) or not isinstance(phase2, (Sequence, np.ndarray)):
        raise ValueError(f"phase2 must be a sequence of rewards or a callable, got {type(phase2).__name__}")
    r2, _, _ = prepare_rewards(phase2, (lo, hi), name="phase2")
    if r2.size < T:
        raise ValueError(f"phase2 must hold at least max_rounds={T} rewards (n unless capped), got {r2.size}")
    return lambda i: float(r2[i])


def privitp(phase1_rewards, phase2, *, beta: float, sigma_x: float, sigma_z: float, delta: float,
            truncation: float | None = None, sensitivity: float | None = None,
            reward_range=(0.0, 1.0), rng: np.random.Generator | None = None,
            method: str = "analytic", max_rounds: int | None = None) -> Selection:
    """PrivITP (paper Alg. 2) with independent Phase-1 and Phase-2 batches, Phase 2 capped at
    T = ``max_rounds`` rounds (default T = n, the paper's mechanism).

    Phase 1: lambda~ = clip(lambda + N(0, sigma_x^2), -beta, R_max), lambda solved on
    ``phase1_rewards`` (n = their number). Phase 2: for i = 1..T, the reward of a *fresh*
    candidate (``phase2`` is a sequence of rewards, or a callable returning the reward of the next
    freshly generated candidate, called only until acceptance) is noised,
    r~_i = r_i + N(0, sigma_z^2), and accepted with probability min(w_i/M, 1),
    w_i = relu((r~_i - lambda~)/beta), M = (R_max + sigma_z L - lambda~)/beta, L = sqrt(2 ln T) by
    default. No acceptance: fallback (a fresh base-policy draw, halting_time = T + 1).

    The returned epsilon is the realised ex-post cost epsilon_1 + epsilon_2^post(t) (Thm 4.1; the
    fallback costs T kappa), epsilon_1 from the exact Gaussian mechanism (``method="classic"`` for
    the paper's formula). With T = n the draws and the result are those of the uncapped mechanism.
    """
    lo, hi = check_reward_range(reward_range)
    r1, r_max, n_clipped = prepare_rewards(phase1_rewards, (lo, hi), name="phase1_rewards")
    n = r1.size
    delta_r = check_sensitivity(sensitivity, r_max)
    beta = check_positive("beta", beta)
    sigma_x = check_positive("sigma_x", sigma_x)
    sigma_z = check_positive("sigma_z", sigma_z)
    delta = check_delta(delta)
    T = check_max_rounds(max_rounds, n)
    L = default_truncation(T) if truncation is None else check_nonnegative("truncation", truncation)
    eps1 = gaussian_mechanism_epsilon(sigma_x, delta_r, delta, method=method)
    reward_of = _phase2_source(phase2, T, lo, hi)
    gen = as_generator(rng)

    lam = solve_itp_lambda(r1, beta)
    lam_t = min(max(lam + sigma_x * gen.standard_normal(), -beta), r_max)
    b = r_max + sigma_z * L - lam_t  # = beta * M
    hit = None
    for i in range(T):
        excess = reward_of(i) + sigma_z * gen.standard_normal() - lam_t
        p = 0.0 if excess <= 0 else (1.0 if excess >= b else excess / b)
        if gen.random() < p:
            hit = i
            break
    t = None if hit is None else hit + 1
    eps2 = float(privitp_epsilon2(t, lam_t, sigma_z, delta_r, r_max, L, n=T))
    return Selection(index=hit, mechanism="privitp", epsilon=ulp_up(eps1 + eps2), delta=delta,
                     fallback=hit is None, halting_time=T + 1 if hit is None else t, n=n, max_rounds=T,
                     lambda_tilde=lam_t, sigma_x=sigma_x, sigma_z=sigma_z, truncation=L,
                     epsilon_1=eps1, epsilon_2=eps2, n_clipped=n_clipped)
