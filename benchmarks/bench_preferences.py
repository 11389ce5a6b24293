"""``privalign rm train --preferences`` on 100k pairs with cached features: time and peak memory (issue 52).

Run: ``.venv/bin/python benchmarks/bench_preferences.py [--pairs 100000] [--persons 20000]
[--public-pairs 2000] [--dir DIR] [--repeat 2]``

Writes a synthetic TRL file (conversational, explicit prompts, a ``user_id`` column) of ``--pairs``
pairs from ``--persons`` persons (each person one pair, the rest spread uniformly: 1 + Poisson(4)
pairs a person at the defaults), a public file of ``--public-pairs`` pairs from 500 other persons,
and fills both files' feature caches beforehand with synthetic raw features: rows of SmolLM2's width
(2 x 576 + 1, float32; Gaussian hidden states with a planted direction that tells chosen from
rejected, a negative log-probability), written with ``preference_features.FeatureStore`` in parts of
256 texts as the featurizer writes them. The features do not come from a model: this measures
training from cached features (reading both files, the keys, the cache, the choice on the public
file, bounding, the feature map on D, the fit, writing the head), not featurizing. The command

    privalign rm train --preferences D --privacy-unit user_id --public PUBLIC --max-pairs-per-person 4 --out H

then runs as a subprocess, timed end to end, with its peak RSS (``getrusage`` of the children).
The target is <= 60 s on 2 cores. The files are kept in ``--dir`` (default a folder under /tmp) and
reused by a later run with the same sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from privalign.preference_features import FLUSH_EVERY, FeatureStore, cache_path, text_key
from privalign.preferences.trl import read_preferences

HIDDEN = 576  # SmolLM2-135M's hidden size: raw rows of 2 * 576 + 1
MODEL = "smollm2"


def write_file(path: Path, pairs: int, persons: int, prefix: str, rng: np.random.Generator) -> None:
    """``pairs`` rows from ``persons`` persons, every person at least one; every prompt distinct."""
    who = np.concatenate([np.arange(persons), rng.integers(0, persons, pairs - persons)])
    rng.shuffle(who)
    with path.open("w") as f:
        for i, p in enumerate(who):
            a, b = int(rng.integers(10, 5000)), int(rng.integers(10, 5000))
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"[{prefix}{i}] What is {a} + {b}?"}],
                                "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}."}],
                                "rejected": [{"role": "assistant", "content": f"{a} + {b} = {a + b + 1 + i % 7}."}],
                                "user_id": f"{prefix}{p}"}) + "\n")


def fill_cache(path: Path, rng: np.random.Generator) -> int:
    """Synthetic raw features for every text of the file, in parts of FLUSH_EVERY texts; returns the
    number of texts."""
    table = read_preferences(path, "user_id")
    keys, chosen = [], []
    for p, c, r in zip(table.prompts, table.chosen, table.rejected):
        keys += [text_key(MODEL, p, c), text_key(MODEL, p, r)]
        chosen += [1.0, -1.0]
    store = FeatureStore(cache_path(table, MODEL))
    direction = rng.standard_normal(HIDDEN).astype(np.float32)
    direction /= np.linalg.norm(direction)
    for lo in range(0, len(keys), FLUSH_EVERY):
        n = min(FLUSH_EVERY, len(keys) - lo)
        sign = np.asarray(chosen[lo:lo + n], np.float32)[:, None]
        raw = rng.standard_normal((n, 2 * HIDDEN + 1), dtype=np.float32)
        raw[:, HIDDEN:2 * HIDDEN] += 1.5 * sign * direction
        raw[:, -1] = -rng.gamma(2.0, 0.5, n)
        store.append(keys[lo:lo + n], raw)
    return len(keys)


def prepare(folder: Path, pairs: int, persons: int, public_pairs: int) -> tuple[Path, Path]:
    d, public = folder / "prefs.jsonl", folder / "public.jsonl"
    stamp = folder / "sizes.json"
    sizes = {"pairs": pairs, "persons": persons, "public_pairs": public_pairs}
    if stamp.exists() and json.loads(stamp.read_text()) == sizes:
        return d, public
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    for path, n, p, prefix in ((d, pairs, persons, "u"), (public, public_pairs, 500, "pub")):
        write_file(path, n, p, prefix, rng)
        t = time.perf_counter()
        texts = fill_cache(path, rng)
        print(f"{path.name}: {n:,} pairs, {texts:,} texts cached in {time.perf_counter() - t:.0f} s", flush=True)
    stamp.write_text(json.dumps(sizes))
    return d, public


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=100_000)
    ap.add_argument("--persons", type=int, default=20_000)
    ap.add_argument("--public-pairs", type=int, default=2_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "privalign-bench-preferences")
    a = ap.parse_args()
    d, public = prepare(a.dir, a.pairs, a.persons, a.public_pairs)
    cmd = [sys.executable, "-m", "privalign", "rm", "train", "--preferences", str(d), "--privacy-unit", "user_id",
           "--public", str(public), "--max-pairs-per-person", "4", "--out", str(a.dir / "head.json")]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    print("command: " + " ".join(["privalign", *cmd[3:]]))
    for run in range(a.repeat):
        for name in ("head.json", "head.private.json"):
            (a.dir / name).unlink(missing_ok=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        seconds = time.perf_counter() - t
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode:
            sys.exit(f"rm train failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        # ru_maxrss of the children is the largest any child reached (KiB on Linux)
        print(f"run {run + 1}: {seconds:.1f} s wall, {cpu:.1f} s CPU, peak RSS {after.ru_maxrss / 1024:.0f} MiB "
              f"(target <= 60 s)", flush=True)
    print(" ".join((done.stdout + done.stderr).split())[:300])


if __name__ == "__main__":
    main()
