"""Auditing the one-time release of a certified head (issue 28 item 5): ``audit.audit_release`` and
``privalign audit --release``."""

import json
import math

import numpy as np
import pytest
from scipy import stats
from typer.testing import CliRunner

from privalign.accounting import gaussian_mechanism_epsilon
from privalign.audit import _gaussian_pair_power, audit_release, epsilon_lower_bound
from privalign.cli import app
from privalign.rewards.policy_bt import train_policy_bt
from privalign.rewards.release import draw_release, release_head, release_noise_scale

from .test_policy_bt import synthetic_pool
from .test_release import KW, _train_pool

EPS_W, DELTA_W, RUNS = 1.0, 1e-6, 20_000


@pytest.fixture(scope="module")
def trained():
    pid, y, raw = synthetic_pool()
    model, _ = train_policy_bt(raw, pid, y, task="arithmetic-mix", **KW)
    return model, pid, y, raw


def test_the_audit_draws_through_the_release_sampling_step(trained):
    model = trained[0]
    sigma = release_noise_scale(model, EPS_W, DELTA_W)
    head = release_head(model, EPS_W, DELTA_W, np.random.default_rng(7))
    assert np.array_equal(head.w_tilde, draw_release(model.w, sigma, np.random.default_rng(7)))
    many = draw_release(model.w, sigma, np.random.default_rng(7), draws=3)
    assert many.shape == (3, model.w.size) and np.array_equal(many[0], head.w_tilde)


def test_a_threshold_on_the_projection_can_show_the_whole_claim_at_the_certified_shift(trained):
    """On the projection, the release is the Gaussian pair N(0, 1) vs N(mu, 1): at mu = Delta_r /
    sigma the best threshold test reaches epsilon_w exactly (the analytic Gaussian's profile), so
    the direction loses nothing; at a finite sample size the test shows less."""
    model = trained[0]
    sigma = release_noise_scale(model, EPS_W, DELTA_W)
    mu = model.sensitivity / sigma
    t = np.linspace(-5, 15, 200_001)
    with np.errstate(invalid="ignore", divide="ignore"):
        best = np.nanmax(np.log((stats.norm.sf(t - mu) - DELTA_W) / stats.norm.sf(t)))
    assert best == pytest.approx(EPS_W, abs=1e-3)
    assert gaussian_mechanism_epsilon(sigma, model.sensitivity, DELTA_W) == pytest.approx(EPS_W, rel=1e-9)
    assert _gaussian_pair_power(mu, RUNS, DELTA_W) < best
    assert _gaussian_pair_power(100 * mu, RUNS, DELTA_W) == pytest.approx(epsilon_lower_bound(RUNS, 0, RUNS, DELTA_W))


def test_the_release_audit_stays_below_the_claim_and_catches_100_times_too_little_noise(trained):
    model, pid, y, raw = trained
    good = audit_release(model, raw, pid, y, epsilon_w=EPS_W, delta_w=DELTA_W, runs=RUNS, seed=0)
    assert good["noise_factor"] == 1.0 and good["epsilon_at_certified_sensitivity"] == pytest.approx(EPS_W)
    # the neighbour is within the certificate, and a strong one (0.41 of Delta_r measured)
    assert 0.25 * good["certified_sensitivity"] < good["realised_shift"] <= good["certified_sensitivity"]
    assert good["mu"] == pytest.approx(good["realised_shift"] / good["sigma"])
    assert good["epsilon_lower_bound"] <= good["epsilon_of_realised_pair"] < EPS_W
    assert good["events_D"] + good["events_D_prime"] > 0

    sigma = release_noise_scale(model, EPS_W, DELTA_W) / 100
    bad = audit_release(model, raw, pid, y, epsilon_w=EPS_W, delta_w=DELTA_W, runs=RUNS, seed=0, noise_scale=sigma)
    assert bad["noise_factor"] == pytest.approx(0.01) and bad["realised_shift"] == good["realised_shift"]
    assert bad["epsilon_lower_bound"] > EPS_W  # caught
    # and by as much as the sample size allows: at most 5 draws per side on the wrong side of the threshold
    assert bad["epsilon_lower_bound"] >= epsilon_lower_bound(RUNS - 5, 5, RUNS, DELTA_W)
    assert bad["largest_bound_for_runs"] == pytest.approx(epsilon_lower_bound(RUNS, 0, RUNS, DELTA_W))


