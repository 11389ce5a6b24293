"""Selection mechanisms: BoN, PrivBoN (Alg. 1), ITP (Huang et al. 2025) and PrivITP (Alg. 2)."""

from .bon import bon, privbon, soft_bon
from .itp import itp, privitp
from .selection import Selection

__all__ = ["Selection", "bon", "itp", "privbon", "privitp", "soft_bon"]
