"""``privalign plan --queries Q``: the epsilon it prints admits exactly Q queries in the real filter."""

import pytest
from typer.testing import CliRunner

from privalign import accounting as A
from privalign.accounting import planner
from privalign.cli import app


def _admitted(total, delta_total, composition, mechanism, epsilon, cap):
    """Queries a real PrivacyFilter admits at ``epsilon`` per query, each settled at its worst case."""
    f = A.PrivacyFilter(total, delta_total, composition)
    event = planner.query_event(mechanism, epsilon)
    for k in range(cap):
        try:
            f.settle(f.reserve(event=event))
        except A.BudgetExceededError:
            return k
    return cap


def _rows(output):
    return {line.split("│")[1].strip(): line.split("│")[2].strip() for line in output.splitlines()
            if line.startswith("│")}


@pytest.mark.parametrize("queries, total, mechanism", [
    (1000, 10.0, "privbon"),          # the case: 1,000 at (10, 1e-6) under zcdp admitted 999
    (10, 10.0, "privbon"),            # epsilon 1.0 itself is one ulp too much for basic (the event rounds up)
    (7, 3.0, "privbon"),              # 3 / 7 is not a float: the filter's sum decides
    (250, 2.0, "privbon"),
    (50, 5.0, "privbon-gaussian"),
])
def test_plan_queries_prints_the_largest_epsilon_the_filter_admits_exactly_q_times(queries, total, mechanism):
    res = CliRunner().invoke(app, ["plan", "--epsilon-total", str(total), "--delta-total", "1e-6",
                                   "--mechanism", mechanism, "--queries", str(queries)])
    assert res.exit_code == 0, res.output
    rows = _rows(res.output)
    for composition in ("basic", "fsrc", "zcdp"):
        eps = float(rows[composition])
        comp = "basic" if composition == "fsrc" else composition  # planned at the worst case
        assert _admitted(total, 1e-6, comp, mechanism, eps, queries + 2) == queries, (composition, eps)
        # and it is the largest, to its printed precision: a little more admits fewer
        assert _admitted(total, 1e-6, comp, mechanism, eps * (1 + 2e-5), queries + 2) < queries, (composition, eps)


def test_plan_queries_is_none_where_no_epsilon_fits():
    assert planner.plan_epsilons(10.0, 0.0, 5, "privbon")["zcdp"] is None  # no conversion at delta 0
    with pytest.raises(ValueError, match="queries must be an integer >= 1, got 0"):
        planner.plan_epsilons(10.0, 1e-6, 0, "privbon")


def test_a_gaussian_privbon_event_requires_r_max():
    sigma = A.privbon_noise_scale(1.0, 0.4, noise="gaussian", n=16, r_max=7.44)
    with pytest.raises(ValueError, match="r_max"):
        A.privbon_event(sigma, 0.4, noise="gaussian", n=16)
    wide, unit = (A.privbon_event(sigma, 0.4, noise="gaussian", n=16, r_max=r) for r in (7.44, 1.0))
    assert wide.epsilon == pytest.approx(1.0, rel=1e-6) and wide.rho > 3 * unit.rho  # r_max 1 would under-charge it
