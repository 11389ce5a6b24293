"""The first hour with privalign, scripted: the README's commands as a newcomer runs them, and the
common mistakes, each of which must end in a one-line error with the documented exit code."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from privalign.cli import app
from privalign.simulate import simulate

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
runner = CliRunner()


def one_line(res, code: int, words: str):
    """The command failed with ``code`` and a short message containing ``words``, no traceback."""
    out = " ".join(res.output.split())
    assert res.exit_code == code, (res.exit_code, res.output)
    assert words in out, res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) <= 3, res.output


def readme_block(after: str, lang: str = "") -> str:
    """The first fenced block after the heading ``after``."""
    tail = README[README.index(after):]
    m = re.search(r"```" + lang + r"\n(.*?)```", tail, re.S)
    return m.group(1)


def test_readme_use_snippet_runs_and_prints_what_matters():
    res = subprocess.run([sys.executable, "-c", readme_block("## Use", "python")], capture_output=True, text=True,
                         cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 3
    assert "of" in lines[2] and "left" in lines[2]  # the realised cost against the reserved worst case


def test_readme_experiment_commands_run_as_written(tmp_path):
    commands = [c for c in readme_block("## Experiments on response pools").replace("\\\n", " ").splitlines()
                if c.startswith("privalign ") and "[" not in c]  # lines with [OPTIONS] are templates
    assert [c.split()[1] for c in commands] == ["simulate", "pool", "evaluate", "report"]
    for c in commands:
        args = c.split("#")[0].split()[1:]
        res = subprocess.run([sys.executable, "-m", "privalign", *args], capture_output=True, text=True, cwd=tmp_path)
        assert res.returncode == 0, (c, res.stderr[-2000:])
    assert (tmp_path / "results" / "run" / "report.html").exists()


def test_version_and_help_fit_80_columns():
    res = runner.invoke(app, ["--version"])
    assert res.exit_code == 0 and res.output.startswith("privalign ")
    for cmd in ([], ["demo"], ["simulate"], ["evaluate"], ["report"], ["reproduce"], ["generate"], ["score"],
                ["audit"], ["serve"], ["pool", "info"], ["pool", "validate"], ["rm", "train"],
                ["rm", "check-sensitivity"], ["plan"], ["featurize"], ["ledger"], ["ledger", "account"]):
        res = runner.invoke(app, [*cmd, "--help"], terminal_width=80, env={"COLUMNS": "80"})
        assert res.exit_code == 0, cmd
        assert max(len(line) for line in res.output.splitlines()) <= 80, cmd
        assert "…" not in res.output, (cmd, res.output)  # nothing cut off


def test_help_paragraphs_wrap_at_the_terminal_not_mid_sentence():
    """Issue 19: a command's description keeps no line break of its source docstring."""
    res = runner.invoke(app, ["reproduce", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert "curves with 95% intervals, privacy-utility, ITP vs PrivITP" in res.output
    res = runner.invoke(app, ["reproduce", "--help"], terminal_width=60, env={"COLUMNS": "60"})
    assert max(len(line) for line in res.output.splitlines()) <= 60


def test_routine_mistakes_are_one_line_errors(tmp_path):
    pool = tmp_path / "p.parquet"
    simulate("gaussian", 4, 20, seed=0).save(pool)
    for args, words in ((["--reward", "nonexistent"], "not a reward column"),
                        (["--reward-range", "3,1"], "lo < hi"),
                        (["--reward-range", "x"], "'lo,hi'"),
                        (["--without-replacement", "--n", "1,64"], "cannot draw n = 64")):
        one_line(runner.invoke(app, ["evaluate", str(pool), *args, "--out", str(tmp_path / "out")]), 2, words)
    res = runner.invoke(app, ["evaluate", str(pool), "--reward-range", "5,6", "--n", "1,2", "--replicates", "2",
                              "--out", str(tmp_path / "clipped")])
    assert res.exit_code == 0 and "100% of the scores lie outside --reward-range" in " ".join(res.output.split())
    one_line(runner.invoke(app, ["reproduce", "--task", "no-such-task", "--out", str(tmp_path / "r")]), 2,
             "no shipped pool")
    one_line(runner.invoke(app, ["reproduce", "--task", "counting", "--audit", str(pool), "--out",
                                 str(tmp_path / "r")]), 2, "not an audit.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": "a", "sample_id": 0, "true_reward": 1, "reward:x": 0.5}\n{not json\n')
    notparquet = tmp_path / "p2.parquet"
    notparquet.write_text("hello")
    for args, code, words in ((["pool", "validate", str(bad)], 1, "line 2 is not valid JSON"),
                              (["pool", "info", str(bad)], 2, "line 2 is not valid JSON"),
                              (["evaluate", str(bad), "--out", str(tmp_path / "o")], 2, "bad.jsonl"),
                              (["pool", "info", str(notparquet)], 2, "not a readable Parquet file")):
        one_line(runner.invoke(app, args), code, words)
    nocols = tmp_path / "nocols.jsonl"
    nocols.write_text('{"a": 1}\n')  # issue 19: a clean message, not a KeyError traceback
    res = runner.invoke(app, ["pool", "validate", str(nocols)])
    assert res.exit_code == 1 and "missing required column 'prompt_id'" in res.output and "Traceback" not in res.output
    # issue 19: n above a prompt's samples is refused without replacement, and warned about with it
    one_line(runner.invoke(app, ["evaluate", str(pool), "--n", "1000", "--without-replacement", "--out",
                                 str(tmp_path / "o2")]), 2, "cannot draw n = 1000")
    res = runner.invoke(app, ["evaluate", str(pool), "--n", "1,4,500", "--replicates", "2", "--algorithms", "bon",
                              "--out", str(tmp_path / "o3")])
    assert res.exit_code == 0 and "n = 500 exceeds the samples of 4 prompt(s)" in " ".join(res.output.split())
    bad_config = tmp_path / "service.toml"
    bad_config.write_text("max_n = 0\n")
    one_line(runner.invoke(app, ["serve", "--config", str(bad_config)]), 2, "invalid config")


def test_service_first_hour_with_the_stock_openai_client(tmp_path):
    """The service as a newcomer meets it: a startup summary, an access log, the model's name
    checked, usage reported, one refusal per exhausted call (no silent retries), rounded epsilons."""
    import openai

    from tests.test_server import ADMIN, CLIENT, Server, call

    srv = Server(tmp_path, f"""
admin_keys = ["{ADMIN}"]
[clients.{CLIENT}]
tenant = "acme"
[generator]
backend = "stub"
[reward]
kind = "stub"
output_range = [0.0, 1.0]
[mechanism]
n = 4
[[budgets]]
name = "acme-rm"
tenant = "acme"
epsilon_total = 0.35
""")
    srv.start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=CLIENT, max_retries=2)
        assert [m.id for m in client.models.list()] == ["stub"]
        with pytest.raises(openai.NotFoundError, match="does not exist") as info:
            client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
        assert info.value.type == "model_not_found"
        epsilon = {"privalign": {"mechanism": "privbon", "epsilon": 0.1}}
        for _ in range(3):
            r = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "What is 2 + 2?"}],
                                               extra_body=epsilon)
        assert r.model == "stub"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 4 * 3, 17)  # words
        block = r.model_extra["privalign"]
        # 0.35 - 3 x 0.1 is 0.04999999999999999 in floating point: shown rounded, kept exact in the ledger
        assert block["epsilon_charged"] == 0.1 and block["budget_remaining"]["epsilon"] == 0.05
        with pytest.raises(openai.RateLimitError) as info:
            client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "Hi"}],
                                           extra_body=epsilon)
        assert info.value.type == "budget_exhausted"
        status, b = call(srv.url, "/v1/budgets/acme-rm", key=ADMIN)
        assert status == 200 and b["refusals"] == 1 and b["queries"] == 3  # the client did not retry
        assert b["epsilon_spent"] == 0.3 and b["delta_total"] == 1e-6  # a conservative default delta
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert "privalign serve on http://" in log and "requests name the model 'stub'" in log
    lines = [line for line in log.splitlines() if "POST /v1/chat/completions" in line]
    assert len(lines) == 5
    assert sum(" 200 " in line and "tenant=acme budget=acme-rm epsilon=0.1" in line for line in lines) == 3
    assert any(" 404 " in line for line in lines) and any(" 429 " in line and "budget=acme-rm" in line
                                                          for line in lines)
    assert all(re.search(r"request_id=[0-9a-f]{32}", line) for line in lines if " 200 " in line)


def test_help_and_info_say_what_is_true(tmp_path):
    """Issue 19: reproduce's default pool, generate's tasks, score without a path, rounded pool info."""
    from privalign.tasks import TASKS

    res = runner.invoke(app, ["reproduce", "--help"], env={"COLUMNS": "300"})
    assert "default: the embedded counting pool" in " ".join(res.output.split())
    res = " ".join(runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "300"}).output.split())
    assert all(t in res for t in TASKS)
    pool = tmp_path / "p.parquet"
    simulate("gaussian", 4, 20, seed=0).save(pool)
    one_line(runner.invoke(app, ["score", str(pool), "--reward", "policy-bt"]), 2, "needs its model: policy-bt:PATH")
    res = runner.invoke(app, ["pool", "info", str(pool)])
    assert res.exit_code == 0
    import re
    assert not re.search(r"\d\.\d{8,}", res.output)  # no float noise such as 0.10250000000000001
