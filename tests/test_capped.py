"""PrivITP with Phase 2 capped at T rounds (issue 31): T = n is today's mechanism bit for bit, the
worst case depends on n only through T and is never below a realised cost, and the exact laws match
the mechanism."""

import itertools
import math
from dataclasses import asdict

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import optimize, stats

from privalign import accounting as A
from privalign.accounting._rounding import ulp_up
from privalign.accounting.privitp import privitp_epsilon2
from privalign.evaluation.harness import METRICS, EvalSettings
from privalign.evaluation.parallel import evaluate
from privalign.mechanisms import privitp
from privalign.simulate import simulate
from privalign.theory import privitp_marginal_law

from . import reference as ref

KW = dict(beta=0.05, sigma_x=0.1, sigma_z=0.1, delta=1e-3)


def _batches(n, seed=3):
    rng = np.random.default_rng(seed)
    return rng.beta(5, 2, n), rng.beta(5, 2, n)


# ---------------------------------------------------------------- T = n is today's mechanism
@pytest.mark.parametrize("seed", range(20))
def test_max_rounds_n_is_the_uncapped_mechanism_bit_for_bit(seed):
    r1, r2 = _batches(16, seed)
    a = privitp(r1, r2, **KW, rng=np.random.default_rng(seed))
    b = privitp(r1, r2, **KW, rng=np.random.default_rng(seed), max_rounds=16)
    assert asdict(a) == asdict(b) and a.max_rounds == 16


def test_harness_with_a_cap_above_every_n_is_the_uncapped_harness():
    pool = simulate("hackable", 6, 80, seed=4).grouped()
    base = dict(algorithms=("privitp",), n_grid=(1, 4, 16), sigma=0.2, replicates=10, seed=3)
    for estimator in ("exact", "mc"):
        a = evaluate(pool, EvalSettings(**base, estimator=estimator))
        b = evaluate(pool, EvalSettings(**base, estimator=estimator, max_rounds=16))
        np.testing.assert_array_equal(a.per_prompt, b.per_prompt)


# ---------------------------------------------------------------- the cap
def test_a_capped_query_examines_at_most_t_candidates_and_its_fallback_costs_t_kappa():
    r1, _ = _batches(64)
    calls = []

    def next_reward():
        calls.append(1)
        return 0.0  # never accepted: lambda~ >= -beta and the noise is far below the gap

    sel = privitp(r1, next_reward, beta=0.05, sigma_x=0.01, sigma_z=1e-3, delta=1e-3, sensitivity=0.01,
                  rng=np.random.default_rng(0), max_rounds=5)
    assert sel.fallback and len(calls) == 5 and sel.halting_time == 6 and sel.max_rounds == 5
    L = A.default_truncation(5)
    assert sel.truncation == L
    eps2 = float(privitp_epsilon2(None, sel.lambda_tilde, 1e-3, 0.01, 1.0, L, n=5))
    assert sel.epsilon == ulp_up(sel.epsilon_1 + eps2)


@pytest.mark.parametrize("T", [8, 16])
def test_epsilon_max_depends_on_n_only_through_t(T):
    sens = 0.02
    for fn in (lambda n: A.privitp_epsilon_max(n, 0.05, 0.1, 0.2, 1e-6, sens, 1.0, max_rounds=T),
               lambda n: A.privitp_rho(n, 0.05, 0.1, 0.2, sens, 1.0, max_rounds=T),
               lambda n: A.privitp_noise_scales(1.0, 1e-6, n, 0.05, sens, 1.0, max_rounds=T)):
        assert fn(T) == fn(64) == fn(1024)
    # the uncapped worst case grows with n; the capped one is the uncapped one at n = T
    assert A.privitp_epsilon_max(1024, 0.05, 0.1, 0.2, 1e-6, sens, 1.0) > \
        A.privitp_epsilon_max(1024, 0.05, 0.1, 0.2, 1e-6, sens, 1.0, max_rounds=T) == \
        A.privitp_epsilon_max(T, 0.05, 0.1, 0.2, 1e-6, sens, 1.0)


@pytest.mark.parametrize("bad", [0, -1, 17, 2.5, "4", True, np.float64(4.0)])
def test_bad_max_rounds_is_a_one_line_error_naming_the_value(bad):
    r1, r2 = _batches(16)
    with pytest.raises(ValueError, match="max_rounds") as e:
        privitp(r1, r2, **KW, max_rounds=bad)
    assert repr(bad) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="max_rounds"):
        A.privitp_epsilon_max(16, 0.05, 0.1, 0.1, 1e-3, 0.1, 1.0, max_rounds=bad)
    with pytest.raises(ValueError, match="max_rounds"):
        A.privitp_event(16, 0.05, 0.1, 0.1, 1e-3, 0.1, 1.0, max_rounds=bad)


def test_a_short_phase2_batch_is_enough_for_a_capped_query():
    r1, r2 = _batches(64)
    assert privitp(r1, r2[:4], **KW, rng=np.random.default_rng(1), max_rounds=4).max_rounds == 4
    with pytest.raises(ValueError, match="at least max_rounds=8"):
        privitp(r1, r2[:4], **KW, rng=np.random.default_rng(1), max_rounds=8)


