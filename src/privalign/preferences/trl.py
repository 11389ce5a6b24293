"""Reading your own preference data in TRL's formats, JSONL or Parquet.

TRL's preference type has two formats, each with an explicit or an implicit prompt, and
``read_preferences`` reads all four (one per file; a file that mixes them is an error):

- ``standard-explicit``: ``{"prompt": "The sky is", "chosen": " blue.", "rejected": " green."}``
- ``standard-implicit``: ``{"chosen": "The sky is blue.", "rejected": "The sky is green."}``; the
  prompt is the longest common prefix of the two texts, cut as TRL's ``extract_prompt`` cuts it:
  where the texts first differ, moved back by one character when that character follows a space
  (the space starts the responses).
- ``conversational-explicit``: ``prompt`` is a list of ``{"role", "content"}`` messages, and
  ``chosen`` and ``rejected`` are each one assistant message.
- ``conversational-implicit``: ``chosen`` and ``rejected`` are whole conversations that share every
  message but the last, the assistant's response; the shared messages are the prompt.

Every row also names its person in the privacy-unit column (``privacy_unit``), or the caller says
``privacy_unit="row"`` to make each row its own person. Any bad row stops the reading with a
one-line ``ValueError`` that names the line (JSONL, 1-based) or row (Parquet, 1-based) and the
offending field or value; reading writes nothing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from privalign._validation import check_count, check_delta

FORMATS = ("standard-explicit", "standard-implicit", "conversational-explicit", "conversational-implicit")
ROW_UNIT = "row"
SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class PreferenceTable:
    """Preference pairs read from one file, one entry per row, in the file's order.

    ``prompts[i]`` is a list of ``{"role", "content"}`` messages (a standard prompt becomes one user
    message); ``chosen[i]`` and ``rejected[i]`` are the two responses' texts; ``person[i]`` is the
    row's person id as a string (``"row-<line>"`` when ``unit`` is ``"row"``); ``lines[i]`` is the
    1-based line of a JSONL file or the 1-based row of a Parquet file. ``dropped`` holds the lines
    of rows left out by ``drop_empty=True`` (empty by default).
    """

    prompts: list
    chosen: list
    rejected: list
    person: np.ndarray
    format: str
    unit: str
    source: Path
    lines: np.ndarray
    dropped: tuple = ()

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def n_persons(self) -> int:
        return int(np.unique(self.person).size)

    @property
    def line_word(self) -> str:
        return "row" if self.source.suffix == ".parquet" else "line"

    def of_persons(self, keep) -> "PreferenceTable":
        """The rows of the persons in ``keep``, in the file's order."""
        rows = np.flatnonzero(np.isin(self.person, np.asarray(list(keep), str)))
        return replace(self, prompts=[self.prompts[i] for i in rows], chosen=[self.chosen[i] for i in rows],
                       rejected=[self.rejected[i] for i in rows], person=self.person[rows], lines=self.lines[rows])

    def where(self, i: int) -> str:
        """Where row ``i`` sits in its file: ``"line 7"`` (JSONL) or ``"row 7"`` (Parquet)."""
        return f"{self.line_word} {int(self.lines[i])}"


