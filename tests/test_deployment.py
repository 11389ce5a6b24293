"""Issue 49: the release with thousands of persons, through a user's path. The shipped deployment head
(4,800 persons, rm train --preferences on examples/build_deployment.py's file) and the counting test
pool carrying its coordinates reproduce the target from a clean clone, in seconds."""

import json
import re
import sys
from importlib import resources
from pathlib import Path

import numpy as np
from typer.testing import CliRunner

from privalign.cli import app
from privalign.pools import Pool
from privalign.preferences.trl import check_disjoint, read_preferences
from privalign.rewards.policy_bt import PolicyBTReward

DATA = resources.files("privalign") / "data"
HEAD, POOL = DATA / "counting-deployment-person.json", DATA / "counting-deployment-smollm2.parquet"


def test_the_shipped_deployment_head_is_a_person_unit_head_of_thousands():
    head = PolicyBTReward.load(HEAD)
    g = head.guarantee()
    assert head.persons == 4800 and head.k == 16 and head.unit == "person"
    assert "user_id" in g["adjacency"] and g["public_inputs"]["person_ids"]["count"] == 4800
    assert head.sensitivity < 4 / (head.persons * head.lam) + 1e-6  # 4k / (m lambda) + 2 g_tol / lambda


def test_plan_reproduces_the_release_target_at_epsilon_1_from_the_shipped_files():
    """At (1, 1e-6) the release keeps >= 90% of BoN's lift at n = 16 on average and >= 80% at the 5th
    percentile over 60 draws, on the 300 test prompts (docs/experiments.md, the issue's target)."""
    res = CliRunner().invoke(app, ["plan", "--epsilon-total", "1", "--delta-total", "1e-6", "--queries", "100",
                                   "--model", str(HEAD), "--pool", str(POOL), "--reward", "deploy-p4800",
                                   "--release-epsilon", "1", "--target-share", "0.9"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    m = re.search(r"epsilon_w 1: \d+ pairs \(4800 persons of k = 16\) keep (\d+)% of the lift on average and (\d+)% "
                  r"at the 5th percentile", out)
    assert m and int(m.group(1)) >= 90 and int(m.group(2)) >= 80, out
    assert "recommended: release then BoN" in out and "not covered by the guarantee" in out


def test_build_deployment_writes_disjoint_trl_files_with_many_persons(tmp_path):
    """examples/build_deployment.py: persons drawn over a pool's prompts, some with two prompts; the
    public and held-out files share no row and no person with the deployment; same seed, same bytes."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import build_deployment as b

    rng = np.random.default_rng(0)
    ids = np.repeat([f"counting-train-{i}" for i in range(60)], 12)
    resp = np.array([str(v) for v in rng.integers(0, 30, ids.size)], object)
    cols = {"prompt_id": ids, "sample_id": np.tile(np.arange(12), 60), "prompt": np.array(["q"] * ids.size, object),
            "response": resp, "answer": resp, "true_reward": (rng.random(ids.size) < 0.3).astype(float),
            "logprob": np.zeros(ids.size), "n_tokens": np.ones(ids.size, int), "reward:logprob": np.zeros(ids.size)}
    Pool(cols, {"task": "counting", "split": "train", "base_model": "smollm2", "reward_models": ["logprob"],
                "true_reward_source": "grader"}).save(tmp_path / "pool.parquet")
    counts = b.build(tmp_path / "pool.parquet", tmp_path / "a", persons={"public": 10, "heldout": 12, "deployment": 200})
    b.build(tmp_path / "pool.parquet", tmp_path / "b", persons={"public": 10, "heldout": 12, "deployment": 200})
    d = read_preferences(tmp_path / "a" / "deployment.jsonl", "user_id")
    assert counts["deployment"]["persons"] == d.n_persons == 200
    assert (tmp_path / "a" / "deployment.jsonl").read_bytes() == (tmp_path / "b" / "deployment.jsonl").read_bytes()
    prompts = [{json.dumps(p) for p, who in zip(d.prompts, d.person) if who == u} for u in np.unique(d.person)]
    assert any(len(p) == 2 for p in prompts) and max(len(p) for p in prompts) <= 2
    assert max(np.unique(d.person, return_counts=True)[1]) <= b.PAIRS_PER_PERSON
    for name in ("public", "heldout"):
        check_disjoint(read_preferences(tmp_path / "a" / f"{name}.jsonl", "user_id"), d)


def test_reproduce_headline_names_the_mode_and_epsilon_w():
    """Item 6: the release sentence says which mode a deployment should use and at what epsilon_w."""
    from privalign.report.html import _release_sentence

    def rel(shares, smallest):
        at = {str(e): {"epsilon_w": e, "mean": 0.2 + 0.4 * m, "p5": 0.2 + 0.4 * p, "share_mean": m, "share_p5": p,
                       "per_query_q1000": 0.25} for e, (m, p) in shares.items()}
        return {"name": "h", "persons": 4800, "pairs_per_person": 16, "delta_w": 1e-6, "n": 16, "bon": 0.6,
                "base": 0.2, "at": at, "smallest": smallest}

    num, verdict, name = (lambda v: f"{v:.3g}"), (lambda ok: "met" if ok else "not met"), (lambda s: s)
    met = _release_sentence(rel({0.3: (0.93, 0.76), 1.0: (1.0, 0.99)},
                                {"epsilon_w": 0.305, "met": True, "share_mean": 0.95, "share_p5": 0.8, "draws": 60,
                                 "bounds": [0.01, 1000]}), num, verdict, name)
    assert "Recommended mode for a deployment with this head: release it once at epsilon_w = 0.305" in met
    assert "per-query PrivBoN over 1,000 queries reaches 0.25" in met
    short = _release_sentence(rel({1.0: (0.5, 0.1)}, {"epsilon_w": None, "met": False, "share_mean": 0.8,
                                                     "share_p5": 0.5, "draws": 60, "bounds": [0.01, 1000]}),
                              num, verdict, name)
    assert "Recommended mode: per-query PrivBoN" in short and "plan --target-share" in short
    far = _release_sentence(rel({1.0: (0.5, 0.1), 10.0: (0.8, 0.5)},
                                {"epsilon_w": 26.2, "met": True, "share_mean": 0.95, "share_p5": 0.8, "draws": 60,
                                 "bounds": [0.01, 1000]}), num, verdict, name)
    assert "Recommended mode: per-query PrivBoN" in far and "would need epsilon_w = 26.2" in far
