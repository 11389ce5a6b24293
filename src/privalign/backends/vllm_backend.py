"""vLLM generator (optional extra ``privalign[vllm]``; needs a GPU). One call samples all k with n=k.

For multi-GPU or multi-node serving, start vLLM's own OpenAI-compatible server and use the HTTP
backend (``OpenAIGenerator``) instead.
"""

from __future__ import annotations

from .base import Generation, fresh_seed


class VLLMGenerator:
    def __init__(self, model: str, tensor_parallel_size: int = 1, **engine_args):
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - GPU-only optional extra
            raise ImportError("the vLLM backend needs a GPU machine and: pip install 'privalign[vllm]'") from e
        self.llm = LLM(model=model, tensor_parallel_size=tensor_parallel_size, **engine_args)
        self.name = f"{model} (vLLM)"

    def generate(self, messages, k, *, max_new_tokens=256, temperature=1.0, seed=None):  # pragma: no cover
        from vllm import SamplingParams

        params = SamplingParams(n=k, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens, logprobs=0,
                                seed=fresh_seed(seed) % (2**31))
        res = self.llm.chat([messages], params)[0]
        out = []
        for c in res.outputs:
            out.append(Generation(c.text, len(c.token_ids), float(c.cumulative_logprob)
                                  if c.cumulative_logprob is not None else None,
                                  prompt_tokens=len(res.prompt_token_ids or []) or None,
                                  finish_reason=c.finish_reason))
        return out
