"""zCDP composition (issue 18): each mechanism's rho, the CKS conversion against a 40-digit
reference, dp-accounting and the Gaussian limit, the filter under adaptive parameters, the
durable ledger (events, migration, re-accounting) and bad input."""

import math
import sqlite3

import mpmath
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import privalign.accounting as A
from privalign.accounting.zcdp import gaussian_profile_epsilon, zcdp_epsilon, zcdp_rho_total
from privalign.ledger import BudgetExhausted, Ledger


def cks_reference(rho, delta, dps=40):
    """inf over alpha of the CKS bound, at 40 digits: the bound is convex in alpha, so a golden
    section search on log(alpha - 1) finds the infimum to the working precision."""
    with mpmath.workdps(dps):
        rho, L = mpmath.mpf(rho), -mpmath.log(mpmath.mpf(delta))

        def f(t):
            a = 1 + mpmath.exp(t)
            return a * rho + (L + (a - 1) * mpmath.log(1 - 1 / a) - mpmath.log(a)) / (a - 1)

        lo, hi = mpmath.mpf(-20), mpmath.mpf(40)
        g = (mpmath.sqrt(5) - 1) / 2
        for _ in range(260):
            c, d = hi - g * (hi - lo), lo + g * (hi - lo)
            if f(c) < f(d):
                hi = d
            else:
                lo = c
        return f((lo + hi) / 2)


@pytest.mark.parametrize("rho,delta", [(1e-4, 1e-6), (0.01125, 1e-6), (1.539, 1e-6), (0.5, 1e-3), (20.0, 1e-9),
                                       (1e-7, 1e-2)])
def test_conversion_agrees_with_a_40_digit_reference_and_never_reports_less(rho, delta):
    ref = max(float(cks_reference(rho, delta)), 0.0)  # the bound can dip below 0: epsilon is then 0
    got = zcdp_epsilon(rho, delta)
    assert got >= ref and got == pytest.approx(ref, rel=1e-8, abs=1e-15)


@settings(max_examples=60, deadline=None)
@given(rho=st.floats(1e-6, 50.0), log_delta=st.floats(-30.0, -1.0))
def test_conversion_never_below_the_gaussian_mechanisms_exact_profile(rho, log_delta):
    delta = math.exp(log_delta)
    eps = zcdp_epsilon(rho, delta)
    limit = gaussian_profile_epsilon(rho, delta)
    assert eps >= limit
    # the Gaussian mechanism at this rho really has delta(eps) <= delta: the limit is attained
    mu = math.sqrt(2 * rho)
    from scipy.stats import norm
    assert norm.cdf(mu / 2 - limit / mu) - math.exp(limit) * norm.cdf(-mu / 2 - limit / mu) <= delta * (1 + 1e-6)


def test_conversion_cross_checked_against_google_dp_accounting():
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rdp

    for rho, delta in [(0.01, 1e-6), (1.0, 1e-6), (1.539, 1e-6), (5.0, 1e-5)]:
        acc = rdp.RdpAccountant()
        acc.compose(dp_event.ZCDpEvent(rho))
        theirs = acc.get_epsilon(delta)  # the same CKS bound on a grid of orders
        ours = zcdp_epsilon(rho, delta)
        assert ours <= theirs * (1 + 1e-9) and ours >= 0.99 * theirs


