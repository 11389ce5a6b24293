"""The privacy filter: FSRC versus basic composition, refusals, concurrency."""

import threading

import numpy as np
import pytest

import privalign as pa
import privalign.accounting as A
from privalign.accounting import BudgetExceededError, PrivacyFilter


def test_fsrc_charges_ex_post_and_basic_charges_worst_case():
    f, g = PrivacyFilter(10.0, 1e-3, "fsrc"), PrivacyFilter(10.0, 1e-3, "basic")
    assert f.charge(0.5, 1e-5, epsilon_max=2.0) == 0.5
    assert g.charge(0.5, 1e-5, epsilon_max=2.0) == 2.0
    assert f.spent == (0.5, 1e-5) and g.spent == (2.0, 1e-5)
    assert f.remaining.epsilon == pytest.approx(9.5) and g.remaining.epsilon == pytest.approx(8.0)


def test_refused_query_spends_nothing():
    """A query refused before it runs (reserve) spends nothing; charge() is for finished queries and
    always records (tests/test_worst_case.py)."""
    f = PrivacyFilter(1.0, 1e-3)
    f.charge(0.6, 1e-4)
    before = (f.spent, f.queries)
    assert not f.can_run(0.5, 0.0)
    with pytest.raises(BudgetExceededError, match="exhausted") as info:
        f.reserve(0.5, 0.0)
    assert info.value.remaining_epsilon == pytest.approx(0.4)
    assert (f.spent, f.queries) == before and f.refusals == 1
    with pytest.raises(BudgetExceededError):
        f.reserve(0.1, 1e-3)  # the delta budget would be exceeded
    assert (f.spent, f.queries) == before


def test_reservations_hold_the_worst_case_until_settled():
    f = PrivacyFilter(1.0)
    r1 = f.reserve(0.6)
    assert not f.can_run(0.5)  # 0.6 is held although nothing is spent yet
    assert f.settle(r1, 0.1) == 0.1
    assert f.can_run(0.5)
    r2 = f.reserve(0.3)
    assert f.settle(r2) == 0.3  # settled at its worst case when no ex-post cost is known
    with pytest.raises(ValueError, match="not open"):
        f.settle(r2, 0.1)


def test_exact_budget_fits_and_never_more():
    f = PrivacyFilter(1.0, composition="basic")
    for _ in range(4):
        f.charge(0.25)
    assert f.spent.epsilon == 1.0 and not f.can_run(1e-12)


def test_threads_never_overspend():
    f = PrivacyFilter(5.0, 0.5, "fsrc")
    rng = np.random.default_rng(0)
    work = [(float(e), float(m)) for e, m in zip(rng.uniform(0, 0.1, 4000), rng.uniform(0.1, 0.3, 4000))]
    charged, refused = [], []
    lock = threading.Lock()

    def worker(items):
        for eps, eps_max in items:
            try:
                amount = f.settle(f.reserve(eps_max, 1e-6), eps)
                with lock:
                    charged.append(amount)
            except BudgetExceededError:
                with lock:
                    refused.append(eps_max)

    threads = [threading.Thread(target=worker, args=(work[i::8],)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(charged) + len(refused) == len(work)
    assert f.queries == len(charged)
    assert f.spent.epsilon == pytest.approx(sum(charged), rel=1e-12)  # no lost update
    assert f.spent.epsilon <= 5.0
    assert f.remaining.epsilon < 0.3  # stopped only when a worst case no longer fit


def test_fsrc_answers_more_privitp_queries_than_basic():
    # n = 16, beta = 0.05, delta = 1e-2, sigma_X = sigma_Z = 1 (paper's split of sigma = 2), total 50.
    # Basic composition answers floor(50 / eps_max) = 6. FSRC stops once spent + eps_max > 50, so it
    # answers about (50 - eps_max) / E[eps] + 1 queries; here E[eps] = eps_1 + E[eps_2] ~ 4.4 gives ~10.
    rng = np.random.default_rng(0)
    n, beta, sx, sz, delta = 16, 0.05, 1.0, 1.0, 1e-2
    eps_max = A.privitp_epsilon_max(n, beta, sx, sz, delta, 1.0, 1.0)
    answered = {}
    for comp in ("fsrc", "basic"):
        f = PrivacyFilter(50.0, 0.99, comp)
        while f.can_run(eps_max, delta):
            r1, r2 = rng.beta(5, 2, n), rng.beta(5, 2, n)
            s = pa.privitp(r1, r2, beta=beta, sigma_x=sx, sigma_z=sz, delta=delta, rng=rng)
            f.charge(s.epsilon, delta, epsilon_max=eps_max)
        assert f.spent.epsilon <= 50.0
        answered[comp] = f.queries
    assert answered["basic"] == int(50.0 // eps_max) == 6
    assert answered["fsrc"] >= 9
