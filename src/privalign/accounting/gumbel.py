"""PrivBoN with Gumbel noise = the exponential mechanism (paper Thm 3.1, Alg. 1).

epsilon = 2 Delta_r / sigma  and  sigma = 2 Delta_r / epsilon.
"""

from __future__ import annotations

import math

from .._validation import check_positive
from ._rounding import ulp_up


def gumbel_epsilon(noise_scale: float, sensitivity: float) -> float:
    """Pure epsilon of Gumbel-max selection with scale ``noise_scale``: 2 Delta_r / sigma (Thm 3.1)."""
    sigma = check_positive("noise_scale", noise_scale)
    delta_r = check_positive("sensitivity", sensitivity)
    return ulp_up(2.0 * delta_r / sigma)


def gumbel_noise_scale(epsilon: float, sensitivity: float) -> float:
    """Gumbel scale that gives pure ``epsilon``: sigma = 2 Delta_r / epsilon (rounded up)."""
    eps = check_positive("epsilon", epsilon)
    delta_r = check_positive("sensitivity", sensitivity)
    sigma = ulp_up(2.0 * delta_r / eps)
    if not math.isfinite(sigma):
        raise ValueError(f"epsilon={epsilon!r} is too small for sensitivity={sensitivity!r}: the noise scale "
                         "2 Delta_r / epsilon overflows float64")
    return sigma
