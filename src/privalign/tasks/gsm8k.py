"""GSM8K (Cobbe et al. 2021): grade-school math word problems, final answer after '####'."""

from __future__ import annotations

import re

from .base import Problem, Task, data_dir, normalise_number, read_jsonl

INSTRUCTION = ("Solve the following math problem step by step. At the end, write the final answer as "
               "'#### <number>'.\n\n")


class GSM8K(Task):
    name = "gsm8k"
    max_new_tokens = 256

    def __init__(self, data: str | None = None):
        self.data = data

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rows = read_jsonl(data_dir(self.data) / "gsm8k" / f"{split}.jsonl", limit)
        return [Problem(id=f"gsm8k-{split}-{i}", question=r["question"],
                        reference=normalise_number(r["answer"].split("####")[-1]), solution=r["answer"])
                for i, r in enumerate(rows)]

    def messages(self, problem: Problem) -> list[dict]:
        # zero-shot chain of thought through the model's chat template
        return [{"role": "user", "content": INSTRUCTION + problem.question}]

    def extract(self, response: str) -> str | None:
        """Strict: the number after the last '####' (no credit for a number merely in the text)."""
        if "####" not in response:
            return None
        return normalise_number(response.split("####")[-1])

    def reference_response(self, problem: Problem) -> str:
        return re.sub(r"<<[^>]*>>", "", problem.solution)
