"""A per-request ceiling (issue 50, item 7): one query cannot drain a shared budget. ``[mechanism]
epsilon_max`` and ``delta_max`` (default: what a request with the configured options may cost); a
request above it is a 400 naming the ceiling, and nothing is charged; a tenant's budget may set its
own lower ceiling."""

import pytest
from pydantic import ValidationError

from privalign.server.app import ApiError, Service, StubGenerator
from privalign.server.config import ServiceConfig

HI = [{"role": "user", "content": "hi"}]


def config(ledger, mechanism=None, budget_a=None):
    return ServiceConfig.model_validate({
        "ledger": ledger, "generator": {"backend": "stub"},
        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
        "mechanism": {"name": "privbon", "n": 4, "epsilon": 0.5, **(mechanism or {})},
        "clients": {"ka": {"tenant": "a"}, "kb": {"tenant": "b"}},
        "budgets": [{"name": "a", "tenant": "a", "epsilon_total": 100.0, **(budget_a or {})},
                    {"name": "b", "tenant": "b", "epsilon_total": 10.0}],
        "model_budget": {"name": "model", "epsilon_total": 1000.0, "delta_total": 0.5}})


def spent(svc):
    return {n: (svc.ledger.budget(n).spent.epsilon, svc.ledger.budget(n).queries) for n in ("a", "b", "model")}


def test_a_request_over_the_default_ceiling_is_refused_and_charges_nothing(tmp_path):
    svc = Service(config(str(tmp_path / "l.db")), generator=StubGenerator())
    try:
        before = spent(svc)
        with pytest.raises(ApiError) as e:
            svc.answer(HI, {"epsilon": 1e6}, "a")
        assert e.value.status == 400 and "epsilon_max = 0.5" in e.value.message and "[mechanism]" in e.value.message
        assert e.value.extra.get("param") == "privalign.epsilon"
        with pytest.raises(ApiError, match="epsilon_max = 0.5"):  # the same cost asked through the noise scale
            svc.answer(HI, {"noise_scale": 1e-6}, "a")
        assert spent(svc) == before and svc.ledger.check() == []
        svc.answer(HI, {"epsilon": 0.5}, "a")  # at the ceiling: answered
        svc.answer(HI, {"epsilon": 0.1}, "a")  # below it
        assert svc.ledger.budget("a").queries == 2
    finally:
        svc.close()


def test_the_operator_sets_the_ceiling_and_a_budget_may_lower_it(tmp_path):
    cfg = config(str(tmp_path / "l.db"), mechanism={"epsilon_max": 2.0, "delta_max": 0.01},
                 budget_a={"epsilon_max": 0.2})
    svc = Service(cfg, generator=StubGenerator())
    try:
        svc.answer(HI, {"epsilon": 2.0}, "b")  # b has the mechanism's ceiling
        with pytest.raises(ApiError, match="epsilon_max = 2"):
            svc.answer(HI, {"epsilon": 2.5}, "b")
        with pytest.raises(ApiError) as e:
            svc.answer(HI, {"epsilon": 0.5}, "a")  # a's own ceiling is lower
        assert e.value.status == 400 and "budget 'a'" in e.value.message and "epsilon_max = 0.2" in e.value.message
        svc.answer(HI, {"epsilon": 0.2}, "a")
        with pytest.raises(ApiError, match="delta_max = 0.01"):  # privitp's delta over the ceiling
            svc.answer(HI, {"mechanism": "privitp", "delta": 0.5, "sigma_x": 100.0, "sigma_z": 100.0}, "b")
        assert svc.ledger.budget("a").queries == 1 and svc.ledger.budget("b").queries == 1
    finally:
        svc.close()


def test_a_privitp_default_request_fits_the_default_ceiling_at_any_n(tmp_path):
    cfg = config(str(tmp_path / "l.db"), mechanism={"name": "privitp", "sigma_x": 0.5, "sigma_z": 0.5,
                                                    "delta": 0.01}, budget_a={"delta_total": 0.5})
    svc = Service(cfg, generator=StubGenerator())
    try:
        for n in (1, 4, cfg.max_n):
            svc.answer(HI, {"n": n}, "a")
        svc.answer(HI, {"mechanism": "privbon"}, "a")  # the other mechanism's configured options fit too
        with pytest.raises(ApiError, match="epsilon_max"):
            svc.answer(HI, {"sigma_x": 0.01, "sigma_z": 0.01}, "a")
    finally:
        svc.close()


def test_a_ceiling_must_be_positive():
    with pytest.raises(ValidationError, match="epsilon_max"):
        config("l.db", mechanism={"epsilon_max": 0})
    with pytest.raises(ValidationError, match="delta_max"):
        config("l.db", budget_a={"delta_max": 1.5})
