"""Pools read what users have (issue 50, item 1): extra columns are kept and named by ``pool info``;
a missing or null prompt_id, response or grade is an error that names the line; no pool command
ends in a traceback."""

import json
import subprocess
import sys

import numpy as np
import pytest

from privalign.pools import PoolError, load_pool

CLI = [sys.executable, "-m", "privalign"]


def run(*args, cwd=None):
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd)


def write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def rows(extra=None):
    out = [{"prompt_id": p, "sample_id": s, "true_reward": float((p + s) % 2), "reward:proxy": 0.1 * s,
            "response": f"r{p}{s}", "user_id": f"u{p}{s}"} for p in range(3) for s in range(4)]
    for i, r in (extra or {}).items():
        out[i] = r
    return out


def test_an_extra_text_column_is_kept_and_named_by_pool_info(tmp_path):
    path = write(tmp_path / "p.jsonl", rows())
    pool = load_pool(path)
    assert list(pool.columns["user_id"][:2]) == ["u00", "u01"]
    assert pool.info()["extra_columns"] == ["user_id"]
    res = run("pool", "info", path)
    assert res.returncode == 0 and json.loads(res.stdout)["extra_columns"] == ["user_id"], res.stderr
    assert run("pool", "validate", path).returncode == 0


@pytest.mark.parametrize("field, what", [("prompt_id", "prompt_id"), ("response", "response"),
                                         ("true_reward", "true_reward")])
@pytest.mark.parametrize("how", ["missing", "null"])
def test_a_missing_or_null_field_names_its_line(tmp_path, field, what, how):
    bad = {k: v for k, v in rows()[5].items() if k != field}
    if how == "null":
        bad[field] = None
    path = write(tmp_path / "p.jsonl", rows({5: bad}))
    with pytest.raises(PoolError, match=f"{what} missing.*line 6"):
        load_pool(path)
    for cmd in ("validate", "info"):
        res = run("pool", cmd, path)
        out = res.stdout + res.stderr
        assert res.returncode in (1, 2) and "line 6" in out and "Traceback" not in out and "│" not in out, out


def test_a_reward_that_is_not_a_number_names_the_column_and_line(tmp_path):
    bad = {**rows()[2], "reward:proxy": "high"}
    path = write(tmp_path / "p.jsonl", rows({2: bad}))
    with pytest.raises(PoolError, match="line 3.*'reward:proxy'.*'high'"):
        load_pool(path)


def test_no_pool_command_ends_in_a_traceback(tmp_path):
    good = write(tmp_path / "good.jsonl", rows())
    (tmp_path / "notapool.txt").write_text("hello\n")
    (tmp_path / "folder").mkdir()
    write(tmp_path / "nopid.jsonl", rows({1: {"sample_id": 1, "true_reward": 0.0, "reward:proxy": 0.2}}))
    for bad in ("notapool.txt", "folder", "nopid.jsonl", "good.jsonl"):
        for args in (("pool", "info", bad), ("pool", "validate", bad),
                     ("evaluate", bad, "--n", "1,2", "--replicates", "2", "--out", tmp_path / "res"),
                     ("rm", "train", "--features", "policy", "--pool", bad, "--out", tmp_path / "rm.json")):
            res = run(*args, cwd=tmp_path)
            out = res.stdout + res.stderr
            assert "Traceback" not in out and "╭" not in out, (args, out)
    assert np.isfinite(load_pool(good).reward()).all()
