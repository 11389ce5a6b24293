"""Randomness keyed by public ids: a stream of one's own for each person, and a keyed hash for splits.

numpy's ``SeedSequence`` takes a list of 32-bit words. ``id_words`` turns a person or prompt id
(any string) into four such words with BLAKE2b, so that ``person_rng(seed, purpose, person)`` is a
generator that depends on (seed, purpose, person id) and on nothing else: how many draws another
person used, whether another person exists, or the order in which persons are visited cannot move it.
``keyed_unit(seed, purpose, ids)`` maps each id to a uniform number in [0, 1) the same way; a split
or a subsample that thresholds it (or keeps the smallest) is stable: adding or removing one id moves
no other id across it.
"""

from __future__ import annotations

import hashlib

import numpy as np

# the purposes: one per random choice, so that two choices on the same person never share draws
PAIRS, BOUND, SUBSAMPLE, SPLIT = 11, 13, 17, 19


def id_words(key: str) -> list[int]:
    """Four 32-bit words of BLAKE2b(key): a stable, well-mixed digest of an id (the id as a UTF-8 str)."""
    if not isinstance(key, str):
        raise TypeError(f"an id must be a str, got {type(key).__name__} {key!r}")
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=16).digest()
    return [int.from_bytes(digest[i:i + 4], "little") for i in range(0, 16, 4)]


def person_rng(seed: int, purpose: int, person: str) -> np.random.Generator:
    """The generator of one person for one purpose: seeded by (seed, purpose, person id) only."""
    return np.random.default_rng([int(seed), int(purpose), *id_words(str(person))])


def keyed_unit(seed: int, purpose: int, ids) -> np.ndarray:
    """A uniform number in [0, 1) for each id, from a keyed hash of (seed, purpose, id): independent
    of every other id (so a threshold or an ordering on it is stable under adding or removing ids)."""
    out = np.empty(len(ids))
    key = f"{int(seed)}:{int(purpose)}:".encode()
    for i, x in enumerate(ids):
        digest = hashlib.blake2b(key + str(x).encode("utf-8"), digest_size=8).digest()
        out[i] = (int.from_bytes(digest, "little") >> 11) / float(1 << 53)
    return out
