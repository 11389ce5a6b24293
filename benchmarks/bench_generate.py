"""Generation throughput and privalign's orchestration overhead.

Run: ``.venv/bin/python benchmarks/bench_generate.py`` (loads the embedded SmolLM2; CPU).

* tokens/s of the transformers backend for short answers (arithmetic, 64 samples x 8 tokens) and
  chain of thought (GSM8K, 16 samples x 256 tokens), against ``model.generate`` on the same
  prompts measured in the same run (the shared-prompt KV cache is the difference);
* the overhead of ``generate_pool`` (grading, shards, progress) over calling the backend directly
  on the same prompts with the same seeds.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from privalign.backends.transformers_backend import TransformersGenerator
from privalign.pipeline import _prompt_seed, generate_pool
from privalign.tasks import get_task


def hf_generate(gen, messages, k, max_new_tokens):
    ids = gen._prompt_ids(messages)
    with torch.no_grad():
        res = gen.model.generate(ids.repeat(k, 1), attention_mask=torch.ones_like(ids.repeat(k, 1)), do_sample=True,
                                 temperature=1.0, top_k=0, max_new_tokens=max_new_tokens,
                                 pad_token_id=gen.tokenizer.eos_token_id)
    new = res[:, ids.shape[1]:]
    eos = gen.tokenizer.eos_token_id
    return sum((row.tolist().index(eos) + 1) if eos in row.tolist() else len(row) for row in new)


def main():
    gen = TransformersGenerator("smollm2")
    rows = []
    for name, task, k, max_new, n_prompts in (("arithmetic (few-shot, answer only)", "arithmetic", 64, 8, 6),
                                              ("GSM8K (zero-shot chain of thought)", "gsm8k", 16, 256, 2)):
        t = get_task(task)
        problems = t.load("test", n_prompts)
        start = time.perf_counter()
        toks = sum(g.n_tokens for i, p in enumerate(problems)
                   for g in gen.generate(t.messages(p), k, max_new_tokens=max_new, seed=_prompt_seed(0, i)))
        direct = time.perf_counter() - start
        start = time.perf_counter()
        hf_toks = sum(hf_generate(gen, t.messages(p), k, max_new) for p in problems)
        hf = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as d:
            start = time.perf_counter()
            generate_pool(t, problems, gen, Path(d) / "pool.parquet", samples=k, max_new_tokens=max_new, seed=0,
                          shard_size=2)
            piped = time.perf_counter() - start
        rows.append((name, k, max_new, len(problems), toks / direct, hf_toks / hf, direct, piped))
    llama = []
    try:
        from privalign.backends.llamacpp_backend import LlamaCppGenerator

        lg = LlamaCppGenerator("smollm2")
        for name, task, k, max_new, n_prompts in (("arithmetic (few-shot, answer only)", "arithmetic", 64, 8, 2),
                                                  ("GSM8K (zero-shot chain of thought)", "gsm8k", 4, 256, 2)):
            t = get_task(task)
            start = time.perf_counter()
            toks = sum(g.n_tokens for i, p in enumerate(t.load("test", n_prompts))
                       for g in lg.generate(t.messages(p), k, max_new_tokens=max_new, seed=i))
            llama.append((name, k, max_new, n_prompts, toks / (time.perf_counter() - start)))
    except ImportError:
        pass
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| workload | samples x max tokens | prompts | privalign tok/s | model.generate tok/s | direct s | generate_pool s | overhead |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name, k, m, n, tps, hf_tps, direct, piped in rows:
        print(f"| {name} | {k} x {m} | {n} | {tps:.0f} | {hf_tps:.0f} | {direct:.1f} | {piped:.1f} | "
              f"{100 * (piped - direct) / direct:+.1f}% |")
    if llama:
        print("\n| llama.cpp backend (high-level API, one sample per call) | samples x max tokens | prompts | tok/s |")
        print("|---|---|---:|---:|")
        for name, k, m, n, tps in llama:
            print(f"| {name} | {k} x {m} | {n} | {tps:.0f} |")


if __name__ == "__main__":
    main()
