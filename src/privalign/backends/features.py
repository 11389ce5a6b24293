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
