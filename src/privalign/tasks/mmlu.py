"""MMLU multiple choice (Hendrycks et al. 2020): grade the letter A-D."""

from __future__ import annotations

import re

from .base import Problem, Task, data_dir, read_jsonl

LETTERS = "ABCD"
SUBJECTS = ("college_mathematics", "college_chemistry", "elementary_mathematics")


class MMLU(Task):
    name = "mmlu"
    max_new_tokens = 32

    def __init__(self, subject: str = "college_mathematics", data: str | None = None):
        if subject not in SUBJECTS:
            raise ValueError(f"subject must be one of {SUBJECTS}, got {subject!r}")
        self.subject, self.data = subject, data
        self.name = f"mmlu-{subject}"

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split != "test":
            raise ValueError(f"MMLU ships only the 'test' split here, got {split!r}")
        rows = read_jsonl(data_dir(self.data) / "mmlu" / f"{self.subject}.jsonl", limit)
        out = []
        for i, r in enumerate(rows):
            body = r["question"] + "\n" + "\n".join(f"{LETTERS[j]}. {c}" for j, c in enumerate(r["choices"]))
            out.append(Problem(id=f"{self.name}-{i}", question=body, reference=LETTERS[r["answer"]]))
        return out

    def messages(self, problem: Problem) -> list[dict]:
        return [{"role": "user", "content": problem.question + "\n\nAnswer with the letter of the correct "
                 "option, as 'Answer: X'."}]

    def extract(self, response: str) -> str | None:
        m = re.findall(r"Answer\s*[:\-]?\s*\(?([ABCD])\b", response)
        if m:
            return m[-1]
        m = re.match(r"\s*\(?([ABCD])\b", response)
        return m.group(1) if m else None

    def reference_response(self, problem: Problem) -> str:
        return f"Answer: {problem.reference}"
