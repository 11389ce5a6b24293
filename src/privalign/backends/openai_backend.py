"""OpenAI-compatible HTTP generator: any vLLM, TGI or llama.cpp server, a hosted endpoint, or
privalign's own service. Uses ``/v1/chat/completions`` (or ``/v1/completions``) with ``n``.

Keep-alive connections, with timeouts, each in an ``httpx.Client`` of its own (``_Clients``): a call
borrows one and gives it back, so the generator is safe to call concurrently (``max_concurrency``
calls at once). Failed calls are retried a bounded number of times with exponential back-off
(429, 5xx, connection errors; a ``Retry-After`` header is honoured); any other 4xx is final.
k samples are asked for with ``n=k`` in one call. A server that caps n (``max_n_per_request``)
gets the k split into concurrent calls, and a server that returns fewer choices than asked (it
ignores ``n``: llama.cpp's server, privalign's own service) gets the missing ones in concurrent
follow-up calls, each with its own seed.
"""

from __future__ import annotations

import contextlib
import itertools
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait

from .._http import RETRY_STATUS, retry_after
from .base import BackendError, Generation, fresh_seed


class _Clients:
    """At most ``size`` kept ``httpx.Client`` objects of one keep-alive connection each; ``take()``
    lends the most recently returned one (its connection is the likeliest to be alive), making a
    new one while fewer than ``size`` exist, and waits when all are lent.

    Why not one client with ``size`` connections: httpcore's pool walks every connection, polling
    each idle socket, whenever a request starts or ends, so with 64 connections its bookkeeping
    was a fifth of the service's Python time at 64 clients (py-spy, docs/benchmarks.md); a
    one-connection client's pass is constant-time.
    """

    def __init__(self, size: int, make):
        self._make, self._idle, self._all = make, [], []
        self._lock, self._free = threading.Lock(), threading.Semaphore(size)

    @contextlib.contextmanager
    def take(self):
        self._free.acquire()
        try:
            with self._lock:
                client = self._idle.pop() if self._idle else None
            if client is None:
                client = self._make()
                with self._lock:
                    self._all.append(client)
            try:
                yield client
            finally:
                with self._lock:
                    self._idle.append(client)
        finally:
            self._free.release()

    def close(self) -> None:
        with self._lock:
            clients, self._all, self._idle = self._all, [], []
        for c in clients:
            c.close()


