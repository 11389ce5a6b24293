"""The service against a real uvicorn server on loopback, a real SQLite ledger file, the stock
openai client; kill -9 under load; and one run with the real embedded model pair."""

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from privalign.ledger import Ledger

ADMIN, CLIENT, OTHER = "admin-key", "client-key", "other-key"
STUB = f"""
admin_keys = ["{ADMIN}"]
max_n = 32
max_prompt_chars = 200
[clients.{CLIENT}]
tenant = "acme"
[clients.{OTHER}]
tenant = "globex"
[generator]
backend = "stub"
[reward]
kind = "stub"
output_range = [0.0, 1.0]
sensitivity = 0.1
[mechanism]
name = "privitp"
n = 8
epsilon = 1.0
beta = 0.05
sigma_x = 0.5
sigma_z = 0.5
delta = 0.01
[[budgets]]
name = "acme-rm"
tenant = "acme"
epsilon_total = {{total}}
delta_total = 0.9
composition = "fsrc"
[[budgets]]
name = "globex-rm"
tenant = "globex"
epsilon_total = 5.0
"""


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    def __init__(self, tmp_path, config: str, ledger_name="ledger.db", ledger_url=None):
        self.ledger_path = ledger_url or tmp_path / ledger_name
        self.config = tmp_path / "config.toml"
        self.config.write_text(f'ledger = "{self.ledger_path}"\n' + config)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self, timeout=120):
        self.proc = subprocess.Popen([sys.executable, "-m", "privalign", "serve", "--config", str(self.config),
                                      "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.proc.stderr.read().decode())
            try:
                return json.loads(urllib.request.urlopen(self.url + "/healthz", timeout=1).read())
            except OSError:
                time.sleep(0.1)
        raise TimeoutError("server did not start")

    def kill9(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=20)


def call(url, path, body=None, key=CLIENT, method=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url + path, data=data, method=method or ("POST" if data is not None else "GET"),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def stub_server(tmp_path):
    srv = Server(tmp_path, STUB.format(total=50.0))
    srv.start()
    yield srv
    srv.stop()


def chat(url, ext=None, key=CLIENT, content="What is 2 + 2?"):
    return call(url, "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": content}],
                                              **({"privalign": ext} if ext is not None else {})}, key=key)


def test_stock_openai_client_gets_a_private_answer(stub_server):
    from openai import OpenAI

    client = OpenAI(base_url=stub_server.url + "/v1", api_key=CLIENT)
    r = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": "Hi"}],
                                       extra_body={"privalign": {"mechanism": "privitp", "n": 8}})
    block = r.model_extra["privalign"]
    assert r.choices[0].message.content.startswith("candidate")
    assert block["mechanism"] == "privitp" and block["n"] == 8 and block["budget"] == "acme-rm"
    t = block["halting_time"]
    assert block["candidates_generated"] == (8 + t if not block["fallback"] else 2 * 8 + 1)
    assert 0 < block["epsilon_charged"] <= block["epsilon_max"]
    assert block["budget_remaining"]["epsilon"] == pytest.approx(50.0 - block["epsilon_charged"])
    c = client.completions.create(model="stub", prompt="Hello", extra_body={"privalign": {"mechanism": "privbon",
                                                                                         "epsilon": 0.5, "n": 4}})
    assert c.model_extra["privalign"]["epsilon_charged"] == pytest.approx(0.5)
    assert call(stub_server.url, "/metrics")[0] == 403  # budget names are per tenant: admins only
    req = urllib.request.Request(stub_server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    metrics = urllib.request.urlopen(req).read().decode()
    assert 'privalign_queries_total{budget="acme-rm",mechanism="privitp"} 1.0' in metrics
    assert "privalign_candidates_generated_total" in metrics
    assert [m.id for m in client.models.list()] == ["stub"]
    parts = client.chat.completions.create(model="stub", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}], temperature=0.7)
    assert parts.choices[0].message.content.startswith("candidate")


