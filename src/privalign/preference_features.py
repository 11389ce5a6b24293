"""Policy features of a preference file's responses, by teacher forcing through the deployed policy.

Each row's prompt (its messages, through the policy's chat template) and its two responses give two
rows of raw features ``[h_last, h_mean, lp]`` (``rewards.policy_bt``), computed with the policy's
``featurize_many`` (``backends``: many prompt-response texts, one plain batched forward pass of 32
texts of similar length at a time) or, for any other featurizer, ``featurize``. Rows go to the
policy ordered by length (similar lengths pad least); ``progress`` reports the texts done.

Features are cached by content beside the file, in the folder ``FILE.features-MODEL/``: a text's
key is a digest of the model, its prompt messages and the response, so a second run, or a run on a
file that shares rows, reads them instead of recomputing. The folder holds part files
(``FeatureStore``), one written once and atomically whenever ``FLUSH_EVERY`` new texts are done:
an interrupted run keeps every part it finished, and memory holds one part's rows at a time, not the
file's. A cache of the older single-file form (``FILE.features-MODEL.npz``) is moved into the folder
as its first part. What ``featurize_table`` returns reads the rows from the parts only when asked
(``CachedRows``), a part at a time.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np

from .preferences.trl import PreferenceTable

FLUSH_EVERY = 256
SHARED_MIN = 4  # texts of one prompt from which its cache is shared
CHUNK = 4096    # rows read and mapped at a time


def cache_path(table: PreferenceTable, model: str) -> Path:
    """The cache folder beside the file (``FILE.features-MODEL``), or under
    ~/.cache/privalign/features/ when the file's folder cannot be written (an installed package's data)."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    name = f"{table.source.name}.features-{safe}"
    if os.access(table.source.parent, os.W_OK):
        return table.source.with_name(name)
    folder = Path.home() / ".cache" / "privalign" / "features"
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.blake2b(str(table.source.resolve()).encode(), digest_size=6).hexdigest()
    return folder / f"{digest}-{name}"


def text_key(model: str, messages: list[dict], response: str) -> str:
    body = json.dumps([model, messages, response], ensure_ascii=False, sort_keys=True)
    return hashlib.blake2b(body.encode("utf-8"), digest_size=16).hexdigest()


class FeatureStore:
    """Raw features by text key: in a folder of parts, ``part-ID.npy`` (float32 rows) and
    ``part-ID.keys.npy`` (their keys), each written once (the keys last, so a part without its keys
    file is unfinished and ignored); or in memory with ``folder=None``. ``code(key)`` is where a
    key's row lies, (part << 32) | row."""

    def __init__(self, folder: Path | None = None):
        self.folder, self.parts, self.index = folder, [], {}
        if folder is None:
            return
        legacy = folder.with_name(folder.name + ".npz")
        for keys_file in sorted(folder.glob("part-*.keys.npy")) if folder.is_dir() else ():
            raw_file = keys_file.with_name(keys_file.name[:-len(".keys.npy")] + ".npy")
            if raw_file.exists():
                self._add(np.load(keys_file).tolist(), raw_file)
        if legacy.exists():  # the older single-file cache becomes a part, once
            with np.load(legacy, allow_pickle=False) as z:
                self.append(z["keys"].tolist(), z["raw"])
            legacy.unlink()

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def code(self, key: str) -> int:
        return self.index[key]

    def _add(self, keys: list, source) -> None:
        part = len(self.parts)
        self.parts.append(source)
        for row, key in enumerate(keys):
            self.index.setdefault(key, (part << 32) | row)

    def append(self, keys: list, raw: np.ndarray) -> None:
        """Store the rows ``raw`` under ``keys``: one new part, written atomically."""
        raw = np.ascontiguousarray(raw, np.float32)
        if self.folder is None:
            return self._add(list(keys), raw)
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"part-{uuid.uuid4().hex}"
        for path, value in ((Path(f"{stem}.npy"), raw), (Path(f"{stem}.keys.npy"), np.array(keys, "U32"))):
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("wb") as f:
                np.save(f, value)
            tmp.replace(path)
        self._add(list(keys), Path(f"{stem}.npy"))

    def apply(self, f, codes: np.ndarray):
        """f(rows) for the rows at ``codes``, in their order: each distinct row read once, a part
        (and at most ``CHUNK`` rows) at a time, so memory holds one block of raw features."""
        codes = np.asarray(codes, np.int64)
        uniq, inverse = np.unique(codes, return_inverse=True)
        part, row = uniq >> 32, uniq & 0xFFFFFFFF
        out = []
        for sel in np.split(np.arange(uniq.size), np.flatnonzero(np.diff(part)) + 1):
            if not sel.size:
                continue
            source = self.parts[int(part[sel[0]])]
            rows = np.load(source, mmap_mode="r") if isinstance(source, Path) else source
            for lo in range(0, sel.size, CHUNK):
                out.append(np.asarray(f(np.asarray(rows[row[sel[lo:lo + CHUNK]]], np.float32))))
            del rows  # a memory map lets go of its pages when closed
        if not out:
            return np.asarray(f(np.zeros((0, self.width), np.float32)))[inverse]
        return np.concatenate(out)[inverse]

    @property
    def width(self) -> int:
        if not self.parts:
            return 0
        source = self.parts[0]
        return (np.load(source, mmap_mode="r") if isinstance(source, Path) else source).shape[1]


