"""Issue 52: ``rm train --preferences --features embedding`` (a certified head on the real MiniLM's
sentence embeddings of each pair) and its release with ``rm release``, scored with ``privalign score``
and served with released-bon; small slices of the shipped example files."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from privalign.cli import app
from privalign.rewards.embedding_bt import EMBEDDER, EmbeddingMap
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import ReleasedHead

from .test_rm_preferences import _slice


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("embedding")
    return _slice("preferences-example.jsonl", d / "mine.jsonl", 8), _slice("preferences-public-example.jsonl",
                                                                            d / "public.jsonl", 5)


def _train(mine, public, out, *extra):
    res = CliRunner().invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public",
                                   str(public), "--features", "embedding", "--max-pairs-per-person", "3", "--lam",
                                   "0.3,1", "--out", str(out), *extra])
    assert res.exit_code == 0, res.output
    return PolicyBTReward.load(out), " ".join(res.output.split())


@pytest.fixture(scope="module")
def trained(files, tmp_path_factory):
    mine, public = files
    out = tmp_path_factory.mktemp("head") / "head.json"
    head, printed = _train(mine, public, out)
    return out, head, printed


def test_an_embedding_head_is_certified_per_person_with_lambda_chosen_on_the_public_file(files, trained, tmp_path):
    mine, public = files
    out, head, printed = trained
    assert isinstance(head.feature_map, EmbeddingMap) and head.w.shape == (384,) and head.base_model == EMBEDDER
    assert head.persons == 8 and head.k == 3 and head.m == 24 and head.unit == "person"
    assert head.lam in (0.3, 1.0)
    assert head.sensitivity == pytest.approx(4 * 3 / (24 * head.lam) + 2e-9 / head.lam)
    g = head.guarantee()
    assert "user_id" in g["adjacency"] and g["public_inputs"]["person_ids"]["count"] == 8
    assert g["public_inputs"]["public_file"] == str(public) and "chooses lambda" in g["public_inputs"]["public_use"]
    assert "lambda chosen on the public preference file only" in g["hyperparameters"]
    assert head.meta["features"] == "embedding"
    assert "P = 8 persons (privacy unit: user_id)" in printed and "sentence embeddings" in printed
    assert "never on D" in printed and "beyond k" not in printed  # nothing read from D on stdout
    assert list(mine.with_name(f"mine.jsonl.features-{EMBEDDER}").glob("part-*.npy"))  # cached by content
    again, printed = _train(mine, public, tmp_path / "again.json")  # a second run reads the cache
    assert "featurizing" not in printed
    np.testing.assert_array_equal(again.w, head.w)


def _edited(src, dst, person, edit):
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    dst.write_text("".join(json.dumps(edit(r) if r["user_id"] == person else r) + "\n" for r in rows))
    return dst


def _message(text):
    return [{"role": "assistant", "content": text}]


def test_one_persons_rows_replaced_move_the_embedding_head_by_at_most_delta_r(files, trained, tmp_path):
    """Raw-file neighbours: one person's rows flipped, or replaced by texts of their own; the whole
    rm train rerun from the edited file (the same public file, the same roster)."""
    mine, public = files
    _, head, _ = trained
    person = sorted({json.loads(line)["user_id"] for line in mine.read_text().splitlines()})[2]
    edits = {"flipped": lambda r: {**r, "chosen": r["rejected"], "rejected": r["chosen"]},
             "replaced": lambda r: {**r, "prompt": [{"role": "user", "content": "Write a poem about the sea."}],
                                    "chosen": _message("zzz " * 40), "rejected": _message("The sea, the sea.")}}
    for name, edit in edits.items():
        nb, _ = _train(_edited(mine, tmp_path / f"{name}.jsonl", person, edit), public, tmp_path / f"{name}.json")
        assert nb.lam == head.lam and nb.persons == head.persons
        moved = float(np.linalg.norm(nb.w - head.w))
        assert 0 < moved <= head.sensitivity, (name, moved, head.sensitivity)


def test_an_embedding_head_is_released_scored_and_served(trained, tmp_path):
    from privalign.accounting import gaussian_mechanism_noise_scale
    from privalign.rewards import reward_from_spec
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig
    from privalign.simulate import simulate

    model, head, _ = trained
    runner = CliRunner()
    rel = tmp_path / "released.json"
    res = runner.invoke(app, ["rm", "release", str(model), "--epsilon", "2", "--delta", "1e-6", "--out", str(rel)])
    assert res.exit_code == 0, res.output
    released = ReleasedHead.load(rel)
    g = released.release
    assert isinstance(released.feature_map, EmbeddingMap) and released.w_tilde.shape == (384,)
    assert g["unit"] == "person" and g["persons"] == 8 and g["sensitivity"] == head.sensitivity
    assert g["sigma"] == pytest.approx(gaussian_mechanism_noise_scale(2.0, head.sensitivity, 1e-6))
    assert g["public_inputs"] == head.meta["public_inputs"]
    body = json.loads(rel.read_text())
    assert body["publishable"] and "w" not in body and body["feature_map"]["kind"] == "embedding"
    # a second release is refused without --again; with it, the file states the composed total
    res = runner.invoke(app, ["rm", "release", str(model), "--epsilon", "1", "--delta", "1e-6", "--out",
                              str(tmp_path / "second.json")])
    assert res.exit_code == 2 and "already released 1 time(s)" in " ".join(res.output.split())
    assert not (tmp_path / "second.json").exists()
    res = runner.invoke(app, ["rm", "release", str(model), "--epsilon", "1", "--delta", "1e-6", "--out",
                              str(tmp_path / "second.json"), "--again"])
    assert res.exit_code == 0, res.output
    assert ReleasedHead.load(tmp_path / "second.json").release["composed"]["epsilon"] == pytest.approx(3.0)
    # privalign score: the texts embedded, w~ . phi
    pool = simulate("hackable", 2, 3, seed=1)
    pool.columns["prompt"] = np.array([f"What is {i} + {i}?" for i in pool.columns["prompt_id"]], object)
    pool.columns["response"] = np.array([f"It is {2 * i + s}." for i, s in zip(pool.columns["prompt_id"],
                                                                               pool.columns["sample_id"])], object)
    pool.save(tmp_path / "pool.parquet")
    from privalign.pipeline import features_path, save_features

    save_features(features_path(tmp_path / "pool.parquet"), np.ones((6, 9), np.float32), pool.columns["prompt_id"],
                  pool.columns["sample_id"])  # recorded policy features: the embedding head does not read them
    res = runner.invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"policy-bt:{rel}"])
    assert res.exit_code == 0, res.output
    from privalign.pools import load_pool

    scored = load_pool(tmp_path / "pool.parquet").columns[f"reward:{released.name}"]
    loaded = reward_from_spec(f"policy-bt:{rel}")
    want = loaded.score(list(pool.columns["prompt"]), list(pool.columns["response"]))
    np.testing.assert_allclose(scored, want, rtol=1e-6)
    phi = loaded.feature_map(loaded._policy().featurize([{"role": "user", "content": "What is 1 + 1?"}], ["It is 2."]))
    assert np.linalg.norm(phi) <= 1 and loaded.score(["What is 1 + 1?"], ["It is 2."])[0] == pytest.approx(
        float((phi @ released.w_tilde)[0]))
    # the service: released-bon, 0 per answer, the release charged once to the model budget
    cfg = ServiceConfig.model_validate({
        "ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
        "reward": {"kind": "policy-bt", "path": str(rel)},
        "mechanism": {"name": "released-bon", "n": 3}, "clients": {"k": {"tenant": "a"}},
        "budgets": [{"name": "a", "tenant": "a", "epsilon_total": 1.0, "delta_total": 1e-6}],
        "model_budget": {"name": "model", "epsilon_total": 5.0, "delta_total": 1e-5}, "warm_up": False})
    svc = Service(cfg, generator=StubGenerator())
    try:
        out = svc.answer([{"role": "user", "content": "What is 12 + 30?"}], None, "a")
        assert out["privalign"]["epsilon_charged"] == 0
        assert svc.guarantee()["unit"] == "person"
        assert svc.ledger.budget("model").spent.epsilon == pytest.approx(2.0)
    finally:
        svc.close()


def test_bad_features_with_preferences_is_one_line(files, tmp_path):
    mine, public = files
    res = CliRunner().invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public",
                                   str(public), "--features", "pixels", "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "must be 'policy' or 'embedding'" in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public",
                                   str(public), "--features", "embedding", "--components", "4", "--out",
                                   str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "--components apply to policy features" in " ".join(res.output.split()), res.output
    assert not list(tmp_path.glob("x*"))


def test_rm_evaluate_reads_an_embedding_head_on_held_out_pairs(trained, tmp_path):
    from .test_rm_preferences import _slice

    model, head, _ = trained
    heldout = _slice("preferences-heldout-example.jsonl", tmp_path / "heldout.jsonl", 3)
    res = CliRunner().invoke(app, ["rm", "evaluate", str(model), "--preferences", str(heldout), "--release-epsilon",
                                   "1,10", "--draws", "20", "--json"])
    assert res.exit_code == 0, res.output
    r = json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]
    assert 0 <= r["exact"]["lo"] <= r["exact"]["accuracy"] <= r["exact"]["hi"] <= 1
    assert "logprob_alone" not in r  # an embedding has no log-probability coordinate
    assert r["releases"][0]["sigma"] > r["releases"][1]["sigma"]
    from privalign.simulate import simulate

    simulate("hackable", 2, 3, seed=1).save(tmp_path / "pool.parquet")
    res = CliRunner().invoke(app, ["rm", "evaluate", str(model), "--preferences", str(heldout), "--pool",
                                   str(tmp_path / "pool.parquet")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "reads sentence embeddings" in out and len(res.output.strip().splitlines()) <= 3, out