def test_the_issues_budget_and_query_counts():
    rho_total = zcdp_rho_total(10, 1e-6)
    assert rho_total == pytest.approx(1.539, abs=1e-3) and zcdp_epsilon(rho_total, 1e-6) <= 10
    limit = A.gaussian_profile_rho(10, 1e-6)
    assert limit == pytest.approx(1.708, abs=1e-3)
    for eps, cks, gauss, basic in ((0.3, 136, 151, 33), (0.1, 1231, 1366, 100)):
        assert int(rho_total // A.bounded_range_rho(eps)) == cks
        assert int(limit // (eps ** 2 / 8)) == gauss
        f = A.PrivacyFilter(10, 1e-6, "zcdp")
        event = A.privbon_event(A.gumbel_noise_scale(eps, 0.01), 0.01)
        while f.can_run(event=event):
            f.charge(event.epsilon, event=event)
        assert f.queries == cks and f.spent.epsilon <= 10
        b = A.PrivacyFilter(10, 1e-6, "basic")
        while b.can_run(eps):
            b.charge(eps)
        assert b.queries == basic


def test_each_mechanisms_rho_bounds_its_renyi_divergence():
    """D_alpha(P || Q) <= rho alpha, computed exactly on neighbouring inputs (|r - r'| <= Delta)."""
    rng = np.random.default_rng(0)
    delta_r, eps = 0.05, 1.0
    sigma = A.gumbel_noise_scale(eps, delta_r)
    rho = A.bounded_range_rho(eps)
    for _ in range(200):
        r = rng.uniform(0, 1, 6)
        r2 = np.clip(r + rng.choice([-delta_r, delta_r], 6) * rng.uniform(0.5, 1, 6), 0, 1)
        p = np.exp(r / sigma - np.logaddexp.reduce(r / sigma))
        q = np.exp(r2 / sigma - np.logaddexp.reduce(r2 / sigma))
        for alpha in (1.5, 2.0, 4.0, 16.0, 64.0):
            d = np.log(np.sum(p ** alpha * q ** (1 - alpha))) / (alpha - 1)
            assert d <= rho * alpha * (1 + 1e-9)
    assert A.gaussian_rho(0.2, 0.05) == pytest.approx(0.05 ** 2 / (2 * 0.04))
    ev = A.privitp_event(16, 0.05, 0.2, 0.2, 1e-6, 0.05, 1.0)
    eps2 = A.privitp_epsilon2_max(16, 0.05, 0.2, 0.05, 1.0)
    assert ev.rho == pytest.approx(0.05 ** 2 / (2 * 0.04) + eps2 ** 2 / 2, rel=1e-8)
    assert eps2 < ev.epsilon  # Phase 2 alone is below the whole worst case


@settings(max_examples=40, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["gumbel", "gaussian", "privitp", "pure"]), st.floats(0.05, 3.0),
                              st.booleans()), min_size=1, max_size=60),
       total=st.floats(0.5, 20.0))
def test_filter_never_admits_past_rho_total_under_adaptive_parameters(ops, total):
    f = A.PrivacyFilter(total, 1e-6, "zcdp")
    held = []
    for kind, x, settle_now in ops:  # each query's parameters chosen from the state so far (adaptive)
        x = x * (1 + f.spent_rho)
        if kind == "gumbel":
            event = A.privbon_event(x, 0.1)
        elif kind == "gaussian":
            event = A.privbon_event(x, 0.1, noise="gaussian", n=8, r_max=1.0)
        elif kind == "privitp":
            event = A.privitp_event(8, 0.05, x, x, 1e-8, 0.1, 1.0)
        else:
            event = A.pure_event(x)
        try:
            res = f.reserve(event=event)
        except A.BudgetExceededError:
            continue
        held.append(res)
        assert f.spent_rho + sum(r.rho for r in held) <= f.rho_total
        if settle_now:
            first = held.pop(0)
            f.settle(first, first.epsilon_max * 0.5)
    for r in held:
        f.settle(r)
    assert f.spent_rho <= f.rho_total and f.spent.epsilon <= total
    assert len(f.charges) == f.queries and all(c.rho > 0 for c in f.charges)


def test_bad_input_is_one_line_naming_the_value(tmp_path):
    with pytest.raises(ValueError, match="delta_total.*got 0"):
        A.PrivacyFilter(10, 0.0, "zcdp")
    with pytest.raises(ValueError, match="composition"):
        A.PrivacyFilter(10, 1e-6, "renyi")
    f = A.PrivacyFilter(10, 1e-6, "zcdp")
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="rho"):
            f.reserve(0.3, rho=bad)
    with pytest.raises(ValueError, match="needs the query's rho"):
        f.reserve(1.0, 1e-6)  # an (epsilon, delta) query has no zCDP bound of its own
    assert f.queries == 0 and f.spent_rho == 0 and not f._open
    led = Ledger(str(tmp_path / "l.db"))
    with pytest.raises(ValueError, match="delta_total"):
        led.set_budget("z", 10, 0.0, "zcdp")
    led.set_budget("z", 10, 1e-6, "zcdp")
    with pytest.raises(ValueError, match="rho"):
        led.reserve("z", 0.3, 0.0, rho=math.nan)
    with pytest.raises(ValueError, match="needs the query's rho"):
        led.reserve("z", 1.0, 1e-6)
    led.set_budget("z", 10, 1e-6, "basic")  # no charge yet: the composition may still change
    led.set_budget("z", 10, 1e-6, "zcdp")
    led.settle(led.reserve("z", 0.3, 0.0, rho=0.01125))
    with pytest.raises(ValueError, match="has charges"):
        led.set_budget("z", 10, 1e-6, "fsrc")
    assert led.budget("z").queries == 1 and led.check() == []


