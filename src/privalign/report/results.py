"""A results directory: machine-readable tables, settings and figures, written atomically.

Everything is first written into a temporary sibling directory, which replaces ``out`` only when
complete; an interruption (Ctrl-C included) removes the temporary directory and leaves no
half-written result files. ``out`` is checked first (``privalign._paths.check_output_dir``): only a
new or empty folder, or one privalign wrote (it carries the manifest ``.privalign-results.json``), is
ever replaced.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import shutil
import tempfile
from pathlib import Path

import numpy as np

from .._paths import check_output_dir, write_manifest

SUMMARY_COLUMNS = ("algorithm", "n", "accuracy", "accuracy_se", "lift", "lift_se", "lift_rel", "lift_rel_se",
                   "proxy_reward", "proxy_reward_se", "win_rate", "win_rate_se", "true_win_rate",
                   "true_win_rate_se", "hacking_gap", "hacking_gap_se", "halting_time", "halting_time_se",
                   "fallback", "fallback_se", "epsilon", "epsilon_se", "epsilon_spent", "sigma", "base_accuracy",
                   "prompts")


def _clean(v):
    if isinstance(v, (np.floating, float)):
        v = float(v)
        return None if math.isnan(v) else ("inf" if math.isinf(v) else v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    if isinstance(v, dict):
        return {k: _clean(x) for k, x in v.items()}
    if isinstance(v, np.ndarray):
        return [_clean(x) for x in v.tolist()]
    return v


def write_csv(path: Path, rows: list[dict], columns=None) -> None:
    columns = list(columns or dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in columns})


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(_clean(obj), indent=2) + "\n")


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    for r in rows:
        for k, v in r.items():
            try:
                r[k] = int(v) if k in ("n", "prompts", "seed", "queries") else float(v)
            except (TypeError, ValueError):
                pass
    return rows


@contextlib.contextmanager
def atomic_directory(out: str | Path):
    """Yield a temporary directory that becomes ``out`` on success and vanishes on failure.

    Raises ``OutputError`` before anything is created when ``out`` may not be replaced."""
    out = check_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write_manifest(tmp)
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        check_output_dir(out)  # again: the folder may have changed while the run worked
    except ValueError as e:
        raise type(e)(f"{e} (this run's results are kept in {tmp})") from None
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
