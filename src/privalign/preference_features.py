"""Policy features of a preference file's responses, by teacher forcing through the deployed policy.

Each row's prompt (its messages, through the policy's chat template) and its two responses give two
rows of raw features ``[h_last, h_mean, lp]`` (``rewards.policy_bt``), computed with the policy's
``featurize_many`` (``backends``: many prompt-response texts, one plain batched forward pass of 32
texts of similar length at a time) or, for any other featurizer, ``featurize``. Rows go to the
policy ordered by length (similar lengths pad least); ``progress`` reports the texts done.
Features are cached by content beside the file (``FILE.features-MODEL.npz``): a text's key is a digest of the model, its prompt messages and the response, so a second run, or a
run on a file that shares rows, reads them instead of recomputing; the cache is written every few
hundred rows, so an interrupted run resumes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .preferences.trl import PreferenceTable

FLUSH_EVERY = 256


def cache_path(table: PreferenceTable, model: str) -> Path:
    """Beside the file (``FILE.features-MODEL.npz``), or under ~/.cache/privalign/features/ when the
    file's folder cannot be written (an installed package's data, say)."""
    import os

    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in model)
    name = f"{table.source.name}.features-{safe}.npz"
    if os.access(table.source.parent, os.W_OK):
        return table.source.with_name(name)
    folder = Path.home() / ".cache" / "privalign" / "features"
    folder.mkdir(parents=True, exist_ok=True)
    digest = hashlib.blake2b(str(table.source.resolve()).encode(), digest_size=6).hexdigest()
    return folder / f"{digest}-{name}"


def text_key(model: str, messages: list[dict], response: str) -> str:
    body = json.dumps([model, messages, response], ensure_ascii=False, sort_keys=True)
    return hashlib.blake2b(body.encode("utf-8"), digest_size=16).hexdigest()


def _load_cache(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        return {}
    with np.load(path, allow_pickle=False) as z:
        return dict(zip(z["keys"].tolist(), z["raw"]))


def _save_cache(path: Path, cache: dict[str, np.ndarray]) -> None:
    if not cache:
        return
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, keys=np.array(list(cache), dtype="U32"), raw=np.stack(list(cache.values())).astype(np.float32))
    tmp.replace(path)


def featurize_table(table: PreferenceTable, policy, model: str, cache: bool = True,
                    progress=None) -> tuple[np.ndarray, np.ndarray]:
    """(chosen raw features, rejected raw features), one row per pair, in the table's order.
    ``progress(done, total)``, when given, is called with the texts computed so far (the cached ones
    are not counted): the CLI shows it with its progress display."""
    path = cache_path(table, model)
    known = _load_cache(path) if cache else {}
    keys = [(text_key(model, p, c), text_key(model, p, r)) for p, c, r in zip(table.prompts, table.chosen,
                                                                           table.rejected)]
    todo = [i for i, (kc, kr) in enumerate(keys) if kc not in known or kr not in known]
    todo.sort(key=lambda i: len(table.chosen[i]) + len(table.rejected[i]) + len(json.dumps(table.prompts[i])))
    many = getattr(policy, "featurize_many", None)
    done = 0
    try:
        for start in range(0, len(todo), FLUSH_EVERY):
            chunk = todo[start:start + FLUSH_EVERY]
            for lo in range(0, len(chunk), 16):  # 32 texts of similar length a forward pass
                rows = chunk[lo:lo + 16]
                if many is not None:
                    raw = np.asarray(many([(table.prompts[i], t) for i in rows
                                           for t in (table.chosen[i], table.rejected[i])]), np.float32)
                else:  # any PolicyFeaturizer: one prompt, its two responses, a call
                    raw = np.concatenate([np.asarray(policy.featurize(table.prompts[i], [table.chosen[i],
                                                                                         table.rejected[i]]),
                                                     np.float32) for i in rows])
                for j, i in enumerate(rows):
                    known[keys[i][0]], known[keys[i][1]] = raw[2 * j], raw[2 * j + 1]
                done += 2 * len(rows)
                if progress is not None:
                    progress(done, 2 * len(todo))
            if cache:
                _save_cache(path, known)
    finally:
        if cache and todo:
            _save_cache(path, known)
    chosen = np.stack([known[kc] for kc, _ in keys]).astype(np.float64)
    rejected = np.stack([known[kr] for _, kr in keys]).astype(np.float64)
    return chosen, rejected
