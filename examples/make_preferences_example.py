"""Write the shipped example of your own preference data: src/privalign/data/preferences-example.jsonl.

    python examples/make_preferences_example.py            # rewrites the shipped files
    python examples/make_preferences_example.py --out my.jsonl

Beside it, ``preferences-public-example.jsonl``: 30 other users' rows of the same kind (seed 53, ids
``public-NNN``), the curator's own data that ``rm train --public`` may use without protection; and
``preferences-heldout-example.jsonl`` (seed 54, ``heldout-NNN``) for ``rm evaluate``. No row of one
file is in another.

TRL's conversational preference format with an explicit prompt, one row per line, and a ``user_id``
column naming the person who asked and judged: ``{"prompt": [{"role": "user", "content": ...}],
"chosen": [{"role": "assistant", "content": ...}], "rejected": [{"role": "assistant", "content":
...}], "user_id": "user-017"}``. The data are synthetic: 80 users, each asking 2 to 8 arithmetic or
counting questions, and preferring the correct answer to a wrong one (off by one, off by ten, digits
swapped, a miscounted letter). Each user has a style of their own (terse, or showing the working),
so one person's rows resemble each other, as real users' do. The output is a function of the seed
alone: the same seed gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "src" / "privalign" / "data" / "preferences-example.jsonl"
PUBLIC = OUT.with_name("preferences-public-example.jsonl")
HELDOUT = OUT.with_name("preferences-heldout-example.jsonl")
WORDS = ("strawberry", "banana", "committee", "mississippi", "bookkeeper", "parallel", "assessment",
         "balloon", "coffee", "letter", "address", "occurrence", "millennium", "necessary", "tomorrow")
ITEMS = ("apples", "pencils", "stamps", "marbles", "books", "coins", "shells", "cards")


def _wrong_number(rng: random.Random, right: int) -> int:
    """A plausible wrong answer: off by one or ten, or two digits swapped."""
    for _ in range(10):
        kind = rng.choice(("one", "ten", "swap"))
        if kind == "one":
            wrong = right + rng.choice((-1, 1))
        elif kind == "ten":
            wrong = right + rng.choice((-10, 10))
        else:
            digits = list(str(abs(right)))
            if len(digits) < 2 or digits[-1] == digits[-2]:
                continue
            digits[-1], digits[-2] = digits[-2], digits[-1]
            wrong = int("".join(digits)) * (1 if right >= 0 else -1)
        if wrong != right and wrong >= 0:
            return wrong
    return right + 1


def _arithmetic(rng: random.Random, verbose: bool) -> tuple[str, str, str]:
    op = rng.choice("+-*")
    a, b = (rng.randint(12, 99), rng.randint(3, 49)) if op != "*" else (rng.randint(3, 19), rng.randint(3, 12))
    a, b = (a, b) if op != "-" or a >= b else (b, a)
    right = a + b if op == "+" else a - b if op == "-" else a * b
    wrong = _wrong_number(rng, right)
    sign = {"+": "+", "-": "-", "*": "×"}[op]
    question = rng.choice((f"What is {a} {sign} {b}?", f"Compute {a} {sign} {b}.", f"{a} {sign} {b} = ?"))

    def answer(value: int) -> str:
        return f"{a} {sign} {b} = {value}." if verbose else str(value)

    return question, answer(right), answer(wrong)


def _letters(rng: random.Random, verbose: bool) -> tuple[str, str, str]:
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    right = word.count(letter)
    wrong = right + 1 if right == 1 or rng.random() < 0.5 else right - 1
    question = f"How many times does the letter '{letter}' appear in '{word}'?"

    def answer(value: int) -> str:
        if not verbose:
            return str(value)
        return f"The letter '{letter}' appears {value} time{'s' if value != 1 else ''} in '{word}'."

    return question, answer(right), answer(wrong)


def _items(rng: random.Random, verbose: bool) -> tuple[str, str, str]:
    item = rng.choice(ITEMS)
    start, given, bought = rng.randint(5, 30), rng.randint(1, 5), rng.randint(2, 12)
    right = start - given + bought
    wrong = _wrong_number(rng, right)
    question = (f"I had {start} {item}, gave {given} to a friend and then bought {bought} more. "
                f"How many {item} do I have now?")

    def answer(value: int) -> str:
        return f"{start} - {given} + {bought} = {value}, so you have {value} {item}." if verbose else f"{value} {item}."

    return question, answer(right), answer(wrong)


def _row(question: str, chosen: str, rejected: str, user: str) -> dict:
    return {"prompt": [{"role": "user", "content": question}],
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "user_id": user}


def make_rows(seed: int = 52, users: int = 80, prefix: str = "user", exclude=frozenset()) -> list[dict]:
    """The example's rows: ``users`` users with 2 to 8 rows each, in a seeded shuffled order."""
    rng = random.Random(seed)
    rows = []
    for u in range(1, users + 1):
        user, verbose = f"{prefix}-{u:03d}", rng.random() < 0.5
        kinds = rng.sample((_arithmetic, _letters, _items), rng.randint(1, 3))  # each user's favourite topics
        asked, target = set(), rng.randint(2, 8)
        while len(asked) < target:
            question, chosen, rejected = rng.choice(kinds)(rng, verbose)
            if question not in asked and (question, chosen, rejected) not in exclude:
                asked.add(question)
                rows.append(_row(question, chosen, rejected, user))
    rng.shuffle(rows)
    return rows


def _key(row: dict) -> tuple:
    return row["prompt"][0]["content"], row["chosen"][0]["content"], row["rejected"][0]["content"]


def write(out: Path = OUT, seed: int = 52, users: int = 80, prefix: str = "user", exclude=frozenset()) -> Path:
    """Write the rows (none of them in ``exclude``, keys (question, chosen, rejected))."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in make_rows(seed, users, prefix, exclude))
    out = Path(out)
    out.write_text(text, encoding="utf-8")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help="where to write (default: the shipped file)")
    parser.add_argument("--seed", type=int, default=52)
    args = parser.parse_args()
    out = write(args.out, args.seed)
    print(f"wrote {out}")
    if args.out == OUT:
        private = frozenset(_key(r) for r in make_rows(args.seed))  # the public rows share none of D's
        print(f"wrote {write(PUBLIC, 53, 30, 'public', private)}")
        public = frozenset(_key(r) for r in make_rows(53, 30, "public", private))
        print(f"wrote {write(HELDOUT, 54, 30, 'heldout', private | public)}")


if __name__ == "__main__":
    main()
