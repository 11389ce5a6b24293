"""Immutable privacy events: what one query costs, with its mechanism and parameters.

Modelled on Google's dp-accounting ``dp_event``: an event describes the mechanism that ran, not a
running total, so a budget's history can be re-accounted later under another composition
(``account``, ``privalign ledger account``). Each event carries its cost under every composition
privalign offers: ``epsilon`` (the pure or worst-case epsilon, with ``delta``: basic composition
and FSRC's reservation) and ``rho`` (zCDP; ``accounting.zcdp`` gives each mechanism's proof).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .._validation import check_nonnegative
from .gaussian import gaussian_rnm_epsilon
from .gumbel import gumbel_epsilon
from .privitp import privitp_epsilon_max, privitp_rho
from .zcdp import bounded_range_rho, check_rho, pure_dp_rho, zcdp_epsilon


@dataclass(frozen=True)
class PrivacyEvent:
    """One query's cost. ``epsilon`` with ``delta``: its (worst-case) approximate-DP cost; ``rho``: its
    zCDP cost (``None`` when the mechanism has no zCDP bound); ``params``: the mechanism's settings
    as (name, value) pairs, enough to recompute both."""

    mechanism: str
    epsilon: float
    delta: float = 0.0
    rho: float | None = None
    params: tuple[tuple[str, float], ...] = field(default=())

    def __post_init__(self):
        check_nonnegative("epsilon", self.epsilon)
        if not 0 <= check_nonnegative("delta", self.delta) < 1:
            raise ValueError(f"delta must lie in [0, 1), got {self.delta!r}")
        if self.rho is not None:
            check_rho(self.rho)

    def to_json(self) -> str:
        return json.dumps(dict(self.params), sort_keys=True)

    @classmethod
    def from_record(cls, mechanism: str | None, epsilon: float, delta: float, rho: float | None,
                    params: str | None) -> "PrivacyEvent":
        return cls(mechanism or "unknown", float(epsilon), float(delta), None if rho is None else float(rho),
                   tuple(sorted(json.loads(params or "{}").items())))


def _params(**kw) -> tuple[tuple[str, float], ...]:
    return tuple(sorted((k, v) for k, v in kw.items() if v is not None))


def pure_event(epsilon: float, mechanism: str = "pure") -> PrivacyEvent:
    """Any pure epsilon-DP mechanism: rho = epsilon^2 / 2."""
    eps = check_nonnegative("epsilon", epsilon)
    return PrivacyEvent(mechanism, eps, 0.0, pure_dp_rho(eps) if eps > 0 else 0.0, _params(epsilon=eps))


def privbon_event(noise_scale: float, sensitivity: float, *, noise: str = "gumbel", n: int | None = None,
                  r_max: float | None = None) -> PrivacyEvent:
    """PrivBoN at ``noise_scale``: Gumbel is epsilon-bounded-range (rho = epsilon^2 / 8); Gaussian
    noise and OpenDP's exact path are pure epsilon-DP (rho = epsilon^2 / 2).

    Gaussian noise's epsilon depends on n and on the reward range's width r_max (scores on
    [0, r_max]; App. E): both are required, never assumed (a range of 7.44 taken for 1 under-charges
    rho about 9x). Gumbel and exact noise do not use them."""
    if noise == "gaussian":
        if n is None or r_max is None:
            raise ValueError(f"noise='gaussian' needs n and r_max (the reward range's width): its epsilon depends on "
                             f"both (App. E), got n={n!r}, r_max={r_max!r}")
        eps = gaussian_rnm_epsilon(noise_scale, sensitivity, r_max, n)
        rho = pure_dp_rho(eps)
    elif noise in ("gumbel", "exact"):
        eps = gumbel_epsilon(noise_scale, sensitivity)
        rho = bounded_range_rho(eps) if noise == "gumbel" else pure_dp_rho(eps)
    else:
        raise ValueError(f"noise must be 'gumbel', 'gaussian' or 'exact', got {noise!r}")
    return PrivacyEvent(f"privbon-{noise}", eps, 0.0, rho,
                        _params(noise_scale=noise_scale, sensitivity=sensitivity, n=n, r_max=r_max))


def privitp_event(n: int, beta: float, sigma_x: float, sigma_z: float, delta: float, sensitivity: float,
                  r_max: float, truncation: float | None = None, max_rounds: int | None = None) -> PrivacyEvent:
    """PrivITP with T = ``max_rounds`` Phase-2 rounds (default n): its worst case epsilon_max with
    delta (Phase 1 analytic Gaussian), and rho = Phase 1's Gaussian rho plus Phase 2's pure worst
    case squared over two (``privitp_rho``)."""
    eps = privitp_epsilon_max(n, beta, sigma_x, sigma_z, delta, sensitivity, r_max, truncation,
                              max_rounds=max_rounds)
    rho = (privitp_rho(n, beta, sigma_x, sigma_z, sensitivity, r_max, truncation, max_rounds)
           if math.isfinite(eps) else math.inf)
    return PrivacyEvent("privitp", eps, delta, rho if math.isfinite(rho) else None,
                        _params(n=n, beta=beta, sigma_x=sigma_x, sigma_z=sigma_z, delta=delta,
                                sensitivity=sensitivity, r_max=r_max, truncation=truncation,
                                max_rounds=max_rounds))


def account(charges, composition: str, delta_total: float | None = None) -> dict:
    """What a list of settled charges costs under ``composition``.

    ``charges``: (event, realised epsilon or None for a worst-case settlement) pairs. Basic: the sum
    of worst cases; FSRC: the sum of realised (else worst-case) epsilons; zCDP: the sum of rho's,
    converted at ``delta_total`` (events without a rho make it unknown). Deltas add (not under zCDP,
    whose only delta is the conversion's)."""
    charges = list(charges)
    if composition == "basic":
        return {"epsilon": math.fsum(max(e.epsilon, r or 0.0) for e, r in charges),
                "delta": math.fsum(e.delta for e, _ in charges), "rho": None, "queries": len(charges)}
    if composition == "fsrc":
        return {"epsilon": math.fsum(e.epsilon if r is None else r for e, r in charges),
                "delta": math.fsum(e.delta for e, _ in charges), "rho": None, "queries": len(charges)}
    if composition == "zcdp":
        missing = sum(e.rho is None for e, _ in charges)
        if missing:
            return {"epsilon": None, "delta": delta_total, "rho": None, "queries": len(charges),
                    "missing_rho": missing}
        rho = math.fsum(e.rho for e, _ in charges)
        return {"epsilon": zcdp_epsilon(rho, delta_total) if delta_total else None, "delta": delta_total,
                "rho": rho, "queries": len(charges)}
    raise ValueError(f"composition must be one of ('fsrc', 'basic', 'zcdp'), got {composition!r}")
