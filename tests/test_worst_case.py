"""The worst case is an upper bound on every realisable cost, every search terminates, and once an
answer exists its charge is recorded (issues 8 and 12)."""

import itertools
import math
import warnings

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st
from scipy import optimize

from privalign import accounting as A
from privalign.accounting import BudgetExceededError, BudgetOverrunError, PrivacyFilter
from privalign.accounting._rounding import ulp_up
from privalign.accounting.privitp import _sup_monotone_sum, privitp_epsilon2
from privalign.ledger import Ledger
from privalign.mechanisms import privitp


def _realised_sup(n, beta, sigma_x, sigma_z, delta, sens, L, points=4001):
    """The largest realised epsilon found over lambda~ in [-beta, 1] and t in {n, fallback}: a dense
    grid, then a bounded local search around its best cell, computed as the mechanism computes it."""
    eps1 = A.gaussian_mechanism_epsilon(sigma_x, sens, delta)

    def realised(x):
        x = np.clip(np.atleast_1d(x), -beta, 1.0)
        at_n = privitp_epsilon2(n, x, sigma_z, sens, 1.0, L, n=n)
        fallback = privitp_epsilon2(None, x, sigma_z, sens, 1.0, L, n=n)
        return np.array([ulp_up(eps1 + float(v)) for v in np.maximum(at_n, fallback)])

    xs = np.linspace(-beta, 1.0, points)
    vals = realised(xs)
    k = int(np.argmax(vals))
    lo, hi = xs[max(k - 1, 0)], xs[min(k + 1, xs.size - 1)]
    res = optimize.minimize_scalar(lambda x: -realised(x)[0], bounds=(lo, hi), method="bounded",
                                   options={"xatol": 1e-13})
    return max(float(vals.max()), float(-res.fun))


def test_sup_bound_keeps_every_cell():
    """A sawtooth with 20,000 teeth of equal height: the old search kept 512 cells and returned a
    bound below values it had itself evaluated."""
    teeth = 20_000

    def inc(x):
        return np.floor(np.asarray(x) * teeth) / teeth * 2.0

    def dec(x):
        return -2.0 * np.asarray(x)

    bound = _sup_monotone_sum(lambda x: (dec(x), inc(x)), 0.0, 1.0)
    xs = np.linspace(0.0, 1.0, 2_000_001)
    assert bound >= float(np.max(dec(xs) + inc(xs)))


GRID = list(itertools.product([2, 8, 64, 1024], [0.05, 0.3, 1.0], [0.01, 0.0598798520, 0.5]))


@pytest.mark.parametrize("n,sigma_z,sens", GRID)
def test_epsilon_max_covers_every_realisable_outcome(n, sigma_z, sens):
    L = A.default_truncation(n)
    declared = A.privitp_epsilon_max(n, 0.05, 0.03, sigma_z, 0.05, sens, 1.0, L)
    assert _realised_sup(n, 0.05, 0.03, sigma_z, 0.05, sens, L) <= declared


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 2048), sigma_z=st.floats(0.01, 3.0), sens=st.floats(0.001, 1.0),
       beta=st.floats(1e-4, 1.0), trunc=st.floats(0.0, 5.0))
@example(n=3, sigma_z=3.0, sens=0.0078125, beta=0.0001, trunc=0.0)  # realised 2e-13 above a one-margin bound
def test_epsilon_max_bounds_realised_cost_property(n, sigma_z, sens, beta, trunc):
    declared = A.privitp_epsilon_max(n, beta, 0.5, sigma_z, 1e-2, sens, 1.0, trunc)
    assert _realised_sup(n, beta, 0.5, sigma_z, 1e-2, sens, trunc, points=801) <= declared


def test_issue_12_run_is_within_its_declared_worst_case():
    kw = dict(beta=0.05, sigma_x=0.03, sigma_z=0.5, delta=0.05, sensitivity=0.0598798520)
    declared = A.privitp_epsilon_max(8, kw["beta"], kw["sigma_x"], kw["sigma_z"], kw["delta"], kw["sensitivity"], 1.0)
    rng = np.random.default_rng(12)
    for _ in range(200):
        sel = privitp(rng.random(8), rng.random(8), rng=rng, **kw)
        assert sel.epsilon <= declared


# ---------------------------------------------------------------- every search terminates


