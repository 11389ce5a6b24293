"""FastAPI wrapper: OpenAI-compatible routes, budgets, health and Prometheus metrics.

FastAPI is an optional extra; this module is imported only by ``privalign serve``. (No
``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class.)
"""

import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool

from .app import ApiError, Service
from .config import ServiceConfig


def create_app(cfg: ServiceConfig, service: Service | None = None):
    svc = service or Service(cfg)
    app = FastAPI(title="privalign", version="0.1.0")
    app.state.service = svc

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        # a refusal for lack of budget is final: tell the stock openai client not to retry it
        headers = ({"x-should-retry": "false"} if exc.kind == "budget_exhausted" else
                   {"retry-after": str(exc.extra["retry_after"])} if "retry_after" in exc.extra else None)
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        return JSONResponse({"error": {"type": "internal_error", "message": type(exc).__name__}}, status_code=500)

    def key_of(request: Request) -> str | None:
        auth = request.headers.get("authorization", "")
        return auth[7:].strip() if auth.lower().startswith("bearer ") else None

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ApiError(400, "invalid_json", f"the request body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "invalid_request", "the request body must be a JSON object")
        return body

    def check_openai_n(body):
        if body.get("n", 1) != 1:
            raise ApiError(400, "invalid_request", "n (choices) must be 1: the service returns one selected response; "
                                                   "set the number of candidates with privalign.n")
        if body.get("stream"):  # refused before anything is reserved: nothing is charged
            raise ApiError(400, "invalid_request", "stream=true is not supported: the answer is selected among "
                                                   "complete candidates; send the request without stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        role, tenant = svc.caller(key_of(request))
        body = await body_of(request)
        check_openai_n(body)
        out = await run_in_threadpool(svc.answer, body.get("messages"), body.get("privalign"), tenant,
                                      body.get("max_tokens"), body.get("temperature"))
        return JSONResponse({"id": "chatcmpl-" + out["privalign"]["request_id"], "object": "chat.completion",
                "created": int(time.time()), "model": body.get("model") or svc.generator.name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out["text"]},
                             "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "privalign": out["privalign"]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        role, tenant = svc.caller(key_of(request))
        body = await body_of(request)
        check_openai_n(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "invalid_request", "prompt must be a string")
        out = await run_in_threadpool(svc.answer, [{"role": "user", "content": prompt}], body.get("privalign"),
                                      tenant, body.get("max_tokens"), body.get("temperature"))
        return JSONResponse({"id": "cmpl-" + out["privalign"]["request_id"], "object": "text_completion",
                "created": int(time.time()), "model": body.get("model") or svc.generator.name,
                "choices": [{"index": 0, "text": out["text"], "finish_reason": "stop", "logprobs": None}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
                "privalign": out["privalign"]})

    @app.get("/v1/budgets")
    def budgets(request: Request):
        role, tenant = svc.caller(key_of(request))
        return {"budgets": [b.as_dict() for b in svc.ledger.budgets(tenant)]}

    @app.get("/v1/budgets/{name}")
    def budget(name: str, request: Request):
        role, tenant = svc.caller(key_of(request))
        from ..ledger import UnknownBudget

        try:
            b = svc.ledger.budget(name)
        except UnknownBudget:
            raise ApiError(404, "not_found", f"unknown budget {name!r}") from None
        if tenant is not None and b.tenant != tenant:
            raise ApiError(404, "not_found", f"unknown budget {name!r}")  # do not reveal other tenants' budgets
        return b.as_dict()

    @app.post("/v1/budgets/{name}")
    async def set_budget(name: str, request: Request):
        role, _ = svc.caller(key_of(request))
        if role != "admin":
            raise ApiError(403, "forbidden", "only an admin key can create or raise a budget")
        body = await body_of(request)
        try:
            b = svc.ledger.set_budget(name, float(body.get("epsilon_total", 0)), float(body.get("delta_total", 0.0)),
                                      body.get("composition", "fsrc"), body.get("tenant"))
        except (TypeError, ValueError) as e:
            raise ApiError(400, "invalid_request", str(e)) from None
        return b.as_dict()

    @app.get("/healthz")
    def healthz():
        return {"status": "ok", "recovered_on_start": svc.recovered, "generator": svc.generator.name}

    @app.get("/v1/models")
    def models(request: Request):
        svc.caller(key_of(request))
        return {"object": "list", "data": [{"id": svc.generator.name, "object": "model", "created": 0,
                                            "owned_by": "privalign"}]}

    @app.get("/metrics")
    def metrics(request: Request):
        role, _ = svc.caller(key_of(request))  # budget names are per tenant: admins only
        if role != "admin":
            raise ApiError(403, "forbidden", "metrics need an admin key")
        return PlainTextResponse(generate_latest(svc.registry).decode(), media_type="text/plain; version=0.0.4")

    return app
