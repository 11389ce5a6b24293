"""The paper's theory (Sections 2-4, App. E) as plain functions.

Constants and bounds
    skyline (Prop. 2.1), epsilon_star (eq. (4)), sigma_star and beta_star, the regret bounds
    (2), (3), (5), (6) (stated with "<~", i.e. up to absolute constants: we return the bracketed
    expressions with constant 1), and the Prop. 3.6 limits of win-rate and hacking gap.

Exact selection laws for a fixed candidate set (reused by the evaluation harness)
    ``bon_law``, ``privbon_law`` (softmax for Gumbel noise, the probit integral of Prop. E.2 for
    Gaussian noise), ``sequential_law`` for rejection sampling, ``itp_law`` and ``privitp_law``
    (given lambda~), and ``privitp_marginal_law`` which integrates Phase 1's noise out.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import special

from ._special import log_mean_ndtr
from ._validation import (
    check_count,
    check_max_rounds,
    check_nonnegative,
    check_positive,
    check_reward_range,
    check_rewards,
    prepare_rewards,
)
from .accounting.privitp import default_truncation, itp_lambda

# --------------------------------------------------------------------------- constants and bounds


def skyline(coverage: float, eps_rm: float) -> float:
    """Regret lower bound of any algorithm (Prop. 2.1): sqrt(C eps_RM^2) / 4."""
    return 0.25 * math.sqrt(check_positive("coverage", coverage) * check_positive("eps_rm", eps_rm) ** 2)


def epsilon_star(sensitivity: float, coverage: float, eps_rm: float) -> float:
    """"Privacy is free" threshold, eq. (4): epsilon* = 2 Delta_r sqrt(C) / eps_RM."""
    return 2 * check_positive("sensitivity", sensitivity) * math.sqrt(
        check_positive("coverage", coverage)) / check_positive("eps_rm", eps_rm)


def sigma_star(coverage: float, eps_rm: float) -> float:
    """Regret-optimal PrivBoN noise (Section 3.1): sigma* = eps_RM / sqrt(C)."""
    return check_positive("eps_rm", eps_rm) / math.sqrt(check_positive("coverage", coverage))


def beta_star(coverage: float, eps_rm: float, r_max: float, sigma: float) -> float:
    """Regret-optimal PrivITP regulariser (Section 4): beta* = sqrt((eps_RM^2 + R_max sigma) / C)."""
    return math.sqrt((check_positive("eps_rm", eps_rm) ** 2 + check_positive("r_max", r_max)
                      * check_nonnegative("sigma", sigma)) / check_positive("coverage", coverage))


def privbon_regret_bound(sigma: float, coverage: float, eps_rm: float, r_max: float, n: int) -> float:
    """Eq. (2): sigma C + eps_RM^2/sigma + sqrt(C) eps_RM + R_max e^{(R_max + eps_RM sqrt(log n))/sigma} / sqrt(n)."""
    s, c, e = check_positive("sigma", sigma), check_positive("coverage", coverage), check_positive("eps_rm", eps_rm)
    r, n = check_positive("r_max", r_max), check_count("n", n)
    return s * c + e * e / s + math.sqrt(c) * e + r * math.exp((r + e * math.sqrt(math.log(n))) / s) / math.sqrt(n)


def privbon_private_regret_bound(epsilon: float, sensitivity: float, coverage: float, eps_rm: float) -> float:
    """Eq. (3), sigma = 2 Delta_r / epsilon: 2 Delta_r C / eps + eps eps_RM^2 / (2 Delta_r) + sqrt(C) eps_RM."""
    eps, d = check_positive("epsilon", epsilon), check_positive("sensitivity", sensitivity)
    c, e = check_positive("coverage", coverage), check_positive("eps_rm", eps_rm)
    return 2 * d * c / eps + eps * e * e / (2 * d) + math.sqrt(c) * e


def privitp_regret_bound(beta: float, sigma: float, coverage: float, eps_rm: float, r_max: float,
                         n: int) -> float:
    """Eq. (5), sigma = sigma_X + sigma_Z: beta C + (eps_RM^2 + R_max sigma)/beta + sqrt(C) eps_RM + R_max/sqrt(n)."""
    b, s = check_positive("beta", beta), check_nonnegative("sigma", sigma)
    c, e = check_positive("coverage", coverage), check_positive("eps_rm", eps_rm)
    r, n = check_positive("r_max", r_max), check_count("n", n)
    return b * c + (e * e + r * s) / b + math.sqrt(c) * e + r / math.sqrt(n)


def privitp_private_regret_bound(coverage: float, eps_rm: float, r_max: float, t: float,
                                 sensitivity: float, epsilon_1: float, epsilon_2: float,
                                 delta: float) -> float:
    """Eq. (6): 3 sqrt(C (eps_RM^2 + R_max t Delta_r / eps_2 + R_max Delta_r sqrt(ln(1/delta)) / eps_1))."""
    c, e, r = check_positive("coverage", coverage), check_positive("eps_rm", eps_rm), check_positive("r_max", r_max)
    d = check_positive("sensitivity", sensitivity)
    e1, e2 = check_positive("epsilon_1", epsilon_1), check_positive("epsilon_2", epsilon_2)
    if not 0 < delta < 1:
        raise ValueError(f"delta must lie in (0, 1), got {delta!r}")
    inner = e * e + r * check_positive("t", t) * d / e2 + r * d * math.sqrt(math.log(1 / delta)) / e1
    return 3 * math.sqrt(c * inner)


def privbon_win_rate_limit(reward_noise: float, sigma: float) -> float:
    """Prop. 3.6(a): PrivBoN's win-rate against pi0 tends to Phi(s_r / (sigma sqrt 2)) as n -> inf."""
    return float(special.ndtr(check_positive("reward_noise", reward_noise)
                              / (check_positive("sigma", sigma) * math.sqrt(2))))


