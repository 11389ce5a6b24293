"""The vllm: reward kind against a loopback server answering in vLLM's classify JSON (issue 29, item 5)."""

import socket
import threading
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")


def _port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _logit(prompt: str, response: str) -> float:
    """The fake reward model: a raw logit, negative for short answers (a sigmoid would hide the sign)."""
    return len(response) / 4.0 - len(prompt) / 10.0 - 2.0


def vllm_classify_app(classes: int = 1, shape: str = "vllm", fail_first: int = 0, models=("acme/rm-1.5b",)):
    """/v1/models and /classify as vLLM serves them: messages (one conversation) or input (texts);
    ``use_activation`` false gives the raw logit, otherwise the sigmoid vLLM applies by default."""
    import math

    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse

    app = FastAPI()
    stats = app.state.stats = {"classify": 0, "failed": 0, "bodies": []}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in models]}

    @app.post("/classify")
    async def classify(request: Request):
        body = await request.json()
        stats["classify"] += 1
        stats["bodies"].append(body)
        if stats["failed"] < fail_first:
            stats["failed"] += 1
            return JSONResponse({"error": "busy"}, status_code=503, headers={"retry-after": "0"})
        if body.get("model") not in models:
            return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, status_code=404)
        if "messages" in body:
            m = body["messages"]
            pairs = [(m[0]["content"], m[1]["content"])]
        else:
            pairs = [tuple(t.split("\n", 1)) for t in body["input"]]
        if shape == "other":
            return {"scores": [_logit(p, r) for p, r in pairs]}
        data = []
        for i, (p, r) in enumerate(pairs):
            x = _logit(p, r)
            raw = [x] + [0.0] * (classes - 1)
            probs = raw if body.get("use_activation") is False else [1 / (1 + math.exp(-v)) for v in raw]
            data.append({"index": i, "label": "LABEL_0", "probs": probs, "num_classes": classes})
        return {"id": "classify-1", "object": "list", "created": 0, "model": body["model"], "data": data[::-1],
                "usage": {"prompt_tokens": 10, "total_tokens": 10}}

    return app


class Loopback:
    def __init__(self, app):
        import uvicorn

        self.app, self.port = app, _port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
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


PROMPTS = ["What is 2 + 2?", "Count the r's in 'strawberry'.", "Is 91 prime?"] * 7
RESPONSES = ["4", "There are three r's in strawberry: Answer: 3", "No, 91 = 7 x 13, so it is not prime."] * 7


def test_chat_requests_get_raw_logits_in_order_with_the_served_model():
    from privalign.pipeline import load_reward

    with Loopback(vllm_classify_app()) as srv:
        rm = load_reward(f"vllm:{srv.url}/v1")
        assert rm.model == "acme/rm-1.5b" and rm.name == "rm-1.5b"
        s = rm.score(PROMPTS, RESPONSES)
        np.testing.assert_allclose(s, [_logit(p, r) for p, r in zip(PROMPTS, RESPONSES)])
        assert s.min() < 0 < s.max()  # raw logits, not sigmoid probabilities
        bodies = srv.app.state.stats["bodies"]
        assert len(bodies) == len(PROMPTS)
        assert all(b["use_activation"] is False and [m["role"] for m in b["messages"]] == ["user", "assistant"]
                   for b in bodies)


