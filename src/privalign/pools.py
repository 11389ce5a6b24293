"""Response pools: one row per sampled response, stored as Parquet.

Columns: ``prompt_id``, ``sample_id``, one ``reward:<name>`` column per reward model,
``true_reward`` in [0, 1] (correctness for math tasks, or a gold reward model's score mapped to
[0, 1]), and optional ``response``, ``answer``, ``logprob``. Pool-level metadata (task, base model,
reward models, sampling settings, ``true_reward_source``: ``"grader"`` or ``"gold"``) travels in
the Parquet schema metadata under the key ``privalign``.

JSONL input is accepted in the same long layout (one row per line) and in the layout of the paper
authors' public scripts, one prompt per line:
``{"prompt", "gt_answer", "responses": [{"text", "predicted_answer", "is_correct", "proxy_reward"}]}``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REWARD_PREFIX = "reward:"
HEAD_FEATURES_PREFIX = "phi:"  # phi:<reward>:<j>, a certified head's feature coordinates (Pool.head_features)
REQUIRED = ("prompt_id", "sample_id", "true_reward")
OPTIONAL_TEXT = ("response", "answer", "prompt")
NUMERIC = ("true_reward", "logprob", "n_tokens")  # and every reward:<name> and phi:<name>:<j>
KNOWN = REQUIRED + OPTIONAL_TEXT + NUMERIC  # any other column is the user's own: kept, named by info()


class PoolError(ValueError):
    """A malformed pool; the message lists the offending rows."""


@dataclass
class Pool:
    """Columns as numpy arrays (one entry per response) plus metadata."""

    columns: dict[str, np.ndarray]
    metadata: dict = field(default_factory=dict)
    lines: np.ndarray | None = None  # a JSONL pool's line number of each row (problems name lines, not rows)

    # ------------------------------------------------------------------ basic views
    @property
    def n_rows(self) -> int:
        return len(self.columns["prompt_id"])

    @property
    def extra_columns(self) -> list[str]:
        """The columns privalign does not read: the user's own (a user_id, a split), kept as they are."""
        return [c for c in self.columns if c not in KNOWN and not c.startswith((REWARD_PREFIX, HEAD_FEATURES_PREFIX))]

    @property
    def reward_names(self) -> list[str]:
        return [c[len(REWARD_PREFIX):] for c in self.columns if c.startswith(REWARD_PREFIX)]

    def reward(self, name: str | None = None) -> np.ndarray:
        names = self.reward_names
        if not names:
            raise PoolError("the pool has no reward column (reward:<name>)")
        if name is None:
            name = self.metadata.get("default_reward", names[0])
        if name not in names:
            raise PoolError(f"reward {name!r} not in the pool; it has {names}")
        return self.columns[REWARD_PREFIX + name]

    def head_features(self, name: str) -> np.ndarray | None:
        """phi(x, y) of the certified head ``name``, shape (rows, d), from the columns ``phi:<name>:<j>``
        (``privalign score --head-features``): the head's score is phi . w, and a released head's is
        phi . w~. None when the pool does not carry them."""
        prefix = f"{HEAD_FEATURES_PREFIX}{name}:"
        cols = sorted((int(c[len(prefix):]), c) for c in self.columns if c.startswith(prefix))
        if not cols:
            return None
        return np.column_stack([np.asarray(self.columns[c], np.float64) for _, c in cols])

    def subset_rows(self, mask: np.ndarray) -> "Pool":
        """The rows where ``mask`` holds (every column), with the same metadata."""
        return Pool({k: v[mask] for k, v in self.columns.items()}, self.metadata,
                    None if self.lines is None else self.lines[mask])

    def grouped(self, reward: str | None = None) -> "GroupedPool":
        """Rows grouped by prompt (stable order): flat arrays plus offsets, read-only.

        A pool whose rows already come prompt by prompt in increasing prompt_id (as ``save`` and
        the pipeline write them) is grouped as views of its columns, with no sort and no copy.
        """
        pid = self.columns["prompt_id"]
        proxy = np.asarray(self.reward(reward), float)
        true = np.asarray(self.columns["true_reward"], float)
        if _non_decreasing(pid):
            starts = np.flatnonzero(np.r_[True, pid[1:] != pid[:-1]])
            ids = pid[starts]
        else:
            rank = _sorted_codes(pid)  # the order of np.argsort(pid, kind="stable"), on integers (fast)
            order = np.argsort(rank, kind="stable")
            r = rank[order]
            starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
            ids, proxy, true = pid[order[starts]], proxy[order], true[order]
        return GroupedPool(prompt_ids=ids, offsets=np.r_[starts, len(pid)],
                           proxy=_read_only(proxy), true=_read_only(true))

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[str]:
        """Everything wrong with the pool, each message naming the rows (up to 10 each)."""
        out = []
        for col in REQUIRED:
            if col not in self.columns:
                out.append(f"missing required column {col!r}")
        if out:  # nothing else can be checked by row
            return out + ([] if self.reward_names else ["no reward column: expected at least one 'reward:<name>' column"])
        n = self.n_rows
        if not self.reward_names:
            out.append("no reward column: expected at least one 'reward:<name>' column")
        for name, col in self.columns.items():
            if len(col) != n:
                out.append(f"column {name!r} has {len(col)} entries, expected {n}")
        if out:
            return out

        def rows(mask, what):
            bad = np.flatnonzero(mask)
            if bad.size:
                ids = ", ".join(self._where(i) for i in bad[:10])
                more = f" and {bad.size - 10} more" if bad.size > 10 else ""
                out.append(f"{what}: {ids}{more}")

        for col in ("prompt_id", "sample_id", "response"):
            if col in self.columns:
                rows(_missing(self.columns[col]), f"{col} missing or null")
        if out:  # rows without an identity cannot be grouped or compared
            return out
        for name in self.reward_names:
            col = _as_float(self.columns[REWARD_PREFIX + name])
            rows(np.isnan(col), f"reward {name!r} missing or NaN")
            rows(np.isinf(col), f"reward {name!r} infinite")
        tr = _as_float(self.columns["true_reward"])
        rows(np.isnan(tr), "true_reward missing or NaN")
        rows((tr < 0) | (tr > 1), "true_reward outside [0, 1]")
        rows(_later_duplicates(self.columns["prompt_id"], self.columns["sample_id"]), "duplicate (prompt_id, sample_id)")
        return out

    def _where(self, i: int) -> str:
        """Row ``i`` as a user finds it: its line in a JSONL file, else its row, with its prompt and sample."""
        at = f"line {int(self.lines[i])}" if self.lines is not None else f"row {i}"
        ident = [f"{c.split('_')[0]} {_show(self.columns[c][i])}" for c in ("prompt_id", "sample_id")
                 if not _missing(self.columns[c][i:i + 1])[0]]
        return at + (f" ({', '.join(ident)})" if ident else "")

    def validate(self) -> "Pool":
        problems = self.problems()
        if problems:
            raise PoolError("invalid pool:\n  " + "\n  ".join(problems))
        return self

    def info(self) -> dict:
        g = self.grouped()
        sizes = np.diff(g.offsets)
        per_prompt_acc = np.add.reduceat(g.true, g.offsets[:-1]) / sizes
        out = {
            "rows": self.n_rows,
            "prompts": int(sizes.size),
            "samples_per_prompt": {"min": int(sizes.min()), "median": float(np.median(sizes)),
                                   "max": int(sizes.max())},
            "rewards": {},
            "true_reward": {"mean": float(g.true.mean()),
                            "per_prompt_mean_quartiles": [float(q) for q in np.quantile(per_prompt_acc, [0.25, 0.5, 0.75])]},
            "columns": list(self.columns),
            "extra_columns": self.extra_columns,
            "metadata": self.metadata,
        }
        for name in self.reward_names:
            r = _as_float(self.reward(name))
            out["rewards"][name] = {"mean": float(np.nanmean(r)), "std": float(np.nanstd(r)),
                                    "min": float(np.nanmin(r)), "max": float(np.nanmax(r))}
        return out

    # ------------------------------------------------------------------ I/O
    def save(self, path: str | Path) -> Path:
        """Write Parquet atomically (temporary file, then rename)."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = Path(path)
        table = pa.table({k: v for k, v in self.columns.items()})
        meta = dict(table.schema.metadata or {})
        meta[b"privalign"] = json.dumps(self.metadata).encode()
        table = table.replace_schema_metadata(meta)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(path)
        return path


@dataclass
class GroupedPool:
    prompt_ids: np.ndarray
    offsets: np.ndarray
    proxy: np.ndarray
    true: np.ndarray

    @property
    def n_prompts(self) -> int:
        return len(self.offsets) - 1

    def prompt(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[k], self.offsets[k + 1]
        return self.proxy[a:b], self.true[a:b]

    def subset(self, prompts: np.ndarray) -> "GroupedPool":
        parts = [slice(self.offsets[k], self.offsets[k + 1]) for k in prompts]
        sizes = np.array([s.stop - s.start for s in parts])
        return GroupedPool(prompt_ids=self.prompt_ids[prompts], offsets=np.r_[0, np.cumsum(sizes)],
                           proxy=np.concatenate([self.proxy[s] for s in parts]),
                           true=np.concatenate([self.true[s] for s in parts]))


def _codes(values) -> np.ndarray:
    """Integer codes of a column's values (equal values, equal codes), vectorised through Arrow."""
    import pyarrow as pa

    try:
        return np.asarray(pa.array(values).dictionary_encode().indices.to_numpy(zero_copy_only=False), np.int64)
    except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types: compare their text
        return np.unique(np.asarray([str(v) for v in values]), return_inverse=True)[1].astype(np.int64)


