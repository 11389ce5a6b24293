"""Tasks: a dataset of problems, a prompt format, and a grader that maps a response to [0, 1]."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    reference: str          # the gold final answer (normalised text)
    solution: str = ""      # the dataset's worked solution, when there is one
    meta: dict = field(default_factory=dict)


class Task:
    """A task: ``load`` problems, build chat ``messages`` for a problem, ``grade`` a response."""

    name: str = ""
    max_new_tokens: int = 256

    def load(self, split: str = "test", limit: int | None = None) -> list[Problem]:
        raise NotImplementedError

    def messages(self, problem: Problem) -> list[dict]:
        raise NotImplementedError

    def extract(self, response: str) -> str | None:
        raise NotImplementedError

    def grade(self, response: str, problem: Problem) -> float:
        """1.0 if the response's final answer equals the reference, else 0.0."""
        answer = self.extract(response)
        return float(answer is not None and self.same(answer, problem.reference))

    def same(self, answer: str, reference: str) -> bool:
        return answer.strip() == reference.strip()

    def reference_response(self, problem: Problem) -> str:
        """A response in the task's answer format built from the dataset's own solution."""
        raise NotImplementedError


def data_dir(explicit: str | Path | None = None) -> Path:
    """Where the datasets live: ``explicit``, $PRIVALIGN_DATA_DIR, or ../shared/data next to the repo."""
    candidates = [explicit, os.environ.get("PRIVALIGN_DATA_DIR")]
    here = Path(__file__).resolve()
    candidates += [p / "shared" / "data" for p in here.parents]
    for c in candidates:
        if c and Path(c).is_dir():
            return Path(c)
    raise FileNotFoundError("dataset directory not found: pass --data-dir or set PRIVALIGN_DATA_DIR")


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    rows = []
    with open(path) as fh:
        for line in fh:
            if line.strip():
                rows.append(json.loads(line))
                if limit is not None and len(rows) >= limit:
                    break
    return rows


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def normalise_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5'; None if there is no number."""
    m = _NUMBER.search(text.replace("$", ""))
    if not m:
        return None
    s = m.group(0).replace(",", "")
    try:
        v = float(s)
    except ValueError:
        return None
    return str(int(v)) if v == int(v) else repr(v)
