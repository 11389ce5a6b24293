"""Privacy filters for a stream of queries (paper Alg. 3; Lebensold et al. 2024).

A query announces its worst case (epsilon_max, delta) before it runs. It is admitted iff

    spent_epsilon + reserved_epsilon + epsilon_max <= epsilon_total   and
    spent_delta   + reserved_delta   + delta       <= delta_total,

so the total can never be exceeded (Lebensold et al.'s filter condition; the paper's Alg. 3 writes
the same rule as "halt when spent + epsilon_max >= epsilon_total", which differs only at exact
equality). After the query it is charged

* ``"fsrc"`` (filtered self-reporting composition): its realised ex-post epsilon (<= epsilon_max);
* ``"basic"``: epsilon_max, every time;
* ``"zcdp"``: its rho (``accounting.zcdp``), every time. A query is admitted iff
  spent_rho + reserved_rho + rho <= rho_total, with rho_total the largest rho whose CKS conversion
  fits (epsilon_total, delta_total): a Renyi filter at every order, valid when every query's
  parameters are chosen adaptively (Feldman & Zrnic 2021; Whitehouse et al. 2023). Per-query deltas
  play no part (a Gaussian mechanism is zCDP with no delta); the budget's delta_total is the
  conversion's.

A finished query is always charged (``settle``, ``charge``): once an answer exists its cost is
recorded, even when it exceeds the declared worst case or what is left, which closes the budget.

Deltas add under FSRC and basic. The rule lives in pure functions (``admits``, ``admits_rho``,
``charge_amount``, ``charge_rho``), so a durable ledger applies exactly the same logic inside its
own transactions. Every settled query is kept as an immutable ``Charge`` (its ``PrivacyEvent``:
mechanism, parameters, epsilon, rho), so the stream can be re-accounted under another
composition (``events.account``).
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from .._validation import check_nonnegative, check_positive
from .events import PrivacyEvent, pure_event
from .zcdp import check_rho, pure_dp_rho, zcdp_epsilon, zcdp_rho_total

COMPOSITIONS = ("fsrc", "basic", "zcdp")


class BudgetExceededError(RuntimeError):
    """A query's worst case does not fit in what is left of the budget; nothing was spent."""

    def __init__(self, epsilon_max: float, delta: float, remaining_epsilon: float,
                 remaining_delta: float, rho: float | None = None, remaining_rho: float | None = None):
        self.epsilon_max = epsilon_max
        self.delta = delta
        self.remaining_epsilon = remaining_epsilon
        self.remaining_delta = remaining_delta
        self.rho, self.remaining_rho = rho, remaining_rho
        if rho is not None:
            msg = (f"privacy budget exhausted: the query needs rho={rho:.6g} (zCDP) but only rho={remaining_rho:.6g} "
                   f"remains (nothing was charged)")
        else:
            msg = (f"privacy budget exhausted: the query needs up to epsilon={epsilon_max:.6g}, delta={delta:.3g} "
                   f"but only epsilon={remaining_epsilon:.6g}, delta={remaining_delta:.3g} remain (nothing was charged)")
        super().__init__(msg)


class Privacy(NamedTuple):
    epsilon: float
    delta: float


def check_composition(composition: str) -> str:
    if composition not in COMPOSITIONS:
        raise ValueError(f"composition must be one of {COMPOSITIONS}, got {composition!r}")
    return composition


def admits(spent: Privacy, reserved: Privacy, total: Privacy, epsilon_max: float, delta: float) -> bool:
    """The filter condition: does a query with worst case (epsilon_max, delta) fit?"""
    return (spent.epsilon + reserved.epsilon + epsilon_max <= total.epsilon
            and spent.delta + reserved.delta + delta <= total.delta)


def admits_rho(spent_rho: float, reserved_rho: float, rho_total: float, rho: float) -> bool:
    """The zCDP filter condition: spent + reserved + rho <= rho_total."""
    return spent_rho + reserved_rho + rho <= rho_total


def budget_rho_total(composition: str, epsilon_total: float, delta_total: float) -> float | None:
    """rho_total of a zcdp budget (``zcdp.zcdp_rho_total``); None for the other compositions. Raises
    ValueError naming delta_total when it is 0 (rho-zCDP has no (epsilon, 0) conversion)."""
    if check_composition(composition) != "zcdp":
        return None
    return zcdp_rho_total(epsilon_total, delta_total) if math.isfinite(epsilon_total) else math.inf


