"""A built-in task family that a 135M model can partly solve on a CPU.

One-digit additions and subtractions, "What is a + b?", asked after two worked examples given as
earlier chat turns (few-shot), answered with a number in a few tokens. SmolLM2-135M-Instruct at
temperature 1 is right about a quarter of the time, with most per-prompt accuracies between 10%
and 60% (../shared/MODELS.md), so selection effects are visible and large pools are cheap.

The 200 problems (a, b in 0..9, + and -) are split by a fixed shuffle into ``train`` (preference
data for reward models) and ``test`` (100 each). Grading is strict: the number after the last
'=' if the response has one, else the first number in it, must equal the answer, so a response
that merely repeats a number from the question gets no credit.
"""

from __future__ import annotations

import itertools
import re

import numpy as np

from .base import Problem, Task

EXAMPLES = [("What is 2 + 5?", "7"), ("What is 9 - 4?", "5")]
_NUM = re.compile(r"-?\d+")


def _all_problems() -> list[tuple[int, str, int]]:
    probs = []
    for a, b, op in itertools.product(range(10), range(10), "+-"):
        probs.append((a, op, b))
    order = np.random.default_rng(20261202).permutation(len(probs))
    return [probs[i] for i in order]


class Arithmetic(Task):
    name = "arithmetic"
    max_new_tokens = 8

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        allp = _all_problems()
        chosen = allp[:100] if split == "test" else allp[100:]
        out = []
        for i, (a, op, b) in enumerate(chosen[:limit]):
            value = a + b if op == "+" else a - b
            out.append(Problem(id=f"arith-{split}-{i}", question=f"What is {a} {op} {b}?", reference=str(value),
                               meta={"a": a, "b": b, "op": op}))
        return out

    def messages(self, problem: Problem) -> list[dict]:
        msgs = []
        for q, a in EXAMPLES:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": problem.question}]

    def extract(self, response: str) -> str | None:
        tail = response.rsplit("=", 1)[-1] if "=" in response else response
        m = _NUM.search(tail)
        return m.group(0) if m else None

    def reference_response(self, problem: Problem) -> str:
        return problem.reference
