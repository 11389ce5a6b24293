"""privalign: differentially private inference-time alignment.

Select among LLM responses with a reward model trained on private preference data, without
leaking that data: PrivBoN (Gumbel or Gaussian noise) and PrivITP (chi^2-pessimistic rejection
sampling with an ex-post privacy cost), with an exact accountant and a privacy filter.

>>> import numpy as np, privalign
>>> rng = np.random.default_rng(0)
>>> sel = privalign.privbon([0.2, 0.9, 0.4], epsilon=1.0, rng=rng)
>>> sel.epsilon <= 1.0 + 1e-12
True
"""

from . import accounting, theory
from .accounting import BudgetExceededError, PrivacyFilter
from .mechanisms import Selection, bon, itp, privbon, privitp

__version__ = "0.1.0"

__all__ = [
    "BudgetExceededError", "PrivacyFilter", "Selection", "__version__", "accounting", "bon", "itp",
    "privbon", "privitp", "theory",
]
