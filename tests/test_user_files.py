"""A user's files are never deleted (issue 50, item 5): a results folder may hold files privalign did
not write; a run replaces only privalign's own files (those its manifest lists) and lists what it
left alone; it refuses only where keeping both is impossible, in one line that says what to do."""

import json

import pytest
from typer.testing import CliRunner

from privalign._paths import MANIFEST, OutputError, left_alone
from privalign.cli import app
from privalign.report.results import atomic_directory
from privalign.simulate import simulate

runner = CliRunner()
FAST = ["--algorithms", "bon", "--n", "1,2", "--replicates", "2", "--workers", "1"]


@pytest.fixture
def pool(tmp_path):
    p = tmp_path / "pool.parquet"
    simulate("gaussian", 3, 8, seed=0).save(p)
    return p


def test_a_rerun_keeps_the_users_files_and_subfolders(tmp_path, pool):
    out = tmp_path / "res1"
    res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)])
    assert res.exit_code == 0, res.output
    (out / "NOTES.md").write_text("my notes")
    (out / "mine").mkdir()
    (out / "mine" / "plot.png").write_bytes(b"png")
    res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "NOTES.md").read_text() == "my notes" and (out / "mine" / "plot.png").read_bytes() == b"png"
    assert (out / "summary.csv").exists() and "NOTES.md" not in json.loads((out / MANIFEST).read_text())["files"]
    said = " ".join(res.output.split())
    assert "left alone" in said and "NOTES.md" in said and "mine" in said, res.output
    assert sorted(left_alone(out)) == ["NOTES.md", "mine"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".res1.")], "a temporary was left"


def test_a_users_folder_is_written_into_and_kept(tmp_path, pool):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    res = runner.invoke(app, ["evaluate", str(pool), *FAST, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "thesis.tex").read_text() == "years of work" and (out / "summary.csv").exists()


def test_privalign_files_of_an_earlier_run_that_this_run_does_not_write_are_removed(tmp_path):
    out = tmp_path / "run"
    with atomic_directory(out) as tmp:
        (tmp / "old.csv").write_text("a\n")
        (tmp / "keep.csv").write_text("a\n")
    (out / "yours.txt").write_text("y")
    with atomic_directory(out) as tmp:
        (tmp / "keep.csv").write_text("b\n")
    assert not (out / "old.csv").exists() and (out / "keep.csv").read_text() == "b\n"
    assert (out / "yours.txt").read_text() == "y"


def test_a_users_file_with_the_name_of_a_result_is_refused_in_one_line_and_kept(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "summary.csv").write_text("my own summary")
    with pytest.raises(OutputError) as e:
        with atomic_directory(out) as tmp:
            (tmp / "summary.csv").write_text("a\n")
    msg = str(e.value)
    assert "summary.csv" in msg and "move it" in msg and "kept in" in msg and "\n" not in msg, msg
    assert (out / "summary.csv").read_text() == "my own summary"


def test_the_demo_keeps_a_users_notes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "results" / "demo"
    out.mkdir(parents=True)
    (out / "NOTES.md").write_text("notes")
    with atomic_directory(out) as tmp:  # reproduce --out results/demo writes through atomic_directory
        (tmp / "report.html").write_text("<html>")
    assert (out / "NOTES.md").read_text() == "notes" and (out / "report.html").exists()
