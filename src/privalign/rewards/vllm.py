"""A reward model served by vLLM (``vllm serve REWARD_MODEL``), through its classify API.

vLLM serves sequence-classification reward models (Skywork-Reward, ...) at ``POST /classify``
(vLLM >= 0.11.1, where ``use_activation`` replaced the earlier ``activation``/``softmax`` options):

- request, one conversation per call: ``{"model": M, "messages": [{"role": "user", "content":
  prompt}, {"role": "assistant", "content": response}], "use_activation": false}``. The server
  applies the model's chat template and adds no special tokens on top of it (vLLM's default for
  chat input), so the reward model reads its BOS once. ``chat=False`` sends plain texts instead,
  ``batch_size`` at a time: ``{"model": M, "input": ["prompt\\nresponse", ...], "use_activation": false}``.
- ``use_activation: false``: the raw logit, not vLLM's default sigmoid of a one-logit head (a
  sigmoid squeezes the scores into (0, 1) and changes the exponential mechanism's sensitivity).
- response: ``{"data": [{"index": i, "probs": [score], "num_classes": 1, ...}, ...]}``; a head with
  more than one class, or any other shape, is an error naming what came back.

Calls run ``concurrency`` at a time, on keep-alive connections; 429, 5xx and connection errors are
retried ``max_retries`` times with exponential back-off (``Retry-After`` honoured), any other 4xx is
final. ``model`` defaults to the one model the server lists at ``GET /v1/models``.
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .._http import RETRY_STATUS, retry_after
from ..errors import BackendError
from .base import RewardModel


class VLLMReward(RewardModel):
    def __init__(self, base_url: str, model: str | None = None, chat: bool = True, batch_size: int = 64,
                 concurrency: int = 8, timeout: float = 300.0, max_retries: int = 3, backoff: float = 0.5,
                 max_backoff: float = 30.0, api_key: str | None = None,
                 output_range: tuple[float, float] = (-1e9, 1e9), name: str | None = None):
        import httpx  # lazily: the serve extra

        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(concurrency, int) or concurrency < 1:
            raise ValueError(f"concurrency must be a positive integer, got {concurrency!r}")
        url = base_url.rstrip("/")
        self.base_url = url[:-3] if url.endswith("/v1") else url  # /classify sits beside /v1, not in it
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm reward needs an http(s) URL, got {base_url!r}")
        self.chat, self.batch_size, self.concurrency = chat, batch_size, concurrency
        self.timeout, self.max_retries, self.backoff, self.max_backoff = timeout, max(0, int(max_retries)), backoff, max_backoff
        self.output_range = output_range
        self.calls = 0  # HTTP calls made, retries included
        self._lock = threading.Lock()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._http = httpx.Client(base_url=self.base_url, headers=headers,
                                  timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                  limits=httpx.Limits(max_connections=concurrency,
                                                      max_keepalive_connections=concurrency))
        self.model = model or self._served_model()
        self.name = name or self.model.rstrip("/").split("/")[-1]

    def close(self) -> None:
        self._http.close()

    # ---------------------------------------------------------------- HTTP
    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        import httpx

        attempt = 0
        while True:
            with self._lock:
                self.calls += 1
            wait = None
            try:
                r = self._http.request(method, path, json=body)
            except httpx.ReadTimeout as e:
                raise BackendError(f"{self.base_url}{path} did not answer within {self.timeout} s") from e
            except httpx.TransportError as e:
                error = f"{self.base_url}{path}: {type(e).__name__}: {e}"
            else:
                if r.status_code < 300:
                    try:
                        return r.json()
                    except ValueError as e:
                        raise BackendError(f"{self.base_url}{path} answered non-JSON: {r.text[:200]!r}") from e
                error = f"{self.base_url}{path} answered {r.status_code}: {r.text[:500]}"
                if r.status_code not in RETRY_STATUS:
                    raise BackendError(error)
                wait = retry_after(r.headers.get("retry-after"))
            if attempt >= self.max_retries:
                raise BackendError(f"{error} (after {attempt + 1} attempts)")
            time.sleep(min(wait if wait is not None else random.uniform(0, self.backoff * 2 ** attempt),
                           self.max_backoff))
            attempt += 1

    def _served_model(self) -> str:
        body = self._call("GET", "/v1/models")
        ids = [m.get("id") for m in body.get("data", []) if isinstance(m, dict)] if isinstance(body, dict) else []
        if len(ids) != 1 or not isinstance(ids[0], str):
            raise BackendError(f"{self.base_url}/v1/models lists {ids or body!r}: name the reward model "
                               "(model=...) when the server does not serve exactly one")
        return ids[0]

    # ---------------------------------------------------------------- scoring
    def _scores(self, body: dict, expected: int) -> list[float]:
        """The raw logits of a classify answer, in input order; any other shape is an error."""
        data = body.get("data") if isinstance(body, dict) else None
        shape = ("expected {'data': [{'index': i, 'probs': [score], 'num_classes': 1}, ...]}, got "
                 f"{str(body)[:200]}")
        if not isinstance(data, list) or len(data) != expected:
            raise BackendError(f"{self.base_url}/classify answered in another shape: {shape}")
        out = [None] * expected
        for item in data:
            probs = item.get("probs") if isinstance(item, dict) else None
            index = item.get("index") if isinstance(item, dict) else None
            if not isinstance(probs, list) or not isinstance(index, int) or not 0 <= index < expected:
                raise BackendError(f"{self.base_url}/classify answered in another shape: {shape}")
            if len(probs) != 1:
                raise BackendError(f"{self.model!r} at {self.base_url} has {len(probs)} output classes: privalign "
                                   "needs a single-logit reward model")
            out[index] = float(probs[0])
        if any(v is None for v in out):
            raise BackendError(f"{self.base_url}/classify answered in another shape: {shape}")
        return out

    def _chat_one(self, pair: tuple[str, str]) -> float:
        prompt, response = pair
        body = {"model": self.model, "use_activation": False,
                "messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]}
        return self._scores(self._call("POST", "/classify", body), 1)[0]

    def _text_batch(self, texts: list[str]) -> list[float]:
        body = {"model": self.model, "input": texts, "use_activation": False}
        return self._scores(self._call("POST", "/classify", body), len(texts))

    def score(self, prompts, responses):
        pairs = list(zip(prompts, responses))
        if not pairs:
            return np.zeros(0)
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="privalign-vllm") as pool:
            if self.chat:
                return np.array(list(pool.map(self._chat_one, pairs)), dtype=float)
            texts = [f"{p}\n{r}" for p, r in pairs]
            batches = [texts[i:i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
            return np.array([s for b in pool.map(self._text_batch, batches) for s in b], dtype=float)