def _sorted_codes(values) -> np.ndarray:
    """Integer codes that sort as the values do (equal values, equal codes): the rank of each row's
    value among the distinct values, found through Arrow's dictionary encoding."""
    import pyarrow as pa

    try:
        enc = pa.array(values).dictionary_encode()
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return np.unique(np.asarray(values), return_inverse=True)[1].astype(np.int64)
    uniq = np.asarray(enc.dictionary.to_pylist(), dtype=object)
    rank = np.empty(uniq.size, np.int64)
    rank[np.argsort(uniq, kind="stable")] = np.arange(uniq.size)
    return rank[np.asarray(enc.indices.to_numpy(zero_copy_only=False), np.int64)]


def _non_decreasing(values) -> bool:
    """True when every value is >= the one before it; values that do not compare count as False."""
    try:
        return bool(np.all(values[1:] >= values[:-1]))
    except TypeError:
        return False


def _read_only(a: np.ndarray) -> np.ndarray:
    v = a.view()
    v.flags.writeable = False
    return v


def _rows_in_order(prompt_id, sample_id, chunk: int = 1 << 20) -> bool:
    """True when (prompt_id, sample_id) strictly increases from row to row, as in a pool written
    grouped by prompt (then no pair repeats). Checked in chunks, so that 13 million rows need no
    row-sized temporaries; values that do not compare (mixed types) count as out of order."""
    n = len(prompt_id)
    try:
        for i in range(0, n - 1, chunk):
            a, b = prompt_id[i:i + chunk + 1], sample_id[i:i + chunk + 1]
            if not ((a[1:] > a[:-1]) | ((a[1:] == a[:-1]) & (b[1:] > b[:-1]))).all():
                return False
    except TypeError:
        return False
    return True


def _later_duplicates(prompt_id, sample_id) -> np.ndarray:
    """True for every row whose (prompt_id, sample_id) occurred in an earlier row."""
    n = len(prompt_id)
    if _rows_in_order(prompt_id, sample_id):  # the usual case: no codes, no sort
        return np.zeros(n, bool)
    a = _codes(prompt_id)
    b = _codes(sample_id)
    key = a * (int(b.max()) + 1 if n else 1) + b
    order = np.argsort(key, kind="stable")
    dup = np.zeros(n, bool)
    sorted_key = key[order]
    dup[order[1:][sorted_key[1:] == sorted_key[:-1]]] = True
    return dup


def _show(v) -> str:
    v = v.item() if isinstance(v, np.generic) else v
    return repr(v) if isinstance(v, str) else str(v)


def _as_float(col) -> np.ndarray:
    """The column as float64: the column itself when it is float64 already (no copy)."""
    if col.dtype == object:
        return np.array([math.nan if v is None else float(v) for v in col], float)
    return np.asarray(col, float)


def _missing(col) -> np.ndarray:
    """True where a column has no value: None, or NaN."""
    col = np.asarray(col)
    if col.dtype == object:
        return np.array([v is None or (isinstance(v, float) and math.isnan(v)) for v in col], bool)
    if col.dtype.kind == "f":
        return np.isnan(col)
    return np.zeros(len(col), bool)


def _number(v, name: str, line: int):
    if v is None:
        return math.nan
    if isinstance(v, (bool, int, float)):
        return float(v)
    raise PoolError(f"invalid pool: line {line}: column {name!r} is {v!r}, not a number")


