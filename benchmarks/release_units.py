"""What a release of the counting head keeps of BoN's lift, by unit of privacy (issue 28).

    .venv/bin/python benchmarks/release_units.py results/pools/counting-train.parquet \
        results/pools/counting-test.parquet [--draws 60]

The train pool is `make pools`' counting train pool (features recorded), the test pool the shipped
counting pool with features from `privalign featurize`. Rows:
- "pairs, k": the certificate at a fixed number of pairs m (every fit pair kept), with k pairs per
  person (P = m / k): Delta_r = 4k/(m lambda). k = 1 is the legacy pair unit.
- "person (k = 16)": privalign's unit, a person = a train prompt's grader (P = fit prompts).
Accuracy is BoN at n = 16 by its exact law, averaged over release draws, with the 5th percentile.
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np

from privalign.pipeline import pool_features
from privalign.pools import load_pool
from privalign.rewards.policy_bt import train_policy_bt
from privalign.rewards.release import release_accuracy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("train")
    ap.add_argument("test")
    ap.add_argument("--draws", type=int, default=60)
    ap.add_argument("--epsilons", default="0.3,1,3,10")
    a = ap.parse_args()
    tr, te = load_pool(a.train), load_pool(a.test)
    raw_tr, raw_te = pool_features(tr, a.train), pool_features(te, a.test)
    pid, y = te.columns["prompt_id"], te.columns["true_reward"]
    kw = dict(task="counting", range_epsilon=0.0, pairs_per_prompt=64)
    heads = {}
    for k in (1, 4, 16):  # the pair view: m pairs fixed, k of them per person
        m, _ = train_policy_bt(raw_tr, tr.columns["prompt_id"], tr.columns["true_reward"], unit="pair",
                               pairs_per_person=k, **kw)
        m.meta = {**m.meta, "persons": m.m // k, "head_id": "study",
                  "procedure": {**m.meta["procedure"], "unit": "person"}}  # studied as P = m / k persons
        heads[f"pairs (m = {m.m}), k = {k}"] = m
    m, _ = train_policy_bt(raw_tr, tr.columns["prompt_id"], tr.columns["true_reward"], pairs_per_person=16, **kw)
    heads[f"person (P = {m.meta['persons']}), k = 16"] = m
    print(f"| unit | lambda | Delta_r | " + " | ".join(f"eps_w = {e}" for e in a.epsilons.split(",")) + " |")
    print("|---|---|---|" + "---|" * len(a.epsilons.split(",")))
    for name, h in heads.items():
        cells = []
        for e in a.epsilons.split(","):
            r = release_accuracy(h, raw_te, pid, y, float(e), 1e-6, 16, a.draws, np.random.default_rng(0))
            cells.append(f"{r['mean']:.3f} ({r['p5']:.3f}); {r['share_mean']:.0%} ({r['share_p5']:.0%})")
        print(f"| {name} | {h.lam:g} | {h.sensitivity:.3g} | " + " | ".join(cells) + " |")
    print(f"BoN (n = 16) with the exact person-unit head {r['bon']:.3f}, base policy {r['base']:.3f}")


if __name__ == "__main__":
    main()