def test_keys_tenants_and_budget_administration(stub_server):
    url = stub_server.url
    status, body = call(url, "/v1/budgets")
    assert status == 200 and [b["name"] for b in body["budgets"]] == ["acme-rm"]
    assert call(url, "/v1/budgets/globex-rm")[0] == 404  # another tenant's budget is invisible
    assert call(url, "/v1/budgets", key="nope")[0] == 401
    assert chat(url, {"budget": "globex-rm"})[0] == 404  # the same answer as for a budget that does not exist
    assert chat(url, {"budget": "globex-rm"})[1]["error"] == chat(url, {"budget": "no-such-rm"})[1]["error"] | {
        "message": "unknown budget 'globex-rm'"}
    assert call(url, "/v1/budgets/acme-rm", {"epsilon_total": 100.0})[0] == 403  # clients cannot change budgets
    status, b = call(url, "/v1/budgets/acme-rm", {"epsilon_total": 100.0, "delta_total": 0.9}, key=ADMIN)
    assert status == 200 and b["epsilon_total"] == 100.0
    assert call(url, "/v1/budgets/acme-rm", {"epsilon_total": 10.0, "delta_total": 0.9}, key=ADMIN)[0] == 400
    status, b = call(url, "/v1/budgets/new-rm", {"epsilon_total": 3.0, "tenant": "acme"}, key=ADMIN)
    assert status == 200 and call(url, "/v1/budgets/new-rm")[0] == 200
    assert len(call(url, "/v1/budgets", key=ADMIN)[1]["budgets"]) == 3


def test_bad_input_is_refused_and_charges_nothing(stub_server):
    url = stub_server.url
    bad = [(None, b"{not json"), ({"model": "x", "messages": "hi"}, None),
           ({"model": "x", "messages": [{"role": "user", "content": "x" * 500}]}, None),
           ({"model": "x", "messages": [{"role": "user", "content": "hi"}], "n": 3}, None)]
    hi = [{"role": "user", "content": "hi"}]
    bad += [({"model": "x", "messages": hi, "stream": True}, None),                 # streaming is refused
            ({"model": "x", "messages": hi, "max_tokens": 9}, None),                # over the cap (8)
            ({"model": "x", "messages": hi, "temperature": 0}, None),
            ({"model": "x", "messages": hi * 65}, None),                            # too many messages
            ({"model": "x", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None)]
    for ext in [{"mechanism": "bon"}, {"n": 0}, {"n": 33}, {"n": 2.5}, {"epsilon": 0, "mechanism": "privbon"},
                {"epsilon": -1, "mechanism": "privbon"}, {"beta": "high"}, {"delta": 1.5}, {"colour": "red"},
                # extreme but valid numbers: the accountant answers, the service refuses with a 4xx
                {"epsilon": 1e-320, "mechanism": "privbon"}, {"noise_scale": 1e-320, "mechanism": "privbon"},
                {"sigma_z": 1e-300}, {"sigma_x": 1e-300}]:
        bad.append(({"model": "x", "messages": hi, "privalign": ext}, None))
    for body, raw in bad:
        status, err = call(url, "/v1/chat/completions", body, raw=raw)
        assert 400 <= status < 500 and err["error"]["message"], (body, raw, status, err)
    state = call(url, "/v1/budgets/acme-rm")[1]
    assert state["queries"] == 0 and state["epsilon_spent"] == 0 and state["open_reservations"] == 0
    assert chat(url, {"beta": 1e-300})[0] == 200  # extreme but servable: a correct, charged answer


def test_exhausted_budget_answers_429_and_never_overspends(tmp_path):
    srv = Server(tmp_path, STUB.format(total=3.0))
    srv.start()
    try:
        statuses = []
        for _ in range(40):
            status, body = chat(srv.url, {"mechanism": "privbon", "epsilon": 0.4, "n": 4})
            statuses.append(status)
        assert statuses[:7] == [200] * 7 and set(statuses[7:]) == {429}
        assert body["error"]["type"] == "budget_exhausted" and body["error"]["budget"] == "acme-rm"
        req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST", data=json.dumps(
            {"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT}"})
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(req)
        assert info.value.code == 429 and info.value.headers["x-should-retry"] == "false"  # openai: no retry
        statuses.append(429)
        state = call(srv.url, "/v1/budgets/acme-rm")[1]
        assert state["epsilon_spent"] <= 3.0 and state["queries"] == 7 and state["refusals"] == 34
    finally:
        srv.stop()


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_concurrent_clients_never_overspend(tmp_path, backend):
    url = None
    if backend == "postgres":
        url = os.environ.get("PRIVALIGN_TEST_POSTGRES")
        if not url:
            pytest.skip("PRIVALIGN_TEST_POSTGRES is not set (.ci/run starts a PostgreSQL server and sets it)")
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("DROP TABLE IF EXISTS events, budgets")
    srv = Server(tmp_path, STUB.format(total=20.0), ledger_url=url)
    srv.start()
    answered, lock = [], threading.Lock()

    def client(i):
        for _ in range(25):
            status, body = chat(srv.url, {"mechanism": "privitp" if i % 2 else "privbon", "n": 6, "epsilon": 0.3})
            if status == 200:
                with lock:
                    answered.append(body["privalign"])
            else:
                assert status == 429

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        srv.stop()
    ledger = Ledger(str(srv.ledger_path))
    charges = ledger.charges("acme-rm")
    assert ledger.check() == []
    assert len(charges) == len(answered) > 0
    assert math.fsum(c[2] for c in charges) <= 20.0
    assert {c[0] for c in charges} == {a["request_id"] for a in answered}


