"""policy-bt: the policy's own features (real SmolLM2), the feature map's norm bound, training with
validation-chosen lambda, the certificate under adversarial replacement, and the CLI."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from privalign.cli import app
from privalign.pipeline import features_path, generate_pool, pool_features, save_features, score_pool
from privalign.metrics import within_prompt_auc
from privalign.pools import Pool, load_pool
from privalign.preferences.splits import split_ids as split_train_prompts
from privalign.pipeline import load_reward
from privalign.rewards.policy_bt import (
    FeatureMap,
    PolicyBTReward,
    model_procedure,
    retrain,
    preference_rows,

    train_policy_bt,
    train_procedure,
)
from privalign.rewards.neighbours import EDITS, check_sensitivity, edited
from privalign.tasks import get_task

H = 16  # hidden size of the synthetic features


def synthetic_pool(prompts=60, samples=24, seed=0):
    """Raw features [h_last, h_mean, lp] where correct answers sit higher along one hidden direction."""
    rng = np.random.default_rng(seed)
    pid = np.repeat([f"p{i}" for i in range(prompts)], samples)
    acc = rng.uniform(0.1, 0.6, prompts).repeat(samples)
    y = (rng.random(pid.size) < acc).astype(float)
    h = rng.standard_normal((pid.size, H)) * 3.0 + 10.0
    h[:, 0] += 4.0 * y
    lp = -rng.gamma(2.0, 0.5, pid.size) + 0.3 * y
    raw = np.concatenate([h, h, lp[:, None]], axis=1).astype(np.float32)
    return pid, y, raw


def test_feature_map_has_norm_at_most_one_for_any_input():
    pid, y, raw = synthetic_pool()
    fmap = FeatureMap.fit(raw, q=8)
    rng = np.random.default_rng(1)
    wild = np.concatenate([raw, rng.standard_normal((500, raw.shape[1])) * 1e6,
                           rng.standard_normal((5, raw.shape[1])) * 1e300])
    # a NaN or infinite hidden state sits at the origin (an error would depend on one person's rows)
    nan = fmap(np.full((1, raw.shape[1]), np.nan))
    assert np.isfinite(nan).all() and np.allclose(nan[0, :-1], 0)
    phi = fmap(wild)
    assert phi.shape == (wild.shape[0], 9) and np.isfinite(phi).all()
    assert np.all(np.linalg.norm(phi, axis=1) <= 1 + 1e-12)


def test_training_chooses_lambda_on_validation_prompts_and_its_certificate_holds():
    pid, y, raw = synthetic_pool()
    model, grid = train_policy_bt(raw, pid, y, lambdas=(0.01, 0.1, 1.0), components=(4, 8), seed=0,
                                  range_epsilon=0.0)
    assert len(grid) == 18 and model.lam in (0.01, 0.1, 1.0)  # q x c x lambda
    assert model.meta["selection_auc"] > 0.6  # the planted signal is found on prompts it was not trained on
    assert model.private["val_auc"] > 0.6
    assert model.sensitivity == pytest.approx(4 * model.k / (model.m * model.lam) + 2 * model.g_tol / model.lam)
    lo, hi = model.output_range
    assert hi == pytest.approx(min(np.sqrt(2 * np.log(2) / model.lam), 1 / model.lam) + model.g_tol / model.lam)
    scores = model.score_features(raw)
    assert np.all((scores >= lo) & (scores <= hi))
    rows = check_sensitivity(model, raw, pid, y, trials=21, seed=3)
    assert {r["adversary"] for r in rows} == set(EDITS)  # every raw-data edit is tried
    assert not any(r["settings_changed"] for r in rows)  # the whole procedure was rerun; its choice held
    assert max(r["weight_change"] for r in rows) <= model.sensitivity
    assert max(r["max_score_change"] for r in rows) <= model.sensitivity
    assert max(r["weight_change"] for r in rows) > 0.05 * model.sensitivity  # the attack has teeth


def test_the_choice_of_settings_never_reads_d():
    """Issue 23: (q, c, lambda) and the whole selection grid are the same for any D' ~ D, and the
    final head moves by at most Delta_r. The old procedure trained its candidates on D, so changing
    D's labels changed the grid (and, near a tie, the choice)."""
    pid, y, raw = synthetic_pool()
    kw = dict(lambdas=(0.01, 0.1, 1.0), components=(4, 8), cs=(0.6, 0.95), seed=0)
    base = train_procedure(raw, pid, y, **kw)
    fit_p, _ = split_train_prompts(pid, 0.6, 0)
    in_d = np.isin(pid, list(fit_p))
    # every correctness label of D's prompts flipped: a data set as far from D as can be
    flipped = train_procedure(raw, pid, np.where(in_d, 1 - y, y), **kw)
    assert flipped.grid == base.grid and flipped.settings == base.settings
    assert np.array_equal(flipped.feature_map.components, base.feature_map.components)
    # one person's raw rows at a time, each of the first 12 people: flipped, emptied, or made extreme
    for person in sorted(set(base.data.person.tolist()))[:12]:
        for kind in ("flipped", "all-correct", "extreme"):
            nb = edited(raw, pid, y, person, kind, fmap=base.feature_map, direction=-base.w)
            t = train_procedure(nb.raw, nb.prompt_ids, nb.correct, **kw)
            assert t.grid == base.grid and t.settings == base.settings
            sens = 4 * 16 / (base.m * t.lam) + 2 * 1e-9 / t.lam  # k = 16
            assert np.linalg.norm(t.w - base.w) <= sens


