"""Which OpenAI request parameters the service honours, and which it refuses (docs/deploy.md, table).

A parameter is honoured only where the service can do what it means without weakening the privacy
guarantee; everything else is refused with a 400 that names it, before anything is reserved or
charged. A parameter set to OpenAI's own default (``top_p = 1``, a penalty of 0, ``echo = false``,
...) asks for nothing and is accepted; any other value is refused. Unknown top-level fields are
refused too: a typo must not be answered, and charged, as if it had been understood.

Honoured: ``model``, ``messages`` / ``prompt``, ``max_tokens`` and ``max_completion_tokens`` (the same
cap), ``temperature``, ``stop`` (every candidate is cut at the first stop string before it is scored),
``user`` (logged), ``n`` = 1 (one selected choice), ``best_of`` on /v1/completions (the number of
candidates, as ``privalign.n``), ``stream``, ``stream_options``, ``privalign``, and ``logprobs`` /
``top_logprobs``: the returned answer's per-token log-probabilities under the policy, where the
backend computes them (transformers; the service refuses them for any other backend). The policy
does not read the private data, so they are post-processing of the answer and cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ApiError

ROLES = ("system", "developer", "user", "assistant")

# what each endpoint honours (besides its prompt field)
HONOURED = {"model", "max_tokens", "max_completion_tokens", "temperature", "n", "stream", "stream_options", "stop",
            "user", "logprobs", "top_logprobs", "privalign"}
HONOURED_CHAT = HONOURED | {"messages"}
HONOURED_COMPLETIONS = (HONOURED - {"max_completion_tokens", "top_logprobs"}) | {"prompt", "best_of"}

# refused unless at OpenAI's default (the value that asks for nothing): parameter -> (defaults, why)
_REFUSED = {
    "seed": ((None,), "the candidates are fresh samples and the privacy noise is never seeded; a seed could not "
                      "make an answer reproducible"),
    "top_p": ((None, 1, 1.0), "candidates are samples of the policy at its temperature; nucleus sampling is not "
                              "offered"),
    "presence_penalty": ((None, 0, 0.0), "not supported by the generator path"),
    "frequency_penalty": ((None, 0, 0.0), "not supported by the generator path"),
    "logit_bias": ((None, {}), "not supported by the generator path"),
    "response_format": ((None, {"type": "text"}), "structured output is not enforced on candidates"),
    "tools": ((None, []), "tool calls are not supported"),
    "tool_choice": ((None, "none"), "tool calls are not supported"),
    "parallel_tool_calls": ((None,), "tool calls are not supported"),
    "functions": ((None, []), "function calls are not supported"),
    "function_call": ((None, "none"), "function calls are not supported"),
    "echo": ((None, False), "the prompt is not echoed"),
    "suffix": ((None, ""), "insertion (suffix) is not supported"),
    "modalities": ((None, ["text"]), "only text is served"),
    "audio": ((None,), "only text is served"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "store": ((None, False), "nothing is stored for distillation or evals"),
    "metadata": ((None,), "nothing is stored, so there is nothing to tag"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
    "reasoning_effort": ((None,), "not supported by the generator path"),
    "web_search_options": ((None,), "web search is not supported"),
}


@dataclass(frozen=True)
class OpenAIParams:
    """A request's validated OpenAI parameters, as the service uses them."""

    max_tokens: int | None = None
    temperature: float | None = None
    stop: tuple[str, ...] = ()
    user: str | None = None
    candidates: int | None = None  # best_of: the number of candidates (privalign.n)
    logprobs: int | None = None    # asked: the number of alternatives per token (top_logprobs); None: not asked


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", param=param)


def check_params(body: dict, endpoint: str, token_cap: int, max_n: int) -> OpenAIParams:
    """Check an /v1/chat/completions (``endpoint="chat"``) or /v1/completions body's OpenAI
    parameters: a 400 naming the first refused, unknown or invalid one, else what to apply."""
    honoured = HONOURED_CHAT if endpoint == "chat" else HONOURED_COMPLETIONS
    for key in body:
        if key in honoured:
            continue
        if key in _REFUSED:
            defaults, why = _REFUSED[key]
            if any(body[key] == d and type(body[key]) is type(d) for d in defaults):
                continue  # OpenAI's default: asks for nothing
            raise _bad(key, f"not supported by this service ({why}); leave it out (got {body[key]!r})")
        other = "/v1/completions" if endpoint == "chat" else "/v1/chat/completions"
        if key in HONOURED_CHAT | HONOURED_COMPLETIONS:
            raise _bad(key, f"not a parameter of this endpoint (it belongs to {other}); leave it out")
        raise _bad(key, "unknown parameter; leave it out (privalign's own options go in the 'privalign' object)")
    ext = body.get("privalign")
    if ext is not None and not isinstance(ext, dict):
        raise _bad("privalign", f"must be an object such as {{\"n\": 16}}, got {ext!r}")
    max_tokens = _max_tokens(body, token_cap)
    temperature = body.get("temperature")
    if temperature is not None and (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
                                    or not 0 < temperature <= 2):
        raise _bad("temperature", f"must lie in (0, 2] (the candidates are samples of the policy), got {temperature!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"must be a string, got {user!r}")
    return OpenAIParams(max_tokens=max_tokens, temperature=temperature, stop=_stop(body.get("stop")),
                        user=user, candidates=_best_of(body, ext, max_n), logprobs=_logprobs(body, endpoint))


def _logprobs(body: dict, endpoint: str) -> int | None:
    """The alternatives per token asked for, or None when log-probabilities are not asked: chat takes
    ``logprobs: true`` with ``top_logprobs`` in [0, 20]; /v1/completions ``logprobs`` in [0, 5]."""
    v = body.get("logprobs")
    if endpoint == "chat":
        top = body.get("top_logprobs")
        if v is not None and not isinstance(v, bool):
            raise _bad("logprobs", f"must be true or false, got {v!r}")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
            raise _bad("top_logprobs", f"must be an integer in [0, 20], got {top!r}")
        if top and not v:
            raise _bad("top_logprobs", "needs logprobs: true")
        return (top or 0) if v else None
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= 5:
        raise _bad("logprobs", f"must be an integer in [0, 5] (alternatives per token), got {v!r}")
    return v


def _max_tokens(body: dict, token_cap: int) -> int | None:
    """max_tokens or max_completion_tokens (the same cap on every candidate); both must agree."""
    given = {k: body[k] for k in ("max_tokens", "max_completion_tokens") if body.get(k) is not None}
    for key, v in given.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise _bad(key, f"must be a positive integer, got {v!r}")
        if v > token_cap:
            raise _bad(key, f"{v} is over this service's cap of {token_cap} tokens (max_tokens_cap in the config)")
    if len(set(given.values())) > 1:
        raise _bad("max_completion_tokens", f"differs from max_tokens ({given['max_completion_tokens']} against "
                                            f"{given['max_tokens']}); give one")
    return next(iter(given.values()), None)


def _stop(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(s, str) and s for s in stops):
        raise _bad("stop", f"must be a non-empty string or a list of 1 to 4 of them, got {stop!r}")
    return tuple(stops)


def _best_of(body: dict, ext: dict | None, max_n: int) -> int | None:
    """best_of (/v1/completions): how many candidates to select among, as privalign.n; n (choices) is 1."""
    best_of = body.get("best_of")
    if best_of is None:
        return None
    if isinstance(best_of, bool) or not isinstance(best_of, int) or not 1 <= best_of <= max_n:
        raise _bad("best_of", f"must be an integer in [1, {max_n}] (max_n in the config), got {best_of!r}")
    if ext and ext.get("n") is not None and ext["n"] != best_of:
        raise _bad("best_of", f"differs from privalign.n ({best_of} against {ext['n']!r}); give one")
    return best_of


def check_roles(messages) -> None:
    """Every message's role is one of ``ROLES`` (a tool or function message implies tool calls)."""
    if not isinstance(messages, list):
        return  # the service's own check names the shape
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if isinstance(role, str) and role not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, got {role!r}")


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to (not including) the first occurrence of any stop string, and whether it was cut."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)
