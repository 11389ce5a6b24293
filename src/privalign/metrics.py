"""Shared numerics of selection, used by the experiments and by reward-model training alike (layer 1:
numpy and scipy only)."""

from __future__ import annotations

import math

import numpy as np
from scipy import special


def softmax_rows(x: np.ndarray, sigma: float) -> np.ndarray:
    """PrivBoN with Gumbel noise: softmax(x / sigma) per row (Prop. 3.2)."""
    return special.softmax(x / sigma, axis=1)


def within_prompt_auc(scores, correct, prompt_ids) -> float:
    """Pairwise AUC within prompts: P(score(correct) > score(incorrect)) (+ ties/2) over all
    (correct, incorrect) pairs of the same prompt, pooled; what selection among one prompt's
    candidates can use."""
    from scipy.stats import rankdata

    pid = np.asarray(prompt_ids, str)
    y = np.asarray(correct, float) >= 0.5
    s = np.asarray(scores, float)
    order = np.argsort(pid, kind="stable")
    pid, y, s = pid[order], y[order], s[order]
    starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
    num = den = 0.0
    for a, b in zip(starts, np.r_[starts[1:], pid.size]):
        yy = y[a:b]
        n1, n0 = int(yy.sum()), int((~yy).sum())
        if n1 == 0 or n0 == 0:
            continue
        num += rankdata(s[a:b])[yy].sum() - n1 * (n1 + 1) / 2
        den += n1 * n0
    return num / den if den else math.nan
