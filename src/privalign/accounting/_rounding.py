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


def margin_up(x):
    """x (1 + REL_MARGIN) for x >= 0, elementwise; exact zeros stay zero."""
    x = np.asarray(x, dtype=float)
    out = x + np.abs(x) * REL_MARGIN
    return float(out) if out.ndim == 0 else out