def test_a_smaller_deployment_keeps_fewer_people_and_pays_in_sensitivity():
    """``max_persons`` (reward models of several strengths): D is a seeded subset of P people, the
    certificate is for that P (Delta_r = 4k/(P k lambda)), the rerun procedure reproduces it, and
    the legacy ``max_pairs`` is refused under the person unit."""
    pid, y, raw = synthetic_pool()
    kw = dict(lambdas=(0.1, 1.0), components=(4,), seed=0, range_epsilon=0.0, pairs_per_person=4)
    full, _ = train_policy_bt(raw, pid, y, **kw)
    small, _ = train_policy_bt(raw, pid, y, max_persons=10, **kw)
    assert small.meta["persons"] == 10 < full.meta["persons"]
    assert small.m == 40 < full.m
    assert small.sensitivity == pytest.approx(4 * 4 / (40 * small.lam) + 2e-9 / small.lam)
    assert model_procedure(small)["max_persons"] == 10
    assert np.allclose(retrain(small, raw, pid, y).w, small.w)  # the recorded procedure reruns it
    assert max(r["weight_change"] for r in check_sensitivity(small, raw, pid, y, trials=6, seed=1)) <= small.sensitivity
    with pytest.raises(ValueError, match="max_persons"):
        train_policy_bt(raw, pid, y, max_persons=0, **kw)
    with pytest.raises(ValueError, match="max_pairs=40"):
        train_policy_bt(raw, pid, y, max_pairs=40, **kw)


def test_the_unit_of_privacy_is_a_person_with_at_most_k_pairs():
    """Each fit prompt is one person; at most k of their pairs are kept (seeded, excess dropped and
    counted); m = P k, so replacing all of one person's pairs moves w by at most Delta_r, and the
    certificate states k and the adjacency in persons."""
    from privalign.rewards.policy_bt import bound_per_person, train_procedure

    person = np.array(list("aaaaabbc"))
    keep = bound_per_person(person, 2, seed=0)
    assert [int((person[keep] == p).sum()) for p in "abc"] == [2, 2, 1]
    assert np.array_equal(keep, bound_per_person(person, 2, seed=0))  # seeded
    pid, y, raw = synthetic_pool()
    kw = dict(lambdas=(1.0,), components=(4,), seed=0, pairs_per_prompt=16)
    t = train_procedure(raw, pid, y, pairs_per_person=3, **kw)
    counts = np.unique(t.data.person, return_counts=True)[1]
    assert counts.max() <= 3 and t.m == 3 * t.data.persons and t.data.dropped > 0
    assert t.private["pairs_dropped_beyond_k"] == t.data.dropped
    assert t.private["pairs"] + t.data.dropped == int(counts.sum()) + t.data.dropped
    model, _ = train_policy_bt(raw, pid, y, pairs_per_person=3, range_epsilon=0.0, **kw)
    g = model.guarantee()
    assert "(their pairs: at most k = 3" in g["adjacency"] and "P = " in g["adjacency"]
    # the worst neighbours the data-level search finds: within the person certificate, and a
    # sizeable share of it (the search has teeth; the certificate is a worst case over all D)
    rows = check_sensitivity(model, raw, pid, y, trials=8, seed=0)
    moved = max(r["weight_change"] for r in rows)
    assert 0.25 * model.sensitivity < moved <= model.sensitivity


