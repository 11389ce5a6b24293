"""FastAPI wrapper: OpenAI-compatible routes, budgets, health and Prometheus metrics.

FastAPI is an optional extra; this module is imported only by ``privalign serve``. (No
``from __future__ import annotations`` here: FastAPI must see the real ``Request`` class.)
"""

import atexit
import contextlib
import json
import logging
import queue
import sys
import threading
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from starlette.concurrency import run_in_threadpool

from .app import ApiError, Service, shown
from .admin import budget_update
from .config import ServiceConfig
from .openai_params import check_params, check_roles

access = logging.getLogger("privalign.access")


class AccessLog:
    """ASGI middleware: one line per request on the ``privalign.access`` logger (stderr unless a
    logging config says otherwise): method, path, status, latency, request id, tenant, budget,
    epsilon charged and the request's OpenAI ``user``. Routes put the last five in ``request.state``;
    values not known yet (a refusal before the ledger) are ``-``. The event loop only appends a
    tuple to a queue; a writer thread makes the log record and writes it, so logging never blocks
    (or slows) request handling."""

    def __init__(self, app):
        self.app = app
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._write, daemon=True, name="privalign-access-log").start()
        atexit.register(self._drain)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            st = scope.get("state") or {}
            self.queue.put_nowait((scope["method"], scope["path"], status[0], 1000 * (time.perf_counter() - t0),
                                   st.get("request_id", "-"), st.get("tenant", "-"), st.get("budget", "-"),
                                   st.get("epsilon", "-"), st.get("user", "-")))

    def _write(self):
        while True:
            self._log(self.queue.get())

    def _drain(self):
        """Write what is still queued when the process exits."""
        while True:
            try:
                self._log(self.queue.get_nowait())
            except queue.Empty:
                return

    @staticmethod
    def _log(fields):
        access.info("%s %s %d %.1fms request_id=%s tenant=%s budget=%s epsilon=%s user=%s", *fields)



def render_logprobs(entries: list[dict], kind: str, offset: int) -> dict:
    """Per-token log-probabilities in OpenAI's shape: chat's ``{"content": [...], "refusal": null}``,
    or /v1/completions' parallel lists (``tokens``, ``token_logprobs``, ``top_logprobs`` as
    token -> logprob maps, ``text_offset`` from ``offset``)."""
    if kind == "chat.completion":
        return {"content": entries, "refusal": None}
    offsets, seen = [], b""
    for e in entries:  # in characters of the answer: a character split across tokens starts at its first
        offsets.append(offset + len(seen.decode("utf-8", errors="ignore")))
        seen += bytes(e.get("bytes") or e["token"].encode("utf-8"))
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{a["token"]: a["logprob"] for a in e["top_logprobs"]} for e in entries],
            "text_offset": offsets}

def _access_to_stderr():
    """The access log's default destination: stderr, one timestamped line per request."""
    if not access.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
        access.addHandler(handler)
        access.setLevel(logging.INFO)
        access.propagate = False


def shown_budget(b) -> dict:
    """A budget's state for display: epsilons and deltas to 12 significant digits (the ledger keeps
    the exact values, and admits and charges with them)."""
    return {k: shown(v) if isinstance(v, float) else v for k, v in b.as_dict().items()}


