"""``privalign ledger show | events | check``, text and --json, on a real SQLite ledger file."""

import json
import sqlite3
import time

import pytest
from typer.testing import CliRunner

from privalign import accounting as A
from privalign.cli import app
from privalign.ledger import Ledger


@pytest.fixture
def ledger(tmp_path):
    path = str(tmp_path / "l.db")
    led = Ledger(path)
    led.set_budget("acme", 10.0, 1e-6, "zcdp", "acme")
    led.set_budget("model", 5.0, 0.0, "fsrc", None)
    event = A.privbon_event(A.gumbel_noise_scale(0.3, 0.01), 0.01)
    for i in range(3):
        led.settle(led.reserve("acme", request_id=f"req-{i}", event=event), 0.3)
        led.settle(led.reserve("model", 0.3, request_id=f"req-{i}"), 0.3)
    led.reserve("model", 0.5, request_id="open-one")  # held, not settled
    led.close()
    return path


def run(*args):
    res = CliRunner().invoke(app, ["ledger", *args])
    return res.exit_code, res.output


def test_ledger_show_gives_every_budget_in_epsilon_delta_and_rho(ledger):
    code, out = run("show", ledger, "--json")
    assert code == 0, out
    b = {x["name"]: x for x in json.loads(out)["budgets"]}
    assert b["acme"]["queries"] == 3 and b["acme"]["rho_spent"] == pytest.approx(3 * 0.3 ** 2 / 8)
    assert b["model"]["epsilon_spent"] == pytest.approx(0.9) and b["model"]["epsilon_reserved"] == 0.5
    assert b["model"]["epsilon_remaining"] == pytest.approx(5 - 0.9 - 0.5) and b["model"]["open_reservations"] == 1
    code, out = run("show", ledger)
    assert code == 0 and "acme (tenant acme, zcdp): epsilon 10 / " in out and "model (model budget, fsrc)" in out


def test_ledger_events_filters_by_request_id_and_time(ledger):
    code, out = run("events", ledger, "--budget", "model", "--json")
    events = json.loads(out)["events"]
    assert code == 0 and [e["kind"] for e in events] == ["reserve", "settle"] * 3 + ["reserve"]
    code, out = run("events", ledger, "--budget", "model", "--request-id", "req-1", "--json")
    assert [(e["request_id"], e["kind"]) for e in json.loads(out)["events"]] == [("req-1", "reserve"), ("req-1", "settle")]
    code, out = run("events", ledger, "--budget", "model", "--since", str(time.time() + 60), "--json")
    assert code == 0 and json.loads(out)["events"] == []
    code, out = run("events", ledger, "--budget", "model", "--until", "2000-01-01T00:00", "--json")
    assert code == 0 and json.loads(out)["events"] == []
    code, out = run("events", ledger, "--budget", "model", "--since", "yesterday")
    assert code == 2 and "--since" in out and "'yesterday'" in out
    code, out = run("events", ledger, "--budget", "nope")
    assert code == 2 and "unknown budget 'nope'" in out
    code, out = run("events", ledger, "--budget", "acme")
    assert code == 0 and "req-2" in out


def test_ledger_check_finds_a_tampered_counter(ledger, tmp_path):
    code, out = run("check", ledger, "--json")
    assert code == 0 and json.loads(out) == {"ledger": ledger, "ok": True, "budgets": 2, "problems": []}
    with sqlite3.connect(ledger) as db:
        db.execute("UPDATE budgets SET spent_epsilon = 0.1 WHERE name = 'model'")
    code, out = run("check", ledger, "--json")
    report = json.loads(out)
    assert code == 1 and not report["ok"] and report["problems"][0].startswith("model: counters say spent 0.1")
    code, out = run("check", ledger)
    assert code == 1 and "model: counters say spent 0.1" in out
    code, out = run("check", str(tmp_path / "missing.db"))
    assert code == 2 and "no ledger at" in out and not (tmp_path / "missing.db").exists()
