"""privalign.accounting: exact privacy accounting for private Best-of-N selection.

Pure functions (numpy/scipy only) plus one stateful object, ``PrivacyFilter``. Every epsilon is
rounded toward the larger value: the accountant never under-reports.
"""

from .calibration import check_temperature, paper_noise_split, privbon_noise_scale, privitp_noise_scales
from .events import PrivacyEvent, account, privbon_event, privitp_event, pure_event
from .filter import (
    COMPOSITIONS,
    BudgetExceededError,
    BudgetOverrunError,
    Charge,
    Privacy,
    PrivacyFilter,
    Reservation,
    admits,
    admits_rho,
    budget_rho_total,
    charge_amount,
    charge_rho,
    query_rho,
)
from .gaussian import (
    gaussian_mechanism_epsilon,
    gaussian_mechanism_noise_scale,
    gaussian_rnm_epsilon,
    gaussian_rnm_noise_scale,
)
from .gumbel import gumbel_epsilon, gumbel_noise_scale
from .privitp import (
    default_truncation,
    itp_lambda,
    privitp_epsilon2,
    privitp_epsilon2_max,
    privitp_epsilon_max,
    privitp_phase2_terms,
    privitp_rho,
)
from .zcdp import (
    bounded_range_rho,
    gaussian_profile_epsilon,
    gaussian_profile_rho,
    gaussian_rho,
    pure_dp_rho,
    zcdp_epsilon,
    zcdp_rho_total,
)

__all__ = [
    "COMPOSITIONS", "BudgetExceededError", "BudgetOverrunError", "Privacy", "PrivacyFilter", "Reservation", "admits",
    "charge_amount", "check_temperature", "default_truncation", "gaussian_mechanism_epsilon",
    "gaussian_mechanism_noise_scale", "gaussian_rnm_epsilon", "gaussian_rnm_noise_scale",
    "gumbel_epsilon", "gumbel_noise_scale", "itp_lambda", "paper_noise_split",
    "privbon_noise_scale", "privitp_epsilon2", "privitp_epsilon_max", "privitp_noise_scales",
    "privitp_phase2_terms", "privitp_epsilon2_max", "privitp_rho", "Charge", "PrivacyEvent", "account",
    "privbon_event", "privitp_event", "pure_event", "admits_rho", "budget_rho_total", "charge_rho", "query_rho",
    "bounded_range_rho", "gaussian_profile_epsilon", "gaussian_profile_rho", "gaussian_rho", "pure_dp_rho",
    "zcdp_epsilon", "zcdp_rho_total",
]
