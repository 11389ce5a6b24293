"""Simulation worlds: response pools drawn from known laws, reproducible from a seed.

``gaussian`` (the paper's model, Thm 3.3 / Prop. 3.6)
    Every prompt has true accuracy ``base_accuracy``; true_reward ~ Bernoulli(base_accuracy) and
    proxy = true_reward + N(0, reward_noise^2). With ``base_accuracy`` in {0, 1} the true reward
    is constant and Prop. 3.6 applies verbatim (win-rate limit Phi(s_r / (sigma sqrt 2))); the
    hacking-gap limit s_r^2 / sigma holds for any accuracy.

``hackable`` (a reward model that is confidently wrong, as in the paper's Figure 1)
    Per-prompt accuracy p ~ Beta with mean ``base_accuracy`` and concentration ``concentration``;
    true_reward ~ Bernoulli(p); the proxy is ``margin`` + N(0, correct_noise^2) for correct
    responses and N(0, wrong_noise^2) for incorrect ones. The wrong answers' wider error makes the
    largest proxy scores come from wrong answers once n is large: BoN's accuracy rises, peaks near
    n ~ 8-32 with the defaults, and falls, while its proxy reward keeps rising. Soft selection
    with sigma > (wrong_noise^2 - correct_noise^2) / (2 margin) keeps preferring correct answers.
"""

from __future__ import annotations

import numpy as np

from .pools import Pool

WORLDS = ("gaussian", "hackable")


def _check(prompts: int, samples: int):
    if prompts < 1 or samples < 1:
        raise ValueError(f"prompts and samples must be >= 1, got prompts={prompts!r}, samples={samples!r}")


def gaussian_world(prompts: int, samples: int, *, seed: int = 0, base_accuracy: float = 0.3,
                   reward_noise: float = 0.5) -> Pool:
    _check(prompts, samples)
    if not 0 <= base_accuracy <= 1:
        raise ValueError(f"base_accuracy must lie in [0, 1], got {base_accuracy!r}")
    if reward_noise <= 0:
        raise ValueError(f"reward_noise must be positive, got {reward_noise!r}")
    rng = np.random.default_rng(seed)
    true = (rng.random((prompts, samples)) < base_accuracy).astype(float)
    proxy = true + reward_noise * rng.standard_normal((prompts, samples))
    return _pool(true, proxy, {"world": "gaussian", "seed": seed, "base_accuracy": base_accuracy,
                               "reward_noise": reward_noise})


def hackable_world(prompts: int, samples: int, *, seed: int = 0, base_accuracy: float = 0.3,
                   concentration: float = 4.0, margin: float = 1.0, correct_noise: float = 0.2,
                   wrong_noise: float = 0.6) -> Pool:
    _check(prompts, samples)
    if not 0 < base_accuracy < 1:
        raise ValueError(f"base_accuracy must lie in (0, 1), got {base_accuracy!r}")
    for name, v in (("concentration", concentration), ("correct_noise", correct_noise),
                    ("wrong_noise", wrong_noise)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v!r}")
    rng = np.random.default_rng(seed)
    p = rng.beta(base_accuracy * concentration, (1 - base_accuracy) * concentration, prompts)
    true = (rng.random((prompts, samples)) < p[:, None]).astype(float)
    noise = np.where(true == 1, correct_noise, wrong_noise) * rng.standard_normal((prompts, samples))
    proxy = margin * true + noise
    return _pool(true, proxy, {"world": "hackable", "seed": seed, "base_accuracy": base_accuracy,
                               "concentration": concentration, "margin": margin,
                               "correct_noise": correct_noise, "wrong_noise": wrong_noise})


def _pool(true: np.ndarray, proxy: np.ndarray, params: dict) -> Pool:
    prompts, samples = true.shape
    cols = {
        "prompt_id": np.repeat(np.arange(prompts), samples),
        "sample_id": np.tile(np.arange(samples), prompts),
        "reward:proxy": proxy.ravel(),
        "true_reward": true.ravel(),
    }
    meta = {"task": f"simulated:{params['world']}", "base_model": "simulation",
            "reward_models": ["proxy"], "default_reward": "proxy", "true_reward_source": "grader",
            "sampling": {"prompts": prompts, "samples": samples}, "world": params}
    return Pool(cols, meta)


def simulate(world: str, prompts: int, samples: int, *, seed: int = 0, **options) -> Pool:
    if world == "gaussian":
        return gaussian_world(prompts, samples, seed=seed, **options)
    if world == "hackable":
        return hackable_world(prompts, samples, seed=seed, **options)
    raise ValueError(f"world must be one of {WORLDS}, got {world!r}")
