"""How many queries one budget serves, and at what epsilon per query (``privalign plan``).

For a budget (epsilon_total, delta_total) and one mechanism repeated:

* basic: floor(epsilon_total / epsilon) queries (PrivITP also floor(delta_total / delta)); with a
  noise floor tau, PrivBoN's queries are counted at the epsilon they spend, 2 Delta_r / sigma;
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
from .filter import BudgetExceededError, PrivacyFilter
from .zcdp import gaussian_profile_rho, zcdp_rho_total

MECHANISMS = ("privbon", "privbon-gaussian", "privitp")


def query_event(mechanism: str, epsilon: float, *, n: int = 16, sensitivity: float = 0.01, beta: float = 0.05,
                delta: float = 1e-8, phase1_fraction: float = 0.5, max_rounds: int | None = None,
                temperature: float = 0.0) -> PrivacyEvent:
    """The event of one query at ``epsilon`` per query (its worst case), on the [0, 1] scale with
    Delta_r = ``sensitivity``: Gumbel or Gaussian PrivBoN, or PrivITP calibrated to ``epsilon`` with
    Phase 2 capped at T = min(``max_rounds``, n) rounds (None: T = n). PrivBoN's noise is floored at
    ``temperature``: the event is then the epsilon the query spends, below ``epsilon``."""
    if mechanism == "privbon":
        return privbon_event(privbon_noise_scale(epsilon, sensitivity, temperature=temperature), sensitivity)
    if mechanism == "privbon-gaussian":
        sigma = privbon_noise_scale(epsilon, sensitivity, noise="gaussian", n=n, r_max=1.0, temperature=temperature)
        return privbon_event(sigma, sensitivity, noise="gaussian", n=n, r_max=1.0)
    if temperature:
        raise ValueError(f"a noise floor (temperature) applies to privbon and privbon-gaussian, not {mechanism!r}")
    if mechanism == "privitp":
        T = None if max_rounds is None else min(max_rounds, n)
        sx, sz = privitp_noise_scales(epsilon, delta, n, beta, sensitivity, 1.0, phase1_fraction=phase1_fraction,
                                      max_rounds=T)
        return privitp_event(n, beta, sx, sz, delta, sensitivity, 1.0, max_rounds=T)
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


def admitted(epsilon_total: float, delta_total: float, composition: str, event: PrivacyEvent, cap: int) -> int:
    """How many queries of ``event`` the real ``PrivacyFilter`` admits, one after another, each
    settled at its worst case (so its own rounding and summation order apply), counting up to ``cap``."""
    f = PrivacyFilter(epsilon_total, delta_total, composition)
    for k in range(cap):
        try:
            f.settle(f.reserve(event=event))
        except BudgetExceededError:
            return k
    return cap


def plan_epsilons(epsilon_total: float, delta_total: float, queries: int, mechanism: str, **kw) -> dict:
    """The largest epsilon per query (the one a request asks for, ``query_event``'s argument) at
    which each composition's filter admits exactly ``queries`` queries of ``mechanism`` (``kw`` as
    ``query_event``); None where no epsilon does.

    The rule is the real filter's, rounding margins included: each candidate epsilon is checked by
    running up to ``queries + 1`` queries through a ``PrivacyFilter`` (``admitted``). The closed forms
    (epsilon_total / Q; sqrt(8 rho_total / Q) for Gumbel under zcdp) only start the search. The value
    returned is the exact threshold rounded down to 6 significant digits (more where 6 cannot tell Q
    from Q + 1), so the printed number, pasted into a request or a config, admits exactly Q."""
    if isinstance(queries, bool) or not isinstance(queries, int) or queries < 1:
        raise ValueError(f"queries must be an integer >= 1, got {queries!r}")

    def count(composition):
        def k(eps):
            try:
                event = query_event(mechanism, eps, **kw)
            except ValueError:  # this epsilon cannot be reached (e.g. PrivITP's phase split)
                return 0
            return admitted(epsilon_total, delta_total, composition, event, queries + 1)
        return k

    out = {"basic": _largest_exact(count("basic"), queries, epsilon_total / queries)}
    out["fsrc"] = out["basic"]  # planned at the worst case: FSRC's ex-post saving is not known in advance
    if delta_total <= 0:
        out["zcdp"] = None
        return out
    rho_total = zcdp_rho_total(epsilon_total, delta_total)
    if mechanism == "privbon":
        guess = math.sqrt(8 * rho_total / queries)
    elif mechanism == "privbon-gaussian":
        guess = math.sqrt(2 * rho_total / queries)
    else:
        guess = _largest(lambda e: query_event(mechanism, e, **kw).rho * queries <= rho_total,
                         hi=max(out["basic"] or 0.0, 1.0) * 10)
    out["zcdp"] = None if guess is None else _largest_exact(count("zcdp"), queries, guess)
    return out


def _largest_exact(count, queries: int, guess: float, rel: float = 1e-8) -> float | None:
    """The largest x (to 6 significant digits, rounded down) with count(x) == queries, for count
    decreasing in x: the threshold t = max {x: count(x) >= queries} is bracketed from ``guess`` and
    bisected to a relative ``rel``; None when no x > 0 reaches ``queries``."""
    if not (guess > 0 and math.isfinite(guess)):
        return None
    step = 1e-7
    if count(guess) >= queries:
        lo, hi = guess, guess * (1 + step)
        while count(hi) >= queries:
            lo, step = hi, step * 4
            hi = guess * (1 + step)
            if step > 1e6:
                return None  # no epsilon stops it
    else:
        lo, hi = guess * (1 - step), guess
        while count(lo) < queries:
            hi, step = lo, step * 4
            if step >= 1:
                return None  # not even a tiny epsilon is admitted this often (e.g. the deltas do not fit)
            lo = guess * (1 - step)
    while hi - lo > rel * hi:
        mid = (lo + hi) / 2
        if count(mid) >= queries:
            lo = mid
        else:
            hi = mid
    for digits in range(6, 18):  # lo rounded down to the fewest digits (>= 6) that still admit exactly Q
        q = 10.0 ** (math.floor(math.log10(lo)) - digits + 1)
        x = float(f"{math.floor(lo / q) * q:.{digits}g}")
        if x <= lo and count(x) == queries:
            return x
    return lo if count(lo) == queries else None


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