def read_preferences(path, privacy_unit: str, *, max_rows=None, drop_empty: bool = False) -> PreferenceTable:
    """Read TRL preference data from ``path`` (``.jsonl`` or ``.parquet``), with its persons.

    ``privacy_unit`` names the column that identifies a person (``"user_id"``, say): all of one
    person's rows are protected together. ``"row"`` makes every row its own person (ids
    ``"row-<line>"``); it must be asked for explicitly, since it is the right unit only when no
    person contributed two rows. Person ids are compared as strings: an integer id (or an integral
    float such as ``7.0``) becomes its decimal string, so ``7``, ``7.0`` and ``"7"`` are one person;
    ``null``, an empty string, a boolean or a non-integral float is an error. ``max_rows`` reads only
    the first rows. ``drop_empty=True`` leaves out (and lists in ``dropped``) the rows whose chosen
    or rejected response is empty or blank, as in 4 of HH-RLHF's 1,500 harmless-base test rows,
    where the preferred answer is to say nothing; by default such a row is an error.

    Errors, each a one-line ``ValueError`` naming the first bad line (or row) and the field or
    value: a malformed JSON line; a missing ``chosen``, ``rejected`` or privacy-unit field;
    ``chosen`` equal to ``rejected``; an empty or non-string text; a file mixing formats; a null or
    empty person id; a file with a single person.
    """
    path = Path(path)
    if not isinstance(privacy_unit, str) or not privacy_unit.strip():
        raise ValueError(f"privacy_unit must name a column or be 'row', got {privacy_unit!r}")
    if max_rows is not None:
        max_rows = check_count("max_rows", max_rows)
    records, columns = _read_records(path, max_rows)
    word = "row" if path.suffix == ".parquet" else "line"
    if not records:
        raise ValueError(f"{path} has no rows")
    if privacy_unit != ROW_UNIT and privacy_unit not in columns:
        raise ValueError(
            f"{path} has no column {privacy_unit!r} to name persons (it has {', '.join(map(repr, columns))}); "
            "name the column that identifies a person, or pass --privacy-unit row (privacy_unit='row') "
            "to make every row its own person")
    rows, persons, lines, dropped = _parse_rows(records, path, word, privacy_unit, drop_empty)
    persons, lines = np.array(persons, dtype=str), np.array(lines, dtype=np.int64)
    if np.unique(persons).size < 2:
        raise ValueError(
            f"{path}: every row belongs to one person ({privacy_unit} = {str(persons[0])!r}); privacy over "
            "persons needs at least two, and a release would publish that one person's data")
    persons.setflags(write=False)
    lines.setflags(write=False)
    return PreferenceTable(prompts=[r[1] for r in rows], chosen=[r[2] for r in rows],
                           rejected=[r[3] for r in rows], person=persons, format=rows[0][0],
                           unit=privacy_unit, source=path, lines=lines, dropped=dropped)


# ---------------------------------------------------------------------------------------- files
def _read_records(path: Path, max_rows) -> tuple[list[tuple[int, dict]], list[str]]:
    """``[(line or row number, record)]`` and the column names, in order of first appearance."""
    if not path.exists():
        raise ValueError(f"preference file not found: {path}")
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{path}: privalign reads TRL preference data from .jsonl or .parquet files, "
                         f"not {path.suffix or 'a file without a suffix'!r}")
    if path.suffix == ".parquet":
        return _read_parquet(path, max_rows)
    return _read_jsonl(path, max_rows)


def _read_jsonl(path: Path, max_rows) -> tuple[list[tuple[int, dict]], list[str]]:
    records, columns = [], {}
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if max_rows is not None and len(records) >= max_rows:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {number} is not UTF-8 text (byte {e.start + 1})") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {number} is not valid JSON ({e.msg}, column {e.colno}): "
                                 f"{_show(line.strip())}; a JSONL file has one JSON object per line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}: line {number} is a JSON {type(record).__name__}, not an object "
                                 f"with chosen and rejected fields: {_show(record)}")
            records.append((number, record))
            columns.update(dict.fromkeys(record))
    return records, list(columns)


