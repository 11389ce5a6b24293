"""Naming persons: the ids that say whose rows are whose, checked before anything reads the rows."""

from __future__ import annotations

import hashlib

import numpy as np


def person_ids(values, what: str = "prompt_id") -> np.ndarray:
    """The ids as a str array, or a one-line ValueError naming the first row whose id is missing,
    empty or not a string (a number would silently become another person's id)."""
    values = list(values)
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise ValueError(f"{what} of row {i} must be a non-empty string (it names a person), got "
                             f"{type(v).__name__} {v!r}")
        if not v.strip():
            raise ValueError(f"{what} of row {i} is empty: every row must name its person")
    return np.asarray(values, str)


def roster_digest(ids) -> str:
    """BLAKE2b (16 bytes) of the sorted distinct ids, one per line: names the roster without listing it."""
    return hashlib.blake2b("\n".join(sorted(set(map(str, ids)))).encode(), digest_size=16).hexdigest()
