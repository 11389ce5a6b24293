"""A results directory: machine-readable tables, settings and figures, written atomically.

Everything is first written into a temporary sibling directory, whose files are moved into ``out``
only when complete; an interruption (Ctrl-C included) removes the temporary directory and leaves no
half-written result files. ``out`` is checked first (``privalign._paths.check_output_dir``). Only
privalign's own files there (those its manifest ``.privalign-results.json`` lists) are replaced or,
when this run no longer writes them, removed; every other file and folder is left alone.
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

from .._paths import MANIFEST, OutputError, check_output_dir, is_results_dir, owned_files, write_manifest

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
    """Yield a temporary directory whose files become privalign's files in ``out`` on success; it
    vanishes on failure. ``out``'s other files are left alone.

    Raises ``OutputError`` before anything is created when ``out`` may not be written, and after the
    run (its results kept in the temporary directory, named) where a user's file has the name of one
    of its files."""
    out = check_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        check_output_dir(out)  # again: the folder may have changed while the run worked
        _install(tmp, out)
    except OutputError as e:
        raise OutputError(f"{e} (this run's results are kept in {tmp})") from None
    shutil.rmtree(tmp, ignore_errors=True)


def _clash(out: Path, rel: str, owned: set[str], older: bool) -> str | None:
    """Where the result ``rel`` would replace something that is not privalign's: a folder or a user's
    file at its path, or a file where one of its folders goes."""
    target = out / rel
    for q in target.parents:
        if q == out:
            break
        if q.exists() and not q.is_dir():
            return str(q.relative_to(out))
    if target.is_dir() or (target.exists() and not older and rel not in owned):
        return rel
    return None


def _install(tmp: Path, out: Path) -> None:
    """Move the run's files from ``tmp`` into ``out``, replacing privalign's own files there and
    removing those of an earlier run that this one does not write; list them in the manifest."""
    new = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file() and p.name != MANIFEST)
    owned = owned_files(out) if out.is_dir() else set()
    older = owned is None and is_results_dir(out)  # a manifest from before manifests listed files: same names are ours
    for rel in new:  # check every file first: a user's file of the same name cannot be kept beside ours
        clash = _clash(out, rel, owned or set(), older)
        if clash is not None:
            raise OutputError(f"--out {out}: {clash} is not privalign's and has the name of a result this run "
                              "writes; move it away and rerun")
    out.mkdir(parents=True, exist_ok=True)
    for rel in new:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).replace(out / rel)
    for rel in sorted((owned or set()) - set(new)):  # an earlier run's files this run does not write
        stale = out / rel
        if stale.is_file():
            stale.unlink()
            for parent in stale.parents:  # and the folders they leave empty, up to out
                if parent == out or any(parent.iterdir()):
                    break
                parent.rmdir()
    write_manifest(out, new)
