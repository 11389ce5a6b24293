"""The ledger as the deployment's single source of truth (issue 30, item 3): two ``privalign serve``
processes on one ledger (SQLite; PostgreSQL when PRIVALIGN_TEST_POSTGRES is set), the banner,
/v1/budgets, /metrics and responses read from the ledger."""

import os
import re
import subprocess
import sys
import urllib.request
import uuid

import pytest

from privalign.ledger import Ledger

from .test_server import ADMIN, CLIENT, STUB, Server, call, chat, free_port

MODEL = '[model_budget]\nname = "model"\nepsilon_total = 30.0\n'
ASK = {"mechanism": "privbon", "epsilon": 0.5, "n": 4}


def ledgers():
    yield "sqlite"
    if os.environ.get("PRIVALIGN_TEST_POSTGRES"):
        yield "postgres"


@pytest.fixture(params=list(ledgers()))
def ledger_url(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "shared.db")
    return fresh_postgres()


def fresh_postgres() -> str:
    """A new, empty database on the PRIVALIGN_TEST_POSTGRES server: one ledger is one deployment
    (its model budget is recorded once), so each test needs its own."""
    import psycopg

    base = os.environ["PRIVALIGN_TEST_POSTGRES"]
    name = "t" + uuid.uuid4().hex[:12]
    with psycopg.connect(base, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return base.rsplit("/", 1)[0] + "/" + name


def replica(tmp_path, name, ledger_url, config):
    folder = tmp_path / name
    folder.mkdir()
    return Server(folder, config, ledger_url=ledger_url)


def test_a_replica_without_the_model_budget_adopts_the_ledgers_and_one_naming_another_refuses(tmp_path, ledger_url):
    a = replica(tmp_path, "a", ledger_url, STUB.format(total=50.0) + MODEL)
    b = replica(tmp_path, "b", ledger_url, STUB.format(total=50.0))  # no [model_budget]
    a.start()
    try:
        b.start()
        try:
            for _ in range(3):
                assert chat(b.url, ASK)[0] == 200
            assert "model budget 'model' adopted from the ledger" in b.log_path.read_text()
            # the replica without [model_budget] charged it, and states the model budget's guarantee
            model = call(a.url, "/v1/budgets/model", key=ADMIN)[1]
            assert model["queries"] == 3 and model["epsilon_spent"] == pytest.approx(1.5)
            assert call(b.url, "/v1/budgets", key=ADMIN)[1]["guarantee"]["model_budget"] == "model"
        finally:
            b.stop()
    finally:
        a.stop()
    c = replica(tmp_path, "c", ledger_url, STUB.format(total=50.0) + MODEL.replace('"model"', '"model-2"'))
    res = subprocess.run([sys.executable, "-m", "privalign", "serve", "--config", str(c.config), "--port",
                          str(free_port())], capture_output=True, text=True, timeout=60)
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "model_budget.name" in err and "'model'" in err and "'model-2'" in err


def test_the_banner_after_a_restart_reads_the_ledger(tmp_path, ledger_url):
    srv = replica(tmp_path, "a", ledger_url, STUB.format(total=10.0) + MODEL)
    srv.start()
    try:
        assert call(srv.url, "/v1/budgets/acme-rm", {"epsilon_total": 20}, key=ADMIN)[0] == 200
        assert call(srv.url, "/v1/budgets/model", {"epsilon_total": 45}, key=ADMIN)[0] == 200
        assert call(srv.url, "/v1/budgets/api-rm", {"epsilon_total": 3, "tenant": "acme"}, key=ADMIN)[0] == 200
    finally:
        srv.stop()
    srv.log_path.write_text("")
    srv.start()
    try:
        log = srv.log_path.read_text()
        assert "budget 'acme-rm' (tenant acme): epsilon 20," in log and "budget 'api-rm' (tenant acme): epsilon 3," in log
        assert "model budget 'model': epsilon 45," in log
        assert "the ledger holds epsilon 20" in log and "the config says 10" in log  # and it says why
    finally:
        srv.stop()


def test_metrics_budgets_and_responses_agree_on_a_zcdp_budget(tmp_path):
    config = (STUB.format(total=10.0).replace('composition = "fsrc"', 'composition = "zcdp"')
              .replace("delta_total = 0.9", "delta_total = 1e-6"))
    srv = Server(tmp_path, config)
    srv.start()
    try:
        for _ in range(3):
            status, out = chat(srv.url, {"mechanism": "privbon", "epsilon": 0.3, "n": 4})
            assert status == 200
        p = out["privalign"]
        assert p["epsilon_charged"] == pytest.approx(0.3) and "conversion" in p["accounting"]
        b = call(srv.url, "/v1/budgets/acme-rm")[1]
        assert p["budget_remaining"]["epsilon"] == pytest.approx(b["epsilon_remaining"])
        req = urllib.request.Request(srv.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
        metrics = urllib.request.urlopen(req).read().decode()
        spent = float(re.search(r'privalign_budget_epsilon_spent\{budget="acme-rm"\} (\S+)', metrics).group(1))
        assert spent == pytest.approx(b["epsilon_spent"]) and spent > 3 * 0.3  # the conversion, not the sum
    finally:
        srv.stop()
    led = Ledger(str(srv.ledger_path))
    assert led.check() == [] and led.setting("tenant_budget:acme") == "acme-rm"
