"""Issue 52: a user's own preference file through rm train --preferences, rm release, rm evaluate and
privalign serve, with the real SmolLM2 (small slices of the shipped example files, so that the
featurizing stays in seconds)."""

import json
from importlib import resources
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from privalign.cli import app
from privalign.preferences.trl import read_preferences
from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.preference_bt import PreferencePairs, train_preference_bt
from privalign.rewards.release import ReleasedHead

DATA = resources.files("privalign") / "data"


def _slice(src: str, dst: Path, users: int) -> Path:
    """The rows of the first ``users`` persons of a shipped example file."""
    rows = [json.loads(line) for line in (DATA / src).read_text().splitlines()]
    keep = sorted({r["user_id"] for r in rows})[:users]
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows if r["user_id"] in keep))
    return dst


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefs")
    return (_slice("preferences-example.jsonl", d / "mine.jsonl", 8),
            _slice("preferences-public-example.jsonl", d / "public.jsonl", 5),
            _slice("preferences-heldout-example.jsonl", d / "heldout.jsonl", 3))


def test_a_users_file_through_train_release_evaluate(files, tmp_path):
    mine, public, heldout = files
    runner = CliRunner()
    train = ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public", str(public),
             "--max-pairs-per-person", "3", "--lam", "0.3,1", "--components", "4", "--release-epsilon", "3",
             "--out", str(tmp_path / "head.json")]
    res = runner.invoke(app, train)
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "P = 8 persons (privacy unit: user_id)" in out and "k = 3" in out and "never on D" in out
    assert "dropped" in out and "beyond k" not in out  # nothing read from D on stdout
    head = PolicyBTReward.load(tmp_path / "head.json")
    assert head.persons == 8 and head.m == 24 and head.unit == "person"
    assert head.sensitivity == pytest.approx(4 * 3 / (24 * head.lam) + 2e-9 / head.lam)
    g = head.guarantee()
    assert "user_id" in g["adjacency"] and g["public_inputs"]["person_ids"]["count"] == 8
    assert list(mine.with_name("mine.jsonl.features-smollm2").glob("part-*.npy"))  # cached by content beside the file
    released = ReleasedHead.load(tmp_path / "head.released.json")
    assert released.release["unit"] == "person" and released.release["persons"] == 8
    # evaluate: the exact head, the log-probability alone and releases over draws, as JSON
    res = runner.invoke(app, ["rm", "evaluate", str(tmp_path / "head.json"), "--preferences", str(heldout),
                              "--release-epsilon", "1,10", "--draws", "20", "--json"])
    assert res.exit_code == 0, res.output
    r = json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]  # (a library may warn after it)
    assert r["pairs"] == len(read_preferences(heldout, "row")) and 0 <= r["exact"]["lo"] <= r["exact"]["hi"] <= 1
    assert [x["epsilon_w"] for x in r["releases"]] == [1.0, 10.0] and all(x["p5"] <= x["mean"] for x in r["releases"])
    assert r["releases"][0]["sigma"] > r["releases"][1]["sigma"]
    # a second run reads the cached features: only the public file's rows are new to nothing
    res = runner.invoke(app, [*train[:-1], str(tmp_path / "again.json")])
    assert res.exit_code == 0 and "featurizing" not in res.output, res.output


def test_a_released_preference_head_serves_each_answer_free(files, tmp_path):
    """privalign serve's Service with the released head of a user's file: 0 per answer, the release
    recorded once in the model budget, the statement in persons."""
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig

    mine, public, _ = files
    res = CliRunner().invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id",
                                   "--public", str(public), "--lam", "1", "--components", "4",
                                   "--release-epsilon", "2", "--out", str(tmp_path / "h.json")])
    assert res.exit_code == 0, res.output
    cfg = ServiceConfig.model_validate({
        "ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
        "reward": {"kind": "policy-bt", "path": str(tmp_path / "h.released.json")},
        "mechanism": {"name": "released-bon", "n": 3}, "clients": {"k": {"tenant": "a"}},
        "budgets": [{"name": "a", "tenant": "a", "epsilon_total": 1.0, "delta_total": 1e-6}],
        "model_budget": {"name": "model", "epsilon_total": 5.0, "delta_total": 1e-5}, "warm_up": False})
    svc = Service(cfg, generator=StubGenerator())
    try:
        for _ in range(3):
            out = svc.answer([{"role": "user", "content": "What is 12 + 30?"}], None, "a")
            assert out["privalign"]["epsilon_charged"] == 0
        g = svc.guarantee()
        assert g["unit"] == "person" and "a person in the reward model's preference data" in g["statement"]
        assert svc.ledger.budget("model").spent.epsilon == pytest.approx(2.0)
    finally:
        svc.close()


