"""Privacy filters for a stream of queries (paper Alg. 3; Lebensold et al. 2024).

A query announces its worst case (epsilon_max, delta) before it runs. It is admitted iff

    spent_epsilon + reserved_epsilon + epsilon_max <= epsilon_total   and
    spent_delta   + reserved_delta   + delta       <= delta_total,

so the total can never be exceeded (Lebensold et al.'s filter condition; the paper's Alg. 3 writes
the same rule as "halt when spent + epsilon_max >= epsilon_total", which differs only at exact
equality). After the query it is charged

* ``"fsrc"`` (filtered self-reporting composition): its realised ex-post epsilon (<= epsilon_max);
* ``"basic"``: epsilon_max, every time.

A finished query is always charged (``settle``, ``charge``): once an answer exists its cost is
recorded, even when it exceeds the declared worst case or what is left, which closes the budget.

Deltas add under both. The rule lives in two pure functions, ``admits`` and ``charge_amount``,
so a durable ledger can apply exactly the same logic inside its own transactions.
"""

from __future__ import annotations

import itertools
import math
import threading
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from .._validation import check_nonnegative, check_positive

COMPOSITIONS = ("fsrc", "basic")


class BudgetExceededError(RuntimeError):
    """A query's worst case does not fit in what is left of the budget; nothing was spent."""

    def __init__(self, epsilon_max: float, delta: float, remaining_epsilon: float,
                 remaining_delta: float):
        self.epsilon_max = epsilon_max
        self.delta = delta
        self.remaining_epsilon = remaining_epsilon
        self.remaining_delta = remaining_delta
        super().__init__(
            f"privacy budget exhausted: the query needs up to epsilon={epsilon_max:.6g}, delta={delta:.3g} "
            f"but only epsilon={remaining_epsilon:.6g}, delta={remaining_delta:.3g} remain (nothing was charged)"
        )


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


class PrivacyFilter:
    """In-memory privacy filter over one budget (thread-safe).

    >>> f = PrivacyFilter(epsilon_total=1.0, delta_total=1e-3)
    >>> f.charge(0.25, 1e-4, epsilon_max=0.6)   # FSRC charges the ex-post 0.25
    0.25
    >>> f.remaining.epsilon
    0.75
    """

    def __init__(self, epsilon_total: float, delta_total: float = 0.0, composition: str = "fsrc"):
        self.total = Privacy(check_positive("epsilon_total", epsilon_total, allow_inf=True),
                             check_nonnegative("delta_total", delta_total))
        if self.total.delta >= 1:
            raise ValueError(f"delta_total must be < 1, got {delta_total!r}")
        self.composition = check_composition(composition)
        self._spent = Privacy(0.0, 0.0)
        self._open: dict[int, Reservation] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.queries = 0
        self.refusals = 0
        self.overruns = 0  # queries charged more than their declared worst case, or after the budget ran out

    @property
    def spent(self) -> Privacy:
        return self._spent

    @property
    def reserved(self) -> Privacy:
        with self._lock:
            return self._reserved()

    def _reserved(self) -> Privacy:
        return Privacy(math.fsum(r.epsilon_max for r in self._open.values()),
                       math.fsum(r.delta for r in self._open.values()))

    @property
    def remaining(self) -> Privacy:
        with self._lock:
            res = self._reserved()
            return Privacy(max(self.total.epsilon - self._spent.epsilon - res.epsilon, 0.0),
                           max(self.total.delta - self._spent.delta - res.delta, 0.0))

    @staticmethod
    def _check_request(epsilon_max, delta):
        return check_nonnegative("epsilon_max", epsilon_max), check_nonnegative("delta", delta)

    def can_run(self, epsilon_max: float, delta: float = 0.0) -> bool:
        """Would a query with this worst case be admitted now?"""
        epsilon_max, delta = self._check_request(epsilon_max, delta)
        with self._lock:
            return admits(self._spent, self._reserved(), self.total, epsilon_max, delta)

    def reserve(self, epsilon_max: float, delta: float = 0.0) -> Reservation:
        """Step 1: hold the worst case, or raise ``BudgetExceededError`` (nothing held)."""
        epsilon_max, delta = self._check_request(epsilon_max, delta)
        with self._lock:
            reserved = self._reserved()
            if not admits(self._spent, reserved, self.total, epsilon_max, delta):
                self.refusals += 1
                raise BudgetExceededError(
                    epsilon_max, delta,
                    max(self.total.epsilon - self._spent.epsilon - reserved.epsilon, 0.0),
                    max(self.total.delta - self._spent.delta - reserved.delta, 0.0))
            res = Reservation(next(self._ids), epsilon_max, delta)
            self._open[res.id] = res
            return res

    def settle(self, reservation: Reservation, epsilon: float | None = None) -> float:
        """Step 2: charge the realised cost (``None``: the worst case) and release the rest.

        Never refuses an open reservation: a realised epsilon above the reservation's epsilon_max is
        charged in full, counted in ``overruns`` and warned about (the budget may then be overspent,
        which closes it: nothing more is admitted)."""
        eps = reservation.epsilon_max if epsilon is None else check_nonnegative("epsilon", epsilon)
        amount = charge_amount(self.composition, eps, reservation.epsilon_max)
        with self._lock:
            if self._open.pop(reservation.id, None) is None:
                raise ValueError(f"reservation {reservation.id} is not open (already settled?)")
            self._spent = Privacy(self._spent.epsilon + amount, self._spent.delta + reservation.delta)
            self.queries += 1
            if eps > reservation.epsilon_max:
                self.overruns += 1
        if eps > reservation.epsilon_max:
            warnings.warn(f"realised epsilon={eps!r} exceeded the reserved epsilon_max={reservation.epsilon_max!r}; "
                          "charged in full", RuntimeWarning, stacklevel=2)
        return amount

    def charge(self, epsilon: float, delta: float = 0.0, *, epsilon_max: float | None = None) -> float:
        """Record a finished query in one step; returns the amount charged.

        ``epsilon_max`` is the worst case the query could have cost (defaults to ``epsilon``, as for
        a PrivBoN query with a fixed pure epsilon). The answer already exists, so its cost is always
        recorded: if the worst case does not fit, it is charged anyway, the budget is closed, and
        ``BudgetOverrunError`` says so. To refuse a query before it runs, use ``reserve``/``settle``
        or ``run``.
        """
        eps = check_nonnegative("epsilon", epsilon)
        eps_max = eps if epsilon_max is None else check_nonnegative("epsilon_max", epsilon_max)
        delta = check_nonnegative("delta", delta)
        with self._lock:
            reserved = self._reserved()
            fits = admits(self._spent, reserved, self.total, eps_max, delta)
            remaining = (max(self.total.epsilon - self._spent.epsilon - reserved.epsilon, 0.0),
                         max(self.total.delta - self._spent.delta - reserved.delta, 0.0))
            res = Reservation(next(self._ids), eps_max, delta)
            self._open[res.id] = res
            if not fits:
                self.overruns += 1
        amount = self.settle(res, eps)
        if not fits:
            raise BudgetOverrunError(amount, eps_max, delta, *remaining)
        return amount

    def run(self, query, epsilon_max: float, delta: float = 0.0):
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
        res = self.reserve(epsilon_max, delta)
        try:
            answer, eps = query()
        except BaseException:
            self.settle(res)
            raise
        self.settle(res, eps)
        return answer

    def __repr__(self) -> str:
        return (f"PrivacyFilter(total={tuple(self.total)}, spent={tuple(self._spent)}, "
                f"composition={self.composition!r}, queries={self.queries})")
