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
              beta: float = 0.05, max_rounds: int | None = None,
              pairs_per_person: int | None = None) -> tuple[EvalSettings, dict]:
    """Settings for the pool's certified reward model (its declared range and Delta_r), rescaled to
    ``pairs`` = m' (default its own m) with ``pairs_per_person`` = k' (default its own k): Delta_r
    scales as k' m / (k m'), from Delta_r = 4k/(m lambda). PrivITP capped at ``max_rounds``; returns
    (settings, a description of the model)."""
    s = declared_reward(pool, EvalSettings(reward=reward, delta=delta, beta=beta, max_rounds=max_rounds))
    if s.sensitivity is None:
        name = s.reward or pool.metadata.get("default_reward") or (pool.reward_names or ["(none)"])[0]
        raise ValueError(f"the pool records no certified sensitivity for reward {name!r}: plan needs a certified "
                         "reward model (policy-bt, minilm-bt)")
    info = pool.metadata["reward_model_info"][s.reward]
    m0 = (info.get("certificate") or {}).get("m")
    k0 = int((info.get("certificate") or {}).get("pairs_per_person") or 1)
    desc = {"reward": s.reward, "m": m0, "sensitivity": s.sensitivity, "pairs_per_person": k0}
    if pairs is not None or pairs_per_person is not None:
        m1 = m0 if pairs is None else pairs
        k1 = k0 if pairs_per_person is None else pairs_per_person
        if not m0 or m1 < 1 or k1 < 1:
            raise ValueError(f"pairs and pairs_per_person must be >= 1 and the model must record its m, got "
                             f"pairs={pairs!r}, pairs_per_person={pairs_per_person!r}, m={m0!r}")
        s = replace(s, sensitivity=min(1.0, s.sensitivity * (m0 / m1) * (k1 / k0)))
        desc.update(m=m1, pairs_per_person=k1, sensitivity=s.sensitivity, rescaled_from=m0)
    return s, desc


def accuracy_at(pool: Pool, base: EvalSettings, mechanism: str, epsilon: float | None, n: int = 16,
                phase1_fraction: float = 0.5) -> float | None:
    """Mean accuracy of ``mechanism`` at ``epsilon`` per query and n candidates (None: not reachable)."""
    if epsilon is None or not math.isfinite(epsilon) or epsilon <= 0:
        return None
    grouped = pool.grouped(base.reward)
    try:
        s = calibrate(base, mechanism, epsilon, n, base.beta, phase1_fraction, temperature=base.temperature)
    except ValueError:
        return None
    return _accuracy(grouped, s)[0]


def reference_accuracies(pool: Pool, base: EvalSettings, n: int = 16) -> dict:
    """BoN at n and the base policy (n = 1), for scale."""
    grouped = pool.grouped(base.reward)
    bon = _accuracy(grouped, replace(base, algorithms=("bon",), n_grid=(n,)))
    return {"bon": bon[0], "base": float(bon[2].mean()), "sensitivity": sensitivity_of(base)}
