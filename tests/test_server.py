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
from pathlib import Path
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
        # stderr (startup summary and access log) goes to a file: a pipe nobody reads would fill and block
        self.log_path = Path(str(self.config)).with_suffix(".log")
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "privalign", "serve", "--config", str(self.config),
                                      "--port", str(self.port)], stdout=subprocess.DEVNULL, stderr=self.log,
                                     cwd=getattr(self, "cwd", None))
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log_path.read_text())
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
        if getattr(self, "log", None) is not None:
            self.log.close()


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


def chat(url, ext=None, key=CLIENT, content="What is 2 + 2?", model=None):
    """A chat request (``model`` left out unless given: the service accepts a missing name)."""
    return call(url, "/v1/chat/completions", {**({"model": model} if model else {}),
                                              "messages": [{"role": "user", "content": content}],
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
    # Phase 1 + Phase 2's first chunk of 4 in one call, then the last chunk of 4 + the fallback's draw
    assert block["candidates_generated"] == (8 + 4 if t <= 4 else 2 * 8 + 1)
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
    admin = call(url, "/v1/budgets", key=ADMIN)[1]
    assert len(admin["budgets"]) == 3
    # no model budget: the guarantee for a person in D is the sum over every budget, said plainly
    assert admin["guarantee"]["model_budget"] is None and admin["guarantee"]["epsilon"] == pytest.approx(100 + 5 + 3)
    assert "add up" in admin["guarantee"]["statement"] and "guarantee" not in call(url, "/v1/budgets")[1]
    assert "no model budget" in stub_server.log_path.read_text()  # and the start banner says so


def test_bad_input_is_refused_and_charges_nothing(stub_server):
    url = stub_server.url
    bad = [(None, b"{not json"), ({"model": "stub", "messages": "hi"}, None),
           ({"model": "stub", "messages": [{"role": "user", "content": "x" * 500}]}, None),
           ({"model": "stub", "messages": [{"role": "user", "content": "hi"}], "n": 3}, None)]
    hi = [{"role": "user", "content": "hi"}]
    bad += [({"model": "stub", "messages": hi, "stream": "yes"}, None),                # stream must be a bool
            ({"model": "stub", "messages": hi, "max_tokens": 9}, None),                # over the cap (8)
            ({"model": "stub", "messages": hi, "temperature": 0}, None),
            ({"model": "stub", "messages": hi * 65}, None),                            # too many messages
            ({"model": "stub", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, None),
            ({"model": "stub", "messages": [{"role": "user", "content": ""}]}, None),      # empty prompt
            ({"model": "stub", "messages": [{"role": "user", "content": "   \n"}]}, None)]  # blank prompt
    for ext in [{"mechanism": "bon"}, {"n": 0}, {"n": 33}, {"n": 2.5}, {"epsilon": 0, "mechanism": "privbon"},
                {"epsilon": -1, "mechanism": "privbon"}, {"beta": "high"}, {"delta": 1.5}, {"colour": "red"},
                # extreme but valid numbers: the accountant answers, the service refuses with a 4xx
                {"epsilon": 1e-320, "mechanism": "privbon"}, {"noise_scale": 1e-320, "mechanism": "privbon"},
                {"sigma_z": 1e-300}, {"sigma_x": 1e-300}]:
        bad.append(({"model": "stub", "messages": hi, "privalign": ext}, None))
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
            {"model": "stub", "messages": [{"role": "user", "content": "hi"}]}).encode(),
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
            conn.execute("DROP TABLE IF EXISTS events, budgets, settings")
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


def test_the_readmes_example_config_serves_the_counting_head_from_any_directory(tmp_path):
    """Issue 19: `privalign serve --config examples/service.toml` from another working directory finds
    its reward model in privalign's data, serves the certified counting head, and states the guarantee."""
    example = (Path(__file__).resolve().parents[1] / "examples" / "service.toml").read_text()
    body = "\n".join(line for line in example.splitlines() if not line.startswith("ledger ="))
    srv = Server(tmp_path, body)
    srv.cwd = str(tmp_path)
    srv.start(timeout=300)
    try:
        status, out = call(srv.url, "/v1/chat/completions", {"messages": [{"role": "user", "content":
                                                                         "What number comes after 41?"}],
                                                           "privalign": {"n": 4}}, key="change-me-client")
        assert status == 200, out
        p = out["privalign"]
        assert p["mechanism"] == "privbon" and p["composition"] == "zcdp" and p["epsilon_charged"] == pytest.approx(0.3)
        log = srv.log_path.read_text()
        assert "policy-bt" in log and "model budget 'model'" in log
        admin = call(srv.url, "/v1/budgets", key="change-me-admin")[1]
        assert admin["guarantee"]["model_budget"] == "model" and admin["guarantee"]["range_release_epsilon"] > 0
    finally:
        srv.stop()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'ledger = "{tmp_path / "never.db"}"\n[reward]\nkind = "policy-bt"\npath = "nope.json"\n')
    res = subprocess.run([sys.executable, "-m", "privalign", "serve", "--config", str(bad)], capture_output=True,
                         text=True, cwd=tmp_path)
    assert res.returncode == 2 and "reward.path: no file 'nope.json'" in " ".join(res.stderr.split())
    assert "Traceback" not in res.stderr and not (tmp_path / "never.db").exists()  # nothing created


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
epsilon_max = 10.0                 # a request may ask for epsilon 2 (the default ceiling is epsilon 1)
[[budgets]]
name = "default"
epsilon_total = 100.0
delta_total = 1e-4
""")
    health = srv.start(timeout=300)
    try:
        assert health["generator"].startswith("SmolLM2")
        status, body = chat(srv.url, {"mechanism": "privbon", "epsilon": 2.0})
        assert status == 200 and body["privalign"]["candidates_generated"] == 4
        status, body = chat(srv.url, {"mechanism": "privitp", "n": 4})
        assert status == 200 and body["privalign"]["candidates_generated"] <= 2 * 4 + 1
        from privalign.backends.openai_backend import OpenAIGenerator

        gen = OpenAIGenerator(srv.url, "smollm2", api_key=CLIENT, max_n_per_request=1,
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
    real_settle_all = svc.ledger.settle_all

    def flaky(rids, epsilon=None, kind="settle"):
        if epsilon is not None:
            raise OSError("disk I/O error")
        return real_settle_all(rids, epsilon, kind)

    svc.ledger.settle_all = flaky
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


# ---------------------------------------------------------------------------------------------
# Concurrency, back-pressure and the OpenAI-compatible backend (issue 11)


def fake_openai_app(delay: float = 0.0, max_choices: int | None = None, script=(), gate=None, record=True):
    """A fake OpenAI-compatible server: answers /v1/chat/completions and /v1/completions with ``n``
    choices (at most ``max_choices``) after ``delay`` seconds (and after ``gate`` is set, when given);
    the first calls answer the statuses in ``script``. Counts calls and the most in flight at once
    (also at GET /stats), and the TCP connections they came on (``peers``)."""
    import asyncio

    import anyio.to_thread
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    stats = app.state.stats = {"calls": 0, "in_flight": 0, "max_in_flight": 0, "bodies": [], "peers": set()}
    script = list(script)

    async def complete(request: Request, chat: bool):
        body = await request.json()
        stats["calls"] += 1
        stats["peers"].add(request.client.port)  # one client port per TCP connection
        if record:
            stats["bodies"].append(body)
        if script:
            status = script.pop(0)
            return JSONResponse({"error": {"message": f"scripted {status}"}}, status_code=status,
                                headers={"retry-after": "0"})
        stats["in_flight"] += 1
        stats["max_in_flight"] = max(stats["max_in_flight"], stats["in_flight"])
        try:
            if delay:
                await asyncio.sleep(delay)
            if gate is not None:
                await anyio.to_thread.run_sync(gate.wait, 30)
        finally:
            stats["in_flight"] -= 1
        k = int(body.get("n", 1))
        k = min(k, max_choices) if max_choices else k
        text = [f"answer {body.get('seed')}/{i}" for i in range(k)]
        choices = [({"index": i, "message": {"role": "assistant", "content": t}} if chat else {"index": i, "text": t})
                   | {"finish_reason": "stop", "logprobs": None} for i, t in enumerate(text)]
        return {"id": "x", "object": "chat.completion", "created": 0, "model": body.get("model"), "choices": choices,
                "usage": {"prompt_tokens": 1, "completion_tokens": k, "total_tokens": 1 + k}}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await complete(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, False)

    @app.get("/stats")
    async def get_stats():
        return {k: v for k, v in stats.items() if k not in ("bodies", "peers")}

    return app


class FakeOpenAI:
    """``fake_openai_app`` served by uvicorn in a thread of the test process, on loopback."""

    def __init__(self, **kw):
        import uvicorn

        self.app = fake_openai_app(**kw)
        self.stats = self.app.state.stats
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def openai_backend_config(url: str, generator: str = "") -> str:
    """The stub test config with the openai backend pointed at ``url``."""
    return STUB.format(total=50.0).replace('[generator]\nbackend = "stub"\n',
                                           f'[generator]\nbackend = "openai"\nbase_url = "{url}"\n{generator}')


def test_concurrent_requests_reach_the_backend_concurrently(tmp_path):
    with FakeOpenAI(delay=0.3) as fake:
        srv = Server(tmp_path, openai_backend_config(fake.url))
        srv.start()
        try:
            results = [None] * 8

            def one(i):
                results[i] = chat(srv.url, {"mechanism": "privbon", "n": 4, "epsilon": 0.5})

            threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert [r[0] for r in results] == [200] * 8
            assert all(r[1]["choices"][0]["message"]["content"].startswith("answer") for r in results)
            assert fake.stats["calls"] == 8 and all(b["n"] == 4 for b in fake.stats["bodies"])
            assert fake.stats["max_in_flight"] > 1  # no global lock: requests reach the backend together
            state = call(srv.url, "/v1/budgets/acme-rm")[1]
            assert state["queries"] == 8 and state["epsilon_spent"] == pytest.approx(8 * 0.5)
        finally:
            srv.stop()


def test_a_full_queue_answers_503_with_retry_after_and_charges_nothing(tmp_path):
    gate = threading.Event()
    with FakeOpenAI(gate=gate) as fake:
        srv = Server(tmp_path, openai_backend_config(fake.url, "max_concurrency = 1\nmax_queue = 0\n"))
        srv.start()
        try:
            first = []
            t = threading.Thread(target=lambda: first.append(chat(srv.url, {"mechanism": "privbon", "epsilon": 0.5})))
            t.start()
            deadline = time.time() + 30
            while fake.stats["in_flight"] < 1 and time.time() < deadline:  # the first request holds the backend
                time.sleep(0.02)
            before = call(srv.url, "/v1/budgets/acme-rm")[1]
            assert before["open_reservations"] == 1
            req = urllib.request.Request(srv.url + "/v1/chat/completions", method="POST", data=json.dumps(
                {"messages": [{"role": "user", "content": "hi"}],
                 "privalign": {"mechanism": "privbon", "epsilon": 0.5}}).encode(),
                headers={"Content-Type": "application/json", "Authorization": f"Bearer {CLIENT}"})
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(req, timeout=30)
            assert info.value.code == 503 and info.value.headers["retry-after"] == "1"
            assert json.loads(info.value.read())["error"]["type"] == "overloaded"
            after = call(srv.url, "/v1/budgets/acme-rm")[1]
            assert after["open_reservations"] == 1 and after["epsilon_spent"] == before["epsilon_spent"]
            assert after["queries"] == before["queries"] == 0
            gate.set()
            t.join(30)
            assert first[0][0] == 200
            state = call(srv.url, "/v1/budgets/acme-rm")[1]
            assert state["queries"] == 1 and state["epsilon_spent"] == pytest.approx(0.5)
            assert state["open_reservations"] == 0 and fake.stats["calls"] == 1
        finally:
            gate.set()
            srv.stop()


def test_openai_backend_retries_5xx_and_429_but_not_other_4xx():
    from privalign.backends.base import BackendError
    from privalign.backends.openai_backend import OpenAIGenerator

    hi = [{"role": "user", "content": "hi"}]
    with FakeOpenAI(script=[503, 429]) as fake:
        gen = OpenAIGenerator(fake.url, api_key="k", backoff=0.01)
        out = gen.generate(hi, 3, max_new_tokens=4)
        assert len(out) == 3 and all(o.text.startswith("answer") for o in out)
        assert fake.stats["calls"] == 3 == gen.calls  # two refusals (Retry-After: 0), then the answer
        gen.close()
    with FakeOpenAI(script=[503] * 5) as fake:
        gen = OpenAIGenerator(fake.url, max_retries=2, backoff=0.01)
        with pytest.raises(BackendError, match="503"):
            gen.generate(hi, 2)
        assert fake.stats["calls"] == 3  # bounded: one call and two retries
    with FakeOpenAI(script=[400]) as fake:
        gen = OpenAIGenerator(fake.url, backoff=0.01)
        with pytest.raises(BackendError, match="400"):
            gen.generate(hi, 2)
        assert fake.stats["calls"] == 1  # a 4xx other than 429 is final
    gen = OpenAIGenerator(f"http://127.0.0.1:{free_port()}", max_retries=1, backoff=0.01)
    with pytest.raises(BackendError, match="after 2 attempts"):  # connection refused: retried, then final
        gen.generate(hi, 1)


def test_openai_backend_keeps_a_bounded_set_of_connections():
    """Kept connections, one call on each at a time: sequential calls reuse one connection, and
    concurrent calls from many threads never open more than the generator's connections."""
    from concurrent.futures import ThreadPoolExecutor

    from privalign.backends.openai_backend import OpenAIGenerator

    hi = [{"role": "user", "content": "hi"}]
    with FakeOpenAI(delay=0.05) as fake:
        gen = OpenAIGenerator(fake.url, max_concurrency=8)
        for _ in range(5):
            assert len(gen.generate(hi, 2)) == 2
        assert fake.stats["calls"] == 5 and len(fake.stats["peers"]) == 1
        with ThreadPoolExecutor(20) as pool:
            outs = list(pool.map(lambda _: gen.generate(hi, 2), range(60)))
        assert all(len(o) == 2 for o in outs) and fake.stats["calls"] == 65
        assert fake.stats["max_in_flight"] == 8 and len(fake.stats["peers"]) == 8
        gen.close()


def test_openai_backend_when_the_server_ignores_n_and_caps_it():
    from privalign.backends.openai_backend import OpenAIGenerator

    hi = [{"role": "user", "content": "hi"}]
    with FakeOpenAI(max_choices=1) as fake:  # llama.cpp's server, privalign's own service: one choice per call
        gen = OpenAIGenerator(fake.url, extra_body={"top_p": 0.9})
        out = gen.generate(hi, 5, max_new_tokens=4)
        assert len(out) == 5 and len({o.text for o in out}) == 5  # every call had its own seed
        assert fake.stats["calls"] == 5 and [b["n"] for b in fake.stats["bodies"]] == [5, 1, 1, 1, 1]
        assert all(b["top_p"] == 0.9 and b["max_tokens"] == 4 for b in fake.stats["bodies"])
        fake.stats["bodies"].clear()
        assert len(gen.generate(hi, 3)) == 3  # the cap is remembered: three calls of n = 1 at once
        assert [b["n"] for b in fake.stats["bodies"]] == [1, 1, 1]
    with FakeOpenAI() as fake:
        gen = OpenAIGenerator(fake.url, max_n_per_request=2, chat=False)
        out = gen.generate(hi, 5)
        assert len(out) == 5 and sorted(b["n"] for b in fake.stats["bodies"]) == [1, 2, 2]
        assert all("prompt" in b for b in fake.stats["bodies"])
        assert len({b["seed"] for b in fake.stats["bodies"]}) == 3


def test_privitp_generates_phase_2_in_chunks(tmp_path):
    """Backend calls per PrivITP query: Phase 1 with Phase 2's first chunk, then at most one more
    chunk (n = 8, phase2_chunks = 2) carrying the fallback's draw; each chunk scored in one call."""
    import numpy as np

    from privalign.rewards import CallableReward
    from privalign.server.app import Service, StubGenerator
    from privalign.server.config import ServiceConfig

    class Counting(StubGenerator):
        def __init__(self):
            self.sizes = []

        def generate(self, messages, k, **kw):
            self.sizes.append(k)
            return super().generate(messages, k, **kw)

    scored = []

    def score(prompts, responses):
        scored.append(list(responses))
        return np.array([int(r[-8:], 16) / 2**32 for r in responses])

    for chunks, calls_max in ((2, 2), (4, 4), (8, 8)):
        cfg = ServiceConfig.model_validate({
            "ledger": str(tmp_path / f"l{chunks}.db"), "generator": {"backend": "stub"},
            "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
            "mechanism": {"phase2_chunks": chunks, "sigma_x": 0.5, "sigma_z": 0.5, "delta": 1e-6},
            "budgets": [{"name": "default", "epsilon_total": 1e9, "delta_total": 0.9}]})
        gen = Counting()
        svc = Service(cfg, generator=gen, reward=CallableReward(score, (0.0, 1.0), sensitivity=0.1))
        c = 8 // chunks
        calls, fallbacks = [], 0
        for _ in range(60):
            gen.sizes.clear()
            scored.clear()
            out = svc.answer([{"role": "user", "content": "hi"}], {"mechanism": "privitp", "n": 8}, "default")
            p = out["privalign"]
            t = p["halting_time"]
            chunks_used = min(-(-t // c), chunks)  # the chunks Phase 2 examined (all of them after a fallback)
            calls.append(len(gen.sizes))
            assert len(gen.sizes) == len(scored) == chunks_used <= calls_max
            assert gen.sizes[0] == 8 + c + (chunks == 1)
            assert p["candidates_generated"] == sum(gen.sizes) == 8 + chunks_used * c + (chunks_used == chunks)
            # the answer is the t-th Phase-2 candidate, or the never-scored fallback draw
            phase2 = scored[0][8:] + [r for s in scored[1:] for r in s]
            if p["fallback"]:
                fallbacks += 1
                assert t == 9 and out["text"] not in {r for s in scored for r in s}
            else:
                assert out["text"] == phase2[t - 1]
        if chunks == 2:
            assert sum(calls) / len(calls) <= 2  # the old one-candidate-per-call loop made 6.4 on average
        svc.close()


@pytest.mark.slow
def test_llamacpp_server_behind_the_service(tmp_path):
    """A real OpenAI-compatible server on loopback (llama.cpp's, from llama-cpp-python[server], serving
    the embedded SmolLM2 GGUF), privalign serve with the openai backend in front of it, and the stock
    openai client: an answer, with its privacy charged. llama.cpp's server returns one choice per
    call whatever n, so the backend asks for the others in concurrent calls."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llama_cpp.server")
    from openai import OpenAI

    from privalign.backends.base import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    port = free_port()
    log = tmp_path / "llama-server.log"  # a file, not a pipe: its verbose start-up would fill a pipe and block
    with open(log, "wb") as fh:
        llama = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
                                  "--port", str(port), "--n_ctx", "2048", "--model_alias", "smollm2"],
                                 stdout=fh, stderr=subprocess.STDOUT)
    srv = None
    try:
        deadline = time.time() + 300
        while True:
            if llama.poll() is not None:
                raise RuntimeError(log.read_text(errors="replace")[-2000:])
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except OSError:
                assert time.time() < deadline, "llama.cpp's server did not start"
                time.sleep(0.5)
        srv = Server(tmp_path, openai_backend_config(f"http://127.0.0.1:{port}", 'model = "smollm2"\n'))
        srv.start()
        client = OpenAI(base_url=srv.url + "/v1", api_key=CLIENT)
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is 2 + 3?"}],
                                           max_tokens=8, extra_body={"privalign": {"mechanism": "privbon", "n": 4,
                                                                                  "epsilon": 1.0}})
        block = r.model_extra["privalign"]
        assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
        assert block["candidates_generated"] == 4 and block["epsilon_charged"] == pytest.approx(1.0)
        r = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Name a colour."}],
                                           max_tokens=8, extra_body={"privalign": {"mechanism": "privitp", "n": 4}})
        itp = r.model_extra["privalign"]
        assert 0 < itp["epsilon_charged"] <= itp["epsilon_max"]
        state = call(srv.url, "/v1/budgets/acme-rm")[1]
        assert state["queries"] == 2 and state["open_reservations"] == 0
        assert state["epsilon_spent"] == pytest.approx(1.0 + itp["epsilon_charged"])
    finally:
        if srv is not None:
            srv.stop()
        llama.terminate()
        llama.wait(30)


def test_worker_threads_cover_every_admitted_request(tmp_path):
    """Blocking work runs in anyio's worker threads; at start-up their number is raised to cover
    max_concurrency backend calls, max_queue waiting requests and headroom, so an admitted request
    never queues for a thread."""
    import anyio.to_thread
    from fastapi.testclient import TestClient

    from privalign.server.config import ServiceConfig
    from privalign.server.http import create_app

    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"),
                                        "generator": {"backend": "stub", "max_concurrency": 100, "max_queue": 300},
                                        "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1}})
    with TestClient(create_app(cfg)) as client:
        assert client.portal.call(lambda: anyio.to_thread.current_default_thread_limiter().total_tokens) >= 400
        assert client.app.state.service.max_concurrency == 100


def test_openai_backend_does_not_retry_what_the_server_marks_final(tmp_path):
    """privalign's own budget_exhausted 429 carries x-should-retry: false: one call, one refusal."""
    from privalign.backends.base import BackendError
    from privalign.backends.openai_backend import OpenAIGenerator

    srv = Server(tmp_path, STUB.format(total=0.6))
    srv.start()
    try:
        gen = OpenAIGenerator(srv.url, "stub", api_key=CLIENT, backoff=0.01,
                              extra_body={"privalign": {"mechanism": "privbon", "n": 2, "epsilon": 0.5}})
        assert len(gen.generate([{"role": "user", "content": "hi"}], 1, max_new_tokens=4)) == 1
        with pytest.raises(BackendError, match="budget_exhausted") as info:
            gen.generate([{"role": "user", "content": "hi"}], 1, max_new_tokens=4)
        assert "attempts" not in str(info.value)
        assert call(srv.url, "/v1/budgets/acme-rm")[1]["refusals"] == 1
        gen.close()
    finally:
        srv.stop()


def test_zcdp_budget_serves_the_cks_count_of_gumbel_queries(tmp_path):
    """Issue 18: (10, 1e-6) under zcdp answers 136 Gumbel PrivBoN queries at epsilon 0.3 and 1,231 at 0.1
    (at least 95% of 8 rho_total / epsilon^2, at most the Gaussian limit's 151 and 1,366; basic: 33, 100)."""
    srv = Server(tmp_path, STUB.format(total=50.0))
    srv.start()
    try:
        status, body = call(srv.url, "/v1/budgets/acme-z", {"epsilon_total": 10, "delta_total": 0.0,
                                                            "composition": "zcdp", "tenant": "acme"}, key=ADMIN)
        assert status == 400 and "delta_total" in body["error"]["message"]  # no conversion exists at delta 0
        status, body = call(srv.url, "/v1/budgets/acme-z", {"epsilon_total": 10, "delta_total": 1e-6,
                                                            "composition": "renyi", "tenant": "acme"}, key=ADMIN)
        assert status == 400 and "renyi" in body["error"]["message"]
        for eps, low, high in ((0.3, 129, 151), (0.1, 1170, 1366)):
            name = f"acme-z{eps}"
            status, b = call(srv.url, f"/v1/budgets/{name}", {"epsilon_total": 10, "delta_total": 1e-6,
                                                             "composition": "zcdp", "tenant": "acme"}, key=ADMIN)
            assert status == 200 and b["rho_total"] == pytest.approx(1.539, abs=1e-3)
            answered = 0
            while True:
                status, body = chat(srv.url, {"mechanism": "privbon", "epsilon": eps, "n": 4, "budget": name})
                if status != 200:
                    break
                answered += 1
                p = body["privalign"]
                assert p["composition"] == "zcdp" and p["rho_charged"] == pytest.approx(eps ** 2 / 8)
                assert p["epsilon_charged"] == pytest.approx(eps) and "rho" in p["budget_remaining"]
            assert status == 429 and body["error"]["type"] == "budget_exhausted" and "rho" in body["error"]
            assert low <= answered <= high, answered
            state = call(srv.url, f"/v1/budgets/{name}")[1]
            assert state["queries"] == answered and state["rho_spent"] <= state["rho_total"]
            assert state["epsilon_spent"] <= 10 and state["delta_spent"] is None  # zcdp: delta is fixed
        led = Ledger(str(srv.ledger_path))
        assert led.check() == []
        assert led.account("acme-z0.3")["accounts"]["basic"]["epsilon"] == pytest.approx(136 * 0.3)
    finally:
        srv.stop()


def test_a_poisoned_request_merged_with_another_tenants_fails_alone(tmp_path):
    """Issue 22: two tenants' requests merged into one scoring batch, one of them poisoned (the
    reward model raises on its prompt). The other is answered with its ordinary charge; the poisoned
    one gets a JSON 5xx and its own worst case; the ledger is consistent."""
    config = STUB.format(total=50.0).replace('kind = "stub"\n', 'kind = "stub"\nbatch = true\nfail_marker = "POISON"\n')
    config = config.replace('backend = "stub"\n', 'backend = "stub"\nbatch_wait_ms = 400\n')
    srv = Server(tmp_path, config)
    srv.start()
    try:
        out = {}

        def send(key, content):
            out[key] = chat(srv.url, {"mechanism": "privbon", "epsilon": 0.5, "n": 4}, key=key, content=content)

        threads = [threading.Thread(target=send, args=(CLIENT, "What is 2 + 2?")),
                   threading.Thread(target=send, args=(OTHER, "POISON: what is 3 + 3?"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        status, body = out[CLIENT]
        assert status == 200 and body["privalign"]["epsilon_charged"] == pytest.approx(0.5)
        status, body = out[OTHER]
        assert status == 502 and body["error"]["type"] == "backend_error" and "POISON" in body["error"]["message"]
        metrics = urllib.request.urlopen(urllib.request.Request(
            srv.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})).read().decode()
        retried = [line for line in metrics.splitlines() if line.startswith("privalign_score_batch_retried")]
        assert retried and float(retried[0].split()[-1]) == 2.0  # they were merged, then rerun one by one
        led = Ledger(str(srv.ledger_path))
        assert led.check() == []
        acme, globex = led.budget("acme-rm"), led.budget("globex-rm")
        assert acme.queries == 1 and acme.spent.epsilon == pytest.approx(0.5)
        assert globex.queries == 1 and globex.spent.epsilon == pytest.approx(0.5)  # its own worst case, no one else's
        assert [c[2] for c in led.charges("acme-rm")] == [pytest.approx(0.5)]
    finally:
        srv.stop()


def test_an_answer_cut_at_max_tokens_says_length(stub_server):
    """Issue 19: the selected candidate's own stop reason: cut at max_tokens is "length"."""
    import openai

    client = openai.OpenAI(base_url=stub_server.url + "/v1", api_key=CLIENT)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    cut = client.chat.completions.create(model="stub", messages=msgs, max_tokens=2,
                                         extra_body={"privalign": {"mechanism": "privbon", "n": 4}})
    assert cut.choices[0].finish_reason == "length"
    whole = client.chat.completions.create(model="stub", messages=msgs, max_tokens=8,
                                           extra_body={"privalign": {"mechanism": "privbon", "n": 4}})
    assert whole.choices[0].finish_reason == "stop"


def test_streaming_with_the_stock_openai_client(stub_server):
    """Issue 19: stream=true answers in OpenAI's chunk format after the charge is settled: the text,
    then the finish reason and the privalign block, usage with include_usage, then [DONE]; a
    request that fails does so before the first byte, as an ordinary JSON error."""
    import openai

    client = openai.OpenAI(base_url=stub_server.url + "/v1", api_key=CLIENT, max_retries=0)
    msgs = [{"role": "user", "content": "What is 2 + 2?"}]
    before = call(stub_server.url, "/v1/budgets/acme-rm")[1]["queries"]
    chunks = list(client.chat.completions.create(model="stub", messages=msgs, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"privalign": {"mechanism": "privbon", "n": 4}}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.startswith("candidate ") and chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    block = finals[0].model_extra["privalign"]
    assert block["epsilon_charged"] > 0 and block["mechanism"] == "privbon"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4 * 3
    state = call(stub_server.url, "/v1/budgets/acme-rm")[1]
    assert state["queries"] == before + 1 and state["open_reservations"] == 0  # charged once, settled
    completion = list(client.completions.create(model="stub", prompt="What is 3 + 3?", stream=True,
                                                extra_body={"privalign": {"mechanism": "privbon", "n": 2}}))
    assert "".join(c.choices[0].text for c in completion if c.choices).startswith("candidate ")
    with pytest.raises(openai.BadRequestError):  # fails before the first byte: a JSON error, nothing charged
        list(client.chat.completions.create(model="stub", messages=[{"role": "user", "content": " "}], stream=True))
    assert call(stub_server.url, "/v1/budgets/acme-rm")[1]["queries"] == before + 2


def test_streaming_and_invoke_with_langchain_openai(stub_server):
    """Issue 19: a LangChain chat model pointed at the service: ``.invoke`` and ``.stream`` both
    get the private answer, each charged once and settled."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=stub_server.url + "/v1", api_key=CLIENT, model="stub", max_retries=0,
                     extra_body={"privalign": {"mechanism": "privbon", "n": 4}}, stream_usage=True)
    before = call(stub_server.url, "/v1/budgets/acme-rm")[1]["queries"]
    whole = llm.invoke("What is 2 + 2?")
    assert whole.content.startswith("candidate ")
    parts = list(llm.stream("What is 2 + 2?"))
    assert "".join(p.content for p in parts).startswith("candidate ") and len(parts) >= 2
    usage = [p.usage_metadata for p in parts if p.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 4 * 3  # every candidate's tokens, as billed
    state = call(stub_server.url, "/v1/budgets/acme-rm")[1]
    assert state["queries"] == before + 2 and state["open_reservations"] == 0


def test_models_are_loaded_before_the_service_answers_its_first_request(tmp_path):
    """Issue 19: /healthz meant 'up' while the reward model still loaded on the first request; the
    service now scores one dummy pair at start, before the port opens."""
    from privalign.server.app import Service, StubGenerator, StubReward
    from privalign.server.config import ServiceConfig

    class Lazy(StubReward):
        loaded = 0

        def score(self, prompts, responses):
            Lazy.loaded += 1  # a lazily loaded model would load here
            return super().score(prompts, responses)

    cfg = ServiceConfig.model_validate({"ledger": str(tmp_path / "l.db"), "generator": {"backend": "stub"},
                                        "reward": {"kind": "stub", "output_range": [0, 1]}})
    Service(cfg, generator=StubGenerator(), reward=Lazy()).close()
    assert Lazy.loaded == 1
    Service(cfg.model_copy(update={"warm_up": False}), generator=StubGenerator(), reward=Lazy()).close()
    assert Lazy.loaded == 1


CAPPED = STUB.replace("max_n = 32", "max_n = 1024").replace(
    "delta = 0.01", "delta = 0.01\nmax_rounds = 16\nmax_rounds_max = 64\nphase2_chunks = 2")


def test_capped_privitp_through_serve_costs_the_same_at_n_1024_as_at_16(tmp_path):
    """Issue 31: with T = 16 the worst case per query does not grow with n; T is the operator's cap,
    a request may lower or raise it within max_rounds_max and n; bad values are 400s that charge nothing."""
    srv = Server(tmp_path, CAPPED.format(total=1e6))
    srv.start()
    try:
        url = srv.url
        blocks = {}
        for ext in ({"n": 16}, {"n": 1024}, {"n": 1024, "max_rounds": 64}, {"n": 4}):
            status, body = chat(url, {"mechanism": "privitp", **ext})
            assert status == 200, body
            blocks[tuple(ext.items())] = p = body["privalign"]
            T = min(ext.get("max_rounds", 16), ext["n"])
            assert p["max_rounds"] == T and p["halting_time"] <= T + 1
            assert p["candidates_generated"] <= ext["n"] + T + 1
            assert p["epsilon_charged"] <= p["epsilon_max"]
        at16, at1024 = blocks[(("n", 16),)], blocks[(("n", 1024),)]
        assert at1024["epsilon_max"] == at16["epsilon_max"]
        assert blocks[(("n", 1024), ("max_rounds", 64))]["epsilon_max"] > at1024["epsilon_max"]
        assert blocks[(("n", 4),)]["epsilon_max"] < at16["epsilon_max"]  # T = min(16, n) = 4
        before = call(url, "/v1/budgets/acme-rm")[1]
        for ext in ({"max_rounds": 0}, {"max_rounds": -3}, {"n": 16, "max_rounds": 17}, {"max_rounds": 2.5},
                    {"n": 1024, "max_rounds": 65}, {"max_rounds": "4"}, {"max_rounds": True},
                    {"mechanism": "privbon", "max_rounds": 4}):
            status, err = chat(url, {"mechanism": "privitp", **ext})
            assert status == 400 and "max_rounds" in err["error"]["message"], (ext, status, err)
            assert "\n" not in err["error"]["message"]
        after = call(url, "/v1/budgets/acme-rm")[1]
        assert after["queries"] == before["queries"] and after["epsilon_spent"] == before["epsilon_spent"]
    finally:
        srv.stop()
