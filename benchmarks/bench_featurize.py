"""Featurizing a preference file's texts (issue 52's speed item): privalign's ``featurize_table``
against a plain batched Hugging Face forward pass over the same texts, in the same run.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_featurize.py [--prompts 24] [--repeat 2]

The texts are a deployment's: the shipped counting test pool's first ``--prompts`` prompts (the task's
chat prompt with its worked examples) and each prompt's distinct responses, written as a TRL file of
pairs. The baseline renders each (prompt, response) through the chat template, tokenizes batches of 32
texts of similar length with padding, and calls the model once a batch (``model(**batch)``: logits at
every position, what a user would write; and, as a second baseline, the base model's last hidden
states only). privalign's path computes each distinct text once, runs a
prompt's responses after one shared pass over the prompt (4 or more a prompt) and reads the last hidden
states, their mean and the log-probability (the raw features of a policy-bt head). Prints texts/s of
each and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from importlib import resources
from pathlib import Path

import numpy as np


def _texts(prompts: int):
    from privalign.pools import load_pool
    from privalign.tasks import Problem, get_task

    pool = load_pool(resources.files("privalign") / "data" / "counting-smollm2.parquet")
    task = get_task("counting")
    pid = np.asarray(pool.columns["prompt_id"], str)
    out = []
    for p in list(dict.fromkeys(pid.tolist()))[:prompts]:
        rows = np.flatnonzero(pid == p)
        messages = task.messages(Problem(id=p, question=str(pool.columns["prompt"][rows[0]]), reference=""))
        responses = sorted({str(pool.columns["response"][i]) for i in rows if str(pool.columns["response"][i]).strip()})
        out.append((messages, responses))
    return out


def plain_forward(model, tokenizer, items, batch: int = 32, logits: bool = True) -> float:
    import torch

    texts = [tokenizer.apply_chat_template(m + [{"role": "assistant", "content": r}], tokenize=False)
             for m, rs in items for r in rs]
    texts.sort(key=len)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    t0 = time.perf_counter()
    with torch.no_grad():
        for lo in range(0, len(texts), batch):
            enc = tokenizer(texts[lo:lo + batch], padding=True, return_tensors="pt", add_special_tokens=False)
            (model if logits else model.model)(**enc)  # without logits: the last hidden states only
    return len(texts) / (time.perf_counter() - t0)


def privalign_featurize(policy, items, folder: Path) -> float:
    from privalign.preference_features import featurize_table
    from privalign.preferences.trl import read_preferences

    path = folder / f"bench-{time.perf_counter_ns()}.jsonl"
    rows = []
    for m, rs in items:  # every response once: as the chosen side of one pair, or the rejected of the first
        for j, r in enumerate(rs):
            other = rs[0] if j else rs[-1]
            if other != r:
                rows.append({"prompt": m, "chosen": [{"role": "assistant", "content": r}],
                             "rejected": [{"role": "assistant", "content": other}], "user_id": f"u{len(rows)}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = read_preferences(path, "user_id")
    n = len({(json.dumps(m), r) for m, rs in items for r in rs})
    t0 = time.perf_counter()
    featurize_table(table, policy, "smollm2", cache=False)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=2)
    a = ap.parse_args()
    import torch

    from privalign.backends import load_policy

    policy = load_policy("smollm2")
    items = _texts(a.prompts)
    n = sum(len(rs) for _, rs in items)
    print(f"{n} distinct texts of {len(items)} prompts (the shipped counting test pool), torch threads "
          f"{torch.get_num_threads()}")
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(a.repeat):
            base = plain_forward(policy.model, policy.tokenizer, items)
            hidden = plain_forward(policy.model, policy.tokenizer, items, logits=False)
            ours = privalign_featurize(policy, items, Path(tmp))
            print(f"run {run + 1}: plain HF forward {base:.1f} texts/s (hidden states only {hidden:.1f}), privalign "
                  f"featurize {ours:.1f} texts/s: ratio {ours / base:.2f} ({ours / hidden:.2f})")


if __name__ == "__main__":
    main()