def test_ledger_zcdp_budget_admits_by_rho_and_reaccounts_its_history(tmp_path):
    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("z", 10, 1e-6, "zcdp")
    event = A.privbon_event(A.gumbel_noise_scale(0.3, 0.01), 0.01)
    n = 0
    while True:
        try:
            rid = led.reserve("z", event=event)
        except BudgetExhausted as e:
            assert "rho" in str(e)
            break
        led.settle(rid, event.epsilon)
        n += 1
    assert n == 136
    b = led.budget("z")
    d = b.as_dict()
    assert d["rho_total"] == pytest.approx(1.539, abs=1e-3) and d["rho_spent"] == pytest.approx(136 * 0.3 ** 2 / 8)
    assert d["epsilon_spent"] <= 10 and d["epsilon_spent"] == pytest.approx(zcdp_epsilon(b.spent_rho, 1e-6))
    assert led.check() == []
    acc = led.account("z")["accounts"]
    assert acc["basic"]["epsilon"] == pytest.approx(136 * 0.3) and acc["fsrc"]["epsilon"] == pytest.approx(136 * 0.3)
    assert acc["zcdp"]["epsilon"] <= 10 and acc["zcdp"]["rho"] == pytest.approx(b.spent_rho)
    hist = led.history("z")
    assert len(hist) == 136 and hist[0][0].mechanism == "privbon-gumbel"
    assert hist[0][0] == event and hist[0][1] == event.epsilon  # the event, as it was recorded


OLD_SCHEMA = [
    """CREATE TABLE budgets (name TEXT PRIMARY KEY, tenant TEXT, epsilon_total DOUBLE PRECISION NOT NULL,
        delta_total DOUBLE PRECISION NOT NULL, composition TEXT NOT NULL,
        spent_epsilon DOUBLE PRECISION NOT NULL DEFAULT 0, spent_delta DOUBLE PRECISION NOT NULL DEFAULT 0,
        reserved_epsilon DOUBLE PRECISION NOT NULL DEFAULT 0, reserved_delta DOUBLE PRECISION NOT NULL DEFAULT 0,
        queries BIGINT NOT NULL DEFAULT 0, refusals BIGINT NOT NULL DEFAULT 0, open BIGINT NOT NULL DEFAULT 0)""",
    """CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, budget TEXT NOT NULL, kind TEXT NOT NULL,
        reservation BIGINT, request_id TEXT, owner TEXT, epsilon DOUBLE PRECISION NOT NULL,
        delta DOUBLE PRECISION NOT NULL, epsilon_max DOUBLE PRECISION NOT NULL, created DOUBLE PRECISION NOT NULL)""",
]


def test_an_existing_ledger_is_migrated_and_keeps_its_history(tmp_path):
    path = tmp_path / "old.db"
    con = sqlite3.connect(path)
    for stmt in OLD_SCHEMA:
        con.execute(stmt)
    con.execute("INSERT INTO budgets (name, epsilon_total, delta_total, composition, spent_epsilon, queries) "
                "VALUES ('b', 10, 1e-6, 'fsrc', 0.5, 1)")
    con.execute("INSERT INTO events (budget, kind, request_id, epsilon, delta, epsilon_max, created) "
                "VALUES ('b', 'reserve', 'r1', 0.5, 0, 0.5, 0)")
    con.execute("INSERT INTO events (budget, kind, reservation, request_id, epsilon, delta, epsilon_max, created) "
                "VALUES ('b', 'settle', 1, 'r1', 0.5, 0, 0.5, 0)")
    con.commit()
    con.close()
    led = Ledger(str(path))
    assert led.check() == []
    led.settle(led.reserve("b", event=A.privbon_event(A.gumbel_noise_scale(0.3, 0.01), 0.01)), 0.3)
    acc = led.account("b")["accounts"]
    assert acc["fsrc"]["epsilon"] == pytest.approx(0.8) and acc["zcdp"]["derived_rho"] == 1
    assert acc["zcdp"]["rho"] == pytest.approx(0.5 ** 2 / 2 + 0.3 ** 2 / 8)
    assert Ledger(str(path)).check() == []  # a second open finds nothing to migrate


def test_a_dead_processs_zcdp_reservation_is_recovered_at_its_rho(tmp_path):
    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("z", 10, 1e-6, "zcdp")
    event = A.privitp_event(8, 0.05, 0.5, 0.5, 1e-8, 0.1, 1.0)
    led.reserve("z", event=event)  # its process "dies" before settling
    other = Ledger(str(tmp_path / "l.db"))
    assert other.recover(lease=0.0) == 1
    b = other.budget("z")
    assert b.spent_rho == pytest.approx(event.rho) and b.reserved_rho == 0 and other.check() == []


