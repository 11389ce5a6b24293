"""Replies in OpenAI's shapes: a chat or text completion (``reply``), the same as a stream of
``text/event-stream`` chunks (``stream_reply``), and per-token log-probabilities
(``render_logprobs``)."""

import json
import time

from fastapi.responses import JSONResponse, StreamingResponse


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


def _id(out: dict, kind: str) -> str:
    return ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + out["privalign"]["request_id"]


def reply(out: dict, body: dict, kind: str, choice: dict, model: str) -> JSONResponse:
    """The selected answer as one JSON completion; ``model`` is the served name when the request
    named none."""
    return JSONResponse({"id": _id(out, kind), "object": kind, "created": int(time.time()),
                         "model": body.get("model") or model,
                         "choices": [{"index": 0, **choice, "finish_reason": out["finish_reason"],
                                      "logprobs": None if out.get("logprobs") is None else
                                      render_logprobs(out["logprobs"], kind, 0)}],
                         "usage": out["usage"], "privalign": out["privalign"]})


def stream_reply(out: dict, body: dict, kind: str, model: str) -> StreamingResponse:
    """The selected answer in OpenAI's chunk format (``text/event-stream``). The answer is selected
    among complete candidates and its charge is durably settled before the first byte, so a
    failure is an ordinary JSON error and nothing can be charged twice; the text is sent in
    pieces, the ``privalign`` block and ``usage`` (with ``stream_options.include_usage``) last."""
    obj = "chat.completion.chunk" if kind == "chat.completion" else "text_completion"
    head = {"id": _id(out, kind), "object": obj, "created": int(time.time()), "model": body.get("model") or model}
    usage = bool((body.get("stream_options") or {}).get("include_usage"))
    return StreamingResponse(_events(out, kind, head, usage), media_type="text/event-stream",
                             headers={"cache-control": "no-cache", "x-accel-buffering": "no"})


def _choice(kind: str, text, finish=None, first=False, lp=None) -> dict:
    if kind == "chat.completion":
        delta = ({"role": "assistant", "content": text} if first else {"content": text}) if text is not None else {}
        return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": lp}
    return {"index": 0, "text": text or "", "finish_reason": finish, "logprobs": lp}


def _pieces(out: dict, kind: str) -> tuple[list[str], list]:
    """The answer's pieces and their log-probabilities: a chunk per token with its log-probabilities,
    or one chunk when the tokens' texts do not join to the answer (a character split across tokens);
    without log-probabilities, pieces of 16 characters."""
    text, entries = out["text"], out.get("logprobs")
    if entries is None:
        pieces = [text[i:i + 16] for i in range(0, len(text), 16)] or [""]
        return pieces, [None] * len(pieces)
    at = 0
    groups = ([[e] for e in entries] if "".join(e["token"] for e in entries) == text else [entries])
    pieces, lps = [], []
    for g in groups:
        piece = "".join(e["token"] for e in g) if len(groups) > 1 else text
        pieces.append(piece)
        lps.append(render_logprobs(g, kind, at))
        at += len(piece)
    return pieces or [""], lps or [render_logprobs([], kind, 0)]


def _events(out: dict, kind: str, head: dict, usage: bool):
    pieces, lps = _pieces(out, kind)
    for i, (piece, lp) in enumerate(zip(pieces, lps)):
        yield f"data: {json.dumps({**head, 'choices': [_choice(kind, piece, first=i == 0, lp=lp)]})}\n\n"
    last = {**head, "choices": [_choice(kind, None, out["finish_reason"])], "privalign": out["privalign"]}
    yield f"data: {json.dumps(last)}\n\n"
    if usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': out['usage']})}\n\n"
    yield "data: [DONE]\n\n"