def query_rho(epsilon_max: float, delta: float, rho: float | None) -> float:
    """A query's rho for a zcdp budget: as given, or epsilon_max^2 / 2 for a pure query (delta = 0);
    a query with delta > 0 and no rho cannot be accounted under zCDP."""
    if rho is not None:
        return check_rho(rho)
    if delta > 0:
        raise ValueError(f"a zcdp budget needs the query's rho: an (epsilon={epsilon_max!r}, delta={delta!r}) "
                         "guarantee alone has no zCDP bound")
    return pure_dp_rho(epsilon_max) if epsilon_max > 0 else 0.0


def charge_rho(rho_reserved: float, epsilon: float | None = None, epsilon_max: float | None = None) -> float:
    """What a finished query costs under zCDP: its reserved rho; a realised epsilon above the declared
    worst case (an accountant slip) is charged in full, as max(rho, epsilon^2 / 2)."""
    if epsilon is not None and epsilon_max is not None and epsilon > epsilon_max:
        return max(rho_reserved, pure_dp_rho(epsilon))
    return rho_reserved


def charge_amount(composition: str, epsilon: float, epsilon_max: float) -> float:
    """What a finished query costs: ex-post epsilon under FSRC, epsilon_max under basic composition.

    Once an answer exists its cost is always recorded, never refused: a realised epsilon above the
    declared epsilon_max (which the accountant's rounding makes impossible, but a caller's own
    mechanism might) is charged in full, max(epsilon, epsilon_max) under basic composition.
    """
    if check_composition(composition) == "fsrc":
        return epsilon
    return max(epsilon, epsilon_max)


class BudgetOverrunError(BudgetExceededError):
    """A query that had already run did not fit: its cost *was* recorded (the answer exists), the
    budget is now overspent and admits nothing more. Reserve before running (``PrivacyFilter.run``)
    to refuse instead."""

    def __init__(self, charged: float, epsilon_max: float, delta: float, remaining_epsilon: float,
                 remaining_delta: float):
        super().__init__(epsilon_max, delta, remaining_epsilon, remaining_delta)
        self.charged = charged
        self.args = (f"the finished query's worst case epsilon={epsilon_max:.6g}, delta={delta:.3g} did not fit "
                     f"(epsilon={remaining_epsilon:.6g}, delta={remaining_delta:.3g} were left); its cost "
                     f"epsilon={charged:.6g} was charged anyway and the budget is closed",)


@dataclass(frozen=True)
class Reservation:
    """An admitted query's hold on the budget, to be settled once it has run."""

    id: int
    epsilon_max: float
    delta: float
    rho: float = 0.0
    event: PrivacyEvent | None = None


@dataclass(frozen=True)
class Charge:
    """One settled query, immutable: its event, the realised epsilon (None: settled at its worst case)
    and what the budget's composition charged for it."""

    event: PrivacyEvent
    realised_epsilon: float | None
    epsilon: float
    rho: float


def query_request(zcdp: bool, epsilon_max, delta, rho, event):
    """A query's worst case checked, as (epsilon_max, delta, rho, event): from ``event`` when given;
    under zcdp its rho (``query_rho``: epsilon^2 / 2 for a pure query without one)."""
    if event is not None:
        epsilon_max, delta, rho = event.epsilon, event.delta, event.rho
    epsilon_max, delta = check_nonnegative("epsilon_max", epsilon_max), check_nonnegative("delta", delta)
    if zcdp:
        rho = query_rho(epsilon_max, delta, rho)
    elif rho is not None:
        rho = check_rho(rho)
    if event is None:
        event = (pure_event(epsilon_max, "query") if delta == 0 and rho is None else
                 PrivacyEvent("query", epsilon_max, delta, rho, (("epsilon_max", epsilon_max), ("delta", delta))))
    return epsilon_max, delta, rho, event


