"""Reward models: a declared output range, optional certified sensitivity, batched scoring.

``score_checked`` is how privalign calls every reward model: NaN or infinite scores are an error,
scores outside the declared range are clipped and counted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


class RewardModel:
    name: str = "reward"
    output_range: tuple[float, float] = (-math.inf, math.inf)
    sensitivity: float | None = None  # certified Delta_r in score units, when known

    def score(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
        raise NotImplementedError


@dataclass
class Scored:
    scores: np.ndarray
    n_clipped: int


def score_checked(model: RewardModel, prompts: Sequence[str], responses: Sequence[str]) -> Scored:
    if len(prompts) != len(responses):
        raise ValueError(f"prompts and responses must have the same length, got {len(prompts)} and {len(responses)}")
    s = np.asarray(model.score(list(prompts), list(responses)), dtype=float)
    if s.shape != (len(prompts),):
        raise ValueError(f"reward model {model.name!r} returned shape {s.shape}, expected ({len(prompts)},)")
    bad = np.flatnonzero(~np.isfinite(s))
    if bad.size:
        raise ValueError(f"reward model {model.name!r} returned NaN or infinite scores at positions {bad[:10].tolist()}")
    lo, hi = model.output_range
    n_clipped = int(np.count_nonzero((s < lo) | (s > hi)))
    return Scored(np.clip(s, lo, hi), n_clipped)


class CallableReward(RewardModel):
    """Any Python function f(prompts, responses) -> scores, with a declared output range."""

    def __init__(self, fn: Callable, output_range: tuple[float, float], name: str = "callable",
                 sensitivity: float | None = None):
        lo, hi = output_range
        if not lo < hi:
            raise ValueError(f"output_range must satisfy lo < hi, got {output_range!r}")
        self.fn, self.output_range, self.name, self.sensitivity = fn, (float(lo), float(hi)), name, sensitivity

    def score(self, prompts, responses):
        return self.fn(prompts, responses)


class HTTPReward(RewardModel):
    """A scoring endpoint: POST {"prompts": [...], "responses": [...]} -> {"scores": [...]}."""

    def __init__(self, url: str, output_range: tuple[float, float], name: str = "http", timeout: float = 300.0,
                 api_key: str | None = None):
        self.url, self.output_range, self.name, self.timeout, self.api_key = url, output_range, name, timeout, api_key

    def score(self, prompts, responses):
        import json
        import urllib.request

        req = urllib.request.Request(self.url, data=json.dumps({"prompts": prompts, "responses": responses}).encode(),
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return json.loads(r.read())["scores"]
