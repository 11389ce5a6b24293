"""The loop sampler: the prompts' KV cache prefilled once (the prefix they share encoded once),
copied into each batch, and decoded with the model's own forward pass, one token per step; rows
that have ended leave the batch in ``sample_compact``. Policy features (``features``) ride on the
sampling pass in ``sample``."""

from __future__ import annotations

from .hf_compat import cache_kwarg, output_cache


def prefill(model, tokenizer, device, prompts):
    """Encode the distinct prompts (1-D id tensors) in one batch: (model output, with the cache
    and each prompt's last logits; attention mask, or None where no row is padded).

    The prefix all prompts share (a system prompt, few-shot examples) is encoded once and its
    cache copied to every row; the rest of each prompt is left-padded against it, so a row's
    padding sits between the shared prefix and its own tokens, masked and skipped by the
    position ids."""
    import torch

    if len(prompts) == 1:  # exactly the computation generate() has always made (seeded runs reproduce)
        with torch.no_grad():
            return model(prompts[0][None], use_cache=True), None
    dev = device
    shared = min(len(p) for p in prompts) - 1  # every row keeps at least one token of its own
    for p in prompts[1:]:
        differ = (p[:shared] != prompts[0][:shared]).nonzero()
        if len(differ):
            shared = int(differ[0, 0])
    with torch.no_grad():
        cache, done = None, 0
        if shared >= 8:
            cache = model(prompts[0][None, :shared], use_cache=True, logits_to_keep=1)
            cache = output_cache(cache)
            cache.batch_repeat_interleave(len(prompts))
            done = shared
        tails = [p[done:] for p in prompts]
        width = max(len(t) for t in tails)
        mask = positions = None
        if any(len(t) != width for t in tails):
            pad = tokenizer.pad_token_id
            ids = torch.stack([torch.cat([torch.full((width - len(t),), pad, dtype=t.dtype, device=dev), t])
                               for t in tails])
            mask = torch.stack([torch.cat([torch.ones(done, dtype=torch.long, device=dev),
                                           torch.zeros(width - len(t), dtype=torch.long, device=dev),
                                           torch.ones(len(t), dtype=torch.long, device=dev)]) for t in tails])
            positions = (mask.cumsum(1) - 1).clamp(min=0)[:, done:]
        else:
            ids = torch.stack(tails)
        out = model(ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
                         **{cache_kwarg(model): cache})
    return out, mask


def step(model, tokens, cache, mask=None, positions=None):
    """One decoding step through the base model: (last hidden state, logits, cache)."""
    kw = {cache_kwarg(model.model): cache}
    if mask is None:
        out = model.model(input_ids=tokens, use_cache=True, **kw)
    else:
        out = model.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                               **kw)
    h = out.last_hidden_state
    return h, model.lm_head(h), output_cache(out)


def sample(model, device, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos, features=False):
    """Sample the rows ``idx`` (indices of prompts in ``prefix``) to EOS or ``max_new_tokens``:
    (tokens, token counts, log-probabilities, (last, mean) features or None)."""
    import copy

    import torch

    b = len(idx)
    cache = copy.deepcopy(output_cache(prefix))
    if prefix.logits.shape[0] == 1:
        cache.batch_repeat_interleave(b)
        logits = prefix.logits[:, -1, :].float().expand(b, -1)
    else:
        sel = torch.tensor(idx, device=device)
        cache.batch_select_indices(sel)
        logits = prefix.logits[sel, -1, :].float()
    mask = positions = None
    if prefix_mask is not None:  # left-padded prompts: extend each row's mask and positions by one per step
        mask = prefix_mask[sel]
        positions = mask.sum(1, keepdim=True) - 1
    tokens = torch.empty((b, 0), dtype=torch.long, device=device)
    logprob = torch.zeros(b, dtype=torch.float64, device=device)
    n_tok = torch.zeros(b, dtype=torch.long, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    acc = FeatureAccumulator(b, device) if features else None

    def advance(tok, cache):
        nonlocal mask, positions
        if mask is not None:
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=device)], dim=1)
            positions = positions + 1
        return step(model, tok, cache, mask, positions)

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
            h, step_logits, cache = advance(nxt[:, None], cache)
            if acc is not None:
                acc.add(h[:, -1, :], fed)
            if not alive.any():
                break
            logits = step_logits[:, -1, :].float()
        if acc is not None and alive.any():
            # samples cut at max_new_tokens: their feature sequence ends with an EOS too
            h, _, cache = advance(torch.full((b, 1), eos, device=device), cache)
            acc.add(h[:, -1, :], alive)
    return tokens, n_tok, logprob, acc.result() if acc is not None else None


def sample_compact(model, device, prefix, idx, prefix_mask, max_new_tokens, temperature, gen, eos):
    """``sample`` without features, decoding only the rows still alive: ended rows are dropped
    from the cache, the mask and the positions after each step."""
    import copy

    import torch

    b = len(idx)
    sel = torch.tensor(idx, device=device)
    cache = copy.deepcopy(output_cache(prefix))
    cache.batch_select_indices(sel)
    logits = prefix.logits[sel, -1, :].float()
    mask = positions = None
    if prefix_mask is not None:
        mask = prefix_mask[sel]
        positions = mask.sum(1, keepdim=True) - 1
    rows = torch.arange(b, device=device)  # the rows still decoding, in cache order
    tokens = torch.full((b, max_new_tokens), eos, dtype=torch.long, device=device)
    logprob = torch.zeros(b, dtype=torch.float64, device=device)
    n_tok = torch.zeros(b, dtype=torch.long, device=device)
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
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=mask.dtype, device=device)], dim=1)
                positions = positions + 1
            _, step_logits, cache = step(model, nxt[:, None], cache, mask, positions)
            logits = step_logits[:, -1, :].float()
    return tokens, n_tok, logprob


class FeatureAccumulator:
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
