"""Rounding toward the larger epsilon.

Closed forms are bumped by one ulp; numerically evaluated epsilons (integrals, root finding)
carry a relative error below 1e-12 (checked against 100-digit references in the tests) and are
inflated by ``REL_MARGIN`` so that a reported epsilon is never below the exact one.
"""

from __future__ import annotations

import math

import numpy as np

REL_MARGIN = 1e-9


def ulp_up(x: float) -> float:
    return math.nextafter(float(x), math.inf)


SNAP = 2.0 ** -20


def snap_up(x: float, grid: float = SNAP) -> float:
    """x rounded up to a multiple of ``grid`` (a power of two, so the result is exact). Released
    ex-post costs are snapped: the float noise behind them (PrivITP's lambda~) cannot be read off
    their low bits (Mironov 2012), and the charge never falls below the realised cost."""
    return float(math.ceil(float(x) / grid) * grid)


def margin_up(x):
    """x (1 + REL_MARGIN) for x >= 0, elementwise; exact zeros stay zero."""
    x = np.asarray(x, dtype=float)
    out = x + np.abs(x) * REL_MARGIN
    return float(out) if out.ndim == 0 else out


def smallest_scale(ok, start: float, rel_tol: float = 1e-12, target: str = "the requested privacy") -> float:
    """The smallest scale s > 0 with ok(s), for ok false below a threshold and true above it.

    Brackets the threshold by doubling/halving from ``start``, then bisects in log s; the result
    is returned from above (ok holds there), so a calibrated noise scale is never too small.
    """
    hi = float(start)
    if not (math.isfinite(hi) and hi > 0):
        raise ValueError(f"the search for a noise scale needs a finite positive start, got {start!r}")
    while not ok(hi):
        hi *= 2
        if not math.isfinite(hi):
            raise ValueError(f"no finite noise scale achieves {target}: the scale it needs overflows float64 "
                             "(ask for a larger epsilon or delta)")
    lo = hi / 2
    while ok(lo):
        hi, lo = lo, lo / 2
        if lo < 1e-300:
            return hi
    while hi - lo > rel_tol * hi:
        mid = math.sqrt(lo * hi)
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi
