"""FastAPI wrapper: OpenAI-compatible routes, budgets, health and Prometheus metrics.

Each route is a small function of its request; ``create_app`` assembles them around one
``Service`` (``request.app.state.service``). FastAPI is an optional extra; this module is imported
only by ``privalign serve``. (No ``from __future__ import annotations`` here: FastAPI must see the
real ``Request`` class.)
"""

import contextlib
import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool

from ..ledger import UnknownBudget
from .access_log import AccessLog, _access_to_stderr
from .admin import budget_update
from .app import ApiError, Service, shown
from .config import ServiceConfig
from .openai_params import check_params, check_roles
from .replies import reply, stream_reply


def shown_budget(b) -> dict:
    """A budget's state for display: epsilons and deltas to 12 significant digits (the ledger keeps
    the exact values, and admits and charges with them)."""
    return {k: shown(v) if isinstance(v, float) else v for k, v in b.as_dict().items()}


def _service(request: Request) -> Service:
    return request.app.state.service


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


def check_openai(svc: Service, body: dict) -> None:
    """The OpenAI fields privalign constrains: the model's name, n = 1, no streaming."""
    model = body.get("model")
    if model is not None and model not in svc.model_names:
        raise ApiError(404, "model_not_found", f"the model {model!r} does not exist here; this service serves "
                                               f"{', '.join(map(repr, svc.model_names))} (GET /v1/models)")
    if body.get("n", 1) != 1:
        raise ApiError(400, "invalid_request", "n (choices) must be 1: the service returns one selected response; "
                                               "set the number of candidates with privalign.n")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise ApiError(400, "invalid_request", f"stream must be true or false, got {body['stream']!r}")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(opts.get("include_usage", False), bool)):
        raise ApiError(400, "invalid_request", "stream_options must be {\"include_usage\": true|false}")


async def answer(request: Request, body: dict, messages, tenant, endpoint: str) -> dict:
    """Validate (every OpenAI parameter: ``openai_params``) and answer in a worker thread; the
    access log learns who and what."""
    svc, cfg = _service(request), request.app.state.cfg
    request.state.tenant = tenant or "admin"
    check_openai(svc, body)
    params = check_params(body, endpoint, cfg.token_cap, cfg.max_n)
    if endpoint == "chat":
        check_roles(messages)
    request.state.user = params.user if params.user is not None else "-"
    ext = body.get("privalign")
    if params.candidates is not None:  # best_of: the number of candidates, as privalign.n
        ext = {**(ext or {}), "n": params.candidates}
    out = await run_in_threadpool(svc.answer, messages, ext, tenant, params.max_tokens, params.temperature,
                                  params.stop, params.logprobs)
    p = out["privalign"]
    request.state.request_id, request.state.budget = p["request_id"], p["budget"]
    request.state.epsilon = repr(p["epsilon_charged"])
    return out


def _respond(request: Request, out: dict, body: dict, kind: str, choice: dict):
    model = _service(request).model_names[0]
    return stream_reply(out, body, kind, model) if body.get("stream") else reply(out, body, kind, choice, model)


# the two answering routes are plain Starlette routes: they take the raw request and build their
# own response, so FastAPI's per-request dependency and validation machinery would be pure cost
# (it was most of the service's own CPU per request at 64 concurrent clients, docs/benchmarks.md)
async def chat(request: Request):
    _, tenant = _service(request).caller(key_of(request))  # 401 before the body is read
    body = await body_of(request)
    out = await answer(request, body, body.get("messages"), tenant, "chat")
    return _respond(request, out, body, "chat.completion", {"message": {"role": "assistant", "content": out["text"]}})


async def completions(request: Request):
    _, tenant = _service(request).caller(key_of(request))
    body = await body_of(request)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError(400, "invalid_request", "prompt must be a string")
    out = await answer(request, body, [{"role": "user", "content": prompt}], tenant, "completions")
    return _respond(request, out, body, "text_completion", {"text": out["text"]})