# ---------------------------------------------------------------- the worst case is never below a realised cost
def _realised_sup(T, beta, sigma_x, sigma_z, delta, sens, L, points=2001):
    """The largest realised cost over lambda~ in [-beta, 1] and t in {1..T, fallback}, computed as the
    mechanism computes it: a grid, then a bounded local search around its best cell. (t = T is the
    worst acceptance: kappa >= 0.)"""
    eps1 = A.gaussian_mechanism_epsilon(sigma_x, sens, delta)

    def realised(x):
        x = np.clip(np.atleast_1d(x), -beta, 1.0)
        at_t = privitp_epsilon2(T, x, sigma_z, sens, 1.0, L, n=T)
        fallback = privitp_epsilon2(None, x, sigma_z, sens, 1.0, L, n=T)
        return np.array([ulp_up(eps1 + float(v)) for v in np.maximum(at_t, fallback)])

    xs = np.linspace(-beta, 1.0, points)
    vals = realised(xs)
    k = int(np.argmax(vals))
    res = optimize.minimize_scalar(lambda x: -realised(x)[0], bounds=(xs[max(k - 1, 0)], xs[min(k + 1, points - 1)]),
                                   method="bounded", options={"xatol": 1e-13})
    return max(float(vals.max()), float(-res.fun))


@pytest.mark.parametrize("T,n,sigma_z,sens", list(itertools.product([1, 4, 16], [16, 1024], [0.05, 0.5], [0.01, 0.3])))
def test_capped_epsilon_max_covers_every_realisable_outcome(T, n, sigma_z, sens):
    declared = A.privitp_epsilon_max(n, 0.05, 0.03, sigma_z, 0.05, sens, 1.0, max_rounds=T)
    assert _realised_sup(T, 0.05, 0.03, sigma_z, 0.05, sens, A.default_truncation(T)) <= declared


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 4096), frac=st.floats(0.0, 1.0), sigma_z=st.floats(0.01, 3.0), sens=st.floats(0.001, 1.0),
       beta=st.floats(1e-4, 1.0))
def test_capped_epsilon_max_bounds_realised_cost_property(n, frac, sigma_z, sens, beta):
    T = max(1, int(round(frac * n)))
    declared = A.privitp_epsilon_max(n, beta, 0.5, sigma_z, 1e-2, sens, 1.0, max_rounds=T)
    assert _realised_sup(T, beta, 0.5, sigma_z, 1e-2, sens, A.default_truncation(T), points=601) <= declared


@pytest.mark.parametrize("T,n,sigma_z,d", [(16, 1024, 0.25, 1.0), (4, 4096, 0.05, 0.1), (1, 64, 1.0, 1.0)])
def test_capped_epsilon_max_against_the_high_precision_reference(T, n, sigma_z, d):
    """The reference (mpmath, 120 digits: at least the 40 the issue asks) on a lambda~ grid: the
    declared worst case is above every point and within the grid's resolution of the densest float one."""
    beta, sigma_x, delta = 0.05, 0.25, 1e-2
    L = A.default_truncation(T)
    eps_max = A.privitp_epsilon_max(n, beta, sigma_x, sigma_z, delta, d, 1.0, max_rounds=T)
    eps1 = float(ref.gaussian_mechanism_epsilon(sigma_x, d, delta))
    worst = 0.0
    for lam in np.linspace(-beta, 1.0, 81):
        kappa, accept = ref.privitp_terms(lam, sigma_z, d, 1.0, L)
        worst = max(worst, float(max((T - 1) * kappa + accept, T * kappa)))
    assert eps_max >= eps1 + worst
    dense = np.linspace(-beta, 1.0, 20001)
    kap, acc = A.privitp_phase2_terms(dense, sigma_z, d, 1.0, L)
    assert eps_max <= (eps1 + max(np.max((T - 1) * kap + acc), T * kap[0])) * (1 + 1e-6)


def test_realised_capped_costs_stay_below_the_declared_worst_case():
    r1, r2 = _batches(256)
    kw = dict(beta=0.05, sigma_x=0.03, sigma_z=0.05, delta=1e-3, sensitivity=0.05)
    declared = A.privitp_epsilon_max(256, kw["beta"], kw["sigma_x"], kw["sigma_z"], kw["delta"], 0.05, 1.0,
                                     max_rounds=8)
    rng = np.random.default_rng(5)
    costs = [privitp(r1, r2, **kw, rng=rng, max_rounds=8).epsilon for _ in range(300)]
    assert max(costs) <= declared


# ---------------------------------------------------------------- laws against the mechanism
@pytest.mark.parametrize("T", [1, 8])
def test_capped_law_matches_the_mechanism_chi_square(T):
    r1, r2 = _batches(64)
    p, f = privitp_marginal_law(r1, r2, beta=0.05, sigma_x=0.1, sigma_z=0.1, max_rounds=T)
    N = 20_000
    counts = np.zeros(T + 1)
    rng = np.random.default_rng(0)
    for _ in range(N):
        s = privitp(r1, r2, **KW, rng=rng, max_rounds=T)
        counts[T if s.fallback else s.index] += 1
    expected = np.r_[p, f] * N
    keep = expected >= 5  # the chi-square approximation's rule; the rest pooled
    obs = np.r_[counts[keep], counts[~keep].sum()] if (~keep).any() else counts
    exp = np.r_[expected[keep], expected[~keep].sum()] if (~keep).any() else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < stats.chi2.ppf(1 - 1e-3, obs.size - 1), (stat, obs, exp)


