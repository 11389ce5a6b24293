"""One writer per output (issue 50, item 6): a second ``generate``, ``featurize`` or ``reproduce`` on
an output another run holds says so in one line, with that run's pid, and changes nothing."""

import subprocess
import sys
import time

import pytest

from privalign._paths import OutputError, hold_output
from privalign.simulate import simulate

CLI = [sys.executable, "-m", "privalign"]
HOLDER = """
import sys, time
from privalign._paths import hold_output
release = hold_output(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


@pytest.fixture
def holder():
    procs = []

    def hold(path):
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "held"
        procs.append(p)
        return p

    yield hold
    for p in procs:
        p.kill()
        p.wait()


def one_line_with_pid(res, pid):
    err = res.stderr.strip()
    assert res.returncode == 2 and f"pid {pid}" in err and "another run" in err, (res.returncode, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_a_second_generate_featurize_or_reproduce_is_refused_with_the_holders_pid(tmp_path, holder):
    pool = tmp_path / "pool.parquet"
    p = holder(pool)
    res = subprocess.run([*CLI, "generate", "--task", "counting", "--limit", "2", "--samples", "2",
                          "--out", str(pool)], capture_output=True, text=True, timeout=120)
    one_line_with_pid(res, p.pid)
    assert not pool.exists()
    simulate("gaussian", 2, 3, seed=0).save(tmp_path / "other.parquet")
    q = holder(tmp_path / "other.parquet")
    res = subprocess.run([*CLI, "featurize", str(tmp_path / "other.parquet")], capture_output=True, text=True,
                         timeout=120)
    one_line_with_pid(res, q.pid)
    r = holder(tmp_path / "res")
    res = subprocess.run([*CLI, "reproduce", "--out", str(tmp_path / "res")], capture_output=True, text=True,
                         timeout=120)
    one_line_with_pid(res, r.pid)


def test_a_dead_runs_lock_is_taken_over_and_a_released_one_reused(tmp_path, holder):
    target = tmp_path / "pool.parquet"
    p = holder(target)
    with pytest.raises(OutputError, match=f"pid {p.pid}"):
        hold_output(target)
    p.kill()
    p.wait()
    release = hold_output(target)  # the lock file is left behind, its lock is not
    with pytest.raises(OutputError):
        hold_output(target)
    release()
    hold_output(target)()
    assert not (tmp_path / ".pool.parquet.lock").exists()