def test_kill_9_under_load_keeps_the_ledger_consistent(tmp_path):
    srv = Server(tmp_path, "ledger_lease_s = 1.0\n" + STUB.format(total=1000.0))
    received, lock = [], threading.Lock()
    for round_ in range(3):
        srv.start()
        stop = threading.Event()

        def client():
            while not stop.is_set():
                try:
                    status, body = chat(srv.url, {"mechanism": "privitp", "n": 6})
                except (OSError, ValueError, http.client.HTTPException):
                    continue  # the server died mid-request or mid-response: this answer was never received
                if status == 200:
                    with lock:
                        received.append(body["privalign"]["request_id"])

        threads = [threading.Thread(target=client) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        srv.kill9()
        stop.set()
        for t in threads:
            t.join()
    health = srv.start()  # the restarted service settles the killed requests' reservations at their worst case
    deadline = time.time() + 10  # once the dead process's 1 s lease has expired
    while call(srv.url, "/v1/budgets/acme-rm")[1]["open_reservations"] and time.time() < deadline:
        time.sleep(0.2)
    srv.stop()
    ledger = Ledger(str(srv.ledger_path))
    assert ledger.check() == []
    charged = {c[0]: c for c in ledger.charges("acme-rm")}
    assert set(received) <= set(charged)  # every answer a client received is charged
    assert len(received) > 20
    assert math.fsum(c[2] for c in charged.values()) <= 1000.0
    assert ledger.budget("acme-rm").open == 0
    assert health["recovered_on_start"] >= 0


def test_real_embedded_model_pair_and_http_generator(tmp_path):
    """No backend configured: the service starts with SmolLM2 and the certified MiniLM reward model."""
    srv = Server(tmp_path, f"""
admin_keys = ["{ADMIN}"]
[clients.{CLIENT}]
tenant = "default"
[generator]
max_new_tokens = 4
[mechanism]
n = 4
""")
    health = srv.start(timeout=300)
    try:
        assert health["generator"].startswith("SmolLM2")
        status, body = chat(srv.url, {"mechanism": "privbon", "epsilon": 2.0})
        assert status == 200 and body["privalign"]["candidates_generated"] == 4
        status, body = chat(srv.url, {"mechanism": "privitp", "n": 4})
        assert status == 200 and body["privalign"]["candidates_generated"] <= 2 * 4 + 1
        from privalign.backends.openai_backend import OpenAIGenerator

        gen = OpenAIGenerator(srv.url, api_key=CLIENT, max_n_per_request=1,
                              extra_body={"privalign": {"mechanism": "privbon", "n": 2, "epsilon": 2.0}})
        outs = gen.generate([{"role": "user", "content": "What is 1 + 1?"}], 2, max_new_tokens=4)
        assert len(outs) == 2 and all(isinstance(o.text, str) for o in outs)
    finally:
        srv.stop()


def test_reward_model_fault_is_502_and_charged_at_worst_case(tmp_path):
    import numpy as np

    from privalign.rewards import CallableReward
    from privalign.server.app import ApiError, Service, StubGenerator
    from privalign.server.config import ServiceConfig

    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
                                        "budgets": [{"name": "default", "epsilon_total": 10.0}]})
    nan = CallableReward(lambda p, r: np.full(len(r), np.nan), (0.0, 1.0), sensitivity=0.1)
    svc = Service(cfg, generator=StubGenerator(), reward=nan)
    with pytest.raises(ApiError) as err:
        svc.answer([{"role": "user", "content": "hi"}], {"mechanism": "privbon", "epsilon": 0.5}, "default")
    assert err.value.status == 502 and "NaN" in err.value.message
    state = svc.ledger.budget("default")
    assert state.spent.epsilon == pytest.approx(0.5) and state.open == 0  # never refunded
    assert svc.ledger.check() == []


