"""MATH-500 (Lightman et al. 2023): competition math, graded with math-verify."""

from __future__ import annotations

from .base import Problem, Task, data_dir, read_jsonl

INSTRUCTION = "Solve the following problem. Put your final answer in \\boxed{}.\n\n"


class MATH500(Task):
    name = "math500"
    max_new_tokens = 512

    def __init__(self, data: str | None = None):
        self.data = data

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split != "test":
            raise ValueError(f"MATH-500 ships only the 'test' split, got {split!r}")
        rows = read_jsonl(data_dir(self.data) / "math500" / "test.jsonl", limit)
        return [Problem(id=r.get("unique_id", f"math500-{i}"), question=r["problem"], reference=r["answer"],
                        solution=r["solution"], meta={"subject": r.get("subject"), "level": r.get("level")})
                for i, r in enumerate(rows)]

    def messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": INSTRUCTION + problem.question}]

    def extract(self, response: str) -> str | None:
        return response if "\\boxed" in response else None

    def grade(self, response: str, problem: Problem) -> float:
        """math-verify: parse the gold answer and the response and compare them symbolically."""
        from math_verify import parse, verify

        if self.extract(response) is None:
            return 0.0
        gold = parse("$" + problem.reference + "$")
        pred = parse(response)
        return float(bool(gold) and bool(pred) and verify(gold, pred))

    def reference_response(self, problem: Problem) -> str:
        return problem.solution