def test_text_batches_keep_their_order_and_busy_answers_are_retried():
    from privalign.rewards.vllm import VLLMReward

    with Loopback(vllm_classify_app(fail_first=2)) as srv:
        rm = VLLMReward(srv.url, chat=False, batch_size=4, backoff=0.01)
        s = rm.score(PROMPTS, RESPONSES)
        np.testing.assert_allclose(s, [_logit(p, r) for p, r in zip(PROMPTS, RESPONSES)])
        st = srv.app.state.stats
        assert st["failed"] == 2 and st["classify"] == 2 + -(-len(PROMPTS) // 4)
        assert max(len(b["input"]) for b in st["bodies"]) == 4


def test_other_shapes_more_classes_and_unknown_models_are_named_errors():
    from privalign.backends.base import BackendError
    from privalign.rewards.vllm import VLLMReward

    with Loopback(vllm_classify_app(shape="other")) as srv:
        with pytest.raises(BackendError, match="answered in another shape: expected .*'data'"):
            VLLMReward(srv.url).score(PROMPTS[:2], RESPONSES[:2])
    with Loopback(vllm_classify_app(classes=3)) as srv:
        with pytest.raises(BackendError, match="has 3 output classes: privalign needs a single-logit"):
            VLLMReward(srv.url).score(PROMPTS[:2], RESPONSES[:2])
        with pytest.raises(BackendError, match="answered 404"):
            VLLMReward(srv.url, model="other/rm").score(PROMPTS[:1], RESPONSES[:1])
    with Loopback(vllm_classify_app(models=("a", "b"))) as srv:
        with pytest.raises(BackendError, match="lists \\['a', 'b'\\]: name the reward model"):
            VLLMReward(srv.url)
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        VLLMReward("http://127.0.0.1:9", batch_size=0)
    with pytest.raises(ValueError, match="needs an http\\(s\\) URL, got 'localhost:8000'"):
        VLLMReward("localhost:8000")
    from privalign.pipeline import load_reward

    with pytest.raises(ValueError, match="needs its model: vllm:URL"):
        load_reward("vllm:")


def test_the_cli_scores_a_pool_through_a_vllm_reward(tmp_path):
    from typer.testing import CliRunner

    from privalign.cli import app
    from privalign.pools import Pool, load_pool

    n = 6
    pool = Pool({"prompt_id": np.arange(n), "sample_id": np.zeros(n, dtype=int), "true_reward": np.zeros(n),
                 "reward:length": np.ones(n), "prompt": np.array(PROMPTS[:n], dtype=object),
                 "response": np.array(RESPONSES[:n], dtype=object)})
    pool.save(tmp_path / "pool.parquet")
    with Loopback(vllm_classify_app()) as srv:
        res = CliRunner().invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"vllm:{srv.url}"])
        assert res.exit_code == 0, res.output
    scored = load_pool(tmp_path / "pool.parquet")
    np.testing.assert_allclose(scored.columns["reward:rm-1.5b"], [_logit(p, r) for p, r in zip(PROMPTS[:n], RESPONSES[:n])])
    with Loopback(vllm_classify_app(classes=2)) as srv:
        res = CliRunner().invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"vllm:{srv.url}"])
    assert res.exit_code != 0 and "2 output classes" in res.output and "Traceback" not in res.output


def test_the_service_scores_through_a_vllm_reward_named_in_its_config():
    from pydantic import ValidationError

    from privalign.server.app import build_reward
    from privalign.server.config import ServiceConfig

    for bad, match in (({"reward": {"kind": "minilm-bt", "batch_size": 8}}, "batch_size applies to the hf and vllm"),
                       ({"reward": {"kind": "vllm", "path": "x", "trust_remote_code": True}},
                        "trust_remote_code applies to the hf reward kind, not 'vllm'"),
                       ({"reward": {"kind": "hf", "path": "x", "batch_size": 0}}, "batch_size")):
        with pytest.raises(ValidationError, match=match):
            ServiceConfig.model_validate(bad)
    with Loopback(vllm_classify_app()) as srv:
        cfg = ServiceConfig.model_validate({"reward": {"kind": "vllm", "path": srv.url, "batch_size": 8,
                                                       "output_range": [-20.0, 20.0]}})
        rm = build_reward(cfg)  # batched across concurrent requests, as every served reward is
        s = rm.score(PROMPTS[:3], RESPONSES[:3])
        np.testing.assert_allclose(s, [_logit(p, r) for p, r in zip(PROMPTS[:3], RESPONSES[:3])])
        assert rm.output_range == (-20.0, 20.0)
