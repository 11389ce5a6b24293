"""The large-n study (issue 20): curves to large n per certified reward model, BoN's fall measured
from a peak chosen on held-out prompts, and the paper's claim in words."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from privalign.cli import app
from privalign.evaluation import EvalSettings
from privalign.evaluation.large_n import claim_sentence, study
from privalign.evaluation.suite import LARGE_POOLS
from privalign.report.jobs import run_large_n
from privalign.pools import Pool


def hacked_pool(prompts=40, samples=256, hack=0.02, seed=0):
    """Correct answers score higher, except a few wrong answers the reward model loves (a hack)."""
    rng = np.random.default_rng(seed)
    pid = np.repeat([f"p{i}" for i in range(prompts)], samples)
    acc = rng.uniform(0.2, 0.6, prompts).repeat(samples)
    y = (rng.random(pid.size) < acc).astype(float)
    r = 0.35 + 0.25 * y + 0.08 * rng.standard_normal(pid.size)
    hacked = rng.random(pid.size) < hack
    y[hacked] = 0.0
    r[hacked] = 0.95 + 0.02 * rng.random(hacked.sum())
    r = np.clip(r, 0, 1)
    cols = {"prompt_id": pid.astype(object), "sample_id": np.tile(np.arange(samples), prompts), "true_reward": y,
            "reward:sharp": r, "reward:blurred": r}
    info = {"sharp": {"output_range": [0.0, 1.0], "sensitivity": 1e-3, "certificate": {"m": 4000, "task": "t"}},
            "blurred": {"output_range": [0.0, 1.0], "sensitivity": 0.3, "certificate": {"m": 10, "task": "t"}}}
    return Pool(cols, {"task": "synthetic", "reward_model_info": info, "sampling": {"samples": samples}}).validate()


@pytest.fixture(scope="module")
def hacked():
    return hacked_pool()


def test_bon_falls_on_a_hacked_reward_and_the_study_says_so(hacked):
    s = EvalSettings(replicates=20)
    res = study(hacked, "sharp", s, n_grid=(1, 4, 16, 64, 256))
    sm = res["summary"]
    bon = sm["bon"]
    # BoN rises first (the reward is right for most samples), then finds the hacks
    acc = {r["n"]: r["accuracy"] for r in res["rows"] if r["method"] == "BoN"}
    assert acc[16] > acc[1] + 0.1 and acc[256] < acc[16] - 0.2
    assert bon["falls"] and bon["peak_n"] in (4, 16, 64) and bon["ci"][0] > 0 and bon["last_n"] == 256
    # with Delta_r 1e-3 of the range, Gumbel PrivBoN at epsilon 1 is nearly BoN: it falls too
    gum = sm["private"]["PrivBoN (Gumbel) eps=1"]
    assert gum["falls"] and not sm["claim_met"]
    assert "falls" in claim_sentence(sm) and "not met" in claim_sentence(sm) and "points from BoN" in claim_sentence(sm)
    # ITP is also shown at its own best beta at every n, chosen on held-out prompts
    assert set(sm["itp_beta_by_n"]) == {"1", "4", "16", "64", "256"}
    assert {r["method"] for r in res["rows"]} >= {"BoN", "ITP", "ITP (beta tuned at each n)",
                                                  "PrivBoN (Gaussian) eps=1", "PrivITP eps=1"}


def test_a_noisier_certificate_keeps_private_selection_rising(hacked):
    """Delta_r = 0.3 of the range: the Gumbel temperature 0.6 stops PrivBoN from chasing the hacks."""
    sm = study(hacked, "blurred", EvalSettings(replicates=20), n_grid=(1, 4, 16, 64, 256))["summary"]
    assert sm["bon"]["falls"]
    assert not sm["private"]["PrivBoN (Gumbel) eps=1"]["falls"]
    assert sm["claim_met"] == (not any(v["falls"] for v in sm["private"].values()))


def test_run_large_n_writes_the_verdicts_figures_and_report(tmp_path, hacked):
    out = run_large_n(tmp_path / "r", hacked, "synthetic", settings=EvalSettings(replicates=10),
                      n_grid=(1, 8, 64, 256), prompts=20)
    body = json.loads((out / "large_n.json").read_text())
    assert [s["reward"] for s in body["studies"]] == ["sharp", "blurred"]
    assert all(s["test_prompts"] + s["held_prompts"] == 20 for s in body["studies"])
    for name in ("sharp", "blurred"):
        assert (out / f"large_n_{name}.png").exists()
    html = (out / "report.html").read_text()
    first = html[:html.index("<h2>sharp</h2>")]
    assert "The paper's claim" in first and "BoN peaks at n" in first  # the verdict on the first screen
    # issue 31: capped PrivITP has its own verdict column, its tuning and fallback rate per n, its own colour
    assert "claim: PrivITP capped eps=1" in first and "fallback" in html[html.index("<h2>sharp</h2>"):]
    from privalign.report.figures import CAPPED_COLOR, COLORS, _style

    assert _style({"algorithm": "privitp", "max_rounds": 16})["color"] == CAPPED_COLOR != COLORS["privitp"]
    assert _style({"algorithm": "privitp", "max_rounds": ""})["color"] == COLORS["privitp"]
    with pytest.raises(ValueError, match="not in the pool"):
        run_large_n(tmp_path / "x", hacked, rewards=["nope"], settings=EvalSettings(replicates=2))


def test_reproduce_large_on_a_slice_of_the_shipped_large_pool(tmp_path):
    """The real large-pool path on a slice (12 prompts) of the shipped counting pool."""
    from importlib import resources

    if not (resources.files("privalign") / "data" / LARGE_POOLS["counting"]).is_file():
        pytest.fail("the shipped large counting pool is missing (make pools-large)")
    r = CliRunner().invoke(app, ["reproduce", "--large", "--task", "counting", "--prompts", "12", "--replicates", "4",
                                 "--reward", "policy-bt,policy-bt-m100", "--out", str(tmp_path / "large")])
    assert r.exit_code == 0, r.output
    body = json.loads((tmp_path / "large" / "large_n.json").read_text())
    assert [s["reward"] for s in body["studies"]] == ["policy-bt", "policy-bt-m100"]
    assert all(s["n_max"] == 1024 for s in body["studies"])
    # fewer people, a larger certified sensitivity
    assert body["studies"][1]["sensitivity"] > 10 * body["studies"][0]["sensitivity"]
    assert r.output.count("The paper's claim") == 2


def test_the_large_n_study_shows_privbon_at_its_noise_floor_beside_the_claim(hacked):
    """Issue 51: tau chosen per n on held-out prompts; its rows spend 2 Delta_r / sigma; the claim
    still judges the mechanisms at epsilon's own noise."""
    from privalign.evaluation import private as P

    res = study(hacked, "sharp", EvalSettings(replicates=10), n_grid=(1, 16, 256))
    sm = res["summary"]
    label = f"PrivBoN (Gumbel) eps=1{P.TUNED}"
    assert set(sm["privbon_floor_by_n"]) == {"1", "16", "256"} and label not in sm["private"] and label in sm["verdicts"]
    for r in (r for r in res["rows"] if r["method"] == label):
        assert r["epsilon_spent"] == pytest.approx(2e-3 / max(2e-3, r["temperature"]), rel=1e-9)
        assert r["temperature"] == sm["privbon_floor_by_n"][str(r["n"])]["temperature"]
    # Delta_r = 1e-3: minimum-noise PrivBoN falls like BoN; a floor chosen on held-out prompts binds at n = 256
    assert sm["privbon_floor_by_n"]["256"]["sigma"] > 2e-3 and sm["privbon_floor_by_n"]["256"]["epsilon_spent"] < 1
