"""Splits and subsamples of public ids (prompts, persons), by a keyed hash of each id.

A permutation of the sorted ids moves every id when one is added or removed; a keyed hash does not:
each id's side depends on (seed, id) alone. The ids are public inputs (the certificate names them),
so a split on them reads nothing private.
"""

from __future__ import annotations

import numpy as np

from .streams import SPLIT, SUBSAMPLE, keyed_unit


def split_ids(ids, fraction: float, seed: int = 0) -> tuple[set, set]:
    """(first, second): an id goes to ``first`` when its keyed hash u(seed, id) < ``fraction``.

    Stable: adding or removing an id moves no other id. The sizes are binomial around ``fraction``
    of the ids; where one side would be empty (few ids) it is a one-line error, not a rule that would
    move one id by looking at the others."""
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must lie in (0, 1), got {fraction!r}")
    ids = np.unique(np.asarray(list(ids), str))
    if ids.size < 2:
        raise ValueError(f"a split needs at least 2 distinct ids, got {ids.size}")
    u = keyed_unit(seed, SPLIT, ids.tolist())
    first = u < fraction
    if first.all() or not first.any():
        raise ValueError(f"the keyed split of {ids.size} ids at fraction {fraction:g} (seed {seed}) left one side "
                         "empty: give more prompts (or persons), or another seed")
    return set(ids[first].tolist()), set(ids[~first].tolist())


def subsample_ids(ids, size: int, seed: int = 0) -> list:
    """The ``size`` ids of smallest keyed hash u(seed, id), sorted: a seeded subsample in which an id's
    membership depends on its own u and on the others' only through the ids themselves (public)."""
    ids = np.unique(np.asarray(list(ids), str))
    if size >= ids.size:
        return ids.tolist()
    u = keyed_unit(seed, SUBSAMPLE, ids.tolist())
    return sorted(ids[np.argsort(u, kind="stable")[:size]].tolist())