def _pairs(rng, persons, per, dim=9):
    person = np.repeat([f"u{i}" for i in range(persons)], per)
    chosen = rng.standard_normal((person.size, dim)) + 10
    rejected = rng.standard_normal((person.size, dim)) + 10
    chosen[:, 0] += 1.0
    for raw in (chosen, rejected):
        raw[:, -1] = -rng.gamma(2.0, 0.5, person.size)
    return PreferencePairs(chosen, rejected, person)


def test_one_persons_rows_move_the_preference_head_by_at_most_delta_r():
    """Raw-data neighbours of a preference file: one person's pairs flipped, removed, or replaced by
    extreme ones; the whole procedure (choice on the public pairs, bounding, the head) rerun."""
    rng = np.random.default_rng(0)
    d, public = _pairs(rng, 150, 6), _pairs(rng, 40, 4)
    kw = dict(k=4, seed=0, grid={"lambdas": (0.3,), "components": (3,), "cs": (0.8,)})
    base, _ = train_preference_bt(d, public, **kw)
    me = d.person == "u7"
    flipped = PreferencePairs(np.where(me[:, None], d.rejected, d.chosen), np.where(me[:, None], d.chosen,
                                                                                     d.rejected), d.person)
    removed = PreferencePairs(d.chosen[~me], d.rejected[~me], d.person[~me])
    extreme = PreferencePairs(np.where(me[:, None], d.chosen * 50, d.chosen), np.where(me[:, None], -d.rejected * 50,
                                                                                        d.rejected), d.person)
    for nb in (flipped, removed, extreme):
        t, _ = train_preference_bt(nb, public, **kw)
        assert (t.meta["components"], t.meta["c"], t.lam) == (base.meta["components"], base.meta["c"], base.lam)
        assert np.linalg.norm(t.w - base.w) <= base.sensitivity


def test_bad_preference_input_is_one_line_and_writes_nothing(files, tmp_path):
    mine, public, _ = files
    runner = CliRunner()
    base = ["rm", "train", "--preferences", str(mine), "--out", str(tmp_path / "x.json")]
    for args, message in [
        (["--public", str(public)], "--preferences needs --privacy-unit"),
        (["--privacy-unit", "user_id"], "--preferences needs --public FILE"),
        (["--privacy-unit", "uid", "--public", str(public)], "has no column 'uid'"),
        (["--privacy-unit", "user_id", "--public", str(mine)], "shares"),
    ]:
        res = runner.invoke(app, [*base, *args])
        assert res.exit_code == 2 and message in " ".join(res.output.split()), res.output
        assert not list(tmp_path.glob("x*"))


def test_featurizing_shares_a_prompts_cache_and_computes_each_text_once(tmp_path):
    """Texts of a prompt with several responses go through one prompt pass (featurize); the others
    through featurize_many; both give the features of one plain forward pass a text, and a text that
    appears in several pairs is computed once."""
    from privalign.backends import load_policy
    from privalign.preference_features import featurize_table

    shared = [{"role": "user", "content": "What number comes after 41?"}]
    rows = [{"prompt": shared, "chosen": [{"role": "assistant", "content": "42"}],
             "rejected": [{"role": "assistant", "content": r}], "user_id": f"u{i}"}
            for i, r in enumerate(["43", "41", "40", "4 2"])]
    rows.append({"prompt": [{"role": "user", "content": "Say hi."}], "chosen": [{"role": "assistant", "content": "Hi!"}],
                 "rejected": [{"role": "assistant", "content": "No."}], "user_id": "u9"})
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = read_preferences(path, "user_id")
    policy = load_policy("smollm2")
    calls = {"featurize": 0, "many": 0}
    real_f, real_m = policy.featurize, policy.featurize_many

    def f(messages, responses, *a, **k):
        calls["featurize"] += len(responses)
        return real_f(messages, responses, *a, **k)

    def m(items, *a, **k):
        calls["many"] += len(items)
        return real_m(items, *a, **k)

    policy.featurize, policy.featurize_many = f, m
    chosen, rejected = featurize_table(table, policy, "smollm2", cache=False)
    assert calls == {"featurize": 5, "many": 2}  # "42" once for four pairs, + 4 rejected; the other prompt's 2
    one_by_one = real_m([(p, t) for p, c, r in zip(table.prompts, table.chosen, table.rejected) for t in (c, r)])
    np.testing.assert_allclose(np.stack([chosen, rejected], 1).reshape(len(rows) * 2, -1), one_by_one, atol=2e-4)