CHECKED = ("accuracy", "proxy_reward", "halting_time", "epsilon", "fallback")


@pytest.mark.parametrize("T", [1, 4])
def test_capped_harness_exact_and_plain_monte_carlo_agree(T):
    """Paired over 40 prompts; the threshold is Student's t at a 1e-4 family-wise level over the
    10 checks, with the prompts' degrees of freedom."""
    P = 40
    pool = simulate("hackable", P, 300, seed=8).grouped()
    base = dict(algorithms=("privitp",), n_grid=(4, 16), sigma=0.1, beta=0.05, max_rounds=T)
    rb = evaluate(pool, EvalSettings(**base, replicates=40, seed=1))
    mc = evaluate(pool, EvalSettings(**base, replicates=300, seed=2, estimator="mc"))
    threshold = stats.t.ppf(1 - 1e-4 / (2 * 2 * len(CHECKED)), P - 1)
    for j in range(2):
        for metric in CHECKED:
            i = METRICS.index(metric)
            d = rb.per_prompt[0, j, :, i] - mc.per_prompt[0, j, :, i]  # paired: prompt effects cancel
            se = d.std(ddof=1) / math.sqrt(d.size)
            assert abs(d.mean()) <= threshold * se + 1e-9, (T, j, metric, d.mean(), se)
    # the capped halting time never exceeds T + 1
    assert rb.per_prompt[0, :, :, METRICS.index("halting_time")].max() <= T + 1


def test_evaluate_cli_caps_phase2_and_reports_the_fallback_rate(tmp_path):
    """`privalign evaluate --max-rounds T`: the cap reaches the harness (settings.json), and summary.csv
    carries the fallback rate, which grows as T shrinks (fewer chances to accept); bad T is refused."""
    import csv
    import json

    from typer.testing import CliRunner

    from privalign.cli import app

    pool = tmp_path / "p.parquet"
    simulate("hackable", 12, 64, seed=1).save(pool)
    fallback = {}
    for T in (1, 16):
        out = tmp_path / f"T{T}"
        r = CliRunner().invoke(app, ["evaluate", str(pool), "--algorithms", "privitp", "--n", "16", "--replicates", "4",
                                     "--sigma", "0.2", "--max-rounds", str(T), "--out", str(out)])
        assert r.exit_code == 0, r.output
        assert json.loads((out / "settings.json").read_text())["evaluation"]["max_rounds"] == T
        row = next(csv.DictReader((out / "summary.csv").open()))
        fallback[T] = float(row["fallback"])
        assert float(row["halting_time"]) <= T + 1
    assert fallback[1] > fallback[16] >= 0.0
    r = CliRunner().invoke(app, ["evaluate", str(pool), "--max-rounds", "0", "--out", str(tmp_path / "bad")])
    assert r.exit_code == 2 and "max-rounds" in r.output and not (tmp_path / "bad").exists()


def test_each_rounds_worst_case_sits_at_the_edges_of_the_range():
    """docs/accounting.md ("Where each round's worst case sits"): log A is concave in r (A the exact
    acceptance probability, theory.privitp_acceptance), so the acceptance ratio A(r + Delta)/A(r) is
    largest at r = 0 and the rejection ratio (1 - A(r - Delta))/(1 - A(r)) at r = R: the accountant's
    closed forms equal the maximum over a grid of rewards, for every lambda~."""
    import numpy as np

    from privalign.accounting.privitp import privitp_phase2_terms
    from privalign.theory import privitp_acceptance

    rng = np.random.default_rng(0)
    for _ in range(12):
        R, sz, dr, L = 1.0, float(rng.uniform(0.05, 0.6)), float(rng.uniform(0.01, 0.3)), float(rng.uniform(0.5, 3))
        lt = float(rng.uniform(-0.05, R))
        kappa, accept = (float(v) for v in privitp_phase2_terms(lt, sz, dr, R, L))
        r = np.linspace(0.0, R - dr, 401)
        a_lo = privitp_acceptance(r, lt, sz, (0.0, R), truncation=L)
        a_hi = privitp_acceptance(r + dr, lt, sz, (0.0, R), truncation=L)
        acc_grid = np.log(a_hi) - np.log(a_lo)
        rej_grid = np.log1p(-a_lo) - np.log1p(-a_hi)  # reward r + dr under D, r under D'
        assert np.all(np.diff(acc_grid) <= 1e-9) and np.all(np.diff(rej_grid) >= -1e-9)  # monotone: concavity
        assert accept == pytest.approx(max(acc_grid.max(), 0.0), rel=1e-6, abs=1e-12)
        assert kappa == pytest.approx(max(rej_grid.max(), 0.0), rel=1e-6, abs=1e-12)
