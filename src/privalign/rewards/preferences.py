"""Preference data D for training reward models, built from a task's train split.

GSM8K: the reference solution is preferred over a systematically corrupted copy of it (its final
answer and the last intermediate result changed by a small non-zero amount), so the pair differs in
correctness, not in style. Arithmetic: the correct result is preferred over a wrong one near it.
"""

from __future__ import annotations

import re

import numpy as np

from ..tasks import get_task


def _corrupt_gsm8k(solution: str, rng: np.random.Generator) -> str:
    body, _, final = solution.rpartition("####")
    final = final.strip().replace(",", "")
    try:
        value = float(final)
    except ValueError:
        value = 0.0
    delta = int(rng.choice([-3, -2, -1, 1, 2, 3, 10]))
    wrong = value + delta
    wrong_s = str(int(wrong)) if wrong == int(wrong) else str(wrong)
    body = re.sub(r"<<[^>]*>>", "", body)
    # change the last occurrence of the true answer in the worked solution as well
    idx = body.rfind(final)
    if idx >= 0:
        body = body[:idx] + wrong_s + body[idx + len(final):]
    return f"{body}#### {wrong_s}"


def preference_pairs(task: str, limit: int | None = None, seed: int = 0, data: str | None = None):
    """(prompts, chosen, rejected) from the task's train split."""
    t = get_task(task, data)
    rng = np.random.default_rng(seed)
    problems = t.load("train", limit)
    prompts, chosen, rejected = [], [], []
    for p in problems:
        prompt = p.question
        if task == "gsm8k":
            good = t.reference_response(p)
            bad = _corrupt_gsm8k(p.solution, rng)
        elif task in ("arithmetic", "addition"):
            good = p.reference
            bad = str(int(p.reference) + int(rng.choice([-2, -1, 1, 2])))
        else:
            raise ValueError(f"no preference builder for task {task!r} (have: gsm8k, arithmetic)")
        prompts.append(prompt)
        chosen.append(good)
        rejected.append(bad)
    return prompts, chosen, rejected