def test_max_persons_keeps_a_subset_chosen_by_the_ids_alone(files, tmp_path):
    """--max-persons P trains on P persons picked by a keyed hash of their ids: a person is in or out
    whatever anyone's rows say (editing another person's rows changes nothing), and the same seed
    gives the same subset; P < 2 is a one-line error."""
    from privalign.preferences.splits import subsample_ids

    mine, public, _ = files
    rows = [json.loads(line) for line in mine.read_text().splitlines()]
    ids = sorted({r["user_id"] for r in rows})
    keep = subsample_ids(ids, 5, 0)
    edited = tmp_path / "edited.jsonl"  # another person's rows flipped: the subset is the same
    other = next(i for i in ids if i in keep)
    edited.write_text("".join(json.dumps({**r, "chosen": r["rejected"], "rejected": r["chosen"]} if r["user_id"] == other
                                         else r) + "\n" for r in rows))
    assert read_preferences(edited, "user_id").of_persons(keep).n_persons == 5
    runner = CliRunner()
    res = runner.invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public",
                              str(public), "--max-persons", "5", "--lam", "1", "--components", "4", "--out",
                              str(tmp_path / "five.json")])
    assert res.exit_code == 0, res.output
    head = PolicyBTReward.load(tmp_path / "five.json")
    assert head.persons == 5 and head.guarantee()["public_inputs"]["person_ids"]["count"] == 5
    res = runner.invoke(app, ["rm", "train", "--preferences", str(mine), "--privacy-unit", "user_id", "--public",
                              str(public), "--max-persons", "1", "--out", str(tmp_path / "one.json")])
    assert res.exit_code != 0 and "--max-persons must be at least 2, got 1" in res.output
    assert not (tmp_path / "one.json").exists()


def test_the_persons_figure_draws_measured_and_planned_shares(tmp_path):
    from privalign.report.figures import release_persons

    rows = [{"kind": "measured", "persons": p, "epsilon_w": e, "share_mean": s, "share_p5": s - 0.2}
            for e in (1.0, 3.0) for p, s in ((250, 0.3), (2400, 0.9))]
    rows += [{"kind": "planned", "from_persons": 250, "persons": p, "epsilon_w": 1.0, "share_mean": s, "share_p5": s}
             for p, s in ((250, 0.3), (4000, 0.95))]
    written = release_persons(rows, tmp_path, "persons")
    assert written and all((tmp_path / Path(w).name).exists() for w in written)

HIDDEN = 4  # synthetic raw features [h_last, h_mean, lp] of width 2 * 4 + 1, from a "stub" policy


def _signal(rng, rows: int, good) -> np.ndarray:
    """Raw rows whose h_mean leans along the first axis by ``good`` (1 chosen or correct, 0 not)."""
    raw = rng.standard_normal((rows, 2 * HIDDEN + 1))
    raw[:, HIDDEN] += 2.0 * np.asarray(good, float)
    raw[:, -1] = -rng.gamma(2.0, 0.5, rows)
    return raw


def _signal_pairs(rng, persons, per):
    person = np.repeat([f"u{i}" for i in range(persons)], per)
    return PreferencePairs(_signal(rng, person.size, 1), _signal(rng, person.size, 0), person)