def test_plan_prints_queries_per_composition_and_the_epsilon_each_allows():
    from typer.testing import CliRunner

    from privalign.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["plan", "--epsilon-total", "10", "--delta-total", "1e-6", "--mechanism", "privbon",
                              "--epsilon", "0.3"])
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines()
            if line.startswith("│")}
    assert rows["basic"] == "33" and rows["fsrc"] == "33" and rows["zcdp"] == "136" and rows["(limit)"] == "151"
    res = runner.invoke(app, ["plan", "--epsilon-total", "2", "--epsilon", "1"])  # where zcdp loses: say so
    assert res.exit_code == 0 and "zcdp admits fewer queries than basic" in " ".join(res.output.split())
    res = runner.invoke(app, ["plan", "--epsilon-total", "10", "--queries", "1000"])
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in res.output.splitlines()
            if line.startswith("│")}
    assert float(rows["basic"]) == pytest.approx(0.01) and float(rows["zcdp"]) == pytest.approx(
        math.sqrt(8 * zcdp_rho_total(10, 1e-6) / 1000), rel=1e-3)
    for bad in (["plan", "--epsilon-total", "10"], ["plan", "--epsilon-total", "10", "--epsilon", "1", "--mechanism",
                                                      "laplace"]):
        res = runner.invoke(app, bad)
        assert res.exit_code == 2 and "error:" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["plan", "--epsilon-total", "10", "--epsilon", "1", "--delta-total", "0"])
    assert res.exit_code == 0 and "│ zcdp        │       - │" in res.output  # no conversion at delta 0


def test_plan_on_a_pool_gives_accuracy_and_rescales_to_fewer_pairs():
    from typer.testing import CliRunner

    from privalign.cli import app
    from privalign.evaluation.suite import default_pool

    _, name = default_pool()
    from importlib import resources
    path = str(resources.files("privalign") / "data" / name.split(": ")[1])
    runner = CliRunner()
    out = {}
    for pairs in (None, 300):
        res = runner.invoke(app, ["plan", "--epsilon-total", "10", "--queries", "1000", "--pool", path]
                            + ([] if pairs is None else ["--pairs", str(pairs)]))
        assert res.exit_code == 0, res.output
        rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in res.output.splitlines()
                if line.startswith("│") and line.split("│")[1].strip()}
        out[pairs] = {k: float(v) for k, v in rows.items()}
        assert "BoN (n=16)" in res.output
    assert out[None]["zcdp"] > out[None]["basic"]  # more epsilon per query buys accuracy
    assert out[300]["zcdp"] < out[None]["zcdp"]  # fewer people: a larger Delta_r, more noise, less accuracy


def test_ledger_account_cli(tmp_path):
    from typer.testing import CliRunner

    from privalign.cli import app

    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("b", 10, 1e-6, "fsrc")
    ev = A.privitp_event(8, 0.05, 0.5, 0.5, 1e-8, 0.1, 1.0)
    for _ in range(3):
        led.settle(led.reserve("b", event=ev), ev.epsilon / 2)
    res = CliRunner().invoke(app, ["ledger", "account", str(tmp_path / "l.db"), "--budget", "b"])
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert f"{3 * ev.epsilon:.6g}" in text and f"{1.5 * ev.epsilon:.6g}" in text and f"{3 * ev.rho:.6g}" in text
    res = CliRunner().invoke(app, ["ledger", "account", str(tmp_path / "l.db"), "--budget", "nope"])
    assert res.exit_code == 2 and "unknown budget" in res.output


def test_audit_of_a_composed_stream_stays_below_the_claimed_total():
    """k Gumbel PrivBoN queries on the audit's neighbouring pair: the 95% lower bound on the stream's
    epsilon stays below zCDP's claimed total; the same attack catches a mechanism with 1000x too
    little noise that claims the same epsilon (the test has power)."""
    from tests.test_policy_bt import synthetic_pool

    from privalign.audit import audit_stream
    from privalign.rewards.policy_bt import train_policy_bt

    pid, y, raw = synthetic_pool()
    model, _ = train_policy_bt(raw, pid, y, lambdas=(0.1,), components=(4,), seed=0, range_epsilon=0.0,
                               pairs_per_person=1, unit="pair")  # many pairs: a small Delta_r
    for k, eps in ((20, 0.3), (60, 0.1)):
        res = audit_stream(model, raw, pid, y, queries=k, epsilon=eps, runs=50_000, seed=1)
        assert res["epsilon_lower_bound"] <= res["claimed_zcdp"] <= res["claimed_basic"]
    lo, hi = model.output_range
    sigma = A.gumbel_noise_scale(0.3, model.sensitivity / (hi - lo)) / 1000
    bad = audit_stream(model, raw, pid, y, queries=20, epsilon=0.3, runs=50_000, seed=1, noise_scale=sigma)
    assert bad["epsilon_lower_bound"] > bad["claimed_zcdp"]