def _read_parquet(path: Path, max_rows) -> tuple[list[tuple[int, dict]], list[str]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
        columns = list(file.schema_arrow.names)
        records = []
        for batch in file.iter_batches(batch_size=4096):
            records.extend(batch.to_pylist())
            if max_rows is not None and len(records) >= max_rows:
                break
    except Exception as e:  # pyarrow raises several types for a file that is not Parquet
        raise ValueError(f"{path} is not a readable Parquet file ({type(e).__name__}: "
                         f"{str(e).splitlines()[0][:160] if str(e) else ''})") from None
    if max_rows is not None:
        records = records[:max_rows]
    return list(enumerate(records, start=1)), columns


# ------------------------------------------------------------------------------------------ rows
class _EmptyResponse(ValueError):
    """A chosen or rejected response that is empty or blank (``drop_empty=True`` drops its row)."""


def _parse_rows(records, path: Path, word: str, unit: str, drop_empty: bool):
    """The parsed rows, their persons and numbers, and the numbers of the rows dropped as empty.

    Rows are checked in the file's order, so the error names the first bad row.
    """
    rows, persons, numbers, dropped = [], [], [], []
    for number, rec in records:
        where = f"{path}: {word} {number}"
        try:
            row = _parse_row(rec, where)
        except _EmptyResponse:
            if not drop_empty:
                raise
            _person(rec, unit, number, where)
            dropped.append(number)
            continue
        if rows and row[0] != rows[0][0]:
            raise ValueError(f"{where} is {row[0]} but {word} {numbers[0]} is {rows[0][0]}; "
                             "a file must use one TRL format throughout")
        rows.append(row)
        persons.append(_person(rec, unit, number, where))
        numbers.append(number)
    if not rows:
        raise ValueError(f"{path}: every row has an empty response; none is left to read")
    return rows, persons, numbers, tuple(dropped)


def _parse_row(rec: dict, where: str) -> tuple[str, list, str, str]:
    """``(format, prompt messages, chosen text, rejected text)`` of one record."""
    for key in ("chosen", "rejected"):
        if key not in rec:
            raise ValueError(f"{where}: missing field {key!r} (fields: {', '.join(map(repr, rec))})")
        if rec[key] is None:
            raise ValueError(f"{where}: {key} is null; it must be the response's text")
    chosen, rejected = rec["chosen"], rec["rejected"]
    conversational = isinstance(chosen, list)
    if isinstance(rejected, list) != conversational:
        raise ValueError(f"{where}: chosen is {_kind(chosen)} but rejected is {_kind(rejected)}; "
                         "both must be strings (standard) or both message lists (conversational)")
    if chosen == rejected:
        raise ValueError(f"{where}: chosen equals rejected ({_show(chosen)}); a preference needs two "
                         "different responses")
    explicit = rec.get("prompt") is not None
    if explicit and isinstance(rec["prompt"], list) != conversational:
        raise ValueError(f"{where}: prompt is {_kind(rec['prompt'])} but chosen is {_kind(chosen)}; "
                         "a row must be all standard (strings) or all conversational (message lists)")
    form = ("conversational" if conversational else "standard") + ("-explicit" if explicit else "-implicit")
    if conversational:
        prompt, c, r = (_conversational_explicit if explicit else _conversational_implicit)(rec, where)
    elif explicit:
        prompt = [{"role": "user", "content": _text(rec["prompt"], "prompt", where)}]
        c, r = _text(chosen, "chosen", where, True), _text(rejected, "rejected", where, True)
    else:
        prompt, c, r = _standard_implicit(chosen, rejected, where)
    if c == r:
        raise ValueError(f"{where}: chosen equals rejected after the prompt ({_show(c)}); a preference "
                         "needs two different responses")
    return form, prompt, c, r


def _text(value, field: str, where: str, response: bool = False) -> str:
    """``value``, a string with some non-blank character; a blank response raises ``_EmptyResponse``."""
    if not isinstance(value, str) or not value.strip():
        what = "an empty text" if isinstance(value, str) else f"{_kind(value)}"
        error = _EmptyResponse if response and isinstance(value, str) else ValueError
        raise error(f"{where}: {field} must be a non-empty string, got {what} ({_show(value)})"
                    + ("; drop_empty=True leaves such rows out" if error is _EmptyResponse else ""))
    return value


def _messages(value, field: str, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: {field} must be a non-empty list of messages, got {_show(value)}")
    out = []
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise ValueError(f"{where}: {field}[{j}] must be a message {{'role', 'content'}}, got {_show(m)}")
        last = field in ("chosen", "rejected") and j == len(value) - 1
        out.append({"role": m["role"], "content": _text(m.get("content"), f"{field}[{j}].content", where, last)})
    return out


def _response(messages: list[dict], field: str, where: str) -> str:
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"{where}: the response in {field} must be an assistant message, got role "
                         f"{messages[-1]['role']!r}")
    return messages[-1]["content"]


def _conversational_explicit(rec: dict, where: str) -> tuple[list, str, str]:
    prompt = _messages(rec["prompt"], "prompt", where)
    texts = []
    for field in ("chosen", "rejected"):
        messages = _messages(rec[field], field, where)
        if len(messages) != 1:
            raise ValueError(f"{where}: {field} must be one assistant message after an explicit prompt, "
                             f"got {len(messages)} messages")
        texts.append(_response(messages, field, where))
    return prompt, texts[0], texts[1]


def _conversational_implicit(rec: dict, where: str) -> tuple[list, str, str]:
    chosen = _messages(rec["chosen"], "chosen", where)
    rejected = _messages(rec["rejected"], "rejected", where)
    shared = 0  # TRL's extract_prompt: the common leading messages are the prompt
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0 or not len(chosen) == len(rejected) == shared + 1:
        raise ValueError(
            f"{where}: with no prompt field, chosen and rejected must share every message but the last "
            f"(the prompt) and differ in the last (the response); they share {shared} of {len(chosen)} "
            f"and {len(rejected)} messages")
    return chosen[:shared], _response(chosen, "chosen", where), _response(rejected, "rejected", where)


def _standard_implicit(chosen, rejected, where: str) -> tuple[list, str, str]:
    chosen, rejected = _text(chosen, "chosen", where), _text(rejected, "rejected", where)
    n = min(len(chosen), len(rejected))
    cut = next((i for i in range(n) if chosen[i] != rejected[i]), n)
    if cut > 0 and chosen[cut - 1] == " ":  # as TRL's extract_prompt: the space starts the response
        cut -= 1
    prompt = chosen[:cut]
    if not prompt.strip():
        raise ValueError(f"{where}: with no prompt field, chosen and rejected must begin with the same "
                         f"prompt, but they share no leading text ({_show(chosen)} vs {_show(rejected)})")
    c = _text(chosen[cut:], "chosen (after the shared prompt)", where, True)
    r = _text(rejected[cut:], "rejected (after the shared prompt)", where, True)
    return [{"role": "user", "content": prompt}], c, r


# --------------------------------------------------------------------------------------- persons
def _person(rec: dict, unit: str, number: int, where: str) -> str:
    """The row's person id as a string; see ``read_preferences`` for the conversion of numbers."""
    if unit == ROW_UNIT:
        return f"row-{number}"
    if unit not in rec:
        raise ValueError(f"{where}: missing field {unit!r}, the privacy unit that names the row's person")
    value = rec[unit]
    if value is None or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{where}: the person id ({unit}) is null; every row must name its person")
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{where}: the person id ({unit}) must be a string or an integer, got {value!r}")
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or not float(value).is_integer():
            raise ValueError(f"{where}: the person id ({unit}) must be a string or an integer, got {value!r}")
        return str(int(value))
    if not isinstance(value, str):
        raise ValueError(f"{where}: the person id ({unit}) must be a string or an integer, got {_show(value)}")
    if not value.strip():
        raise ValueError(f"{where}: the person id ({unit}) is empty ({value!r}); every row must name its person")
    return value


# ---------------------------------------------------------------------------------------- checks
def check_disjoint(public: PreferenceTable, private: PreferenceTable) -> None:
    """Refuse a ``--public`` file that shares a row or a person with the private data D.

    A row is shared when its prompt, chosen and rejected are all equal; a person when the two files
    use the same id (checked only when both name persons by a column: ``"row-<n>"`` ids are
    positions, not people). The error names the first shared row or person in the public file.
    """
    rows = {}
    for j in range(len(private)):
        rows.setdefault(_row_key(private, j), j)
    ids = {}
    if public.unit != ROW_UNIT and private.unit != ROW_UNIT:
        for j, pid in enumerate(private.person):
            ids.setdefault(pid, j)
    for i in range(len(public)):
        j = rows.get(_row_key(public, i))
        if j is not None:
            raise ValueError(
                f"the --public file {public.source} shares a row with the private data {private.source}: "
                f"public {public.where(i)} is private {private.where(j)} (chosen {_show(public.chosen[i])}); "
                "public data must not hold any of D's rows")
        j = ids.get(public.person[i])
        if j is not None:
            raise ValueError(
                f"the --public file {public.source} shares person id {str(public.person[i])!r} with the private "
                f"data {private.source} (public {public.where(i)}, private {private.where(j)}); public data "
                "must come from people outside D")


def check_release_delta(delta, persons) -> float:
    """Require ``delta < 1/P``, P the number of persons (an int, a ``PreferenceTable`` or person ids).

    With delta >= 1/P a mechanism may publish one person's data whole and still meet the guarantee.
    Returns delta as a float.
    """
    d = check_delta(delta)
    if isinstance(persons, PreferenceTable):
        p = persons.n_persons
    elif isinstance(persons, (int, np.integer)) and not isinstance(persons, bool):
        p = check_count("persons", persons)
    else:
        p = int(np.unique(np.asarray(persons, dtype=str)).size)
    if p < 1 or d >= 1.0 / p:
        raise ValueError(
            f"delta={delta!r} is at least 1/P = 1/{p} = {1.0 / max(p, 1):.3g} for the P={p} persons in the "
            "data: with delta >= 1/P a release may publish one person's data whole; choose delta < 1/P "
            "(and usually far below it)")
    return d


def _row_key(table: PreferenceTable, i: int) -> tuple[str, str, str]:
    return json.dumps(table.prompts[i], sort_keys=True), table.chosen[i], table.rejected[i]


def _kind(value) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a message list"
    return "null" if value is None else f"a {type(value).__name__}"


def _show(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