class CachedRows:
    """Rows of raw features held in a ``FeatureStore``, read only when used. Indexing by rows
    (a slice, a mask, indices) selects without reading; ``np.asarray`` reads them (float32);
    ``map_rows(f)`` is f applied block by block (what ``FeatureMap`` calls), and ``rows[:, j]`` reads
    one column the same way."""

    ndim = 2
    dtype = np.dtype(np.float32)

    def __init__(self, store: FeatureStore, codes: np.ndarray):
        self.store, self.codes = store, np.asarray(codes, np.int64)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.codes.size, self.store.width)

    def __len__(self) -> int:
        return self.codes.size

    def __getitem__(self, key):
        if isinstance(key, (int, np.integer)):
            return np.asarray(CachedRows(self.store, self.codes[[key]]))[0]
        if isinstance(key, tuple):
            rows, cols = key[0], key[1:]
            return self[rows].map_rows(lambda block: block[(slice(None), *cols)])
        return CachedRows(self.store, self.codes[key])

    def map_rows(self, f):
        return self.store.apply(f, self.codes)

    def __array__(self, dtype=None, copy=None):
        out = self.map_rows(lambda block: block)
        return out if dtype is None else out.astype(dtype)


def _plan_jobs(table: PreferenceTable, todo: dict, one_prompt: bool, many) -> list[tuple[bool, list[str]]]:
    """(one prompt's texts after its shared cache?, keys) per batch: texts of a prompt with at least
    ``SHARED_MIN`` of them to compute share its cache (``featurize``), the rest are batched by length."""
    by_prompt: dict[str, list[str]] = {}
    for key, (i, _) in todo.items():
        by_prompt.setdefault(json.dumps(table.prompts[i], sort_keys=True), []).append(key)
    jobs, single = [], []
    for ks in by_prompt.values():
        if one_prompt and (len(ks) >= SHARED_MIN or many is None):
            jobs += [(True, ks[lo:lo + 64]) for lo in range(0, len(ks), 64)]
        else:
            single += ks
    single.sort(key=lambda k: len(todo[k][1]) + len(json.dumps(table.prompts[todo[k][0]])))
    return jobs + [(False, single[lo:lo + 32]) for lo in range(0, len(single), 32)]


def featurize_table(table: PreferenceTable, policy, model: str, cache: bool = True, progress=None,
                    load_policy=None) -> tuple[CachedRows, CachedRows]:
    """(chosen raw features, rejected raw features), one row per pair, in the table's order, as
    ``CachedRows`` of the cache (``cache=False``: of memory). ``progress(done, total)``, when given, is
    called with the texts computed so far (the cached ones are not counted). ``policy`` may be None
    with ``load_policy()`` to build it only when a text is not cached.

    Each distinct text is computed once. Texts that share a prompt with at least ``SHARED_MIN`` others
    go through the policy's ``featurize`` (the prompt's forward pass once, then all its responses after
    a copy of its cache: 2.7x faster than one forward pass a text at 8 responses a prompt on 2 cores,
    docs/benchmarks.md); the rest through ``featurize_many`` (one plain forward pass a batch of texts of
    similar length). New rows go to disk every ``FLUSH_EVERY`` texts, as one new part."""
    store = FeatureStore(cache_path(table, model) if cache else None)
    keys = [(text_key(model, p, c), text_key(model, p, r)) for p, c, r in zip(table.prompts, table.chosen,
                                                                           table.rejected)]
    todo: dict[str, tuple[int, str]] = {}  # key -> (row whose prompt it has, response)
    for i, (kc, kr) in enumerate(keys):
        for key, text in ((kc, table.chosen[i]), (kr, table.rejected[i])):
            if key not in store and key not in todo:
                todo[key] = (i, text)
    if todo and policy is None:
        policy = load_policy()
    many = getattr(policy, "featurize_many", None)
    jobs = _plan_jobs(table, todo, hasattr(policy, "featurize"), many) if todo else []
    done, pending, rows = 0, [], []
    try:
        for shared, job in jobs:
            if shared:
                raw = policy.featurize(table.prompts[todo[job[0]][0]], [todo[k][1] for k in job])
            else:
                raw = many([(table.prompts[todo[k][0]], todo[k][1]) for k in job])
            pending += job
            rows.append(np.asarray(raw, np.float32))
            done += len(job)
            if progress is not None:
                progress(done, len(todo))
            if len(pending) >= FLUSH_EVERY:
                store.append(pending, np.concatenate(rows))
                pending, rows = [], []
    finally:
        if pending:
            store.append(pending, np.concatenate(rows))
    return tuple(CachedRows(store, np.array([store.code(k[j]) for k in keys], np.int64)) for j in (0, 1))