class OpenAIGenerator:
    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None, chat: bool = True,
                 timeout: float = 600.0, max_n_per_request: int | None = None, extra_body: dict | None = None,
                 max_retries: int = 3, max_concurrency: int = 64, backoff: float = 0.5, max_backoff: float = 30.0):
        import httpx  # lazily: the serve extra

        if max_n_per_request is not None and max_n_per_request < 1:
            raise ValueError(f"max_n_per_request must be >= 1, got {max_n_per_request}")
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key, self.chat, self.timeout = model, api_key, chat, timeout
        self.max_n, self.extra_body = max_n_per_request, dict(extra_body or {})
        self.max_retries, self.backoff, self.max_backoff = max(0, int(max_retries)), backoff, max_backoff
        self.max_concurrency = max(1, int(max_concurrency))
        self.name = f"{model} @ {self.base_url}"
        self._n_cap: int | None = None  # learned: the most choices this server returns per call
        self.calls = 0  # HTTP calls made (retries included), for diagnostics and tests
        self._count_lock = threading.Lock()
        self._unsupported: set[str] = set()  # OPTIONAL fields this server refused
        # connections: every concurrent service call may split into several concurrent sub-calls
        conns = max(self.max_concurrency, 8)
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        tls = httpx.create_ssl_context()  # made once, shared by every connection
        self._http = _Clients(conns, lambda: httpx.Client(
            base_url=self.base_url, timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)), verify=tls,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=60.0),
            headers=headers))
        # sub-calls of one generate() (splits, top-ups); workers never submit to this pool themselves
        self._pool = ThreadPoolExecutor(max_workers=conns, thread_name_prefix="privalign-openai")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    # ------------------------------------------------------------------ one HTTP call, with retries
    def _post(self, path: str, body: dict) -> dict:
        import httpx

        attempt = 0
        while True:
            with self._count_lock:
                self.calls += 1
            wait = None
            try:
                with self._http.take() as client:
                    r = client.post(path, json=body)
            except httpx.ReadTimeout as e:  # the server is working but slower than `timeout`: final
                raise BackendError(f"{self.base_url}{path} did not answer within {self.timeout} s") from e
            except httpx.TransportError as e:  # refused, reset, connect timeout: worth a retry
                error = f"{self.base_url}{path}: {type(e).__name__}: {e}"
            else:
                if r.status_code < 300:
                    try:
                        return r.json()
                    except ValueError as e:
                        raise BackendError(f"{self.base_url}{path} answered non-JSON: {r.text[:200]!r}") from e
                error = f"{self.base_url}{path} answered {r.status_code}: {r.text[:500]}"
                dropped = self._refused_optional(r, body)
                if dropped:  # a server that refuses seed or logprobs (privalign itself does): ask without them
                    body = {k: v for k, v in body.items() if k != dropped}
                    continue
                # a 4xx other than 429 will not get better, nor anything the server marks final
                # (privalign's own budget_exhausted 429 says x-should-retry: false, as OpenAI's do)
                if r.status_code not in RETRY_STATUS or r.headers.get("x-should-retry") == "false":
                    raise BackendError(error)
                wait = retry_after(r.headers.get("retry-after"))
            if attempt >= self.max_retries:
                raise BackendError(f"{error} (after {attempt + 1} attempts)")
            if wait is None:  # exponential back-off with full jitter
                wait = random.uniform(0, min(self.max_backoff, self.backoff * 2 ** attempt))
            time.sleep(min(wait, self.max_backoff))
            attempt += 1

    OPTIONAL = ("seed", "logprobs")  # asked for when the server has them; dropped once it refuses them

    def _refused_optional(self, r, body: dict) -> str | None:
        """The optional field (``OPTIONAL``, not set by extra_body) that a 400 answer names as refused
        (OpenAI's ``error.param``), remembered so later calls leave it out; else None."""
        if r.status_code != 400:
            return None
        try:
            param = (r.json().get("error") or {}).get("param")
        except (ValueError, AttributeError):
            return None
        if param in self.OPTIONAL and param in body and param not in self.extra_body:
            self._unsupported.add(param)
            return param
        return None

    def _call(self, messages, k: int, max_new_tokens: int, temperature: float, seed: int) -> list[Generation]:
        """One request asking for k choices; returns what the server gave (possibly fewer)."""
        body = {"model": self.model, "n": k, "max_tokens": max_new_tokens, "temperature": temperature,
                "seed": seed % (2**31), "logprobs": True, **self.extra_body}
        for key in self._unsupported - set(self.extra_body):
            body.pop(key, None)
        if self.chat:
            res = self._post("/v1/chat/completions", {**body, "messages": messages})
        else:
            res = self._post("/v1/completions", {**body, "prompt": "\n".join(m["content"] for m in messages)})
        try:
            choices = res["choices"]
            texts = [c["message"]["content"] if self.chat else c["text"] for c in choices]
        except (KeyError, TypeError) as e:
            raise BackendError(f"{self.base_url} answered without choices: {str(res)[:200]}") from e
        usage = res.get("usage") if isinstance(res.get("usage"), dict) else {}
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage.get("prompt_tokens"), int) else None
        out = []
        for c, text in zip(choices[:k], texts[:k]):
            lp = c.get("logprobs") or {}
            content = lp.get("content") if isinstance(lp, dict) else None
            logprob = sum(t["logprob"] for t in content) if content else None
            n_tokens = len(content) if content else int(c.get("n_tokens", 0)) or None
            out.append(Generation(text or "", n_tokens if n_tokens is not None else -1, logprob,
                                  prompt_tokens=prompt_tokens, finish_reason=c.get("finish_reason")))
        return out

    def _calls(self, messages, sizes: list[int], max_new_tokens, temperature, seeds) -> list[list[Generation]]:
        """One call per size, concurrently (the first on this thread), each with its own seed."""
        futures = [self._pool.submit(self._call, messages, k, max_new_tokens, temperature, next(seeds))
                   for k in sizes[1:]]
        try:
            first = self._call(messages, sizes[0], max_new_tokens, temperature, next(seeds))
        finally:
            futures_wait(futures)  # always wait for every call: none outlives generate()
        return [first, *(f.result() for f in futures)]

    @staticmethod
    def _split(k: int, cap: int) -> list[int]:
        return [min(cap, k - i) for i in range(0, k, cap)]

    def generate(self, messages, k, *, max_new_tokens=256, temperature=1.0, seed=None):
        seeds = itertools.count(fresh_seed(seed), 1_000_003)  # a distinct seed per call: same seed, same sample
        cap = min(self.max_n or k, self._n_cap or k)
        sizes = self._split(k, cap)
        got = self._calls(messages, sizes, max_new_tokens, temperature, seeds)
        out = [g for r in got for g in r]
        for _ in range(3):
            if len(out) >= k:
                return out[:k]
            short = [len(r) for r, asked in zip(got, sizes) if len(r) < asked]
            if not out or not short:
                break
            # the server returns fewer choices than asked (it ignores n or caps it): remember its cap
            # and ask for the rest in concurrent calls of that size
            cap = max(1, min(short))
            self._n_cap = cap if self._n_cap is None else min(self._n_cap, cap)
            sizes = self._split(k - len(out), cap)
            got = self._calls(messages, sizes, max_new_tokens, temperature, seeds)
            out += [g for r in got for g in r]
        if len(out) >= k:
            return out[:k]
        raise BackendError(f"{self.base_url} returned {len(out)} of {k} choices")
