"""llama.cpp generator (``llama-cpp-python``, optional extra ``privalign[llamacpp]``).

It compiles from source (about 5 to 8 minutes on 2 cores), so it stays out of the default set-up.
The high-level API samples one completion at a time; every sample gets its own seed (the same
seed would give identical samples).
"""

from __future__ import annotations

from .base import Generation, fresh_seed, smollm2_gguf


class LlamaCppGenerator:
    def __init__(self, model: str = "smollm2", n_ctx: int = 2048, threads: int | None = None):
        try:
            from llama_cpp import Llama
        except ImportError as e:  # pragma: no cover - depends on the optional extra
            raise ImportError("the llama.cpp backend needs: pip install 'privalign[llamacpp]'") from e
        path = str(smollm2_gguf()) if model == "smollm2" else model
        # logits_all: llama-cpp-python returns log-probabilities only for models created with it
        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, logits_all=True, verbose=False)
        self.name = f"{path} (llama.cpp)"

    def generate(self, messages, k, *, max_new_tokens=256, temperature=1.0, seed=None):
        base = fresh_seed(seed)
        out = []
        for i in range(k):
            self.llm.set_seed((base + i) % (2**31))
            r = self.llm.create_chat_completion(messages=messages, max_tokens=max_new_tokens, temperature=temperature,
                                                top_p=1.0, top_k=0, logprobs=True, top_logprobs=1)
            choice = r["choices"][0]
            lp = choice.get("logprobs") or {}
            tokens = lp.get("content") or []
            logprob = float(sum(float(t["logprob"]) for t in tokens)) if tokens else None
            out.append(Generation(choice["message"]["content"], r["usage"]["completion_tokens"], logprob,
                                  prompt_tokens=r["usage"].get("prompt_tokens"),
                                  finish_reason=choice.get("finish_reason")))
        return out