def privbon_hacking_gap_limit(reward_noise: float, sigma: float) -> float:
    """Prop. 3.6(b): PrivBoN's hacking gap E[r_hat - r*] tends to s_r^2 / sigma."""
    return check_positive("reward_noise", reward_noise) ** 2 / check_positive("sigma", sigma)


def bon_win_rate(n: int) -> float:
    """BoN's win-rate against pi0 (continuous scores): n / (n + 1)."""
    n = check_count("n", n)
    return n / (n + 1)


def bon_hacking_gap_rate(reward_noise: float, n: int) -> float:
    """Leading order of BoN's hacking gap: s_r sqrt(2 ln n) (Prop. 3.6(b); exact as n -> inf
    when the reward error dominates the proxy's spread)."""
    return check_positive("reward_noise", reward_noise) * math.sqrt(2 * math.log(check_count("n", n)))


def tilted_policy(base_probs, rewards, sigma: float) -> np.ndarray:
    """Large-n limit of PrivBoN (Prop. 3.2): pi_inf(y) proportional to pi0(y) exp(r(y)/sigma)."""
    p = np.asarray(base_probs, dtype=float)
    r = check_rewards(rewards)
    if p.shape != r.shape or (p < 0).any() or not np.isclose(p.sum(), 1.0):
        raise ValueError("base_probs must be a probability vector with one entry per reward")
    with np.errstate(divide="ignore"):
        logits = np.log(p) + r / check_positive("sigma", sigma)
    return np.exp(logits - special.logsumexp(logits))

# --------------------------------------------------------------------------- selection laws


def bon_law(rewards) -> np.ndarray:
    """BoN: uniform over the argmax set."""
    r = check_rewards(rewards)
    top = (r == r.max()).astype(float)
    return top / top.sum()


_GL_X, _GL_W = np.polynomial.legendre.leggauss(40)


def privbon_law(rewards, noise_scale: float, noise: str = "gumbel", reward_range=None) -> np.ndarray:
    """Selection probabilities of PrivBoN for fixed candidates.

    Gumbel: softmax(r / sigma) (Gumbel-max, Prop. 3.2). Gaussian (Prop. E.2):
    w_i = E_Z[prod_{j != i} Phi(Z + (r_i - r_j)/sigma)], integrated in log space with composite
    Gauss-Legendre over Z in [-12, 12] (the neglected mass is below 1e-32); cost O(n^2 nodes).
    ``reward_range`` clips the scores first, as the mechanism does.
    """
    if reward_range is not None:
        r, _, _ = prepare_rewards(rewards, reward_range)
    else:
        r = check_rewards(rewards)
    sigma = check_positive("noise_scale", noise_scale)
    if noise == "gumbel":
        return special.softmax(r / sigma)
    if noise != "gaussian":
        raise ValueError(f"noise must be 'gumbel' or 'gaussian', got {noise!r}")
    edges = np.linspace(-12.0, 12.0, 25)
    a, b = edges[:-1, None], edges[1:, None]
    z = (0.5 * (b - a) * _GL_X + 0.5 * (a + b)).ravel()
    logw = (np.log(0.5 * (b - a) * _GL_W).ravel() - 0.5 * z * z - 0.5 * math.log(2 * math.pi))
    out = np.empty(r.size)
    d = (r[:, None] - r[None, :]) / sigma
    for i in range(r.size):
        others = np.delete(d[i], i)
        logprod = special.log_ndtr(z[:, None] + others[None, :]).sum(axis=1)
        out[i] = special.logsumexp(logw + logprod)
    p = np.exp(out)
    return p / p.sum()


