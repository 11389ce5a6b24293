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


INSTRUCTION = "Answer with the letter of the correct option."


class MMLULetters(MMLU):
    """``mmlu-letters``: the three shipped MMLU subjects pooled (578 questions), asked after two worked
    examples as earlier chat turns and answered with a bare letter (a few tokens). The first two
    questions of elementary mathematics are the worked examples; the other 576 are split by a fixed
    shuffle into 300 test and 276 train questions. SmolLM2-135M at temperature 1: about 16% mean
    accuracy in a pilot, most questions between 5% and 45%."""

    max_new_tokens = 5
    n_test = 300

    def __init__(self, data: str | None = None):
        self.data, self.name, self.subject = data, "mmlu-letters", "pooled"

    def _rows(self) -> list[dict]:
        rows = []
        for s in ("elementary_mathematics", "college_mathematics", "college_chemistry"):
            rows += [{**r, "subject": s, "index": i}
                     for i, r in enumerate(read_jsonl(data_dir(self.data) / "mmlu" / f"{s}.jsonl"))]
        return rows

    @staticmethod
    def _body(r: dict) -> str:
        return r["question"] + "\n" + "\n".join(f"{LETTERS[j]}. {c}" for j, c in enumerate(r["choices"]))

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        import numpy as np

        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        rows = self._rows()[2:]
        order = np.random.default_rng(20261203).permutation(len(rows))
        picked = order[:self.n_test] if split == "test" else order[self.n_test:]
        return [Problem(id=f"mmlu-{rows[i]['subject']}-{rows[i]['index']}", question=self._body(rows[i]),
                        reference=LETTERS[rows[i]["answer"]], meta={"subject": rows[i]["subject"]})
                for i in picked[:limit]]

    def messages(self, problem: Problem) -> list[dict]:
        msgs = []
        for r in self._rows()[:2]:
            msgs += [{"role": "user", "content": f"{self._body(r)}\n{INSTRUCTION}"},
                     {"role": "assistant", "content": LETTERS[r["answer"]]}]
        return msgs + [{"role": "user", "content": f"{problem.question}\n{INSTRUCTION}"}]

    def reference_response(self, problem: Problem) -> str:
        return problem.reference
