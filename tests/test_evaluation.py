"""The evaluation harness against theory, brute force and the real mechanisms."""

import math

import numpy as np
import pytest

from privalign import theory
from privalign.evaluation import EvalSettings, evaluate
from privalign.evaluation import laws
from privalign.evaluation.harness import METRICS
from privalign.simulate import simulate

ACC = METRICS.index("accuracy")


def summary(result):
    return {(r["algorithm"], r["n"]): r for r in result.summary_rows()}


# ---------------------------------------------------------------- gaussian world: Prop. 3.6
S_R, SIGMA = 0.5, 0.5
RANGE = (-5.0, 6.0)  # declared range wide enough that nothing is clipped; sigma in its units below
W = RANGE[1] - RANGE[0]


@pytest.fixture(scope="module")
def gaussian_constant_truth():
    # base accuracy 1: the true reward is constant, so the proxy's spread is all reward error,
    # exactly Prop. 3.6's setting
    pool = simulate("gaussian", 40, 5000, seed=11, base_accuracy=1.0, reward_noise=S_R).grouped()
    s = EvalSettings(algorithms=("bon", "privbon"), n_grid=(16, 4096), replicates=10, sigma=SIGMA / W,
                     reward_range=RANGE, seed=3)
    return summary(evaluate(pool, s))


def test_privbon_win_rate_and_hacking_gap_reach_prop36_limits(gaussian_constant_truth):
    row = gaussian_constant_truth[("privbon", 4096)]
    # finite-n bias of the self-normalised softmax is O(E[e^{2 eps/sigma}] / (n E[e^{eps/sigma}]^2))
    # = O(e^{(s_r/sigma)^2} / n) ~ 7e-4 here; allow 4 standard errors on top
    bias = math.exp((S_R / SIGMA) ** 2) / 4096
    assert abs(row["win_rate"] - theory.privbon_win_rate_limit(S_R, SIGMA)) <= 4 * row["win_rate_se"] + bias
    assert abs(row["hacking_gap"] - theory.privbon_hacking_gap_limit(S_R, SIGMA)) <= \
        4 * row["hacking_gap_se"] + bias * 5 * S_R


def test_bon_win_rate_is_n_over_n_plus_1(gaussian_constant_truth):
    for n in (16, 4096):
        row = gaussian_constant_truth[("bon", n)]
        # exact under resampling from a finite pool of S = 5000: off n/(n+1) by O(1/S)
        assert abs(row["win_rate"] - theory.bon_win_rate(n)) <= 4 * row["win_rate_se"] + 1 / 5000


def test_bon_hacking_gap_grows_like_sqrt_log_n(gaussian_constant_truth):
    g16, g4096 = (gaussian_constant_truth[("bon", n)]["hacking_gap"] for n in (16, 4096))
    assert g4096 > g16 > theory.privbon_hacking_gap_limit(S_R, 100 * SIGMA)
    # E[max of n N(0, s^2)] / (s sqrt(2 ln n)) tends to 1 from below
    assert 0.8 < g4096 / theory.bon_hacking_gap_rate(S_R, 4096) <= 1.0


def test_privbon_hacking_gap_limit_holds_with_binary_truth():
    pool = simulate("gaussian", 40, 5000, seed=12, base_accuracy=0.3, reward_noise=S_R).grouped()
    s = EvalSettings(algorithms=("privbon",), n_grid=(4096,), replicates=10, sigma=SIGMA / W,
                     reward_range=RANGE, seed=4)
    row = summary(evaluate(pool, s))[("privbon", 4096)]
    assert abs(row["hacking_gap"] - S_R ** 2 / SIGMA) <= 4 * row["hacking_gap_se"] + 0.01


# ---------------------------------------------------------------- hackable world: Figure 1 shape
@pytest.fixture(scope="module")
def hackable_curves():
    pool = simulate("hackable", 60, 3000, seed=5).grouped()
    s = EvalSettings(n_grid=tuple(2 ** k for k in range(0, 13, 2)), replicates=10, sigma=0.5, beta=0.05, seed=6)
    return evaluate(pool, s)


def test_bon_peaks_then_declines_while_its_proxy_keeps_rising(hackable_curves):
    rows = summary(hackable_curves)
    ns = hackable_curves.settings.n_grid
    acc = np.array([rows[("bon", n)]["accuracy"] for n in ns])
    proxy = np.array([rows[("bon", n)]["proxy_reward"] for n in ns])
    peak = int(np.argmax(acc))
    assert 0 < peak < len(ns) - 1
    a = hackable_curves.settings.algorithms.index("bon")
    # the decline from the peak is measured per prompt: far beyond its standard error
    drop = hackable_curves.per_prompt[a, peak, :, ACC] - hackable_curves.per_prompt[a, -1, :, ACC]
    assert drop.mean() > 8 * drop.std(ddof=1) / math.sqrt(drop.size)
    assert np.all(np.diff(proxy) > 0)


