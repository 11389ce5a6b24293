"""How many queries one budget serves, and at what epsilon per query (``privalign plan``).

For a budget (epsilon_total, delta_total) and one mechanism repeated:

* basic: floor(epsilon_total / epsilon) queries (PrivITP also floor(delta_total / delta));
* FSRC: the same for PrivBoN (its epsilon is fixed, there is no ex-post saving); for PrivITP at
  least the basic count, more when realised costs fall below the worst case (``evaluation``'s
  stream experiment measures it on a pool);
* zcdp: floor(rho_total / rho), rho_total = ``zcdp_rho_total``; the Gaussian mechanism's exact
  profile bounds what any zCDP accountant could admit (``gaussian_profile_rho``).

At epsilon 1 per query and a small total, zcdp can admit fewer queries than basic: the conversion
costs about 2 sqrt(rho log(1/delta)) on top of rho, which only the sqrt(k) growth of many small
queries repays. ``plan_counts`` shows both, so the choice is the operator's.
"""

from __future__ import annotations

import math

from .calibration import privbon_noise_scale, privitp_noise_scales
from .events import PrivacyEvent, privbon_event, privitp_event
from .zcdp import gaussian_profile_rho, zcdp_rho_total

MECHANISMS = ("privbon", "privbon-gaussian", "privitp")


def query_event(mechanism: str, epsilon: float, *, n: int = 16, sensitivity: float = 0.01, beta: float = 0.05,
                delta: float = 1e-8, phase1_fraction: float = 0.5) -> PrivacyEvent:
    """The event of one query at ``epsilon`` per query (its worst case), on the [0, 1] scale with
    Delta_r = ``sensitivity``: Gumbel or Gaussian PrivBoN, or PrivITP calibrated to ``epsilon``."""
    if mechanism == "privbon":
        return privbon_event(privbon_noise_scale(epsilon, sensitivity), sensitivity)
    if mechanism == "privbon-gaussian":
        sigma = privbon_noise_scale(epsilon, sensitivity, noise="gaussian", n=n, r_max=1.0)
        return privbon_event(sigma, sensitivity, noise="gaussian", n=n)
    if mechanism == "privitp":
        sx, sz = privitp_noise_scales(epsilon, delta, n, beta, sensitivity, 1.0, phase1_fraction=phase1_fraction)
        return privitp_event(n, beta, sx, sz, delta, sensitivity, 1.0)
    raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")


def plan_counts(epsilon_total: float, delta_total: float, event: PrivacyEvent) -> dict:
    """Queries of ``event`` that each composition admits within (epsilon_total, delta_total)."""
    basic = math.floor(epsilon_total / event.epsilon) if event.epsilon > 0 else math.inf
    if event.delta > 0:
        basic = min(basic, math.floor(delta_total / event.delta))
    out = {"basic": basic, "fsrc": basic, "fsrc_note": "" if event.mechanism == "privitp" else "no ex-post saving"}
    if event.mechanism == "privitp":
        out["fsrc_note"] = "at least this; more as realised costs fall below the worst case"
    if delta_total > 0 and event.rho is not None and event.rho > 0:
        out["zcdp"] = math.floor(zcdp_rho_total(epsilon_total, delta_total) / event.rho)
        out["zcdp_limit"] = math.floor(gaussian_profile_rho(epsilon_total, delta_total) / event.rho)
    else:
        out["zcdp"] = out["zcdp_limit"] = None
    return out


def plan_epsilons(epsilon_total: float, delta_total: float, queries: int, mechanism: str, **kw) -> dict:
    """The largest epsilon per query (its worst case) at which each composition admits ``queries``
    queries of ``mechanism`` (``kw`` as ``query_event``)."""
    if queries < 1:
        raise ValueError(f"queries must be >= 1, got {queries!r}")
    out = {"basic": epsilon_total / queries}
    if mechanism == "privitp":
        d = kw.get("delta", 1e-8)
        if d * queries > delta_total:
            out["basic"] = None  # the deltas alone do not fit
    if delta_total <= 0:
        out["zcdp"] = None
        return out
    rho_total = zcdp_rho_total(epsilon_total, delta_total)
    if mechanism == "privbon":
        out["zcdp"] = math.sqrt(8 * rho_total / queries)
    elif mechanism == "privbon-gaussian":
        out["zcdp"] = math.sqrt(2 * rho_total / queries)
    else:
        out["zcdp"] = _largest(lambda e: query_event(mechanism, e, **kw).rho * queries <= rho_total,
                               hi=max(out["basic"] or 0.0, 1.0) * 10)
    out["fsrc"] = out["basic"]
    return out


def _largest(ok, hi: float, lo: float = 1e-6, steps: int = 20) -> float | None:
    """The largest x in [lo, hi] with ok(x) (ok monotone decreasing), by bisection from below."""
    def safe(x):
        try:
            return ok(x)
        except ValueError:  # this epsilon cannot be reached (e.g. PrivITP's phase split)
            return False

    if not safe(lo):
        return None
    if safe(hi):
        return hi
    for _ in range(steps):
        mid = math.sqrt(lo * hi)
        if safe(mid):
            lo = mid
        else:
            hi = mid
    return lo