def test_tiny_gaussian_noise_gives_unbounded_epsilon_not_a_hang():
    assert A.gaussian_mechanism_epsilon(1e-160, 1.0, 1e-5) == math.inf
    assert A.gaussian_rnm_epsilon(1e-320, 0.5, 1.0, 4) == math.inf
    assert A.privitp_epsilon_max(8, 0.05, 0.5, 1e-300, 1e-2, 1.0, 1.0) == math.inf
    assert A.privitp_epsilon_max(8, 1e-300, 1e-300, 0.5, 1e-300, 1.0, 1.0) == math.inf


@pytest.mark.parametrize("call", [
    lambda: A.gumbel_noise_scale(1e-320, 1.0),
    lambda: A.gaussian_rnm_noise_scale(1e-320, 1.0, 1.0, 4),
    lambda: A.privbon_noise_scale(1e-320, 1.0),
])
def test_unreachable_calibration_names_epsilon(call):
    with pytest.raises(ValueError, match="epsilon=1e-320"):
        call()


# ---------------------------------------------------------------- no answer goes uncharged


def test_settle_charges_an_overrun_in_full():
    f = PrivacyFilter(1.0, 1e-3)
    res = f.reserve(0.5)
    with pytest.warns(RuntimeWarning, match="exceeded the reserved"):
        assert f.settle(res, 0.5000001) == 0.5000001
    assert f.spent.epsilon == 0.5000001 and f.overruns == 1 and f.queries == 1


def test_charge_after_the_fact_records_and_closes_the_budget():
    f = PrivacyFilter(1.0, 1e-3)
    f.charge(0.6, 1e-4)
    with pytest.raises(BudgetOverrunError, match="charged anyway") as info:
        f.charge(0.45, 0.0, epsilon_max=0.5)
    assert isinstance(info.value, BudgetExceededError) and info.value.charged == 0.45
    assert f.spent.epsilon == pytest.approx(1.05) and f.queries == 2
    assert not f.can_run(0.0, 0.0)  # overspent: closed


def test_run_refuses_before_and_charges_after():
    f = PrivacyFilter(1.0)
    assert f.run(lambda: ("a", 0.3), epsilon_max=0.6) == "a"
    with pytest.raises(BudgetExceededError):
        f.run(lambda: pytest.fail("must not run"), epsilon_max=0.8)
    with pytest.raises(RuntimeError):
        f.run(lambda: (_ for _ in ()).throw(RuntimeError("backend failed")), epsilon_max=0.2)
    assert f.spent.epsilon == pytest.approx(0.5) and f.queries == 2


@settings(max_examples=60, deadline=None)
@given(total=st.floats(0.1, 10.0), comp=st.sampled_from(("fsrc", "basic")),
       ops=st.lists(st.tuples(st.sampled_from(["charge", "reserve"]), st.floats(0.0, 2.0), st.floats(0.0, 1.0),
                              st.floats(-1e-6, 1e-6)), max_size=30))
def test_every_delivered_answer_is_covered(total, comp, ops):
    """Random queries: each realised cost is a fraction of its worst case plus a rounding slip
    that may push it above; whatever happens, recorded charges cover every delivered answer."""
    f = PrivacyFilter(total, 0.5, comp)
    delivered = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for kind, eps_max, frac, slip in ops:
            eps = max(eps_max * frac * (1 + slip) + slip, 0.0)
            if kind == "charge":
                try:
                    f.charge(eps, 0.0, epsilon_max=eps_max)
                except BudgetOverrunError:
                    pass
                delivered.append(eps if comp == "fsrc" else max(eps, eps_max))
            else:
                try:
                    res = f.reserve(eps_max)
                except BudgetExceededError:
                    continue  # refused before running: no answer
                f.settle(res, eps)
                delivered.append(eps if comp == "fsrc" else max(eps, eps_max))
    assert f.queries == len(delivered)
    assert f.spent.epsilon >= math.fsum(delivered) * (1 - 1e-12)


def test_ledger_settle_records_an_overrun(tmp_path):
    led = Ledger(str(tmp_path / "ledger.db"))
    led.set_budget("b", 1.0, 0.1, "fsrc", tenant="t")
    rid = led.reserve("b", 0.5, 0.0, "req")
    assert led.settle(rid, 0.5000001) == 0.5000001
    assert led.budget("b").spent.epsilon == 0.5000001
    assert [c[2] for c in led.charges("b")] == [0.5000001]