@pytest.mark.parametrize("algo", ["privbon", "itp", "privitp"])
def test_private_and_pessimistic_selection_do_not_decline(hackable_curves, algo):
    a = hackable_curves.settings.algorithms.index(algo)
    acc = hackable_curves.per_prompt[a, :, :, ACC]  # (n, prompts)
    best = int(np.argmax(acc.mean(axis=1)))
    diff = acc[best] - acc[-1]  # paired across prompts
    assert diff.mean() <= 3 * diff.std(ddof=1) / math.sqrt(diff.size) + 1e-12


# ---------------------------------------------------------------- estimators agree
@pytest.mark.parametrize("algo", ["privbon", "privbon-gaussian", "itp", "privitp", "bon"])
def test_rao_blackwellised_and_plain_monte_carlo_agree(algo):
    pool = simulate("hackable", 12, 300, seed=8).grouped()
    base = dict(algorithms=(algo,), n_grid=(4, 16), sigma=0.1, beta=0.05)
    rb = evaluate(pool, EvalSettings(**base, replicates=40, seed=1))
    mc = evaluate(pool, EvalSettings(**base, replicates=800, seed=2, estimator="mc"))
    for j in range(2):
        for metric in ("accuracy", "proxy_reward", "win_rate", "hacking_gap"):
            i = METRICS.index(metric)
            d = rb.per_prompt[0, j, :, i] - mc.per_prompt[0, j, :, i]  # paired: prompt effects cancel
            se = d.std(ddof=1) / math.sqrt(d.size)
            assert abs(d.mean()) <= 4.5 * se + 1e-9, (algo, j, metric, d.mean(), se)
        if algo in ("itp", "privitp"):
            i = METRICS.index("halting_time")
            d = rb.per_prompt[0, j, :, i] - mc.per_prompt[0, j, :, i]
            assert abs(d.mean()) <= 4.5 * d.std(ddof=1) / math.sqrt(d.size)


@pytest.mark.parametrize("replace", [True, False])
def test_exact_bon_expectation_matches_brute_force_resampling(replace):
    rng = np.random.default_rng(0)
    x = np.round(rng.random(60), 1)  # many ties: uniform tie-breaking matters
    vals = np.stack([rng.random(60), rng.random(60)], axis=1)
    for n in (1, 3, 10, 40):
        exact = laws.bon_exact(x, vals, [n], replace=replace)[0]
        reps = 20_000
        idx = (rng.integers(0, 60, (reps, n)) if replace else np.argsort(rng.random((reps, 60)), axis=1)[:, :n])
        xc = x[idx] + 1e-9 * rng.random(idx.shape)  # random tie-break among equal scores
        chosen = idx[np.arange(reps), np.argmax(xc, axis=1)]
        sample = vals[chosen]
        se = sample.std(axis=0, ddof=1) / math.sqrt(reps)
        assert np.all(np.abs(sample.mean(axis=0) - exact) <= 4.5 * se + 1e-12), (n, replace)


def test_batched_laws_match_single_set_laws():
    rng = np.random.default_rng(1)
    x = rng.random((3, 9))
    for row, law in zip(x, laws.gaussian_rows(x, 0.2)):
        assert np.allclose(law, theory.privbon_law(row, 0.2, noise="gaussian"), atol=1e-6)
    for row, law in zip(x, laws.softmax_rows(x, 0.2)):
        assert np.allclose(law, theory.privbon_law(row, 0.2))
    # the harness's ITP law: lazily examined sequential law over the batched acceptance probabilities
    lam = laws.lambda_rows(x, 0.1)[:, None]
    parts, law_parts, fb, _ = laws.sequential_lazy(
        x.shape[1], x.shape[0], lambda a, b, live: (None, laws.itp_acceptance_rows(x[live, a:b], lam[live], 1.0)),
        first=4)
    law = np.concatenate(law_parts, axis=1)
    for k, row in enumerate(x):
        p, f = theory.itp_law(row, 0.1)
        assert np.allclose(law[k], p) and np.isclose(fb[k], f)


def test_n_equal_1_is_the_base_policy():
    pool = simulate("hackable", 10, 200, seed=2).grouped()
    rows = summary(evaluate(pool, EvalSettings(n_grid=(1,), replicates=400, seed=0)))
    base = rows[("bon", 1)]["base_accuracy"]
    assert rows[("bon", 1)]["accuracy"] == pytest.approx(base, abs=1e-12)
    assert abs(rows[("privbon", 1)]["accuracy"] - base) < 4 * rows[("privbon", 1)]["accuracy_se"] + 0.02


def test_bad_settings_are_refused():
    for kw, name in [({"algorithms": ("best",)}, "algorithms"), ({"n_grid": (0,)}, "n"),
                     ({"replicates": 0}, "replicates"), ({"sigma": 0.0}, "sigma"),
                     ({"normalisation": "minmax"}, "normalisation"), ({"estimator": "x"}, "estimator")]:
        with pytest.raises(ValueError, match=name):
            EvalSettings(**kw).check()


# ---------------------------------------------------------------- executors: identical results
@pytest.fixture(scope="module")
def small_pool():
    return simulate("hackable", 13, 400, seed=9).grouped()


def _settings(estimator, **kw):
    return EvalSettings(algorithms=("bon", "privbon", "privbon-gaussian", "itp", "privitp"), n_grid=(1, 4, 128),
                        replicates=20 if estimator == "exact" else 4, estimator=estimator, seed=5, **kw)


