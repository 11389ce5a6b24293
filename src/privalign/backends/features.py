"""Policy features: per sample [h_last, h_mean, mean token log-probability] of the base model's
last hidden states over the response tokens, accumulated in float32 on the sampling pass
(``loop_sampler.FeatureAccumulator``, ``shared_prefix``) or recomputed by teacher forcing
(``featurize``): the raw input of the certified policy-bt heads."""

from __future__ import annotations

import math

from .hf_compat import output_cache
from .loop_sampler import step


def policy_features(last, mean, logprob: float | None, n_tokens: int):
    """The raw feature vector stored per sample: [h_last, h_mean, mean token log-probability]."""
    import numpy as np

    lp = (logprob / max(n_tokens, 1)) if logprob is not None and math.isfinite(logprob) else 0.0
    return np.concatenate([np.asarray(last, np.float32), np.asarray(mean, np.float32), np.float32([lp])])


def featurize(model, tokenizer, device, ids, responses: list[str], batch_size: int = 64,
              closed: list[bool] | None = None):
    """Policy features of given responses to the prompt ``ids`` (1 x length), by teacher forcing: the
    response's tokens followed by EOS, fed after the shared prompt cache (right-padded, which
    a causal model never attends to). The same features ``generate(features=True)`` records;
    ``closed[i] = False`` marks a response that was cut at ``max_new_tokens`` (no sampled EOS),
    whose recorded log-probability leaves the appended EOS out, as generation does."""
    import copy

    import numpy as np
    import torch

    eos = tokenizer.eos_token_id
    out = []
    with torch.no_grad():
        prefix = model(ids, use_cache=True)
        for start in range(0, len(responses), batch_size):
            chunk = responses[start:start + batch_size]
            toks = [[t for t in tokenizer.encode(r, add_special_tokens=False) if t != eos] + [eos]
                    for r in chunk]
            width = max(len(t) for t in toks)
            batch = torch.tensor([t + [eos] * (width - len(t)) for t in toks], device=device)
            lengths = torch.tensor([len(t) for t in toks], device=device)
            cache = copy.deepcopy(output_cache(prefix))
            cache.batch_repeat_interleave(len(chunk))
            h, logits, _ = step(model, batch, cache)
            mask = (torch.arange(width, device=device)[None, :] < lengths[:, None])
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


def featurize_many(model, tokenizer, device, prompts: list, responses: list[str], batch_size: int = 32,
                   max_tokens: int = 4096):
    """``featurize`` for many (prompt ids, response) pairs at once, each prompt its own: every text
    is the prompt's tokens, the response's and an EOS, right-padded into batches of similar length
    (a causal model never attends to the padding on the right), one plain forward pass per batch.
    The same features as ``featurize`` (to float error): h_last at the EOS, h_mean over the response
    tokens and the EOS, the mean log-probability of those tokens. A text longer than ``max_tokens``
    keeps the end of its prompt (its response whole)."""
    import numpy as np
    import torch

    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    items = []
    for p, r in zip(prompts, responses):
        resp = [t for t in tokenizer.encode(r, add_special_tokens=False) if t != eos] + [eos]
        p = [int(t) for t in (p.tolist() if hasattr(p, "tolist") else p)]
        p = p[-max(1, max_tokens - len(resp)):]
        items.append((p, resp))
    order = sorted(range(len(items)), key=lambda i: len(items[i][0]) + len(items[i][1]))
    out: list = [None] * len(items)
    with torch.no_grad():
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            seqs = [items[i][0] + items[i][1] for i in idx]
            width = max(len(s) for s in seqs)
            ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs], device=device)
            attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device=device)
            h = model.model(input_ids=ids, attention_mask=attn).last_hidden_state  # as ``step`` reads it
            for row, i in enumerate(idx):
                n_p, n_r = len(items[i][0]), len(items[i][1])
                span = slice(n_p, n_p + n_r)
                # the logits only where they predict a response token (the whole vocabulary at every
                # position of a batch would not fit in memory)
                logp = torch.log_softmax(model.lm_head(h[row, n_p - 1:n_p + n_r - 1]).float(), dim=-1)
                lp = logp.gather(1, ids[row, span][:, None]).double().sum()
                hf = h[row].float()
                out[i] = policy_features(hf[n_p + n_r - 1].cpu().numpy(), hf[span].mean(0).cpu().numpy(),
                                         float(lp), n_r)
    return np.stack(out)
