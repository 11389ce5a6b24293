"""zCDP delta shown honestly (issue 50, item 4): under zcdp, delta is fixed by the conversion from
rho to (epsilon, delta), not spent query by query. ``ledger show`` and ``/v1/budgets`` show it once,
with what it means, never as "delta 1e-06 / spent 1e-06 / left 1e-06"."""

import json
import subprocess
import sys

from privalign.accounting import pure_event
from privalign.ledger import Ledger


def _ledger(tmp_path):
    led = Ledger(str(tmp_path / "l.db"))
    led.set_budget("z", 10.0, 1e-6, "zcdp", "t")
    led.set_budget("f", 10.0, 1e-6, "fsrc", "t")
    for name in ("z", "f"):
        rid = led.reserve(name, request_id="q1", event=pure_event(0.5, "privbon"))
        led.settle(rid, 0.5)
    return led


def test_a_zcdp_budget_states_delta_once_and_spends_none(tmp_path):
    led = _ledger(tmp_path)
    z, f = led.budget("z").as_dict(), led.budget("f").as_dict()
    led.close()
    assert z["delta_total"] == 1e-6 and z["delta_spent"] is None and z["delta_remaining"] is None
    assert z["delta_reserved"] is None
    assert "fixed" in z["delta_meaning"] and "not spent" in z["delta_meaning"]
    assert f["delta_spent"] == 0.0 and f["delta_remaining"] == 1e-6 and "delta_meaning" not in f  # fsrc: spent


def test_ledger_show_says_what_a_zcdp_delta_means(tmp_path):
    _ledger(tmp_path).close()
    res = subprocess.run([sys.executable, "-m", "privalign", "ledger", "show", str(tmp_path / "l.db")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if x.startswith("z "))
    assert "delta 1e-06 /" not in line and "delta 1e-06 (fixed by the zcdp conversion" in line, line
    other = next(x for x in res.stdout.splitlines() if x.startswith("f "))
    assert "delta 1e-06 / 0 / 0 / 1e-06" in other, other
    js = json.loads(subprocess.run([sys.executable, "-m", "privalign", "ledger", "show", str(tmp_path / "l.db"),
                                    "--json"], capture_output=True, text=True).stdout)
    z = next(b for b in js["budgets"] if b["name"] == "z")
    assert z["delta_spent"] is None and "delta_meaning" in z


def test_the_service_shows_the_same(tmp_path):
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig
    from privalign.server.http import shown_budget

    cfg = ServiceConfig.model_validate({
        "ledger": str(tmp_path / "s.db"), "generator": {"backend": "stub"},
        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
        "budgets": [{"name": "z", "epsilon_total": 10.0, "delta_total": 1e-6, "composition": "zcdp"}]})
    svc = Service(cfg, generator=StubGenerator())
    try:
        out = svc.answer([{"role": "user", "content": "hi"}], None, "default")
        assert "delta" not in out["privalign"]["budget_remaining"]  # zcdp: rho and epsilon are what is left
        view = shown_budget(svc.ledger.budget("z"))
        assert view["delta_spent"] is None and view["delta_total"] == 1e-6 and "delta_meaning" in view
    finally:
        svc.close()