def sequential_law(accept_probs) -> tuple[np.ndarray, float]:
    """Law of sequential rejection sampling: P(accept at round i) = a_i prod_{j<i} (1 - a_j),
    and P(fallback) = prod_j (1 - a_j). The halting time t = i + 1 has the same law."""
    a = np.clip(np.asarray(accept_probs, dtype=float), 0.0, 1.0)
    survive = np.concatenate([[1.0], np.cumprod(1.0 - a)])
    return a * survive[:-1], float(survive[-1])


def itp_law(rewards, beta: float, reward_range=(0.0, 1.0)) -> tuple[np.ndarray, float]:
    """Exact law of ``itp`` for fixed candidates: (P(index = i), P(fallback))."""
    r, r_max, _ = prepare_rewards(rewards, reward_range)
    lam = itp_lambda(r, check_positive("beta", beta))
    return sequential_law(np.maximum(r - lam, 0.0) / (r_max - lam))


def privitp_acceptance(rewards, lambda_tilde, sigma_z: float, reward_range=(0.0, 1.0),
                       truncation: float | None = None) -> np.ndarray:
    """P(accept | r, lambda~) = E_u Phi((r - lambda~ - b u)/sigma_Z), b = R_max + sigma_Z L - lambda~.

    Exact, including the truncation min(w/M, 1): with u uniform, P(u < min(w/M, 1)) = min(w/M, 1).
    Broadcasts over rewards and lambda~. ``truncation=None`` uses the default for n = len(rewards).
    """
    r, r_max, _ = prepare_rewards(np.ravel(rewards), reward_range)
    r = r.reshape(np.shape(rewards))
    sz = check_positive("sigma_z", sigma_z)
    L = default_truncation(r.size) if truncation is None else check_nonnegative("truncation", truncation)
    lt = np.asarray(lambda_tilde, dtype=float)
    b = r_max + sz * L - lt
    return np.exp(log_mean_ndtr((r - lt - b) / sz, b / sz))


def privitp_law(phase2_rewards, lambda_tilde: float, sigma_z: float, reward_range=(0.0, 1.0),
                truncation: float | None = None) -> tuple[np.ndarray, float]:
    """Law of PrivITP's Phase 2 for fixed candidates given lambda~: (P(index = i), P(fallback))."""
    r = check_rewards(phase2_rewards, "phase2_rewards")
    L = default_truncation(r.size) if truncation is None else truncation
    return sequential_law(privitp_acceptance(r, float(lambda_tilde), sigma_z, reward_range, L))


def privitp_marginal_law(phase1_rewards, phase2_rewards, *, beta: float, sigma_x: float,
                         sigma_z: float, reward_range=(0.0, 1.0), truncation: float | None = None,
                         nodes: int = 96, max_rounds: int | None = None) -> tuple[np.ndarray, float]:
    """PrivITP's law with Phase 1's noise integrated out, batch by batch (two independent batches),
    Phase 2 capped at T = ``max_rounds`` rounds (default n): its first T candidates are examined, the
    probabilities returned are theirs, and L defaults to sqrt(2 ln T).

    lambda~ = clip(lambda + sigma_X Z, -beta, R_max): the two clipped tails are atoms, the middle
    is integrated with Gauss-Legendre over Z, so the law is averaged draw by draw over lambda~
    (averaging acceptance probabilities first and then composing would be biased).
    """
    lo, hi = check_reward_range(reward_range)
    r1, r_max, _ = prepare_rewards(phase1_rewards, (lo, hi), "phase1_rewards")
    n = r1.size
    beta, sx = check_positive("beta", beta), check_positive("sigma_x", sigma_x)
    T = check_max_rounds(max_rounds, n)
    L = default_truncation(T) if truncation is None else truncation
    phase2_rewards = np.asarray(phase2_rewards, dtype=float)[:T]
    lam = itp_lambda(r1, beta)
    z_lo = max((-beta - lam) / sx, -12.0)
    z_hi = min((r_max - lam) / sx, 12.0)
    x, w = np.polynomial.legendre.leggauss(nodes)
    z = 0.5 * (z_hi - z_lo) * x + 0.5 * (z_hi + z_lo)
    weights = list(0.5 * (z_hi - z_lo) * w * np.exp(-0.5 * z * z) / math.sqrt(2 * math.pi))
    lts = list(lam + sx * z)
    weights += [float(special.ndtr(z_lo)), float(special.ndtr(-z_hi))]
    lts += [-beta, r_max]
    probs = np.zeros(np.size(phase2_rewards))
    fallback = 0.0
    for lt, wt in zip(lts, weights):
        p, f = privitp_law(phase2_rewards, lt, sigma_z, (lo, hi), L)
        probs += wt * p
        fallback += wt * f
    total = probs.sum() + fallback
    return probs / total, fallback / total
