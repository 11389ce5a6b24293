"""Pools (Parquet, JSONL, the authors' layout, validation) and the command line contract."""

import json
import subprocess
import sys

import numpy as np
import pytest

from privalign.evaluation import EvalSettings
from privalign.report.jobs import run_evaluate, run_reproduce
from privalign.pools import Pool, PoolError, load_pool
from privalign.report.results import read_csv
from privalign.simulate import simulate

CLI = [sys.executable, "-m", "privalign"]


def run(*args, cwd=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def test_parquet_roundtrip_keeps_columns_and_metadata(tmp_path):
    pool = simulate("hackable", 5, 50, seed=3)
    pool.columns["response"] = np.array([f"text {i}" for i in range(pool.n_rows)], dtype=object)
    pool.save(tmp_path / "p.parquet")
    back = load_pool(tmp_path / "p.parquet")
    assert back.metadata == pool.metadata
    assert np.array_equal(back.columns["reward:proxy"], pool.columns["reward:proxy"])
    assert list(back.columns["response"][:2]) == ["text 0", "text 1"]


def test_authors_jsonl_layout_is_read_unchanged(tmp_path):
    lines = [{"prompt": "2+2?", "gt_answer": "4", "responses": [
        {"text": "4", "predicted_answer": "4", "is_correct": True, "proxy_reward": 0.9},
        {"text": "5", "predicted_answer": "5", "is_correct": False, "proxy_reward": 0.2}]},
        {"prompt": "3+3?", "gt_answer": "6", "responses": [
            {"text": "6", "predicted_answer": "6", "is_correct": True, "proxy_reward": 0.7}]}]
    path = tmp_path / "authors.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines))
    pool = load_pool(path)
    assert pool.n_rows == 3 and pool.reward_names == ["proxy"]
    assert list(pool.columns["true_reward"]) == [1.0, 0.0, 1.0]
    assert list(pool.columns["answer"]) == ["4", "5", "6"]
    assert pool.info()["prompts"] == 2


def test_validation_names_the_bad_rows(tmp_path):
    rows = [{"prompt_id": 0, "sample_id": 0, "reward:rm": 0.5, "true_reward": 1.0},
            {"prompt_id": 0, "sample_id": 1, "reward:rm": None, "true_reward": 0.0},
            {"prompt_id": 0, "sample_id": 2, "reward:rm": float("nan"), "true_reward": 0.0},
            {"prompt_id": 1, "sample_id": 0, "reward:rm": 0.1, "true_reward": 1.5},
            {"prompt_id": 1, "sample_id": 0, "reward:rm": 0.2, "true_reward": 0.0}]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(PoolError) as err:
        load_pool(path)
    text = str(err.value)
    # a JSONL pool's problems name the file's lines (1-based), not rows (issue 50)
    assert "line 2 (prompt 0, sample 1)" in text and "line 3 (prompt 0, sample 2)" in text
    assert "true_reward outside [0, 1]: line 4" in text
    assert "duplicate (prompt_id, sample_id): line 5" in text
    out = run("pool", "validate", path)
    assert out.returncode == 1 and "line 4" in out.stderr
    assert "missing required column 'true_reward'" in "\n".join(
        Pool({"prompt_id": np.arange(2), "sample_id": np.arange(2), "reward:x": np.ones(2)}).problems())


def test_cli_simulate_evaluate_report(tmp_path):
    assert run("simulate", "gaussian", "--prompts", 6, "--samples", 200, "--seed", 1,
               "--out", tmp_path / "pool.parquet").returncode == 0
    res = run("evaluate", tmp_path / "pool.parquet", "--algorithms", "bon,privbon,itp,privitp",
              "--n", "1,2,4,...,32", "--replicates", 5, "--sigma", 0.5, "--beta", 0.05, "--seed", 2,
              "--out", tmp_path / "results")
    assert res.returncode == 0, res.stderr
    rows = read_csv(tmp_path / "results" / "summary.csv")
    need = {"algorithm", "n", "accuracy", "accuracy_se", "lift", "lift_se", "proxy_reward", "proxy_reward_se",
            "win_rate", "win_rate_se", "hacking_gap", "hacking_gap_se", "halting_time", "epsilon"}
    assert need <= set(rows[0]) and len(rows) == 4 * 6
    settings = json.loads((tmp_path / "results" / "settings.json").read_text())
    assert settings["privalign_version"] and settings["evaluation"]["replicates"] == 5
    assert settings["pool"]["metadata"]["world"]["world"] == "gaussian"
    (tmp_path / "results" / "report.html").unlink()
    assert run("report", tmp_path / "results").returncode == 0
    page = (tmp_path / "results" / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') == 2 and "<table>" in page
    bad = run("evaluate", tmp_path / "pool.parquet", "--algorithms", "bon,best", "--out", tmp_path / "x")
    assert bad.returncode == 2 and "algorithms" in bad.stderr and not (tmp_path / "x").exists()


def test_interrupt_leaves_no_half_written_results(tmp_path):
    pool = simulate("hackable", 6, 100, seed=1)
    calls = []

    def interrupt(name, done, total):
        calls.append(done)
        if done == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_evaluate(pool, EvalSettings(n_grid=(1, 4), replicates=3), tmp_path / "out", progress=interrupt)
    assert calls == [1, 2, 3]
    assert list(tmp_path.iterdir()) == []  # neither the results nor a temporary directory remain


def test_reproduce_writes_every_table_figure_and_the_report(tmp_path):
    pool = simulate("hackable", 16, 300, seed=4)
    out = run_reproduce(tmp_path / "res", pool, "test pool", settings=EvalSettings(replicates=4),
                        n_grid=(1, 4, 16), sigma_grid=(0.05, 0.5), beta_grid=(0.01, 0.1), n_ref=8,
                        epsilons=(1.0, 10.0), stream_seeds=2)
    names = {p.name for p in out.iterdir()}
    for stem in ("headline", "curves_all_targets", "privacy_utility", "itp_vs_privitp", "fsrc_stream"):
        assert {f"{stem}.png", f"{stem}.pdf"} <= names
    for table in ("summary.csv", "tuning.csv", "privacy_utility.csv", "noise_sweep.csv", "stream.csv",
                  "stream_summary.csv", "headline.json", "settings.json", "report.html"):
        assert table in names
    # every private setting that was run fits its target
    for r in read_csv(out / "summary.csv") + read_csv(out / "privacy_utility.csv"):
        if r["algorithm"] in ("privbon", "privbon-gaussian", "privitp"):
            assert r["worst_case_epsilon"] <= r["target_epsilon"]
    for r in read_csv(out / "tuning.csv"):
        assert r["worst_case_epsilon"] <= r["target_epsilon"] or r["algorithm"] == "itp"
    summary = read_csv(out / "stream_summary.csv")
    q = {(r["algorithm"], r["composition"]): r["queries_mean"] for r in summary}
    assert q["privitp", "fsrc"] >= q["privitp", "basic"] >= 1
    # Gumbel PrivBoN at epsilon 0.1: zCDP answers more queries from the same budget than basic
    assert q["privbon", "zcdp"] > q["privbon", "basic"] == q["privbon", "fsrc"] >= 199  # 20 / 0.1, rounded up
    assert all(0 <= r["accuracy"] <= 1 for r in summary)
    head = json.loads((out / "headline.json").read_text())
    assert {"bon_lift", "privbon_keeps", "regularisation", "fsrc", "zcdp"} <= set(head)
    page = (out / "report.html").read_text()
    # the run and the verdicts come first, then what was run, the privacy summary, the figures
    assert (page.index("Verdicts") < page.index("What was run") < page.index("Privacy summary")
            < page.index("Headline") < page.index("Raw tables"))
    assert "(zCDP)" in page and "under zCDP against" in page
    assert page.count('src="data:image/png;base64,') == 5
    assert "95% bootstrap" in page
    settings = json.loads((out / "settings.json").read_text())
    # the tuned values live under "chosen": the base settings' sigma/beta are not shown as if they were used
    assert not {"sigma", "beta", "sigma_x", "sigma_z"} & set(settings["evaluation"]) and settings["chosen"]
    # an attached audit record (privalign audit --out) becomes a section and a figure of the report
    from privalign.cli.reproduce import _attach_audit

    rows = [{"mechanism": m, "claimed_epsilon": c, "delta": 0.0, "runs_per_side": 1000, "successes_D": 400,
             "successes_D_prime": 420, "epsilon_lower_bound": lb}
            for m, c, lb in (("bon", "inf", 6.2), ("privbon", 1.0, 0.01), ("privitp", 1.0, 0.0))]
    _attach_audit(out, {"model": "m.json", "certified_sensitivity": 0.1, "realised_sensitivity": 0.02, "rows": rows})
    page = (out / "report.html").read_text()
    assert page.index("Empirical privacy audit") < page.index("Raw tables") and "audit.png" in {p.name for p in out.iterdir()}
    assert "Every private mechanism's lower bound stays at or below its claim" in page
    assert page.count('src="data:image/png;base64,') == 6



def test_headline_says_when_bon_has_no_lift_to_keep_a_share_of():
    """A pool where Best-of-N does not lift accuracy (mmlu-letters) has no PrivBoN share: the
    headline says so instead of failing on the undefined share (JSON null)."""
    from privalign.report.html import headline_sentences

    h = {"n_ref": 16, "target_epsilon": 1.0,
         "privbon_keeps": {"share": None, "privbon_lift": -0.4, "bon_lift": -0.2, "met": False}}
    (line,) = headline_sentences(h)
    assert "no lift" in line and "NOT MET" in line
    h["privbon_keeps"] = {"share": 0.8, "privbon_lift": 4.0, "bon_lift": 5.0, "met": True}
    assert "keeps 80% of BoN's lift" in headline_sentences(h)[0]


@pytest.mark.parametrize("layout", ["ordered", "shuffled", "wide-ids", "negative", "strings", "repeat-adjacent"])
def test_duplicate_rows_match_a_set_based_reference(layout):
    from privalign.pools import _later_duplicates

    rng = np.random.default_rng(3)
    p = np.repeat(np.arange(40), 25)
    s = np.tile(np.arange(25), 40)
    if layout == "wide-ids":
        p = p * 2 ** 40 + 7  # spans more than 2**31: hashed codes, not the values
    elif layout == "negative":
        p, s = p - 20, s - 1000
    elif layout == "strings":
        p = np.array([f"q{v}" for v in p], dtype=object)
    if layout != "ordered":
        s[rng.choice(s.size, 30, replace=False)] = rng.integers(0, 25, 30)  # plant repeats
    if layout == "repeat-adjacent":
        s[1] = s[0]
    if layout not in ("ordered", "repeat-adjacent"):
        order = rng.permutation(p.size)
        p, s = p[order], s[order]
    seen, expected = set(), []
    for key in zip(p.tolist(), s.tolist()):
        expected.append(key in seen)
        seen.add(key)
    got = _later_duplicates(p, s)
    assert got.tolist() == expected
    assert (layout == "ordered") == (not any(expected))


@pytest.mark.parametrize("layout", ["grouped", "shuffled", "strings", "strings-shuffled"])
def test_grouping_matches_a_stable_sort_whatever_the_row_order(layout):
    rng = np.random.default_rng(4)
    p = np.repeat(np.arange(30) * 3 - 7, rng.integers(1, 9, 30))
    if layout.startswith("strings"):
        p = np.array([f"q{v:+04d}" for v in p], dtype=object)
    if layout.endswith("shuffled"):
        p = p[rng.permutation(p.size)]
    true = rng.uniform(size=p.size)
    pool = Pool({"prompt_id": p, "sample_id": np.arange(p.size), "true_reward": true,
                 "reward:rm": rng.normal(size=p.size)})
    g = pool.grouped()
    keys = p.tolist()
    order = sorted(range(p.size), key=lambda i: keys[i])  # Python's sort is stable
    assert g.true.tolist() == true[order].tolist()
    assert g.proxy.tolist() == pool.columns["reward:rm"][order].tolist()
    assert g.prompt_ids.tolist() == sorted(set(keys))
    assert np.diff(g.offsets).tolist() == [keys.count(v) for v in sorted(set(keys))]
    assert not g.true.flags.writeable and not g.proxy.flags.writeable