@pytest.fixture(scope="module")
def stub_head(tmp_path_factory):
    """A preference head on the stub's features (no model), a held-out file whose texts are already in
    its cache, and a simulated pool with recorded stub features that tell correct from wrong."""
    from privalign.pipeline import features_path, save_features
    from privalign.preference_features import FeatureStore, cache_path, text_key
    from privalign.simulate import simulate

    d, rng = tmp_path_factory.mktemp("stub"), np.random.default_rng(3)
    head, _ = train_preference_bt(_signal_pairs(rng, 200, 4), _signal_pairs(rng, 40, 4), k=4, base_model="stub",
                                  grid={"lambdas": (0.3,), "components": (3,), "cs": (0.8,)}, target_epsilon=None)
    head.save(d / "head.json")
    rows = [{"prompt": f"Question {i}?", "chosen": f" yes {i}.", "rejected": f" no {i}.", "user_id": f"h{i % 9}"}
            for i in range(120)]
    (d / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = read_preferences(d / "heldout.jsonl", "row")
    keys = [text_key("stub", p, t) for p, c, r in zip(table.prompts, table.chosen, table.rejected) for t in (c, r)]
    FeatureStore(cache_path(table, "stub")).append(keys, np.stack([_signal(rng, 120, 1), _signal(rng, 120, 0)],
                                                                  1).reshape(240, -1))
    pool = simulate("hackable", 12, 40, seed=1)
    pool.save(d / "pool.parquet")
    save_features(features_path(d / "pool.parquet"), _signal(rng, 480, pool.columns["true_reward"] > 0.5),
                  pool.columns["prompt_id"], pool.columns["sample_id"])
    return d, head, pool


def _bon_by_ranks(scores, y, n):
    """BoN at n with replacement for distinct scores: the i-th smallest of S is best w.p. (i/S)^n - ((i-1)/S)^n."""
    order = np.argsort(scores)
    s = len(scores)
    p = (np.arange(1, s + 1) / s) ** n - (np.arange(s) / s) ** n
    return float(p @ np.asarray(y, float)[order])


def test_rm_evaluate_with_a_pool_adds_bon_exact_released_and_the_base_policy(stub_head):
    d, head, pool = stub_head
    from privalign.pipeline import features_path
    from privalign.rewards.release import release_head

    args = ["rm", "evaluate", str(d / "head.json"), "--preferences", str(d / "heldout.jsonl"), "--pool",
            str(d / "pool.parquet"), "--release-epsilon", "1,1e6", "--draws", "30"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    b = json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]["bon"]
    raw = np.load(features_path(d / "pool.parquet"))["features"]
    pid, y = np.asarray(pool.columns["prompt_id"]), np.asarray(pool.columns["true_reward"], float)
    scores = head.feature_map(raw) @ head.w
    groups = [pid == p for p in np.unique(pid)]
    assert b["n"] == 16 and b["prompts"] == 12
    assert b["exact"] == pytest.approx(np.mean([_bon_by_ranks(scores[g], y[g], 16) for g in groups]), abs=1e-12)
    assert b["base_policy"] == pytest.approx(np.mean([y[g].mean() for g in groups]))
    assert b["exact"] > b["base_policy"]  # the stub's features tell correct from wrong
    low, high = b["releases"]
    assert low["p5"] <= low["mean"] and low["sigma"] > high["sigma"]
    assert high["mean"] == pytest.approx(b["exact"], abs=1e-3) and high["share_mean"] == pytest.approx(1, abs=0.01)
    table = " ".join(CliRunner().invoke(app, args).output.split())
    assert "BoN (n=16) on pool.parquet" in table and "base policy" in table and "100% / 100%" in table
    # a released head: BoN with its one draw
    released = release_head(head, 3.0, 1e-6, np.random.default_rng(0))
    released.save(d / "released.json")
    res = CliRunner().invoke(app, ["rm", "evaluate", str(d / "released.json"), "--preferences",
                                   str(d / "heldout.jsonl"), "--pool", str(d / "pool.parquet"), "--json"])
    assert res.exit_code == 0, res.output
    b = json.JSONDecoder().raw_decode(res.output[res.output.index("{"):])[0]["bon"]
    w_scores = head.feature_map(raw) @ released.w_tilde
    assert b["released"] == pytest.approx(np.mean([_bon_by_ranks(w_scores[g], y[g], 16) for g in groups]), abs=1e-12)


def test_rm_evaluate_refuses_a_pool_without_features_in_one_line(stub_head, tmp_path):
    d, _, pool = stub_head
    pool.save(tmp_path / "bare.parquet")
    res = CliRunner().invoke(app, ["rm", "evaluate", str(d / "head.json"), "--preferences", str(d / "heldout.jsonl"),
                                   "--pool", str(tmp_path / "bare.parquet")])
    out = " ".join(res.output.split())
    assert res.exit_code == 2 and "privalign featurize" in out and len(res.output.strip().splitlines()) <= 3, out


def test_plan_says_how_many_persons_a_release_needs_on_held_out_pairs(stub_head):
    """plan --model HEAD --preferences HELDOUT: the fewest persons whose release keeps 90% of the exact
    head's gain over chance on average and 80% at the 5th percentile, w held fixed; noise 1/P."""
    from privalign.rewards.preference_bt import pair_diffs, pairwise_share, persons_for_pairwise_share

    d, head, _ = stub_head
    res = CliRunner().invoke(app, ["plan", "--model", str(d / "head.json"), "--preferences", str(d / "heldout.jsonl"),
                                   "--release-epsilon", "0.3,1", "--release-delta", "1e-7", "--draws", "40"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "reads the exact head w_D" in out and "not covered by the guarantee" in out
    assert out.count("not covered") == 1
    table = read_preferences(d / "heldout.jsonl", "row")
    from privalign.preference_features import featurize_table

    diffs = pair_diffs(head.feature_map, PreferencePairs(*featurize_table(table, None, "stub"), table.person))
    for eps in (0.3, 1.0):
        got = persons_for_pairwise_share(head, diffs, eps, 1e-7, draws=40)
        p, r = got["persons"], got["result"]
        assert f"epsilon_w {eps:g}: with its own 200 persons" in out
        assert f"{p:,} persons ({p * 4:,} pairs at k = 4)" in out
        assert r["share_mean"] >= 0.9 and r["share_p5"] >= 0.8
        fewer = pairwise_share(head, diffs, eps, 1e-7, draws=40, persons=int(p / 1.1))
        assert fewer["share_mean"] < 0.9 or fewer["share_p5"] < 0.8
    res = CliRunner().invoke(app, ["plan", "--model", str(d / "head.json"), "--preferences", str(d / "heldout.jsonl"),
                                   "--release-epsilon", "0.3", "--release-delta", "4e-3", "--draws", "40"])
    assert res.exit_code == 0 and "needs delta_w < 1/P" in " ".join(res.output.split()), res.output
    twice = [pairwise_share(head, diffs, 1.0, 1e-7, persons=q)["sigma"] for q in (300, 600)]
    assert twice[0] / twice[1] == pytest.approx(2, rel=1e-6)  # sigma proportional to 1/P at fixed k, lambda


def test_plan_with_preferences_refuses_bad_input_in_one_line(stub_head):
    d, head, _ = stub_head
    from privalign.rewards.release import release_head

    release_head(head, 3.0, 1e-6, np.random.default_rng(0)).save(d / "rel.json")
    base = ["plan", "--preferences", str(d / "heldout.jsonl")]
    for args, message in [
        ([], "--preferences needs --model"),
        (["--model", str(d / "head.json")], "needs --release-epsilon"),
        (["--model", str(d / "rel.json"), "--release-epsilon", "1"], "is a released head"),
        (["--model", str(d / "head.json"), "--release-epsilon", "1", "--release-delta", "0.01"], "delta must lie in"),
        (["--model", str(d / "head.json"), "--release-epsilon", "1", "--target-share", "1.5"], "--target-share must"),
    ]:
        res = CliRunner().invoke(app, [*base, *args])
        out = " ".join(res.output.split())
        assert res.exit_code == 2 and message in out and len(res.output.strip().splitlines()) <= 2, out
    res = CliRunner().invoke(app, ["plan", "--epsilon", "0.1"])
    assert res.exit_code == 2 and "--epsilon-total is required" in " ".join(res.output.split())


def test_settings_are_scored_by_the_top_choice_among_a_public_prompts_responses():
    """selection_sets: each public prompt's distinct responses, good when never rejected; a prompt
    whose responses were all rejected somewhere is left out; the accuracy of the top choice equals a
    loop over prompts, and on one pair per prompt it is the pairwise accuracy."""
    from privalign.rewards.preference_bt import pair_correct, selection_sets

    rng = np.random.default_rng(5)
    texts = {name: rng.standard_normal(6) for name in ("a1", "a2", "a3", "b1", "b2", "c1", "c2")}
    pairs = [("A", "a1", "a2"), ("A", "a1", "a3"), ("B", "b1", "b2"), ("C", "c1", "c2"), ("C", "c2", "c1")]
    p = PreferencePairs(np.stack([texts[c] for _, c, _ in pairs]), np.stack([texts[r] for *_, r in pairs]),
                        np.array(["u"] * 5), np.array([q for q, *_ in pairs]))
    sets = selection_sets(p)
    assert sets.good.sum() == 2 and len(sets.starts) == 2  # a1 and b1; prompt C left out
    ws = rng.standard_normal((6, 200))
    got = sets.accuracy(sets.raw @ ws)
    for j in range(ws.shape[1]):
        s = {name: v @ ws[:, j] for name, v in texts.items()}
        want = np.mean([s["a1"] >= max(s["a2"], s["a3"]), s["b1"] >= s["b2"]])
        assert got[j] == want
    one = PreferencePairs(p.chosen[:3], p.rejected[:3] * 0 + rng.standard_normal((3, 6)), p.person[:3],
                          np.array(["A", "B", "D"]))
    w = rng.standard_normal(6)
    assert selection_sets(one).accuracy((selection_sets(one).raw @ w)[:, None])[0] == \
        np.mean(pair_correct(w, one.chosen - one.rejected))
    assert selection_sets(PreferencePairs(p.chosen, p.rejected, p.person)) is None  # no prompts named