def test_the_served_file_holds_no_d_derived_diagnostics(tmp_path):
    pid, y, raw = synthetic_pool()
    model, _ = train_policy_bt(raw, pid, y, lambdas=(0.1,), components=(4,), seed=0, range_epsilon=0.2,
                               rng=np.random.default_rng(0))
    model.save(tmp_path / "rm.json")
    body = json.loads((tmp_path / "rm.json").read_text())
    text = json.dumps({k: v for k, v in body.items() if k != "w"})
    for word in ("train_pair_accuracy", "achieved_grad_norm", "val_auc", "weight_norm"):
        assert word not in text
    g = body["guarantee"]
    assert g["selection_epsilon"] == 0 and g["range_epsilon"] == 0.2 and g["one_time_epsilon"] == 0.2
    assert "without reading D" in g["hyperparameters"] and "operator" in g["secret"]
    assert body["meta"]["procedure"]["lambdas"] == [0.1]
    model.save_private(tmp_path / "rm.private.json")
    private = json.loads((tmp_path / "rm.private.json").read_text())
    assert "never publish" in private["PRIVATE"] and "train_pair_accuracy" in private
    # a file of the old procedure cannot be checked as if its certificate covered it
    del body["meta"]["procedure"]
    (tmp_path / "old.json").write_text(json.dumps(body))
    with pytest.raises(ValueError, match="read D"):
        check_sensitivity(PolicyBTReward.load(tmp_path / "old.json"), raw, pid, y, trials=1)


def test_private_range_release_is_tight_and_keeps_the_certificate():
    pid, y, raw = synthetic_pool()
    model, _ = train_policy_bt(raw, pid, y, lambdas=(1.0,), components=(4,), seed=0, range_epsilon=0.0,
                               pairs_per_person=1, unit="pair")  # many pairs: a small Delta_r
    wide = model.output_range
    norm = float(np.linalg.norm(model.w))
    draws = [model.release_range(0.5, np.random.default_rng(s))[1] for s in range(400)]
    # B = ||w|| + Laplace(Delta_r / 0.5): centred on ||w||, spread Delta_r / 0.5, never below Delta_r
    assert abs(np.median(draws) - norm) < 0.2 * model.sensitivity / 0.5
    assert np.std(draws) == pytest.approx(np.sqrt(2) * model.sensitivity / 0.5, rel=0.2)
    assert min(draws) >= model.sensitivity and max(draws) <= wide[1]
    assert model.range_epsilon == 0.5 and model.certificate()["range_epsilon"] == 0.5
    assert model.sensitivity == pytest.approx(4 / (model.m * model.lam) + 2 * model.g_tol / model.lam)


def test_preference_pairs_are_within_prompt_and_correct_over_incorrect():
    pid, y, _ = synthetic_pool(prompts=10)
    ci, ri = preference_rows(pid, y, {f"p{i}" for i in range(5)}, pairs_per_prompt=7)
    assert np.all(pid[ci] == pid[ri]) and np.all(y[ci] == 1) and np.all(y[ri] == 0)
    assert len(set(zip(ci.tolist(), ri.tolist()))) == ci.size  # distinct pairs
    assert within_prompt_auc(np.array([0.0, 1.0, 2.0]), np.array([0, 1, 1]), np.array(["a", "a", "a"])) == 1.0


def test_cli_train_and_check_sensitivity(tmp_path):
    pid, y, raw = synthetic_pool()
    path = tmp_path / "train.parquet"
    Pool({"prompt_id": pid.astype(object), "sample_id": np.tile(np.arange(24), 60), "true_reward": y,
          "reward:logprob": raw[:, -1].astype(float)}, {"task": "arithmetic-mix"}).save(path)
    save_features(features_path(path), raw, pid, np.tile(np.arange(24), 60))
    runner = CliRunner()
    res = runner.invoke(app, ["rm", "train", "--task", "arithmetic-mix", "--features", "policy", "--pool", str(path),
                              "--lam", "0.03,0.3", "--components", "4", "--out", str(tmp_path / "rm.json")])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "beyond k dropped" not in out and "train pair accuracy" not in out  # nothing read from D on stdout (issue 48)
    for word in ("m = P k = ", "k = 16", "persons", "private report", "lambda = ", "Delta_r = ", "selection AUC", "log-probability alone",
                 "without reading D", "private"):
        assert word in out
    assert (tmp_path / "rm.private.json").exists()
    body = json.loads((tmp_path / "rm.json").read_text())
    assert body["kind"] == "policy-bt" and body["task"] == "arithmetic-mix"
    res = runner.invoke(app, ["rm", "check-sensitivity", str(tmp_path / "rm.json"), "--pool", str(path),
                              "--trials", "20"])
    assert res.exit_code == 0, res.output
    assert "certified Delta_r" in res.output and "changed in 0" in " ".join(res.output.split())
    assert "retraining rm.json on its neighbours: 21/21" in res.output  # progress: the model's own + 20 trials
    res = runner.invoke(app, ["rm", "train", "--features", "policy", "--out", str(tmp_path / "x.json")])
    assert res.exit_code == 2 and "--pool" in res.output


