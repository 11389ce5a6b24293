"""OpenAI-compatible HTTP generator: any vLLM, TGI or llama.cpp server, a hosted endpoint, or
privalign's own service. Uses ``/v1/chat/completions`` (or ``/v1/completions``) with ``n``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from .base import Generation, fresh_seed


class OpenAIGenerator:
    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None, chat: bool = True,
                 timeout: float = 600.0, max_n_per_request: int | None = None, extra_body: dict | None = None):
        self.base_url = base_url.rstrip("/")
        self.model, self.api_key, self.chat, self.timeout = model, api_key, chat, timeout
        self.max_n, self.extra_body = max_n_per_request, extra_body or {}
        self.name = f"{model} @ {self.base_url}"

    def _post(self, path: str, body: dict) -> dict:
        req = urllib.request.Request(self.base_url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{self.base_url}{path} answered {e.code}: {e.read().decode(errors='replace')}") from e

    def generate(self, messages, k, *, max_new_tokens=256, temperature=1.0, seed=None):
        if self.max_n and k > self.max_n:  # servers that cap n (privalign's own service returns one choice)
            base = fresh_seed(seed)
            out = []
            for i in range(0, k, self.max_n):
                out += self.generate(messages, min(self.max_n, k - i), max_new_tokens=max_new_tokens,
                                     temperature=temperature, seed=base + i)
            return out
        body = {"model": self.model, "n": k, "max_tokens": max_new_tokens, "temperature": temperature,
                "seed": fresh_seed(seed) % (2**31), "logprobs": True, **self.extra_body}
        if self.chat:
            res = self._post("/v1/chat/completions", {**body, "messages": messages})
            texts = [c["message"]["content"] for c in res["choices"]]
        else:
            prompt = "\n".join(m["content"] for m in messages)
            res = self._post("/v1/completions", {**body, "prompt": prompt})
            texts = [c["text"] for c in res["choices"]]
        out = []
        for c, text in zip(res["choices"], texts):
            lp = c.get("logprobs") or {}
            content = lp.get("content") if isinstance(lp, dict) else None
            logprob = sum(t["logprob"] for t in content) if content else None
            n_tokens = len(content) if content else int(c.get("n_tokens", 0)) or None
            out.append(Generation(text, n_tokens if n_tokens is not None else -1, logprob))
        return out
