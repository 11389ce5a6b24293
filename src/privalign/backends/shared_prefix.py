"""Many samples of one prompt decoded against a single copy of the prompt's KV cache.

``TransformersGenerator(sampler="shared")`` uses it for Llama-family models (SmolLM2, Llama,
Qwen2-style decoders without attention biases are all the same computation). The prompt is
encoded once; every sampled row attends to that one prefix cache, shape (kv_heads, P, d), and
to its own short suffix cache, shape (rows, kv_heads, T, d), preallocated for ``max_new_tokens``
steps. For row r, head h in kv group g(h), at step t

    a = softmax([q K_prefix^T, q K_suffix(r)[:t+1]^T] / sqrt(d)),  o = a [V_prefix; V_suffix(r)[:t+1]]

which is exactly causal attention over prompt + response, without copying the prompt's cache
into every row (``model.generate`` and the ``loop`` sampler copy it, and copy it again at every
step when the cache grows). Rows whose sample has ended leave the batch, so a step costs what the
live rows cost. Sampling is ancestral at the temperature, one categorical draw per live row per
step (``sample_rows``, inverse CDF) from a private ``torch.Generator``: the law of every sample is
the model's, as in the ``loop`` sampler; only the way random numbers are used differs. Rows
whose responses so far are equal share one node of a prefix tree and are computed once per step
(for hundreds of short answers to one prompt most rows repeat a few prefixes).

Features (``policy_features``) are accumulated in the same pass: every response token, the
sampled EOS included, is fed once, and its last hidden state (after the final norm) is added to
the row's running mean and becomes its last state; a row cut at ``max_new_tokens`` is fed one EOS
more, as in the ``loop`` sampler and in teacher-forced ``featurize``.
"""

from __future__ import annotations

import math

from .hf_compat import output_cache


def supports(model) -> bool:
    """Whether ``model`` has the Llama decoder layout this module computes with."""
    try:
        base = model.model
        layer = base.layers[0]
        attn = layer.self_attn
        parts = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, layer.mlp, layer.input_layernorm,
                 layer.post_attention_layernorm, base.norm, base.rotary_emb, base.embed_tokens, model.lm_head)
    except AttributeError:
        return False
    cfg = model.config
    return (all(p is not None for p in parts) and attn.q_proj.bias is None and not getattr(cfg, "sliding_window", None)
            and getattr(cfg, "model_type", "") in ("llama", "mistral", "qwen2", "smollm3"))


