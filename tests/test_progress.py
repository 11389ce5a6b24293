"""Progress wherever a job takes more than a few seconds (issue 50, item 8): a bar on a terminal,
elsewhere a line every 30 s (here shortened) to stderr with done/total, rate and ETA; Ctrl-C says
whether a rerun resumes and exits 130."""

import io
import os
import signal
import subprocess
import sys
import time

from privalign.cli._progress import LineProgress
from privalign.simulate import simulate

CLI = [sys.executable, "-m", "privalign"]
FAST = {**os.environ, "PRIVALIGN_PROGRESS_SECONDS": "0.2"}


def test_lines_say_done_total_rate_and_eta_even_when_nothing_advances():
    out = io.StringIO()
    with LineProgress(0.05, out) as bar:
        job = bar.add_task("prompts", total=10)
        bar.update(job, completed=3)
        time.sleep(0.2)
        wait = bar.add_task("auditing")
        time.sleep(0.12)
    lines = out.getvalue().splitlines()
    assert any(x.startswith("prompts: 3/10, ") and "/s, ETA " in x for x in lines), lines
    assert any(x.startswith("auditing: working, ") and "elapsed" in x for x in lines), lines
    assert lines[-2].startswith("prompts: 3/10") and "done in" in lines[-2], lines


def test_a_command_off_a_terminal_prints_progress_lines(tmp_path):
    pool = tmp_path / "pool.parquet"
    simulate("gaussian", 40, 64, seed=0).save(pool)
    res = subprocess.run([*CLI, "evaluate", str(pool), "--n", "1,2,4,8", "--replicates", "20", "--workers", "1",
                          "--out", str(tmp_path / "res")], capture_output=True, text=True, env=FAST, timeout=300)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.startswith("prompts: ")]
    assert lines and "done in" in lines[-1], res.stderr
    assert "━" not in res.stderr  # no bar drawn into a log


def _interrupt(args, env, first_line, timeout=240):
    # the child takes Ctrl-C as a user's terminal would, even when this suite runs as a background job
    # (whose shell starts it with SIGINT ignored, which a child inherits and Python then keeps)
    p = subprocess.Popen([*CLI, *args], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    t0 = time.monotonic()
    for line in p.stderr:
        seen.append(line)
        if line.startswith(first_line):
            break
        if time.monotonic() - t0 > timeout:
            break
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    p.wait(timeout=60)
    return p.returncode, "".join(seen) + rest


def test_ctrl_c_says_a_rerun_starts_over(tmp_path):
    code, err = _interrupt(["reproduce", "--out", str(tmp_path / "res")], FAST, "experiments: ")
    assert code == 130 and "a rerun starts over" in err and "Traceback" not in err, err
    assert not (tmp_path / "res").exists()


def test_ctrl_c_during_generate_says_a_rerun_resumes(tmp_path):
    out = tmp_path / "pool.parquet"
    code, err = _interrupt(["generate", "--task", "counting", "--limit", "40", "--samples", "2", "--shard-size", "1",
                            "--out", str(out)], FAST, "prompts: ")
    assert code == 130 and "rerun the same command to resume" in err and "Traceback" not in err, err