def budgets(request: Request):
    svc = _service(request)
    role, tenant = svc.caller(key_of(request))
    out = {"budgets": [shown_budget(b) for b in svc.ledger.budgets(tenant)]}
    if role == "admin":  # what a person in the reward model's data gets from the whole deployment
        out["guarantee"] = svc.guarantee()
    return out


def budget(name: str, request: Request):
    svc = _service(request)
    role, tenant = svc.caller(key_of(request))
    try:
        b = svc.ledger.budget(name)
    except UnknownBudget:
        raise ApiError(404, "not_found", f"unknown budget {name!r}") from None
    if tenant is not None and b.tenant != tenant:
        raise ApiError(404, "not_found", f"unknown budget {name!r}")  # do not reveal other tenants' budgets
    return shown_budget(b)


async def set_budget(name: str, request: Request):
    svc = _service(request)
    role, _ = svc.caller(key_of(request))
    if role != "admin":
        raise ApiError(403, "forbidden", "only an admin key can create or raise a budget")
    body = await body_of(request)

    def update():  # the ledger transactions run in a worker thread, off the event loop
        try:
            current = svc.ledger.budget(name)
        except UnknownBudget:
            current = None
        return svc.ledger.set_budget(name, **budget_update(name, body, current))

    try:
        b = await run_in_threadpool(update)
    except (TypeError, ValueError) as e:
        raise ApiError(400, "invalid_request", str(e)) from None
    return shown_budget(b)


def healthz(request: Request):
    svc = _service(request)
    return {"status": "ok", "recovered_on_start": svc.recovered, "generator": svc.generator.name,
            "unsettled_reservations": len(svc._pending)}


def models(request: Request):
    svc = _service(request)
    svc.caller(key_of(request))
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "privalign"}
                                       for name in svc.model_names]}


def metrics(request: Request):
    svc = _service(request)
    role, _ = svc.caller(key_of(request))  # budget names are per tenant: admins only
    if role != "admin":
        raise ApiError(403, "forbidden", "metrics need an admin key")
    return PlainTextResponse(generate_latest(svc.registry).decode(), media_type="text/plain; version=0.0.4")


async def api_error(request, exc: ApiError):
    if "budget" in exc.extra:
        request.state.budget = exc.extra["budget"]
    # a refusal for lack of budget is final: tell the stock openai client not to retry it
    headers = ({"x-should-retry": "false"} if exc.kind == "budget_exhausted" else
               {"retry-after": str(exc.extra["retry_after"])} if "retry_after" in exc.extra else None)
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def internal_error(request, exc: Exception):
    return JSONResponse({"error": {"type": "internal_error", "message": type(exc).__name__}}, status_code=500)


@contextlib.asynccontextmanager
async def lifespan(app):
    # every blocking call (ledger, generator, reward model) runs in anyio's worker threads, never on
    # the event loop: enough of them for every admitted request (backend calls in flight + the wait
    # queue) plus headroom for refusals and the budget, health and metrics routes
    import anyio.to_thread

    svc = app.state.service
    limiter = anyio.to_thread.current_default_thread_limiter()
    limiter.total_tokens = max(limiter.total_tokens, svc.max_concurrency + svc.max_queue + 32)
    yield


def create_app(cfg: ServiceConfig, service: Service | None = None):
    app = FastAPI(title="privalign", version="0.1.0", lifespan=lifespan)
    app.state.service, app.state.cfg = service or Service(cfg), cfg
    if cfg.access_log:
        _access_to_stderr()
        app.add_middleware(AccessLog)
    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(Exception, internal_error)
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/budgets", budgets, methods=["GET"])
    app.add_api_route("/v1/budgets/{name}", budget, methods=["GET"])
    app.add_api_route("/v1/budgets/{name}", set_budget, methods=["POST"])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app
