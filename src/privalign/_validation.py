"""Argument checks shared by every public function.

Errors follow scikit-learn's convention: a ``ValueError`` that names the argument and
shows the offending value, raised before any randomness is drawn or budget is spent.
"""

from __future__ import annotations

import math
import os
import threading
from numbers import Real

import numpy as np


def check_positive(name: str, value, *, allow_inf: bool = False) -> float:
    """Return ``value`` as a float, requiring ``0 < value`` (and finite unless ``allow_inf``)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a positive number, got {value!r}")
    v = float(value)
    if math.isnan(v) or v <= 0 or (math.isinf(v) and not allow_inf):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return v


def check_nonnegative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    v = float(value)
    if v < 0:
        raise ValueError(f"{name} must be non-negative, got {value!r}")
    return v


def check_delta(value, name: str = "delta") -> float:
    """delta must lie in the open interval (0, 1)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise ValueError(f"{name} must be a number in (0, 1), got {value!r}")
    v = float(value)
    if not (0.0 < v < 1.0):
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {value!r}")
    return v


def check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_max_rounds(max_rounds, n: int) -> int:
    """PrivITP's Phase-2 cap T: an integer 1 <= T <= n; ``None`` means T = n (no cap)."""
    if max_rounds is None:
        return n
    if isinstance(max_rounds, bool) or not isinstance(max_rounds, (int, np.integer)) or not 1 <= max_rounds <= n:
        raise ValueError(f"max_rounds must be an integer with 1 <= max_rounds <= n={n}, got {max_rounds!r}")
    return int(max_rounds)


def check_reward_range(reward_range) -> tuple[float, float]:
    try:
        lo, hi = (float(x) for x in reward_range)
    except (TypeError, ValueError):
        raise ValueError(f"reward_range must be a pair (lo, hi), got {reward_range!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo >= hi:
        raise ValueError(f"reward_range must satisfy lo < hi with finite ends, got {reward_range!r}")
    return lo, hi


def check_sensitivity(sensitivity, r_max: float) -> float:
    """``None`` means the assumption-free default: the width of the reward range (SPEC)."""
    if sensitivity is None:
        return r_max
    s = check_positive("sensitivity", sensitivity)
    if s > r_max * (1 + 1e-12):
        raise ValueError(
            f"sensitivity must not exceed the width of reward_range ({r_max!r}); got {sensitivity!r}. "
            "Clipped scores can never move by more than the width."
        )
    return min(s, r_max)


def check_rewards(rewards, name: str = "rewards") -> np.ndarray:
    """A non-empty 1-D float array with finite entries (NaN/inf are errors, never clipped)."""
    r = np.asarray(rewards, dtype=float)
    if r.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of scores, got shape {r.shape}")
    if r.size == 0:
        raise ValueError(f"{name} must hold at least one candidate, got an empty array")
    if not np.isfinite(r).all():
        bad = np.flatnonzero(~np.isfinite(r))[:5].tolist()
        raise ValueError(f"{name} must be finite; NaN or infinite values at positions {bad}")
    return r


def prepare_rewards(rewards, reward_range, name: str = "rewards") -> tuple[np.ndarray, float, int]:
    """Validate, clip to ``[lo, hi]`` and shift to ``[0, R_max]`` with ``R_max = hi - lo``.

    Clipping is post-processing of the reward model's output and leaves the sensitivity
    unchanged; the shift has factor 1, so ``Delta_r`` keeps its value (SPEC, "Setting").
    Returns the shifted scores, R_max and how many scores were clipped.
    """
    lo, hi = check_reward_range(reward_range)
    r = check_rewards(rewards, name)
    n_clipped = 0
    if r.min() < lo or r.max() > hi:
        n_clipped = int(np.count_nonzero((r < lo) | (r > hi)))
        r = np.clip(r, lo, hi)
    return (r - lo if lo != 0 else r), hi - lo, n_clipped


_SECURE = threading.local()


def secure_generator() -> np.random.Generator:
    """The deployment noise source: a numpy ``Generator`` on randomgen's ``AESCounter`` (AES-128 in
    counter mode, a cryptographically secure generator), keyed with 128 bits from ``os.urandom``.
    One per thread, re-keyed after a fork, so no two threads or processes share a stream; unlike
    numpy's PCG64, its future output cannot be predicted from what it has produced."""
    gen = getattr(_SECURE, "gen", None)
    if gen is None or _SECURE.pid != os.getpid():
        from randomgen import AESCounter

        gen = np.random.Generator(AESCounter(key=int.from_bytes(os.urandom(16), "little")))
        _SECURE.gen, _SECURE.pid = gen, os.getpid()
    return gen


def as_generator(rng) -> np.random.Generator:
    """``None`` (the deployment path): the thread's CSPRNG (``secure_generator``). A seeded numpy
    ``Generator`` only when the caller passes one, for reproducible research runs and tests."""
    if rng is None:
        return secure_generator()
    if isinstance(rng, np.random.Generator):
        return rng
    raise ValueError(f"rng must be a numpy.random.Generator or None, got {type(rng).__name__}")