@pytest.mark.parametrize("estimator", ["exact", "mc"])
def test_two_workers_give_the_single_worker_result_bit_for_bit(small_pool, estimator, monkeypatch):
    from privalign.evaluation import parallel

    monkeypatch.setattr(parallel, "PARALLEL_MIN_WORK", 0)  # a pool even for this small run
    one = evaluate(small_pool, _settings(estimator))
    assert parallel.local_processes(small_pool.n_prompts, _settings(estimator, workers=2)) == 2
    seen = []
    two = evaluate(small_pool, _settings(estimator, workers=2), progress=lambda d, t: seen.append((d, t)))
    assert np.array_equal(one.per_prompt, two.per_prompt, equal_nan=True)  # NaN: halting time of non-ITP
    assert np.array_equal(one.base, two.base)
    assert seen[-1] == (13, 13) and [d for d, _ in seen] == sorted(d for d, _ in seen)


def test_a_prompt_result_does_not_depend_on_the_other_prompts(small_pool):
    s = _settings("exact", reward_range=(-3.0, 4.0))  # a declared range: the subset maps scores alike
    whole = evaluate(small_pool, s)
    part = evaluate(small_pool.subset(np.arange(5)), s)
    assert np.array_equal(whole.per_prompt[:, :, :5], part.per_prompt, equal_nan=True)


def test_small_runs_and_one_worker_start_no_processes(small_pool):
    from privalign.evaluation import parallel

    assert parallel.local_processes(small_pool.n_prompts, _settings("exact", workers=1)) == 1
    small = EvalSettings(n_grid=(1, 4, 16), replicates=20, workers=4)
    assert parallel.local_processes(small_pool.n_prompts, small) == 1  # too little work to repay a pool
    assert parallel.local_processes(1319, EvalSettings(workers=2)) == 2  # the full grid
    assert parallel.shards(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]
    assert parallel.shards(3, 8) == [(0, 1), (1, 2), (2, 3)]


def test_dask_cluster_gives_the_local_result_bit_for_bit(small_pool):
    distributed = pytest.importorskip("distributed")
    local = evaluate(small_pool, _settings("exact"))
    with distributed.LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None) as cluster:
        seen = []
        remote = evaluate(small_pool, _settings("exact", executor="dask", scheduler=cluster.scheduler_address),
                          progress=lambda d, t: seen.append(d))
    assert np.array_equal(local.per_prompt, remote.per_prompt, equal_nan=True)
    assert np.array_equal(local.base, remote.base)
    assert seen[-1] == 13


def test_bad_execution_settings_are_refused():
    for kw, name in [({"workers": 0}, "workers"), ({"executor": "ray"}, "executor"),
                     ({"executor": "dask"}, "scheduler"), ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=name):
            EvalSettings(**kw).check()
    assert "workers" not in EvalSettings(workers=3).as_dict()  # execution does not change the results


@pytest.mark.parametrize("start", [None, -5.0, 0.3, 0.7, 2.0])
def test_batched_itp_lambda_is_the_exact_root_from_any_start(start):
    from privalign.accounting import itp_lambda

    rng = np.random.default_rng(4)
    x = np.concatenate([rng.random((20, 64)), np.round(rng.random((5, 64)), 1)])  # ties too
    got = laws.lambda_rows(x, 0.05, start=start)
    assert np.allclose(got, [itp_lambda(row, 0.05) for row in x], rtol=0, atol=1e-12)
    assert np.allclose(got, laws._lambda_rows_sorted(x, 0.05), rtol=0, atol=1e-12)
    assert np.allclose(np.maximum(x - got[:, None], 0).sum(axis=1), 64 * 0.05, rtol=1e-12)


@pytest.mark.parametrize("truncation", [0.0, 1.5])
def test_privitp_acceptance_matches_the_log_space_closed_form(truncation):
    from privalign._special import log_mean_ndtr

    rng = np.random.default_rng(5)
    x = rng.random(40)
    lam_t = np.r_[rng.uniform(-0.05, 1.0, 5), 1.0]  # lambda~ = r_max: c = L, zero without truncation
    i2 = rng.integers(0, x.size, (lam_t.size, 30))
    sz = 0.25
    got = laws.privitp_acceptance_rows(x[i2], lam_t, sz, 1.0, truncation)
    tabled = laws.privitp_acceptance_rows(x[i2], lam_t, sz, 1.0, truncation,
                                          laws.privitp_lower(x, sz, 1.0, truncation)[i2])
    assert np.array_equal(got, tabled)
    b = (1.0 + sz * truncation - lam_t)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.exp(log_mean_ndtr((x[i2] - lam_t[:, None] - b) / sz, np.broadcast_to(b / sz, i2.shape)))
    if truncation == 0.0:  # c = 0: the uniform mixture collapses to Phi((r - r_max) / sigma_Z)
        from scipy.special import ndtr
        want[-1] = ndtr((x[i2[-1]] - 1.0) / sz)
    assert np.allclose(got, want, rtol=0, atol=1e-12)
