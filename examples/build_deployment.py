"""A deployment's preference file with thousands of persons, from a graded train pool (issue 49).

    python examples/build_deployment.py results/deploy/counting-train-256.parquet --out results/deploy

The pool is ``privalign generate --task counting --split train --samples 256 --seed 3 --sampler shared``:
counting's 148 train prompts, 256 graded samples each. This script plays the people who judged those
samples, as in a deployment where many users meet the same questions, and writes three files in TRL's
conversational format with an explicit prompt (the task's whole chat prompt, its worked examples
included, so that a pair's policy features are those the policy has when it answers that prompt):

- ``public.jsonl``: 150 persons (``public-NNN``) on the first 20 prompts of a fixed shuffle (seed 49):
  the data ``rm train --public`` may use without protection;
- ``heldout.jsonl``: 300 persons (``heldout-NNN``) on the next 20 prompts, for ``rm evaluate``;
- ``deployment.jsonl``: 4,800 persons (``user-NNNNN``) on the other 108 prompts: 85% of persons judged
  one prompt and 15% two, 16 pairs each (8 a prompt for two).

A person's pairs are distinct (right, wrong) pairs of distinct response texts of their prompt, drawn
at random from all such pairs (the judge preferred the right answer); two persons may judge the same
pair. Prompts whose samples are all right or all wrong give no pair and get no person. The output is a
function of the pool and the seed alone (seed 49).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from privalign.pools import load_pool
from privalign.tasks import get_task

PROMPTS = {"public": 20, "heldout": 20}  # the deployment has the rest
PERSONS = {"public": 150, "heldout": 300, "deployment": 4800}
PAIRS_PER_PERSON = 16
TWO_PROMPTS = 0.15


def distinct_pairs(responses, correct) -> list[tuple[str, str]]:
    """Every (right, wrong) pair of distinct, non-empty response texts of one prompt."""
    right = sorted({r for r, c in zip(responses, correct) if c > 0 and r.strip()})
    wrong = sorted({r for r, c in zip(responses, correct) if c <= 0 and r.strip()} - set(right))
    return [(a, b) for a in right for b in wrong]


def build(pool_path: Path, out: Path, seed: int = 49, persons: dict | None = None) -> dict:
    persons = {**PERSONS, **(persons or {})}
    pool = load_pool(pool_path)
    task = get_task(pool.metadata["task"])
    problems = {p.id: p for p in task.load(pool.metadata.get("split", "train"))}
    pid = np.asarray(pool.columns["prompt_id"], str)
    responses = np.asarray(pool.columns["response"], object)
    correct = np.asarray(pool.columns["true_reward"], float)
    ids = list(dict.fromkeys(pid.tolist()))
    rng = np.random.default_rng(seed)
    order = [ids[i] for i in rng.permutation(len(ids))]
    cut = np.cumsum([0, PROMPTS["public"], PROMPTS["heldout"]])
    groups = {"public": order[cut[0]:cut[1]], "heldout": order[cut[1]:cut[2]], "deployment": order[cut[2]:]}
    pairs = {q: distinct_pairs(["" if r is None else str(r) for r in responses[pid == q]], correct[pid == q])
             for q in ids}
    out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name, prompts in groups.items():
        usable = [q for q in prompts if pairs[q]]
        lines = []
        for j in range(persons[name]):
            user = f"user-{j:05d}" if name == "deployment" else f"{name}-{j:03d}"
            two = name == "deployment" and len(usable) > 1 and rng.random() < TWO_PROMPTS
            mine = rng.choice(len(usable), 2 if two else 1, replace=False)
            for q in (usable[i] for i in mine):
                k = min(PAIRS_PER_PERSON // len(mine), len(pairs[q]))
                for i in sorted(rng.choice(len(pairs[q]), k, replace=False)):
                    a, b = pairs[q][i]
                    lines.append(json.dumps({"prompt": task.messages(problems[q]),
                                             "chosen": [{"role": "assistant", "content": a}],
                                             "rejected": [{"role": "assistant", "content": b}], "user_id": user,
                                             "prompt_id": q}))
        (out / f"{name}.jsonl").write_text("".join(line + "\n" for line in lines))
        counts[name] = {"prompts": len(usable), "pairs": len(lines), "persons": persons[name]}
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("pool", type=Path)
    ap.add_argument("--out", type=Path, default=Path("results/deploy"))
    ap.add_argument("--seed", type=int, default=49)
    a = ap.parse_args()
    for name, c in build(a.pool, a.out, a.seed).items():
        print(f"wrote {a.out / (name + '.jsonl')}: {c['pairs']:,} pairs, {c['persons']:,} persons, "
              f"from {c['prompts']:,} prompts")


if __name__ == "__main__":
    main()
