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
ADDITION_EXAMPLES = [("What is 2 + 1?", "3"), ("What is 0 + 4?", "4")]
_NUM = re.compile(r"-?\d+")


def _all_problems(max_operand: int, ops: str) -> list[tuple[int, str, int]]:
    probs = [(a, op, b) for a, b, op in itertools.product(range(max_operand + 1), range(max_operand + 1), ops)]
    order = np.random.default_rng(20261202).permutation(len(probs))
    return [probs[i] for i in order]


class Arithmetic(Task):
    """``arithmetic``: a +/- b with one-digit a, b (200 problems, 100 test / 100 train).
    ``addition``: a + b with a, b in 0..4 (25 problems, 17 test / 8 train) with its own worked
    examples, the easier variant whose per-prompt base accuracy mostly lies between 10% and 60% for
    SmolLM2-135M at temperature 1."""

    max_new_tokens = 8

    def __init__(self, name: str = "arithmetic"):
        if name not in ("arithmetic", "addition"):
            raise ValueError(f"name must be 'arithmetic' or 'addition', got {name!r}")
        self.name = name
        self.max_operand, self.ops = (9, "+-") if name == "arithmetic" else (4, "+")
        self.examples = EXAMPLES if name == "arithmetic" else ADDITION_EXAMPLES

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        allp = _all_problems(self.max_operand, self.ops)
        n_test = 100 if self.name == "arithmetic" else 17
        chosen = allp[:n_test] if split == "test" else allp[n_test:]
        out = []
        for i, (a, op, b) in enumerate(chosen[:limit]):
            value = a + b if op == "+" else a - b
            prefix = "arith" if self.name == "arithmetic" else self.name  # ids of the shipped pool
            out.append(Problem(id=f"{prefix}-{split}-{i}", question=f"What is {a} {op} {b}?", reference=str(value),
                               meta={"a": a, "b": b, "op": op}))
        return out

    def messages(self, problem: Problem) -> list[dict]:
        msgs = []
        for q, a in self.examples:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": problem.question}]

    def extract(self, response: str) -> str | None:
        tail = response.rsplit("=", 1)[-1] if "=" in response else response
        m = _NUM.search(tail)
        return m.group(0) if m else None

    def reference_response(self, problem: Problem) -> str:
        return problem.reference


# ---------------------------------------------------------------- the wide family, for real-data evidence
MIX_EXAMPLES = {
    "+": [("What is 2 + 5?", "7"), ("What is 13 + 4?", "17")],
    "-": [("What is 7 - 2?", "5"), ("What is 15 - 3?", "12")],
    "*": [("What is 2 times 3?", "6"), ("What is 4 times 1?", "4")],
}
MIX_TEST = 300


def _mix_problems() -> list[tuple[int, str, int]]:
    """a + b (a in 0..19, b in 0..9), a - b (same ranges, a >= b), a times b (1..9 each), less the
    worked examples: 430 problems in a fixed shuffle."""
    probs = [(a, "+", b) for a in range(20) for b in range(10)]
    probs += [(a, "-", b) for a in range(20) for b in range(10) if a >= b]
    probs += [(a, "*", b) for a in range(1, 10) for b in range(1, 10)]
    seen = {q for ex in MIX_EXAMPLES.values() for q, _ in ex}
    probs = [p for p in probs if _mix_question(*p) not in seen]
    order = np.random.default_rng(20261203).permutation(len(probs))
    return [probs[i] for i in order]


def _mix_question(a: int, op: str, b: int) -> str:
    return f"What is {a} times {b}?" if op == "*" else f"What is {a} {op} {b}?"


class ArithmeticMix(Arithmetic):
    """``arithmetic-mix``: the arithmetic family widened for pools of real size. Additions with a
    one- or two-digit first operand, non-negative subtractions and one-digit multiplications
    (430 problems: 300 test, 130 train), each asked after two worked examples of its own operation.
    SmolLM2-135M at temperature 1 is right about 20% of the time (additions ~20%, subtractions
    ~10%, products ~30% in a pilot of 16 samples per prompt), most prompts between 5% and 60%."""

    def __init__(self):
        self.name = "arithmetic-mix"

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        allp = _mix_problems()
        chosen = allp[:MIX_TEST] if split == "test" else allp[MIX_TEST:]
        out = []
        for i, (a, op, b) in enumerate(chosen[:limit]):
            value = a + b if op == "+" else a - b if op == "-" else a * b
            out.append(Problem(id=f"{self.name}-{split}-{i}", question=_mix_question(a, op, b),
                               reference=str(value), meta={"a": a, "b": b, "op": op}))
        return out

    def messages(self, problem: Problem) -> list[dict]:
        op = problem.meta.get("op") or ("*" if " times " in problem.question else
                                        "-" if " - " in problem.question else "+")
        msgs = []
        for q, a in MIX_EXAMPLES[op]:
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": problem.question}]


# ---------------------------------------------------------------- counting
COUNTING_EXAMPLES = [("What number comes after 36?", "37"), ("What number comes after 119?", "120")]
COUNTING_TEST = 300


class Counting(Arithmetic):
    """``counting``: "What number comes after a?" for a in 10..459 (448 problems without the two worked
    examples: 300 test, 148 train), asked after two worked examples, answered with a number.
    SmolLM2-135M at temperature 1: about 29% mean accuracy in a pilot (20 prompts x 16 samples),
    three quarters of prompts in [5%, 60%], and its own log-probability picks a right answer out of
    16 samples more than half the time, so selection has a lot to gain."""

    def __init__(self):
        self.name = "counting"
        self.examples = COUNTING_EXAMPLES

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        seen = {q for q, _ in COUNTING_EXAMPLES}
        values = [a for a in range(10, 460) if f"What number comes after {a}?" not in seen]
        order = np.random.default_rng(20261203).permutation(len(values))
        picked = order[:COUNTING_TEST] if split == "test" else order[COUNTING_TEST:]
        return [Problem(id=f"{self.name}-{split}-{i}", question=f"What number comes after {values[k]}?",
                        reference=str(values[k] + 1), meta={"a": values[k]}) for i, k in enumerate(picked[:limit])]