def test_failures_after_the_reservation_charge_the_worst_case_and_answer_5xx(tmp_path):
    """A crash in generation (not a ValueError) and a failing settlement: never a stranded
    reservation, always a JSON 5xx, the worst case charged."""
    from privalign.server.app import ApiError, Service, StubGenerator
    from privalign.server.config import ServiceConfig

    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
                                        "budgets": [{"name": "default", "epsilon_total": 10.0}]})

    class Crashing(StubGenerator):
        def generate(self, *a, **kw):
            raise RuntimeError("CUDA out of memory")

    svc = Service(cfg, generator=Crashing())
    ask = ([{"role": "user", "content": "hi"}], {"mechanism": "privbon", "epsilon": 0.5}, "default")
    with pytest.raises(ApiError) as err:
        svc.answer(*ask)
    assert err.value.status == 500 and err.value.kind == "internal_error"
    assert svc.ledger.budget("default").spent.epsilon == pytest.approx(0.5)

    svc = Service(cfg, generator=StubGenerator())
    real_settle_state = svc.ledger.settle_state

    def flaky(rid, epsilon=None, kind="settle"):
        if epsilon is not None:
            raise OSError("disk I/O error")
        return real_settle_state(rid, epsilon, kind)

    svc.ledger.settle_state = flaky
    with pytest.raises(ApiError) as err:
        svc.answer(*ask)
    assert err.value.status == 500 and err.value.kind == "ledger_error"
    state = svc.ledger.budget("default")
    assert state.spent.epsilon == pytest.approx(1.0) and state.open == 0 and svc.ledger.check() == []


def test_one_tenant_cannot_occupy_every_worker(tmp_path):
    """Past max_inflight_per_tenant, a tenant's requests are refused (429, Retry-After, nothing
    charged) while another tenant is still served."""
    import threading as th

    from privalign.server.app import ApiError, Service, StubGenerator
    from privalign.server.config import ServiceConfig

    gate, entered = th.Event(), th.Semaphore(0)

    class Slow(StubGenerator):
        def generate(self, *a, **kw):
            entered.release()
            gate.wait(30)
            return super().generate(*a, **kw)

    cfg = ServiceConfig.model_validate({
        "ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"}, "max_inflight_per_tenant": 2,
        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
        "clients": {"a-key": {"tenant": "a"}, "b-key": {"tenant": "b"}},
        "budgets": [{"name": "a-rm", "tenant": "a", "epsilon_total": 10.0}, {"name": "b-rm", "tenant": "b",
                                                                              "epsilon_total": 10.0}]})
    svc = Service(cfg, generator=Slow())
    ask = [{"role": "user", "content": "hi"}]
    busy = [th.Thread(target=svc.answer, args=(ask, {"mechanism": "privbon"}, "a")) for _ in range(2)]
    for t in busy:
        t.start()
    entered.acquire()
    entered.acquire()
    with pytest.raises(ApiError) as err:
        svc.answer(ask, {"mechanism": "privbon"}, "a")
    assert err.value.status == 429 and err.value.extra["retry_after"] == 1
    assert svc.ledger.budget("a-rm").open == 2  # the refused request reserved nothing
    other = th.Thread(target=svc.answer, args=(ask, {"mechanism": "privbon"}, "b"))
    other.start()
    entered.acquire()  # tenant b still gets in
    gate.set()
    for t in (*busy, other):
        t.join()
    assert svc.ledger.budget("a-rm").queries == 2 and svc.ledger.budget("b-rm").queries == 1
