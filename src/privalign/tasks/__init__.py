"""Tasks and graders: GSM8K, MATH-500 (math-verify), MMLU (letters), and a built-in arithmetic family."""

from .arithmetic import Arithmetic, ArithmeticMix, Counting
from .base import Problem, Task, data_dir
from .gsm8k import GSM8K
from .math500 import MATH500
from .mmlu import MMLU, MMLULetters

TASKS = ("gsm8k", "math500", "mmlu", "arithmetic", "addition", "arithmetic-mix", "mmlu-letters", "counting")


def get_task(name: str, data: str | None = None) -> Task:
    """``gsm8k``, ``math500``, ``arithmetic``, ``addition``, ``arithmetic-mix``, ``mmlu`` (college mathematics),
    ``counting``, ``mmlu:<subject>`` or ``mmlu-letters`` (three subjects pooled, few-shot, letter answers)."""
    if name == "gsm8k":
        return GSM8K(data)
    if name == "math500":
        return MATH500(data)
    if name in ("arithmetic", "addition"):
        return Arithmetic(name)
    if name == "arithmetic-mix":
        return ArithmeticMix()
    if name == "counting":
        return Counting()
    if name == "mmlu-letters":
        return MMLULetters(data)
    if name == "mmlu" or name.startswith("mmlu:"):
        return MMLU(name.split(":", 1)[1] if ":" in name else "college_mathematics", data)
    raise ValueError(f"task must be one of {TASKS} (or mmlu:<subject>), got {name!r}")


__all__ = ["Arithmetic", "ArithmeticMix", "Counting", "GSM8K", "MATH500", "MMLU", "MMLULetters", "Problem", "TASKS", "Task", "data_dir", "get_task"]
