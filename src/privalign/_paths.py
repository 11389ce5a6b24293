"""Output targets, checked before any work starts: privalign never destroys what it did not write.

A results directory is replaced whole when a run completes (``report.results.atomic_directory``),
so it may be written only when it does not exist, is empty, or carries the manifest
``.privalign-results.json`` that privalign writes into each one. A file target (a pool, a model)
may replace an existing file only when that file is one privalign wrote of the same kind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = ".privalign-results.json"
MANIFEST_BODY = {"kind": "privalign-results", "format": 1,
                 "note": "written by privalign; a later run with --out here replaces this directory whole"}


class OutputError(ValueError):
    """An output target that privalign refuses to write (the message names the path and why)."""


def is_results_dir(path: Path) -> bool:
    """True when ``path`` is a directory holding privalign's results manifest."""
    try:
        return json.loads((path / MANIFEST).read_text()).get("kind") == "privalign-results"
    except (OSError, ValueError, AttributeError):
        return False


def write_manifest(directory: Path) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps(MANIFEST_BODY) + "\n")


def _writable_parent(path: Path, option: str) -> None:
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{option} {path}: {parent} is not writable")


def check_output_dir(path: str | Path, *, option: str = "--out", inputs=()) -> Path:
    """The absolute results directory ``path``, or OutputError when writing it could lose data.

    Refused: an existing file; a non-empty directory without privalign's manifest; the working
    directory or one of its ancestors; a directory that holds one of ``inputs`` (it would be
    replaced with them inside); a parent that is a file or not writable.
    """
    raw = str(path)
    path = Path(path).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise OutputError(f"{option} {raw!r} is the working directory or contains it; a results directory is "
                          f"replaced whole, so name a new folder (e.g. {option} results/run)")
    if path.exists():
        if not path.is_dir():
            raise OutputError(f"{option} {raw}: a file of that name exists; a results directory goes there")
        if any(path.iterdir()) and not is_results_dir(path):
            raise OutputError(f"{option} {raw} is a non-empty directory that privalign did not write (no {MANIFEST}); "
                              f"it would be replaced whole: name a new or empty folder")
    for i in inputs:
        if i is not None and path in Path(i).expanduser().resolve().parents:
            raise OutputError(f"{option} {raw} contains the input {i}, which replacing it would delete")
    _writable_parent(path, option)
    return path


def _parquet_is_pool(path: Path) -> bool:
    try:
        import pyarrow.parquet as pq

        return b"privalign" in (pq.read_schema(path).metadata or {})
    except Exception:  # not Parquet, unreadable, or pyarrow missing: not a pool privalign wrote
        return False


def _json_is_model(path: Path) -> bool:
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and (isinstance(body.get("kind"), str) or "PRIVATE" in body)


_KINDS = {"pool": _parquet_is_pool, "model": _json_is_model}


def check_output_file(path: str | Path, kind: str, *, option: str = "--out") -> Path:
    """The absolute file target ``path``, or OutputError when writing it could lose data.

    ``kind`` is ``"pool"`` (Parquet with privalign's metadata) or ``"model"`` (a privalign model
    JSON): an existing file is replaced only when it is one of those; a directory never is.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    raw = str(path)
    path = Path(path).expanduser().resolve()
    if path.is_dir():
        raise OutputError(f"{option} {raw} is a directory; a {kind} file goes there")
    if path.exists() and not _KINDS[kind](path):
        raise OutputError(f"{option} {raw} exists and is not a {kind} privalign wrote; "
                          f"refusing to overwrite it (move it away or name another file)")
    _writable_parent(path, option)
    return path