class PrivacyFilter:
    """In-memory privacy filter over one budget (thread-safe).

    >>> f = PrivacyFilter(epsilon_total=1.0, delta_total=1e-3)
    >>> f.charge(0.25, 1e-4, epsilon_max=0.6)   # FSRC charges the ex-post 0.25
    0.25
    >>> f.remaining.epsilon
    0.75

    Under ``composition="zcdp"`` a query is admitted by its rho (``rho=``, or an ``event`` from
    ``accounting.events``; a pure query without one costs epsilon^2 / 2), and ``spent`` is the
    (epsilon, delta) that the rho spent so far converts to.
    """

    def __init__(self, epsilon_total: float, delta_total: float = 0.0, composition: str = "fsrc"):
        self.total = Privacy(check_positive("epsilon_total", epsilon_total, allow_inf=True),
                             check_nonnegative("delta_total", delta_total))
        if self.total.delta >= 1:
            raise ValueError(f"delta_total must be < 1, got {delta_total!r}")
        self.composition = check_composition(composition)
        self.rho_total = budget_rho_total(self.composition, self.total.epsilon, self.total.delta)
        self._spent = Privacy(0.0, 0.0)
        self._spent_rho = 0.0
        self._open: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.queries = 0
        self.refusals = 0
        self.overruns = 0  # queries charged more than their declared worst case, or after the budget ran out
        self.charges: list[Charge] = []  # immutable records, in settlement order

    @property
    def zcdp(self) -> bool:
        return self.composition == "zcdp"

    @property
    def spent(self) -> Privacy:
        """What has been spent: the sum of charges (FSRC, basic) or the conversion of the rho spent
        at delta_total (zcdp)."""
        if self.zcdp:
            return self._converted(self._spent_rho)
        return self._spent

    def _converted(self, rho: float) -> Privacy:
        if rho == 0:
            return Privacy(0.0, 0.0)
        return Privacy(zcdp_epsilon(rho, self.total.delta), self.total.delta)

    @property
    def spent_rho(self) -> float:
        return self._spent_rho

    @property
    def reserved(self) -> Privacy:
        with self._lock:
            return self._reserved()

    def _reserved(self) -> Privacy:
        return Privacy(math.fsum(r.epsilon_max for r in self._open.values()),
                       math.fsum(r.delta for r in self._open.values()))

    def _reserved_rho(self) -> float:
        return math.fsum(r.rho for r in self._open.values())

    @property
    def remaining_rho(self) -> float | None:
        if not self.zcdp:
            return None
        with self._lock:
            return max(self.rho_total - self._spent_rho - self._reserved_rho(), 0.0)

    @property
    def remaining(self) -> Privacy:
        """What is left; under zcdp, epsilon_total less the conversion of the rho spent and reserved."""
        with self._lock:
            if self.zcdp:
                used = self._converted(self._spent_rho + self._reserved_rho())
                return Privacy(max(self.total.epsilon - used.epsilon, 0.0),
                               self.total.delta if self._spent_rho + self._reserved_rho() < self.rho_total else 0.0)
            res = self._reserved()
            return Privacy(max(self.total.epsilon - self._spent.epsilon - res.epsilon, 0.0),
                           max(self.total.delta - self._spent.delta - res.delta, 0.0))

    def _request(self, epsilon_max, delta, rho, event):
        return query_request(self.zcdp, epsilon_max, delta, rho, event)

    def _fits(self, epsilon_max, delta, rho) -> bool:
        if self.zcdp:
            return admits_rho(self._spent_rho, self._reserved_rho(), self.rho_total, rho)
        return admits(self._spent, self._reserved(), self.total, epsilon_max, delta)

    def _refusal(self, epsilon_max, delta, rho) -> BudgetExceededError:
        reserved = self._reserved()
        if self.zcdp:
            return BudgetExceededError(epsilon_max, delta, self.remaining_unlocked().epsilon, self.total.delta, rho,
                                       max(self.rho_total - self._spent_rho - self._reserved_rho(), 0.0))
        return BudgetExceededError(epsilon_max, delta,
                                   max(self.total.epsilon - self._spent.epsilon - reserved.epsilon, 0.0),
                                   max(self.total.delta - self._spent.delta - reserved.delta, 0.0))

    def remaining_unlocked(self) -> Privacy:
        used = self._converted(self._spent_rho + self._reserved_rho())
        return Privacy(max(self.total.epsilon - used.epsilon, 0.0), self.total.delta)

    def can_run(self, epsilon_max: float = 0.0, delta: float = 0.0, *, rho: float | None = None,
                event: PrivacyEvent | None = None) -> bool:
        """Would a query with this worst case be admitted now?"""
        epsilon_max, delta, rho, _ = self._request(epsilon_max, delta, rho, event)
        with self._lock:
            return self._fits(epsilon_max, delta, rho)

    def reserve(self, epsilon_max: float = 0.0, delta: float = 0.0, *, rho: float | None = None,
                event: PrivacyEvent | None = None) -> Reservation:
        """Step 1: hold the worst case, or raise ``BudgetExceededError`` (nothing held)."""
        epsilon_max, delta, rho, event = self._request(epsilon_max, delta, rho, event)
        with self._lock:
            if not self._fits(epsilon_max, delta, rho):
                self.refusals += 1
                raise self._refusal(epsilon_max, delta, rho)
            res = Reservation(next(self._ids), epsilon_max, delta, rho or 0.0, event)
            self._open[res.id] = res
            return res

    def settle(self, reservation: Reservation, epsilon: float | None = None) -> float:
        """Step 2: charge the realised cost (``None``: the worst case) and release the rest; returns
        the amount charged (epsilon; rho under zcdp).

        Never refuses an open reservation: a realised epsilon above the reservation's epsilon_max is
        charged in full, counted in ``overruns`` and warned about (the budget may then be overspent,
        which closes it: nothing more is admitted)."""
        eps = reservation.epsilon_max if epsilon is None else check_nonnegative("epsilon", epsilon)
        amount = charge_amount("basic" if self.zcdp else self.composition, eps, reservation.epsilon_max)
        rho = charge_rho(reservation.rho, eps, reservation.epsilon_max)
        with self._lock:
            if self._open.pop(reservation.id, None) is None:
                raise ValueError(f"reservation {reservation.id} is not open (already settled?)")
            self._spent = Privacy(self._spent.epsilon + amount, self._spent.delta + reservation.delta)
            self._spent_rho += rho
            self.queries += 1
            if eps > reservation.epsilon_max:
                self.overruns += 1
            event = reservation.event or pure_event(reservation.epsilon_max, "query")
            self.charges.append(Charge(event, None if epsilon is None else eps, amount, rho))
        if eps > reservation.epsilon_max:
            warnings.warn(f"realised epsilon={eps!r} exceeded the reserved epsilon_max={reservation.epsilon_max!r}; "
                          "charged in full", RuntimeWarning, stacklevel=2)
        return rho if self.zcdp else amount

    def charge(self, epsilon: float, delta: float = 0.0, *, epsilon_max: float | None = None,
               rho: float | None = None, event: PrivacyEvent | None = None) -> float:
        """Record a finished query in one step; returns the amount charged.

        ``epsilon_max`` is the worst case the query could have cost (defaults to ``epsilon``, as for
        a PrivBoN query with a fixed pure epsilon). The answer already exists, so its cost is always
        recorded: if the worst case does not fit, it is charged anyway, the budget is closed, and
        ``BudgetOverrunError`` says so. To refuse a query before it runs, use ``reserve``/``settle``
        or ``run``.
        """
        eps = check_nonnegative("epsilon", epsilon)
        eps_max = eps if epsilon_max is None else check_nonnegative("epsilon_max", epsilon_max)
        eps_max, delta, rho, event = self._request(eps_max, delta, rho, event)
        with self._lock:
            fits = self._fits(eps_max, delta, rho)
            refusal = None if fits else self._refusal(eps_max, delta, rho)
            res = Reservation(next(self._ids), eps_max, delta, rho or 0.0, event)
            self._open[res.id] = res
            if not fits:
                self.overruns += 1
        amount = self.settle(res, eps)
        if not fits:
            raise BudgetOverrunError(amount, eps_max, delta, refusal.remaining_epsilon, refusal.remaining_delta)
        return amount

    def run(self, query, epsilon_max: float = 0.0, delta: float = 0.0, *, rho: float | None = None,
            event: PrivacyEvent | None = None):
        """Reserve the worst case, run ``query()`` (returning ``(answer, realised_epsilon)``), charge
        the realised cost, return the answer. Refuses with ``BudgetExceededError`` before anything
        runs when the worst case does not fit; if ``query`` raises, its worst case is charged (its
        candidates may have been seen) and the error propagates.

        >>> f = PrivacyFilter(epsilon_total=1.0)
        >>> f.run(lambda: ("answer", 0.2), epsilon_max=0.5)
        'answer'
        >>> f.spent.epsilon
        0.2
        """
        res = self.reserve(epsilon_max, delta, rho=rho, event=event)
        try:
            answer, eps = query()
        except BaseException:
            self.settle(res)
            raise
        self.settle(res, eps)
        return answer

    def __repr__(self) -> str:
        extra = f", rho_spent={self._spent_rho!r} of {self.rho_total!r}" if self.zcdp else ""
        return (f"PrivacyFilter(total={tuple(self.total)}, spent={tuple(self.spent)}, "
                f"composition={self.composition!r}, queries={self.queries}{extra})")
