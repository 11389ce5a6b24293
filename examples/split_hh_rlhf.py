"""Split the 1,500 HH-RLHF harmless-base test pairs in ../shared/data/hh-rlhf/ into public, train and
held-out files (issue 52's evidence on real human preferences; docs/experiments.md).

    python examples/split_hh_rlhf.py [--source PATH] [--out results/hh-rlhf] [--seed 0]

The rows are shuffled with numpy's default_rng(seed) and cut into 150 public pairs (the feature
map and the settings are chosen on them, as a curator's own data would be), 247 held-out pairs and
the rest as the private train file. The pairs name no person: train with --privacy-unit row
(each pair its own person). Rows whose chosen or rejected answer is empty (4 of the 1,500) are
left out, as ``read_preferences(..., drop_empty=True)`` would.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT.parent / "shared" / "data" / "hh-rlhf" / "harmless-base-test-1500.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path, default=SOURCE)
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "hh-rlhf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--public", type=int, default=150)
    ap.add_argument("--heldout", type=int, default=247)
    args = ap.parse_args()
    rows = [json.loads(line) for line in args.source.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["chosen"].strip() and r["rejected"].strip() and r["chosen"] != r["rejected"]]
    order = np.random.default_rng(args.seed).permutation(len(rows))
    parts = {"public": order[:args.public], "heldout": order[args.public:args.public + args.heldout],
             "train": order[args.public + args.heldout:]}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, idx in parts.items():
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(rows[i], ensure_ascii=False) + "\n" for i in sorted(idx)))
        print(f"wrote {path}: {len(idx)} pairs")


if __name__ == "__main__":
    main()
