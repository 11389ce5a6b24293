"""Issue 30, item 1: no command destroys what privalign did not write. Every writer checks its
target before any work starts. Since issue 50 (tests/test_user_files.py) a results folder may hold
the user's files: a run replaces only privalign's own files there and leaves the rest alone."""

import json
import os

import pytest
from typer.testing import CliRunner

from privalign._paths import MANIFEST, OutputError, check_output_dir, check_output_file
from privalign.cli import app
from privalign.report.results import atomic_directory
from privalign.simulate import simulate

runner = CliRunner()
FAST = ["--algorithms", "bon", "--n", "1,2", "--replicates", "2", "--workers", "1"]


def refused(res, words):
    out = " ".join(res.output.split())
    assert res.exit_code == 2, (res.exit_code, res.output)
    assert words in out, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 4, res.output


def user_folder(path):
    path.mkdir()
    (path / "thesis.tex").write_text("years of work")
    return path


def intact(path):
    assert (path / "thesis.tex").read_text() == "years of work"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(f".{path.name}.")], "a temporary was left"


@pytest.fixture
def pool(tmp_path):
    p = tmp_path / "pool.parquet"
    simulate("gaussian", 3, 8, seed=0).save(p)
    return p


def test_evaluate_writes_into_a_users_folder_and_leaves_its_files_whole(tmp_path, pool):
    d = user_folder(tmp_path / "mine")
    res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(d)])
    assert res.exit_code == 0 and "left alone" in res.output and "thesis.tex" in res.output, res.output
    intact(d)


def test_out_dot_is_refused_before_any_work_and_leaves_nothing(tmp_path, pool, monkeypatch):
    d = user_folder(tmp_path / "cwd")
    monkeypatch.chdir(d)
    refused(runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", "."]), "working directory")
    intact(d)
    refused(runner.invoke(app, ["reproduce", "--out", "."]), "working directory")
    intact(d)


def test_results_directories_are_replaced_and_empty_folders_used(tmp_path, pool):
    out = tmp_path / "empty"
    out.mkdir()
    for _ in range(2):  # the second run replaces the first run's results
        res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert json.loads((out / MANIFEST).read_text())["kind"] == "privalign-results"
        assert (out / "summary.csv").exists()


def test_a_folder_holding_the_input_is_written_and_the_input_kept(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / MANIFEST).write_text(json.dumps({"kind": "privalign-results", "files": []}))
    pool = out / "pool.parquet"
    simulate("gaussian", 3, 8, seed=0).save(pool)
    res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)])
    assert res.exit_code == 0 and pool.exists() and (out / "summary.csv").exists(), res.output
    # an input that is one of privalign's own results there would be replaced: refused
    (out / MANIFEST).write_text(json.dumps({"kind": "privalign-results", "files": ["pool.parquet"]}))
    refused(runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)]), "holds the input")
    assert pool.exists()


def test_reproduce_and_audit_refuse_a_file_where_their_folder_goes(tmp_path):
    f = tmp_path / "afile"
    f.write_text("years of work")
    refused(runner.invoke(app, ["reproduce", "--out", str(f)]), "a file of that name exists")
    refused(runner.invoke(app, ["reproduce", "--large", "--out", str(f)]), "a file of that name exists")
    refused(runner.invoke(app, ["audit", "--model", "m.json", "--pool", "p.parquet", "--out", str(f)]),
            "a file of that name exists")
    assert f.read_text() == "years of work"


def test_file_writers_refuse_files_they_did_not_write(tmp_path, pool):
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    refused(runner.invoke(app, ["simulate", "gaussian", "--prompts", "2", "--samples", "3", "--out", str(notes)]),
            "not a pool privalign wrote")
    # generate is refused before the task, the data or the model is loaded
    refused(runner.invoke(app, ["generate", "--task", "counting", "--out", str(notes)]), "not a pool privalign wrote")
    refused(runner.invoke(app, ["rm", "train", "--features", "policy", "--out", str(notes)]),
            "not a model privalign wrote")
    refused(runner.invoke(app, ["simulate", "gaussian", "--out", str(tmp_path)]), "is a directory")
    assert notes.read_text() == "keep me"
    # a pool privalign wrote may be replaced
    res = runner.invoke(app, ["simulate", "gaussian", "--prompts", "2", "--samples", "3", "--out", str(pool)])
    assert res.exit_code == 0, res.output


def test_library_checks(tmp_path):
    d = user_folder(tmp_path / "mine")
    with atomic_directory(d) as tmp:  # a user's folder is written into; its files are left alone
        (tmp / "summary.csv").write_text("a\n")
    intact(d)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(OutputError, match="a file of that name exists"):
        check_output_dir(f)
    with pytest.raises(OutputError, match="not a directory"):
        check_output_dir(f / "sub")
    with pytest.raises(ValueError, match="kind must be one of"):
        check_output_file(tmp_path / "x", "picture")
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(OutputError, match="not writable"):
            check_output_dir(ro / "run")


def test_a_folder_filled_while_the_run_worked_keeps_the_users_files(tmp_path):
    out = tmp_path / "run"
    with atomic_directory(out) as tmp:
        (tmp / "summary.csv").write_text("a\n")
        user_folder(out)
    assert (out / "thesis.tex").read_text() == "years of work" and (out / "summary.csv").exists()
    with pytest.raises(OutputError, match="results are kept in"):  # a user's file of a result's name: refused
        with atomic_directory(out) as tmp:
            (tmp / "thesis.tex").write_text("a\n")
    assert (out / "thesis.tex").read_text() == "years of work"