def _columns_from_rows(rows: list[dict], lines: list[int]) -> dict[str, np.ndarray]:
    """Columns from JSONL rows. privalign's numeric columns (``NUMERIC``, ``reward:``, ``phi:``) must
    hold numbers or null (else a PoolError names the line); every other column is kept as it is."""
    names: list[str] = []
    for row in rows:
        for k in row:
            if k not in names:
                names.append(k)
    cols = {}
    for k in names:
        vals = [row.get(k) for row in rows]
        if k in NUMERIC or k.startswith((REWARD_PREFIX, HEAD_FEATURES_PREFIX)):
            cols[k] = np.array([_number(v, k, line) for v, line in zip(vals, lines)], dtype=float)
        elif k in REQUIRED[:2] or k in OPTIONAL_TEXT or not all(
                v is None or isinstance(v, (bool, int, float)) for v in vals):
            cols[k] = np.empty(len(vals), dtype=object)
            cols[k][:] = vals
            if not any(v is None or isinstance(v, str) for v in vals):  # numbers only: a numeric column
                cols[k] = np.array(vals)
        else:
            cols[k] = np.array([math.nan if v is None else v for v in vals], dtype=float)
    return cols


def _from_authors_layout(records: list[dict], lines: list[int]) -> tuple[dict[str, np.ndarray], list[int]]:
    rows, at = [], []
    for p, (rec, line) in enumerate(zip(records, lines)):
        for s, resp in enumerate(rec.get("responses", [])):
            at.append(line)
            row = {"prompt_id": p, "sample_id": s, "true_reward": _truth(resp.get("is_correct"))}
            proxy = resp.get("proxy_reward")
            if isinstance(proxy, dict):
                row.update({REWARD_PREFIX + k: v for k, v in proxy.items()})
            else:
                row[REWARD_PREFIX + "proxy"] = proxy
            if "text" in resp:
                row["response"] = resp["text"]
            if "predicted_answer" in resp:
                row["answer"] = None if resp["predicted_answer"] is None else str(resp["predicted_answer"])
            rows.append(row)
    return _columns_from_rows(rows, at), at


def _truth(v):
    if v is None:
        return None
    return float(bool(v)) if isinstance(v, bool) else float(v)


def load_pool(path: str | Path, validate: bool = True) -> Pool:
    """Read a pool from Parquet or JSONL (long layout, or the paper authors' layout). Anything that
    keeps it from being read as a pool is a PoolError naming the file (and the line, in JSONL)."""
    path = Path(path)
    if not path.exists():
        raise PoolError(f"pool file not found: {path}")
    if path.is_dir():
        raise PoolError(f"{path} is a folder; a pool is one Parquet file, or JSONL with a .jsonl suffix")
    try:
        pool = _read_jsonl(path) if path.suffix in (".jsonl", ".json") else _read_parquet(path)
    except PoolError:
        raise
    except Exception as e:  # any other failure to read it: one line, never a traceback
        raise PoolError(f"{path} cannot be read as a pool ({type(e).__name__}: {str(e).splitlines()[0][:160]})") \
            from None
    return pool.validate() if validate else pool


def _read_jsonl(path: Path) -> Pool:
    records, lines = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise PoolError(f"{path}: line {number} is not valid JSON ({e.msg}, column {e.colno}); "
                            "a JSONL pool has one JSON object per line") from None
        if not isinstance(records[-1], dict):
            raise PoolError(f"{path}: line {number} is not a JSON object; a JSONL pool has one object per line")
        lines.append(number)
    if records and "responses" in records[0]:
        cols, at = _from_authors_layout(records, lines)
        meta = {"source_format": "authors-jsonl", "source": str(path.name), "true_reward_source": "grader"}
    else:
        cols, at = _columns_from_rows(records, lines), lines
        meta = {"source_format": "jsonl", "source": str(path.name)}
    return Pool(cols, meta, np.asarray(at, np.int64))


def _read_parquet(path: Path) -> Pool:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise PoolError(f"{path} is not a readable Parquet file ({type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160]}); pools are Parquet, or JSONL with a .jsonl suffix") from None
    raw = (table.schema.metadata or {}).get(b"privalign")
    meta = json.loads(raw) if raw else {}
    return Pool({name: table.column(name).to_numpy(zero_copy_only=False) for name in table.column_names}, meta)