def sample_rows(logits, temperature: float, gen, node=None, block: int = 256):
    """One token per row from softmax(logits[node[r]] / temperature), and its log-probability.

    ``logits`` holds one row per distinct state (node); ``node`` maps each sampled row to its state
    (default: one row each). Inverse-CDF sampling in two levels, one uniform per row: a block of
    ``block`` tokens with probability equal to its mass, then a token within the block in proportion
    to its probability. The law is the categorical's (up to float64 rounding of partial sums);
    torch's ``multinomial`` draws the same law about ten times slower on a (512, 49152) batch."""
    import torch

    n, v = logits.shape
    dev = logits.device
    if node is None:
        node = torch.arange(n, device=dev)
    z = logits / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    p = torch.exp(z - lse)
    nb = -(-v // block)
    if nb * block != v:
        p = torch.nn.functional.pad(p, (0, nb * block - v))
    pb = p.view(n, nb, block)
    cum = pb.sum(-1, dtype=torch.float64).cumsum(-1)[node]  # (rows, nb)
    u = torch.rand((node.numel(), 1), generator=gen, dtype=torch.float64, device=dev) * cum[:, -1:]
    j = torch.searchsorted(cum, u, right=True).clamp_(max=nb - 1)
    below = torch.where(j > 0, cum.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(u))
    inner = pb[node, j[:, 0]].double().cumsum(-1)
    k = torch.searchsorted(inner, u - below, right=True).clamp_(max=block - 1)
    tok = (j * block + k).squeeze(1).clamp_(max=v - 1)
    return tok, (z[node, tok] - lse[node, 0]).double()


def _children(node, tok, vocab: int):
    """The distinct (parent node, token) pairs of the rows: (parents, tokens, each row's child)."""
    import torch

    keys, child = torch.unique(node * vocab + tok, return_inverse=True)
    return keys // vocab, keys % vocab, child


def _rotate_half(x):
    import torch

    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class SharedPrefixDecoder:
    """One prompt, ``k`` samples, ``batch_size`` rows decoded at a time (see the module docstring)."""

    def __init__(self, model, batch_size: int | None = None):
        if not supports(model):
            raise ValueError(f"the shared-prefix sampler needs a Llama-family decoder, got "
                             f"{type(model).__name__} ({getattr(model.config, 'model_type', '?')})")
        if batch_size is not None and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        self.model, self.batch_size = model, batch_size
        cfg = model.config
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = self.head_dim ** -0.5

    def rows_per_batch(self, k: int, tokens: int, device) -> int:
        """``batch_size`` when set; else 1024 on the CPU, and on CUDA as many of the ``k`` rows as
        the free memory holds, each with its own suffix cache of ``tokens`` positions."""
        from ..devices import auto_batch_size

        if self.batch_size is not None:
            return self.batch_size
        return auto_batch_size(self.model, device, "shared", k, tokens)

    def sample(self, prompt_ids, k: int, *, max_new_tokens: int, temperature: float, gen, eos: int,
               features: bool = False, batch_size: int | None = None):
        """``k`` samples: (tokens (k, max_new_tokens) long, n_tokens (k,), logprob (k,) float64,
        features (last, mean) as float32 numpy arrays or None). ``prompt_ids`` is a 1-D tensor;
        ``batch_size`` rows are decoded at a time (default ``rows_per_batch``)."""
        import torch

        dev = prompt_ids.device
        pk, pv, first = self.prefill(prompt_ids)
        p_len = int(prompt_ids.numel())
        tokens = torch.full((k, max_new_tokens), eos, dtype=torch.long, device=dev)
        n_tok = torch.zeros(k, dtype=torch.long, device=dev)
        logprob = torch.zeros(k, dtype=torch.float64, device=dev)
        hid = self.model.config.hidden_size
        last = torch.zeros((k, hid), dtype=torch.float32, device=dev) if features else None
        total = torch.zeros((k, hid), dtype=torch.float32, device=dev) if features else None
        count = torch.zeros(k, device=dev) if features else None
        size = batch_size or self.rows_per_batch(k, max_new_tokens + 1, dev)
        for start in range(0, k, size):
            rows = torch.arange(start, min(k, start + size), device=dev)
            self._chunk(rows, pk, pv, first, p_len, max_new_tokens, temperature, gen, eos, tokens, n_tok, logprob,
                        (last, total, count) if features else None)
        feats = None
        if features:
            feats = (last.cpu().numpy(), (total / count.clamp(min=1)[:, None]).cpu().numpy())
        return tokens, n_tok, logprob, feats

    def prefill(self, prompt_ids):
        """The prompt through the model once: its keys and values, (L, kv, P, d) each, and the
        logits of the first response token."""
        import torch

        with torch.no_grad():
            out = self.model(prompt_ids[None], use_cache=True)
            cache = output_cache(out)
            pk = torch.stack([layer.keys[0] for layer in cache.layers])
            pv = torch.stack([layer.values[0] for layer in cache.layers])
        return pk, pv, out.logits[0, -1].float()

    def _chunk(self, rows, pk, pv, first, p_len, max_new, temperature, gen, eos, tokens, n_tok, logprob, acc):
        """Decode ``rows`` to EOS or ``max_new``. Rows whose responses so far are equal share one
        node of the prefix tree: a node's hidden state, logits and suffix cache depend only on its
        tokens, so each step runs the model once per distinct (parent, token) node, not per row.
        Each row still draws its own next token from its node's law."""
        import torch

        dev = rows.device
        n_layers = pk.shape[0]
        width = max_new + 1  # a cut row is fed one EOS more when features are recorded
        sk = torch.empty((n_layers, 1, self.kv_heads, width, self.head_dim), dtype=pk.dtype, device=dev)
        sv = torch.empty_like(sk)
        logits = first[None]  # one node: the prompt
        node = torch.zeros(rows.numel(), dtype=torch.long, device=dev)  # each live row's node
        vocab = first.numel()
        with torch.no_grad():
            for t in range(max_new):
                nxt, lp = sample_rows(logits, temperature, gen, node)
                logprob[rows] += lp
                n_tok[rows] += 1
                tokens[rows, t] = nxt
                going = nxt != eos
                last_step = t + 1 == max_new
                if acc is None:
                    if last_step or not going.any():
                        break
                    rows, node, nxt = rows[going], node[going], nxt[going]
                    parents, toks, node = _children(node, nxt, vocab)
                    sk, sv = sk[:, parents], sv[:, parents]
                    logits = self.model.lm_head(self._step(toks, p_len + t, t, pk, pv, sk, sv)).float()
                    continue
                # features: feed every sampled token (EOS included) once, then drop the ended rows
                parents, toks, node = _children(node, nxt, vocab)
                sk, sv = sk[:, parents], sv[:, parents]
                h = self._step(toks, p_len + t, t, pk, pv, sk, sv)
                self._accumulate(acc, rows, h[node])
                if not going.any():
                    break
                rows, node = rows[going], node[going]
                used, node = torch.unique(node, return_inverse=True)
                sk, sv, h = sk[:, used], sv[:, used], h[used]
                if last_step:  # cut at max_new_tokens: their feature sequence ends with an EOS too
                    h = self._step(torch.full((used.numel(),), eos, dtype=torch.long, device=dev), p_len + t + 1,
                                   t + 1, pk, pv, sk, sv)
                    self._accumulate(acc, rows, h[node])
                    break
                logits = self.model.lm_head(h).float()

    @staticmethod
    def _accumulate(acc, rows, h):
        last, total, count = acc  # float32, whatever the model's dtype (bf16 index_put would refuse)
        h = h.to(last.dtype)
        last[rows] = h
        total[rows] += h
        count[rows] += 1

    def _step(self, tok, pos: int, t: int, pk, pv, sk, sv):
        """Feed one token per row at absolute position ``pos`` (suffix slot ``t``): the final
        normed hidden states (rows, hidden). Writes the rows' keys and values into ``sk``/``sv``."""
        import torch

        base = self.model.model
        b = tok.numel()
        kvh, g, d = self.kv_heads, self.heads // self.kv_heads, self.head_dim
        h = base.embed_tokens(tok)[:, None, :]  # (b, 1, hidden)
        cos, sin = base.rotary_emb(h, torch.tensor([[pos]], device=tok.device))
        cos, sin = cos[0], sin[0]  # (1, d)
        for li, layer in enumerate(base.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)[:, 0]
            q = attn.q_proj(x).view(b, kvh, g, d)
            k = attn.k_proj(x).view(b, kvh, d)
            v = attn.v_proj(x).view(b, kvh, d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            sk[li, :, :, t] = k
            sv[li, :, :, t] = v
            # prefix scores: one (kv, b*g, d) x (kv, d, P) product against the single prefix copy
            qk = q.permute(1, 0, 2, 3).reshape(kvh, b * g, d)
            s_pre = torch.bmm(qk, pk[li].transpose(1, 2)).view(kvh, b, g, -1).permute(1, 0, 2, 3)
            s_suf = torch.matmul(q, sk[li, :, :, :t + 1].transpose(-1, -2))  # (b, kv, g, t+1)
            w = torch.softmax(torch.cat([s_pre, s_suf], dim=-1) * self.scale, dim=-1)
            p_len = pk.shape[2]
            w_pre = w[..., :p_len].permute(1, 0, 2, 3).reshape(kvh, b * g, p_len)
            o = torch.bmm(w_pre, pv[li]).view(kvh, b, g, d).permute(1, 0, 2, 3)
            o = o + torch.matmul(w[..., p_len:], sv[li, :, :, :t + 1])
            h = h + attn.o_proj(o.reshape(b, 1, kvh * g * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return base.norm(h)[:, 0]


def check_logits(model, prompt_ids, continuation) -> float:
    """Largest |difference| between this module's logits and the model's own forward pass along a
    given continuation (a list of token ids): the correctness check the tests run."""
    import torch

    dec = SharedPrefixDecoder(model)
    with torch.no_grad():
        full = model(torch.cat([prompt_ids, torch.tensor(continuation, device=prompt_ids.device)])[None]).logits[0]
        pk, pv, _ = dec.prefill(prompt_ids)
        n_layers, width = pk.shape[0], len(continuation)
        sk = torch.empty((n_layers, 1, dec.kv_heads, width, dec.head_dim), dtype=pk.dtype, device=prompt_ids.device)
        sv = torch.empty_like(sk)
        worst = 0.0
        p_len = int(prompt_ids.numel())
        for t, tok in enumerate(continuation):
            h = dec._step(torch.tensor([tok], device=prompt_ids.device), p_len + t, t, pk, pv, sk, sv)
            diff = (model.lm_head(h)[0] - full[p_len + t]).abs().max()
            worst = max(worst, float(diff))
    return worst if math.isfinite(worst) else float("inf")
