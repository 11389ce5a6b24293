"""Preference pairs from graded samples: a correct answer preferred over an incorrect one.

Each prompt's pairs are drawn from that prompt's rows only, with the stream of (seed, owner), the
owner being the person the prompt belongs to (the prompt itself, for privalign's own pools): one
person's grades or samples never move the pairs drawn for anyone else.
"""

from __future__ import annotations

import numpy as np

from .streams import PAIRS, person_rng


def preference_rows(prompt_ids, correct, prompts, pairs_per_prompt: int, seed: int = 0, owner=None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (chosen, rejected): for each prompt in ``prompts`` with correct and incorrect
    samples, up to ``pairs_per_prompt`` distinct (correct, incorrect) pairs drawn at random with the
    stream of (seed, ``owner(prompt)``) (default: the prompt id), in the prompts' sorted order."""
    pid = np.asarray(prompt_ids, str)
    good = np.asarray(correct, float) >= 0.5
    chosen, rejected = [], []
    for p in sorted(prompts):
        rows = np.flatnonzero(pid == p)
        c, w = rows[good[rows]], rows[~good[rows]]
        if c.size == 0 or w.size == 0:
            continue
        rng = person_rng(seed, PAIRS, str(p if owner is None else owner(p)))
        pick = rng.choice(c.size * w.size, size=min(pairs_per_prompt, c.size * w.size), replace=False)
        chosen += c[pick // w.size].tolist()
        rejected += w[pick % w.size].tolist()
    return np.array(chosen, int), np.array(rejected, int)
