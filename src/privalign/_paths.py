"""Output targets, checked before any work starts: privalign never destroys what it did not write.

A results directory may hold files privalign did not write. privalign's own files there are listed
in its manifest ``.privalign-results.json``; a run replaces only those (``report.results.
atomic_directory``) and leaves every other file and folder alone, and says which (``left_alone``).
It refuses only where keeping both is impossible: a user's file with the name of a file the run
writes. A file target (a pool, a model) may replace an existing file only when that file is one
privalign wrote of the same kind.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = ".privalign-results.json"
MANIFEST_BODY = {"kind": "privalign-results", "format": 2,
                 "note": "written by privalign; a later run with --out here replaces the files listed under files, "
                         "and leaves every other file alone"}


class OutputError(ValueError):
    """An output target that privalign refuses to write (the message names the path and why)."""


def _manifest(path: Path) -> dict | None:
    try:
        body = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("kind") == "privalign-results" else None


def is_results_dir(path: Path) -> bool:
    """True when ``path`` is a directory holding privalign's results manifest."""
    return _manifest(path) is not None


def owned_files(path: Path) -> set[str] | None:
    """The files (relative paths) privalign's manifest in ``path`` lists as its own; None where the
    folder has no manifest, or one from before manifests listed their files."""
    body = _manifest(path)
    files = body.get("files") if body else None
    return set(files) if isinstance(files, list) else None


def write_manifest(directory: Path, files=()) -> None:
    (Path(directory) / MANIFEST).write_text(json.dumps({**MANIFEST_BODY, "files": sorted(files)}) + "\n")


def left_alone(path: str | Path) -> list[str]:
    """The top-level entries of a results folder that privalign did not write (and so left alone)."""
    path = Path(path)
    owned = owned_files(path) or set()
    tops = {f.split("/")[0] for f in owned}
    out = []
    for p in sorted(path.iterdir()) if path.is_dir() else []:
        if p.name == MANIFEST or p.name in owned:
            continue
        if p.is_dir() and p.name in tops:  # privalign's folder: what in it is not privalign's
            out += [str(q.relative_to(path)) for q in sorted(p.rglob("*"))
                    if q.is_file() and str(q.relative_to(path)) not in owned]
            continue
        out.append(p.name)
    return out


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

    Refused: an existing file; the working directory or one of its ancestors; an input that is one
    of privalign's own files there (the run would replace it); a parent that is a file or not
    writable. A folder holding files privalign did not write is fine: they are left alone.
    """
    raw = str(path)
    path = Path(path).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if path == cwd or path in cwd.parents:
        raise OutputError(f"{option} {raw!r} is the working directory or contains it; name a folder for the "
                          f"results (e.g. {option} results/run)")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{option} {raw}: a file of that name exists; a results directory goes there")
    owned = owned_files(path) if path.is_dir() else None
    for i in inputs:
        if i is None:
            continue
        rel = Path(i).expanduser().resolve()
        if path in rel.parents and (owned is None and is_results_dir(path) or str(rel.relative_to(path)) in
                                    (owned or ())):
            raise OutputError(f"{option} {raw} holds the input {i} as one of privalign's own results, which this "
                              "run would replace: copy it elsewhere first")
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


def hold_output(target: str | Path, *, option: str = "--out"):
    """Hold ``target`` (a pool file or a results folder) for this run alone, with an exclusive lock on
    the sibling file ``.NAME.lock``, which holds the run's pid; returns the function that lets it go.
    A second run is refused (OutputError, one line with the holder's pid). The lock is the
    operating system's (``flock``): a run that dies lets it go, and a lock file left behind by one
    is taken over."""
    import fcntl

    target = Path(target).expanduser().resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = target.parent / f".{target.name}.lock"
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise OutputError(f"{option} {target}: another run (pid {pid}) is writing it; wait for that run to "
                              f"end, or name another {option}") from None
        try:
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:  # not removed by a run that just let it go
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())

    def release() -> None:
        try:
            lock.unlink()
        except OSError:
            pass
        os.close(fd)

    return release
