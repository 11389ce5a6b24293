"""Calibration: the noise that buys a target epsilon, for each mechanism.

* ``privbon_noise_scale``: Gumbel sigma = 2 Delta_r / epsilon (Thm 3.1), or the Gaussian
  report-noisy-max scale from eq. (26), which depends on n and R_max; a ``temperature`` tau is a
  noise floor, sigma = max(that scale, tau), and the epsilon spent is then computed from sigma.
* ``privitp_noise_scales``: split a per-query worst-case budget epsilon_max between Phase 1
  (sigma_X, Gaussian mechanism at delta) and Phase 2 (sigma_Z), so that
  ``privitp_epsilon_max(...) <= epsilon_max``.
* ``paper_noise_split``: the paper's convention sigma_X = sigma_Z = sigma / 2 (Section 5).
"""

from __future__ import annotations

import math

from .._validation import check_count, check_max_rounds, check_positive
from .gaussian import gaussian_mechanism_noise_scale, gaussian_rnm_noise_scale, gaussian_sampler_floor
from .gumbel import gumbel_noise_scale
from ._rounding import smallest_scale
from .privitp import default_truncation, privitp_epsilon_max


def privbon_noise_scale(epsilon: float, sensitivity: float, *, noise: str = "gumbel",
                        n: int | None = None, r_max: float | None = None, temperature: float = 0.0) -> float:
    """Noise scale for PrivBoN at pure ``epsilon`` (Gaussian noise also needs ``n`` and ``r_max``),
    floored at ``temperature``: sigma = max(the scale that spends epsilon, tau). Above the floor the
    query spends less than ``epsilon`` (Gumbel: 2 Delta_r / tau); recompute it from sigma.

    Gaussian noise is never calibrated below ``gaussian_sampler_floor(r_max)`` (R/sigma <= 24.45, the
    float sampler's support); where the floor binds, the achieved epsilon is below the target."""
    tau = check_temperature(temperature)
    if noise == "gumbel":
        return max(gumbel_noise_scale(epsilon, sensitivity), tau)
    if noise == "gaussian":
        if n is None or r_max is None:
            raise ValueError("noise='gaussian' needs n and r_max: its epsilon depends on both (App. E)")
        if n == 1:
            return max(gaussian_rnm_noise_scale(epsilon, sensitivity, r_max, n), tau)
        return max(gaussian_rnm_noise_scale(epsilon, sensitivity, r_max, n), gaussian_sampler_floor(r_max), tau)
    raise ValueError(f"noise must be 'gumbel' or 'gaussian', got {noise!r}")


def check_temperature(temperature) -> float:
    """A noise floor tau: a finite number >= 0 (0: no floor), in the units of the scores."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    return float(temperature)


def paper_noise_split(sigma: float) -> tuple[float, float]:
    """(sigma_X, sigma_Z) = (sigma/2, sigma/2), the paper's equal split of a total noise sigma."""
    s = check_positive("sigma", sigma)
    return s / 2, s / 2


def privitp_noise_scales(epsilon_max: float, delta: float, n: int, beta: float, sensitivity: float,
                         r_max: float, truncation: float | None = None,
                         phase1_fraction: float = 0.5, max_rounds: int | None = None) -> tuple[float, float]:
    """(sigma_X, sigma_Z) whose PrivITP worst case per query, with T = ``max_rounds`` Phase-2 rounds
    (default n), is at most ``epsilon_max``.

    Phase 1 gets ``phase1_fraction * epsilon_max`` through the exact Gaussian mechanism; sigma_Z is
    the smallest scale (bisection in log sigma_Z, returned from above) whose Phase-2 worst case
    fits in the rest.
    """
    eps = check_positive("epsilon_max", epsilon_max)
    if not 0 < phase1_fraction < 1:
        raise ValueError(f"phase1_fraction must lie in (0, 1), got {phase1_fraction!r}")
    n = check_count("n", n)
    T = check_max_rounds(max_rounds, n)
    L = default_truncation(T) if truncation is None else truncation
    sigma_x = gaussian_mechanism_noise_scale(phase1_fraction * eps, sensitivity, delta)

    sigma_z = smallest_scale(
        lambda sz: privitp_epsilon_max(n, beta, sigma_x, sz, delta, sensitivity, r_max, L, max_rounds=T) <= eps,
        sensitivity, rel_tol=1e-6)
    return sigma_x, sigma_z
