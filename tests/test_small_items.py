"""The small items of issue 50 (item 13): the ``ledger events`` table is not cut at 80 columns; the
banner names the embedded reward model's file when there is no config; "looked in" lists each
folder once; ``plan`` never says "reward None"."""

import os
import subprocess
import sys

import pytest

from privalign.accounting import pure_event
from privalign.ledger import Ledger
from privalign.server.config import ServiceConfig, resolve_model_path

CLI = [sys.executable, "-m", "privalign"]


def test_ledger_events_keeps_whole_request_ids_when_not_a_terminal(tmp_path):
    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("default", 10.0, 1e-6, "fsrc", "t")
    rid = "request-" + "0123456789abcdef" * 4
    led.settle(led.reserve("default", request_id=rid, event=pure_event(0.5, "privbon")), 0.5)
    led.close()
    res = subprocess.run([*CLI, "ledger", "events", str(tmp_path / "l.db"), "--budget", "default"],
                         capture_output=True, text=True, env={**os.environ, "COLUMNS": "80"})
    assert res.returncode == 0 and rid in res.stdout and "…" not in res.stdout, res.stdout


def test_the_banner_names_the_embedded_reward_model_without_a_config(tmp_path, capsys):
    from privalign.cli.service import _print_banner

    cfg = ServiceConfig()
    _print_banner(cfg, None, "127.0.0.1", 8000, 1, [], None, [])
    out = capsys.readouterr()
    line = next(x for x in (out.out + out.err).splitlines() if x.strip().startswith("reward:"))
    assert "arithmetic-minilm-bt.json" in line and "embedded" in line, line


def test_looked_in_lists_each_folder_once(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        resolve_model_path("nope.json", tmp_path)
    looked = str(e.value).split("looked in ")[1]
    assert looked.count(str(tmp_path) + ",") + looked.count(str(tmp_path) + ")") == 1, str(e.value)


def test_plan_names_the_reward_it_read(tmp_path):
    pool = tmp_path / "sim.parquet"
    assert subprocess.run([*CLI, "simulate", "gaussian", "--prompts", "4", "--samples", "20", "--out", str(pool)],
                          capture_output=True).returncode == 0
    res = subprocess.run([*CLI, "plan", "--epsilon-total", "1", "--epsilon", "0.1", "--pool", str(pool)],
                         capture_output=True, text=True)
    out = res.stdout + res.stderr
    assert res.returncode == 2 and "None" not in out and "reward 'proxy'" in out, out
