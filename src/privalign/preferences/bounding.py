"""Contribution bounding, a stage of its own before anything aggregates (PipelineDP's order).

Each person keeps at most k of their pairs: a uniform choice made with that person's own stream
(``streams.person_rng(seed, BOUND, person)``) from that person's pairs alone. Another person's data
never moves it. How many pairs were dropped reads D: it goes to the private report only.
"""

from __future__ import annotations

import numpy as np

from .streams import BOUND, person_rng


def bound_per_person(person, k: int, seed: int = 0) -> np.ndarray:
    """Indices that keep at most ``k`` pairs of each person, in the input order: a person with more
    than k pairs keeps a uniform choice of k, drawn from the stream of (seed, person id)."""
    if k < 1:
        raise ValueError(f"k (pairs per person) must be >= 1, got {k!r}")
    person = np.asarray(person).astype(str)
    order = np.argsort(person, kind="stable")  # each person's rows together, in the input order
    ids, counts = np.unique(person[order], return_counts=True)
    starts, over = np.cumsum(counts) - counts, counts > k
    keep = [order[~np.repeat(over, counts)]]
    for p, lo, c in zip(ids[over], starts[over], counts[over]):
        keep.append(person_rng(seed, BOUND, p).choice(order[lo:lo + c], k, replace=False))
    return np.sort(np.concatenate(keep))