def test_real_policy_features_match_between_sampling_and_teacher_forcing(tmp_path, smollm2):
    """The real model: features recorded while sampling equal the teacher-forced ones, a pool keeps
    them row-aligned, and scoring from recorded features equals scoring from text."""
    task = get_task("arithmetic-mix")
    problems = task.load("test", 2)
    pool = generate_pool(task, problems, smollm2, tmp_path / "p.parquet", samples=5, max_new_tokens=6, seed=1,
                         shard_size=1, features=True)
    raw = pool_features(pool, tmp_path / "p.parquet")
    assert raw.shape == (10, 2 * 576 + 1) and pool.metadata["policy_features"] == "p.parquet.features.npz"
    msgs = task.messages(problems[0])
    again = smollm2.featurize(msgs, [str(r) for r in pool.columns["response"][:5]])
    first = pool.columns["n_tokens"][:5] < 6  # closed by a sampled EOS (see below)
    assert np.allclose(raw[:5][first], again[first], atol=1e-3)

    fmap = FeatureMap.fit(raw, q=4)
    rng = np.random.default_rng(0)
    model = PolicyBTReward(rng.standard_normal(fmap.dim) * 0.1, 0.5, 100, 1, 1e-9, fmap, task="arithmetic-mix")
    model._generator = smollm2
    model.save(tmp_path / "rm.json")
    loaded = load_reward(f"policy-bt:{tmp_path / 'rm.json'}")
    loaded._generator = smollm2
    from_text = loaded.score([str(p) for p in pool.columns["prompt"]], [str(r) for r in pool.columns["response"]])
    # a sample cut at max_new_tokens was not closed by a sampled EOS: its recorded log-probability
    # excludes the EOS that teacher forcing appends (the hidden states agree either way)
    ended = pool.columns["n_tokens"] < 6
    assert ended.sum() >= 5
    assert np.allclose(from_text[ended], model.score_features(raw)[ended], atol=1e-4)
    assert np.allclose(smollm2.featurize(msgs, [str(r) for r in pool.columns["response"][:5]])[:, :-1], raw[:5, :-1],
                       atol=1e-3)
    score_pool(tmp_path / "p.parquet", [loaded])  # uses the recorded features
    scored = load_pool(tmp_path / "p.parquet")
    assert np.allclose(scored.columns["reward:policy-bt"], model.score_features(raw))
    assert scored.metadata["default_reward"] == "policy-bt"
    assert scored.metadata["reward_model_info"]["policy-bt"]["certificate"]["m"] == 100


def test_empirical_audit_has_power_on_bon_and_stays_below_the_claims():
    from privalign.audit import audit, clopper_pearson, epsilon_lower_bound

    lo, hi = clopper_pearson(0, 1000)
    assert lo == 0.0 and hi == pytest.approx(1 - 0.025 ** (1 / 1000))
    assert epsilon_lower_bound(1000, 0, 1000) > 5 and epsilon_lower_bound(500, 500, 1000) == 0.0
    pid, y, raw = synthetic_pool()
    model, _ = train_policy_bt(raw, pid, y, lambdas=(0.1,), components=(4,), seed=0, range_epsilon=0.0)
    res = audit(model, raw, pid, y, epsilon=1.0, runs=20_000, seed=0)
    assert res["realised_sensitivity"] <= res["certified_sensitivity"]
    rows = {r["mechanism"]: r for r in res["rows"]}
    assert rows["bon"]["epsilon_lower_bound"] >= 3  # the canary flips BoN's choice: the attack has power
    for mech in ("privbon", "privbon-gaussian", "privitp", "privitp-capped"):  # capped: issue 31
        assert rows[mech]["epsilon_lower_bound"] <= rows[mech]["claimed_epsilon"]