def create_app(cfg: ServiceConfig, service: Service | None = None):
    svc = service or Service(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # every blocking call (ledger, generator, reward model) runs in anyio's worker threads, never on
        # the event loop: enough of them for every admitted request (backend calls in flight + the wait
        # queue) plus headroom for refusals and the budget, health and metrics routes
        import anyio.to_thread

        limiter = anyio.to_thread.current_default_thread_limiter()
        limiter.total_tokens = max(limiter.total_tokens, svc.max_concurrency + svc.max_queue + 32)
        yield

    app = FastAPI(title="privalign", version="0.1.0", lifespan=lifespan)
    app.state.service = svc
    if cfg.access_log:
        _access_to_stderr()
        app.add_middleware(AccessLog)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        if "budget" in exc.extra:
            request.state.budget = exc.extra["budget"]
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

    def check_openai(body):
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
        request.state.tenant = tenant or "admin"
        check_openai(body)
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

    def stream_reply(out: dict, body: dict, kind: str) -> StreamingResponse:
        """The selected answer in OpenAI's chunk format (``text/event-stream``). The answer is selected
        among complete candidates and its charge is durably settled before the first byte, so a
        failure is an ordinary JSON error and nothing can be charged twice; the text is sent in
        pieces, the ``privalign`` block and ``usage`` (with ``stream_options.include_usage``) last."""
        rid = ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + out["privalign"]["request_id"]
        obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": body.get("model") or svc.model_names[0]}
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        def choice(text, finish=None, first=False, lp=None):
            if kind == "chat.completion":
                delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text is not None else {}
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
            return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}

        def events():
            text, entries = out["text"], out.get("logprobs")
            if entries is not None:  # a chunk per token with its log-probabilities, or one chunk when the
                at = 0              # tokens' texts do not join to the answer (a character split across tokens)
                groups = ([[e] for e in entries] if "".join(e["token"] for e in entries) == text else [entries])
                pieces, lps = [], []
                for g in groups:
                    piece = "".join(e["token"] for e in g) if len(groups) > 1 else text
                    pieces.append(piece)
                    lps.append(render_logprobs(g, kind, at))
                    at += len(piece)
                pieces, lps = pieces or [""], lps or [render_logprobs([], kind, 0)]
            else:
                pieces = [text[i:i + 16] for i in range(0, len(text), 16)] or [""]
                lps = [None] * len(pieces)
            for i, (piece, lp) in enumerate(zip(pieces, lps)):
                yield f"data: {json.dumps({**head, 'choices': [choice(piece, first=i == 0, lp=lp)]})}\n\n"
            last = {**head, "choices": [choice(None, out["finish_reason"])], "privalign": out["privalign"]}
            yield f"data: {json.dumps(last)}\n\n"
            if usage:
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': out['usage']})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no"})

    def reply(out: dict, body: dict, kind: str, choice: dict) -> JSONResponse:
        return JSONResponse({"id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + out["privalign"]["request_id"],
                             "object": kind, "created": int(time.time()), "model": body.get("model") or svc.model_names[0],
                             "choices": [{"index": 0, **choice, "finish_reason": out["finish_reason"],
                                          "logprobs": None if out.get("logprobs") is None else
                                          render_logprobs(out["logprobs"], kind, 0)}],
                             "usage": out["usage"], "privalign": out["privalign"]})

    # the two answering routes are plain Starlette routes: they take the raw request and build their
    # own response, so FastAPI's per-request dependency and validation machinery would be pure cost
    # (it was most of the service's own CPU per request at 64 concurrent clients, docs/benchmarks.md)
    async def chat(request: Request):
        _, tenant = svc.caller(key_of(request))  # 401 before the body is read
        body = await body_of(request)
        out = await answer(request, body, body.get("messages"), tenant, "chat")
        if body.get("stream"):
            return stream_reply(out, body, "chat.completion")
        return reply(out, body, "chat.completion", {"message": {"role": "assistant", "content": out["text"]}})

    async def completions(request: Request):
        _, tenant = svc.caller(key_of(request))
        body = await body_of(request)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise ApiError(400, "invalid_request", "prompt must be a string")
        out = await answer(request, body, [{"role": "user", "content": prompt}], tenant, "completions")
        if body.get("stream"):
            return stream_reply(out, body, "text_completion")
        return reply(out, body, "text_completion", {"text": out["text"]})

    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_route("/v1/completions", completions, methods=["POST"])

    @app.get("/v1/budgets")
    def budgets(request: Request):
        role, tenant = svc.caller(key_of(request))
        out = {"budgets": [shown_budget(b) for b in svc.ledger.budgets(tenant)]}
        if role == "admin":  # what a person in the reward model's data gets from the whole deployment
            out["guarantee"] = svc.guarantee()
        return out

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
        return shown_budget(b)

    @app.post("/v1/budgets/{name}")
    async def set_budget(name: str, request: Request):
        role, _ = svc.caller(key_of(request))
        if role != "admin":
            raise ApiError(403, "forbidden", "only an admin key can create or raise a budget")
        body = await body_of(request)

        def update():  # the ledger transactions run in a worker thread, off the event loop
            from ..ledger import UnknownBudget

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

    @app.get("/healthz")
    def healthz():
        return {"status": "ok", "recovered_on_start": svc.recovered, "generator": svc.generator.name,
                "unsettled_reservations": len(svc._pending)}

    @app.get("/v1/models")
    def models(request: Request):
        svc.caller(key_of(request))
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "privalign"}
                                           for name in svc.model_names]}

    @app.get("/metrics")
    def metrics(request: Request):
        role, _ = svc.caller(key_of(request))  # budget names are per tenant: admins only
        if role != "admin":
            raise ApiError(403, "forbidden", "metrics need an admin key")
        return PlainTextResponse(generate_latest(svc.registry).decode(), media_type="text/plain; version=0.0.4")

    return app
