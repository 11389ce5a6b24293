"""The deployment-wide model budget (issue 21): every query charges its tenant's budget and the
model budget atomically; the one-time range release is charged once; the guarantee for a person in
D is stated; replicas on PostgreSQL share it."""

import os
import threading
import uuid

import pytest

from privalign.server.app import ApiError, Service, StubGenerator, StubReward
from privalign.server.config import ServiceConfig

ASK = ([{"role": "user", "content": "hi"}], {"mechanism": "privbon", "epsilon": 0.5, "n": 4})


def config(ledger, model_total=3.0, composition="fsrc", suffix=""):
    return ServiceConfig.model_validate({
        "ledger": ledger, "generator": {"backend": "stub"},
        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
        "clients": {"ka": {"tenant": "a"}, "kb": {"tenant": "b"}},
        "budgets": [{"name": f"a{suffix}", "tenant": "a", "epsilon_total": 10.0},
                    {"name": f"b{suffix}", "tenant": "b", "epsilon_total": 10.0}],
        "model_budget": {"name": f"model{suffix}", "epsilon_total": model_total, "composition": composition}})


def test_every_query_is_charged_to_its_tenant_and_the_model_budget_atomically(tmp_path):
    svc = Service(config(str(tmp_path / "l.db")), generator=StubGenerator())
    answered = {"a": 0, "b": 0}
    refusal = None
    for i in range(20):
        tenant = "ab"[i % 2]
        try:
            svc.answer(*ASK, tenant)
            answered[tenant] += 1
        except ApiError as e:
            refusal = e
            break
    assert answered == {"a": 3, "b": 3}  # 6 x 0.5 = the model budget's 3, though each tenant has 10
    # a tenant is told the deployment's limit is reached, never the model budget's name or balance
    assert refusal.status == 429 and refusal.extra["budget"] in ("a", "b") and "'model'" not in refusal.message
    assert "epsilon_remaining" not in refusal.extra and "rho_remaining" not in refusal.extra
    with pytest.raises(ApiError) as admin:  # an admin sees which budget refused, and what it has left
        svc.answer(ASK[0], {**ASK[1], "budget": "a"}, None)
    assert admin.value.extra["budget"] == "model" and "epsilon_remaining" in admin.value.extra
    led = svc.ledger
    a, b, m = led.budget("a"), led.budget("b"), led.budget("model")
    assert (a.queries, b.queries, m.queries) == (3, 3, 6) and m.spent.epsilon == pytest.approx(3.0)
    assert a.open == b.open == m.open == 0 and led.check() == []  # the refused query held nothing anywhere
    with pytest.raises(ApiError) as info:  # the model budget is nobody's query budget
        svc.answer(ASK[0], {**ASK[1], "budget": "model"}, None)
    assert info.value.status == 400
    g = svc.guarantee()
    assert g["model_budget"] == "model" and g["epsilon"] == 3.0 and "every tenant" in g["statement"]
    svc.close()


def test_the_range_release_is_charged_once_and_the_guarantee_without_a_model_budget_is_the_sum(tmp_path):
    reward = StubReward()
    reward.range_epsilon = 0.1
    reward.output_range = (0.0, 1.0)
    ledger = str(tmp_path / "l.db")
    first = Service(config(ledger), generator=StubGenerator(), reward=reward)
    again = Service(config(ledger), generator=StubGenerator(), reward=reward)  # a restart, or a second replica
    assert first.release_charged and not again.release_charged
    m = again.ledger.budget("model")
    assert m.spent.epsilon == pytest.approx(0.1) and m.queries == 1 and again.ledger.check() == []
    cfg = config(str(tmp_path / "other.db")).model_copy(update={"model_budget": None})
    plain = Service(cfg, generator=StubGenerator(), reward=reward)
    g = plain.guarantee()
    assert g["model_budget"] is None and g["epsilon"] == pytest.approx(20.1) and "add up" in g["statement"]
    for s in (first, again, plain):
        s.close()


@pytest.mark.skipif(not os.environ.get("PRIVALIGN_TEST_POSTGRES"), reason="needs PRIVALIGN_TEST_POSTGRES")
def test_two_replicas_on_postgres_share_the_model_budget():
    from .test_ledger_truth import fresh_postgres

    url = fresh_postgres()  # one ledger, one deployment: its model budget is recorded once
    suffix = "-" + uuid.uuid4().hex[:8]
    replicas = [Service(config(url, 5.0, "zcdp", suffix), generator=StubGenerator()) for _ in range(2)]
    answered, refused = [], []
    lock = threading.Lock()

    def client(svc, tenant):
        for _ in range(40):
            try:
                svc.answer(*ASK, tenant)
                with lock:
                    answered.append(tenant)
            except ApiError as e:
                assert e.status == 429
                with lock:
                    refused.append(e.extra["budget"])

    threads = [threading.Thread(target=client, args=(svc, t)) for svc in replicas for t in "ab" for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    led = replicas[0].ledger
    m = led.budget("model" + suffix)
    rho_each = 0.5 ** 2 / 8
    assert len(answered) == m.queries
    assert m.spent_rho <= m.rho_total and m.spent_rho == pytest.approx(len(answered) * rho_each)
    # refused by the model budget, which a tenant is not shown: each refusal names the tenant's own budget
    assert len(answered) == int(m.rho_total / rho_each + 1e-9) and set(refused) <= {"a" + suffix, "b" + suffix}
    a, b = led.budget("a" + suffix), led.budget("b" + suffix)
    assert a.queries + b.queries == len(answered) and led.check() == []
    for s in replicas:
        s.close()
