"""The accuracy side of ``privalign plan``: what a per-query epsilon buys on a real pool.

Accuracy of one private method at n candidates and a given epsilon per query, on every prompt of
a pool, by the harness's exact selection laws (``evaluation.private``). ``pairs = m`` rescales the
certified sensitivity as a head trained on m pairs would have it, Delta_r(m) = Delta_r(m0) m0 / m
(the certificate 4k/(m lambda) at the same lambda, its g_tol term ignored), keeping the pool's
scores and declared range: an estimate of how much preference data a target needs.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..pools import Pool
from .harness import EvalSettings
from .private import _accuracy, calibrate, sensitivity_of
from .reward_info import declared_reward


def plan_base(pool: Pool, reward: str | None = None, pairs: int | None = None, delta: float = 1e-8,
              beta: float = 0.05, max_rounds: int | None = None) -> tuple[EvalSettings, dict]:
    """Settings for the pool's certified reward model (its declared range and Delta_r), rescaled to
    ``pairs``, PrivITP capped at ``max_rounds``; returns (settings, a description of the model)."""
    s = declared_reward(pool, EvalSettings(reward=reward, delta=delta, beta=beta, max_rounds=max_rounds))
    if s.sensitivity is None:
        raise ValueError(f"the pool records no certified sensitivity for reward {s.reward!r}: plan needs a certified "
                         "reward model (policy-bt, minilm-bt)")
    info = pool.metadata["reward_model_info"][s.reward]
    m0 = (info.get("certificate") or {}).get("m")
    desc = {"reward": s.reward, "m": m0, "sensitivity": s.sensitivity}
    if pairs is not None:
        if pairs < 1 or not m0:
            raise ValueError(f"pairs must be >= 1 and the model must record its m, got pairs={pairs!r}, m={m0!r}")
        s = replace(s, sensitivity=min(1.0, s.sensitivity * m0 / pairs))
        desc.update(m=pairs, sensitivity=s.sensitivity, rescaled_from=m0)
    return s, desc


def accuracy_at(pool: Pool, base: EvalSettings, mechanism: str, epsilon: float | None, n: int = 16,
                phase1_fraction: float = 0.5) -> float | None:
    """Mean accuracy of ``mechanism`` at ``epsilon`` per query and n candidates (None: not reachable)."""
    if epsilon is None or not math.isfinite(epsilon) or epsilon <= 0:
        return None
    grouped = pool.grouped(base.reward)
    try:
        s = calibrate(base, mechanism, epsilon, n, base.beta, phase1_fraction)
    except ValueError:
        return None
    return _accuracy(grouped, s)[0]


def reference_accuracies(pool: Pool, base: EvalSettings, n: int = 16) -> dict:
    """BoN at n and the base policy (n = 1), for scale."""
    grouped = pool.grouped(base.reward)
    bon = _accuracy(grouped, replace(base, algorithms=("bon",), n_grid=(n,)))
    return {"bon": bon[0], "base": float(bon[2].mean()), "sensitivity": sensitivity_of(base)}