@pytest.mark.parametrize("kwargs, message", [
    (dict(epsilon_w=math.nan), "epsilon must be positive and finite, got nan"),
    (dict(epsilon_w=math.inf), "epsilon must be positive and finite, got inf"),
    (dict(delta_w=0.5), r"delta must lie in \(0, 1/P\) = \(0, 0.0278\) for P = 36 persons, got 0.5"),
    (dict(runs=10), "runs must be at least 1000 release draws per side, got 10"),
    (dict(noise_scale=0.0), "noise_scale must be positive and finite, got 0.0"),
])
def test_bad_release_audit_input_is_named(trained, kwargs, message):
    model, pid, y, raw = trained
    args = {"epsilon_w": EPS_W, "delta_w": DELTA_W, "runs": RUNS, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        audit_release(model, raw, pid, y, **args)


def test_cli_audit_release(tmp_path):
    runner = CliRunner()
    pool = _train_pool(tmp_path)
    res = runner.invoke(app, ["rm", "train", "--task", "arithmetic-mix", "--features", "policy", "--pool", str(pool),
                              "--lam", "1", "--components", "4", "--pairs-per-person", "4", "--release-epsilon", "1",
                              "--out", str(tmp_path / "rm.json")])
    assert res.exit_code == 0, res.output
    base = ["audit", "--model", str(tmp_path / "rm.json"), "--pool", str(pool), "--runs", str(RUNS), "--seed", "0"]
    res = runner.invoke(app, [*base, "--release", "1", "--out", str(tmp_path / "a")])
    text = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "the bound stays below the claimed epsilon_w 1" in text and "certified Delta_r = 0.1111" in text
    record = json.loads((tmp_path / "a" / "release-audit.json").read_text())
    assert record["epsilon_lower_bound"] <= 1.0 and record["runs_per_side"] == RUNS and record["seed"] == 0
    res = runner.invoke(app, [*base, "--release", "1", "--noise-factor", "0.01"])
    assert res.exit_code == 1, res.output
    assert "caught: the release's 95% lower bound" in " ".join(res.output.split())
    # bad input: a one-line error naming the value, exit 2, nothing written
    for args, message in [
        (["--release", "nan"], "--release must be a positive and finite epsilon_w, got nan"),
        (["--release", "-1"], "--release must be a positive and finite epsilon_w, got -1.0"),
        (["--release", "1", "--release-delta", "1"], "--release-delta must lie in (0, 1), got 1.0"),
        (["--release", "1", "--release-delta", "0.5"], "delta must lie in (0, 1/P) = (0, 0.0278) for P = 36"),
        (["--release", "1", "--noise-factor", "inf"], "--noise-factor must be positive and finite, got inf"),
        (["--noise-factor", "0.01"], "--noise-factor 0.01 applies only to a release audit"),
        (["--release", "1", "--runs", "10"], "--runs must be at least 1000 release draws per side, got 10"),
    ]:
        res = runner.invoke(app, [*base, *args, "--out", str(tmp_path / "x")])
        out = res.output.strip()
        assert res.exit_code == 2 and message in " ".join(out.split()), res.output
        assert out.startswith("error:") and not (tmp_path / "x").exists()
    res = runner.invoke(app, [*base, "--release"])
    assert res.exit_code == 2 and "--release" in res.output
    res = runner.invoke(app, ["audit", "--model", str(tmp_path / "rm.released.json"), "--pool", str(pool),
                              "--release", "1"])
    assert res.exit_code == 2 and "needs the exact weights" in " ".join(res.output.split())
