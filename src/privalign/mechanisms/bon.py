"""Best-of-N and Private Best-of-N (paper Alg. 1, Thm 3.1, App. E)."""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .._validation import (
    as_generator,
    check_positive,
    check_rewards,
    check_sensitivity,
    prepare_rewards,
)
from ..accounting.calibration import check_temperature, privbon_noise_scale
from ..accounting.gaussian import check_gaussian_sampler_support, gaussian_rnm_epsilon
from ..accounting.gumbel import gumbel_epsilon, gumbel_noise_scale
from .selection import Selection

NOISES = ("gumbel", "gaussian", "exact")


def bon(rewards, *, rng: np.random.Generator | None = None) -> Selection:
    """Best-of-N: the argmax of the scores, ties broken uniformly at random. Not private."""
    r = check_rewards(rewards)
    best = np.flatnonzero(r == r.max())
    index = int(best[0]) if best.size == 1 else int(best[as_generator(rng).integers(best.size)])
    return Selection(index=index, mechanism="bon", epsilon=math.inf, n=r.size)


def soft_bon(rewards, *, temperature: float = 0.0, rng: np.random.Generator | None = None) -> Selection:
    """Soft Best-of-N: candidate i with probability softmax(r / temperature)_i; temperature 0 is BoN.
    Not private by itself (epsilon = inf): with a reward model released under DP it is
    post-processing, and the temperature is a guard against reward hacking, not a privacy parameter."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if temperature == 0:
        return dataclasses.replace(bon(rewards, rng=rng), mechanism="soft-bon")
    r = check_rewards(rewards)
    z = (r - r.max()) / temperature
    p = np.exp(z) / np.exp(z).sum()
    index = int(min(np.searchsorted(np.cumsum(p), as_generator(rng).random() * p.sum(), side="right"), r.size - 1))
    return Selection(index=index, mechanism="soft-bon", epsilon=math.inf, n=r.size)


def privbon(rewards, *, epsilon: float | None = None, noise_scale: float | None = None,
            sensitivity: float | None = None, reward_range=(0.0, 1.0), noise: str = "gumbel",
            temperature: float = 0.0, rng: np.random.Generator | None = None) -> Selection:
    """Private Best-of-N: argmax_i r_i + g_i over scores clipped to ``reward_range``.

    * ``noise="gumbel"``: g_i ~ Gumbel(0, sigma); i is drawn with probability softmax(r / sigma)
      (Gumbel-max). Pure epsilon = 2 Delta_r / sigma (Thm 3.1, the exponential mechanism). The
      Gumbel variables are drawn as g = -sigma log E with E ~ Exp(1) (same law, 3x faster).
    * ``noise="gaussian"``: g_i ~ N(0, sigma^2); pure epsilon from App. E eq. (26), depends on n.
      A ``noise_scale`` with R/sigma > 24.45 is refused (ValueError): numpy's normal sampler is bounded
      (|z| <= 12.2258), so wider gaps make some indices impossible on one input and possible on its
      neighbour; calibration from ``epsilon`` stops at that floor (the achieved epsilon is then lower).
    * ``noise="exact"``: report-noisy-max with exponential noise of scale sigma, sampled exactly
      (no floating-point noise: OpenDP's ``make_noisy_max``, in Rust, treats the scores as exact
      rationals), pure epsilon = 2 Delta_r / sigma. Its law is permute-and-flip (McKenna & Sheldon
      2020), not softmax: at the same epsilon it is never less accurate. Needs the ``secure``
      extra (``pip install opendp``); ``rng`` is not used (OpenDP draws from the OS).

    Give exactly one of ``epsilon`` and ``noise_scale``. ``sensitivity=None`` uses the width of
    ``reward_range`` (always valid).

    ``temperature`` tau (in the units of the scores, default 0: none) is a noise floor: the noise is
    sigma = max(the scale from ``epsilon`` or ``noise_scale``, tau). Gumbel-max at scale sigma is soft
    BoN at temperature sigma; past the minimum noise it regularises against reward hacking and
    spends less than ``epsilon``. The selection's ``epsilon`` is always the one spent, computed from
    the sigma used (Gumbel and exact: 2 Delta_r / sigma). tau must not be chosen by reading the
    private data behind the scores (docs/experiments.md, "PrivBoN's noise floor").
    """
    r, r_max, n_clipped = prepare_rewards(rewards, reward_range)
    delta_r = check_sensitivity(sensitivity, r_max)
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    if (epsilon is None) == (noise_scale is None):
        raise ValueError("give exactly one of epsilon and noise_scale, got "
                         f"epsilon={epsilon!r}, noise_scale={noise_scale!r}")
    n = r.size
    sigma = _noise(noise, epsilon, noise_scale, check_temperature(temperature), delta_r, n, r_max)
    if noise == "gumbel":
        eps = gumbel_epsilon(sigma, delta_r)
        # argmax_i r_i/sigma + G_i with Gumbel G_i = -log E_i, E_i ~ Exp(1)
        gen = as_generator(rng)
        e = gen.standard_exponential(n)
        while not e.all():  # E = 0 would be a +inf Gumbel that wins whatever the scores: redraw it
            e[e == 0] = gen.standard_exponential(int(np.count_nonzero(e == 0)))
        gumbel = np.log(e)
        index = int(np.argmax(np.subtract(r * (1.0 / sigma), gumbel, out=gumbel)))
    elif noise == "exact":
        index, eps = exact_noisy_max(r, sigma, delta_r)
    else:
        if n > 1:
            check_gaussian_sampler_support(sigma, r_max)
        eps = gaussian_rnm_epsilon(sigma, delta_r, r_max, n)
        index = int(np.argmax(r + sigma * as_generator(rng).standard_normal(n)))
    return Selection(index=index, mechanism=f"privbon-{noise}", epsilon=eps, n=n,
                     noise_scale=sigma, n_clipped=n_clipped)


def _noise(noise: str, epsilon, noise_scale, tau: float, delta_r: float, n: int, r_max: float) -> float:
    """PrivBoN's sigma: the given ``noise_scale`` or the one calibrated to ``epsilon`` (Gumbel and
    exact: 2 Delta_r / epsilon; Gaussian: App. E), floored at the temperature tau."""
    if noise_scale is not None:
        return max(check_positive("noise_scale", noise_scale), tau)
    if noise == "gaussian":
        return privbon_noise_scale(epsilon, delta_r, noise="gaussian", n=n, r_max=r_max, temperature=tau)
    return max(gumbel_noise_scale(epsilon, delta_r), tau)


def exact_noisy_max(scores: np.ndarray, scale: float, sensitivity: float) -> tuple[int, float]:
    """OpenDP's exact report-noisy-max (exponential noise, max divergence): (index, its epsilon for
    an L-infinity input distance of ``sensitivity``, as OpenDP's own privacy map states it)."""
    meas = _noisy_max(float(scale))
    return int(meas([float(v) for v in scores])), float(meas.map(float(sensitivity)))


@functools.lru_cache(maxsize=64)
def _noisy_max(scale: float):
    try:
        import opendp.prelude as dp
    except ImportError as e:  # pragma: no cover - the secure extra is part of the test install
        raise ImportError("noise='exact' needs OpenDP: pip install 'privalign[secure]'") from e
    dp.enable_features("contrib")
    space = dp.vector_domain(dp.atom_domain(T=float, nan=False)), dp.linf_distance(T=float)
    return dp.m.make_noisy_max(*space, dp.max_divergence(), scale=scale)
