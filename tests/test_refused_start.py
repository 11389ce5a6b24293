"""A refused start writes nothing (issue 50, item 2): every start-up check runs before the ledger is
opened or created, so after each kind of refusal a fresh ledger file does not exist, and an
existing ledger holds exactly what it held before."""

import sqlite3
import subprocess
import sys
from importlib import resources

import numpy as np
import pytest

from privalign.rewards.policy_bt import PolicyBTReward
from privalign.rewards.release import release_head

from .test_server import free_port

HEAD = """
admin_keys = ["admin-key"]
[clients.client-key]
tenant = "a"
[generator]
backend = "stub"
[reward]
kind = "policy-bt"
path = "{head}"
[mechanism]
name = "{mechanism}"
n = 2
[[budgets]]
name = "a"
tenant = "a"
epsilon_total = 1.0
delta_total = 1e-6
"""
MODEL_BUDGET = """
[model_budget]
name = "{name}"
epsilon_total = {total}
delta_total = 1e-5
"""
STUB_RELEASED = """
admin_keys = ["admin-key"]
[clients.client-key]
tenant = "{tenant}"
[generator]
backend = "stub"
[reward]
kind = "stub"
output_range = [0.0, 1.0]
[mechanism]
name = "{mechanism}"
n = 2
[[budgets]]
name = "a"
tenant = "{tenant}"
epsilon_total = 1.0
delta_total = 1e-6
"""


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    """A released head file: the shipped counting head's weights, released at (1, 1e-6)."""
    shipped = PolicyBTReward.load(resources.files("privalign") / "data" / "counting-policy-bt.json")
    shipped.meta = {**shipped.meta, "head_id": "test-head", "persons": 89,
                    "procedure": {**shipped.meta["procedure"], "unit": "person"}}
    folder = tmp_path_factory.mktemp("heads")
    release_head(shipped, 1.0, 1e-6, np.random.default_rng(0)).save(folder / "public.json")
    release_head(shipped, 1.0, 1e-6, np.random.default_rng(1)).save(folder / "again.json")
    return folder


def serve(tmp_path, body: str):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'ledger = "{tmp_path / "state" / "ledger.db"}"\n' + body)
    return subprocess.run([sys.executable, "-m", "privalign", "serve", "--config", str(cfg), "--port",
                           str(free_port())], capture_output=True, text=True, cwd=tmp_path, timeout=120)


def refused(res, needle):
    err = res.stderr.strip()
    assert res.returncode == 2 and needle in err and "Traceback" not in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("kind", ["released-privbon", "released-no-model-budget", "released-too-dear",
                                  "not-released-released-bon"])
def test_a_refused_start_leaves_no_ledger(tmp_path, head, kind):
    released = HEAD.replace("{head}", str(head / "public.json"))
    body, needle = {
        "released-privbon": (released.format(mechanism="privbon") + MODEL_BUDGET.format(name="model", total=5.0),
                             "serves with [mechanism] name = 'released-bon'"),
        "released-no-model-budget": (released.format(mechanism="released-bon"), "needs a [model_budget]"),
        "released-too-dear": (released.format(mechanism="released-bon") + MODEL_BUDGET.format(name="model", total=0.5),
                              "cannot cover the head's one-time release"),
        "not-released-released-bon": (STUB_RELEASED.format(tenant="a", mechanism="released-bon")
                                      + MODEL_BUDGET.format(name="model", total=5.0), "needs a released head"),
    }[kind]
    refused(serve(tmp_path, body), needle)
    assert not (tmp_path / "state" / "ledger.db").exists()


def _dump(path):
    con = sqlite3.connect(path)
    try:
        return [line for line in con.iterdump() if "owners" not in line]
    finally:
        con.close()


def _first(tmp_path, body):
    """A ledger configured by a first, valid start (the Service, as the server builds it)."""
    from privalign.server.app import Service
    from privalign.server.config import ServiceConfig
    import tomllib

    cfg = ServiceConfig.model_validate(tomllib.loads(f'ledger = "{tmp_path / "state" / "ledger.db"}"\n' + body))
    (tmp_path / "state").mkdir(exist_ok=True)
    Service(cfg).close()
    return _dump(tmp_path / "state" / "ledger.db")


@pytest.mark.parametrize("kind", ["tenant", "model-budget-name", "released-again"])
def test_a_refused_start_leaves_an_existing_ledger_as_it_was(tmp_path, head, kind):
    if kind == "released-again":
        first = HEAD.replace("{head}", str(head / "public.json")).format(mechanism="released-bon")
        first += MODEL_BUDGET.format(name="model", total=5.0)
        second, needle = first.replace("public.json", "again.json"), "already released into the model budget"
    else:
        first = STUB_RELEASED.format(tenant="a", mechanism="privbon") + MODEL_BUDGET.format(name="model", total=5.0)
        second, needle = {
            "tenant": (STUB_RELEASED.format(tenant="b", mechanism="privbon")
                       + MODEL_BUDGET.format(name="model", total=5.0), "a budget's tenant never changes"),
            "model-budget-name": (STUB_RELEASED.format(tenant="a", mechanism="privbon")
                                  + MODEL_BUDGET.format(name="other", total=5.0), "records the model budget 'model'"),
        }[kind]
    before = _first(tmp_path, first)
    refused(serve(tmp_path, second), needle)
    assert _dump(tmp_path / "state" / "ledger.db") == before


def test_the_service_itself_checks_before_it_opens_the_ledger(tmp_path, head):
    from privalign.rewards.release import ReleasedHead
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig
    import tomllib

    body = HEAD.replace("{head}", str(head / "public.json")).format(mechanism="privbon")
    cfg = ServiceConfig.model_validate(tomllib.loads(f'ledger = "{tmp_path / "l.db"}"\n' + body
                                                     + MODEL_BUDGET.format(name="model", total=5.0)))
    with pytest.raises(ValueError, match="serves with"):
        Service(cfg, generator=StubGenerator(), reward=ReleasedHead.load(head / "public.json"))
    assert not (tmp_path / "l.db").exists()
