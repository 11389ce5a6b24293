"""Reading your own preference data (issue 52): TRL's four formats, persons, and the bad inputs."""

from __future__ import annotations

import importlib.util
import json
import re
from importlib import resources
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from privalign.preferences.trl import (
    FORMATS, PreferenceTable, check_disjoint, check_release_delta, read_preferences)

ROOT = Path(__file__).resolve().parent.parent
HH = ROOT.parent / "shared" / "data" / "hh-rlhf"


def user(text):
    return [{"role": "user", "content": text}]


def assistant(text):
    return [{"role": "assistant", "content": text}]


ROWS = {
    "standard-explicit": [
        {"prompt": "The sky is", "chosen": " blue.", "rejected": " green.", "uid": "a"},
        {"prompt": "The sun is", "chosen": " hot.", "rejected": " cold.", "uid": "b"},
        {"prompt": "Grass is", "chosen": " green.", "rejected": " blue.", "uid": "a"},
    ],
    "standard-implicit": [
        {"chosen": "The sky is blue.", "rejected": "The sky is green.", "uid": "a"},
        {"chosen": "The sun is hot.", "rejected": "The sun is cold.", "uid": "b"},
        {"chosen": "Grass is green.", "rejected": "Grass is blue.", "uid": "a"},
    ],
    "conversational-explicit": [
        {"prompt": user("What color is the sky?"), "chosen": assistant("It is blue."),
         "rejected": assistant("It is green."), "uid": "a"},
        {"prompt": user("Where is the sun?"), "chosen": assistant("In the sky."),
         "rejected": assistant("In the sea."), "uid": "b"},
        {"prompt": [{"role": "system", "content": "Be brief."}] + user("Grass?"),
         "chosen": assistant("Green."), "rejected": assistant("Blue."), "uid": "a"},
    ],
    "conversational-implicit": [
        {"chosen": user("What color is the sky?") + assistant("It is blue."),
         "rejected": user("What color is the sky?") + assistant("It is green."), "uid": "a"},
        {"chosen": user("Where is the sun?") + assistant("In the sky."),
         "rejected": user("Where is the sun?") + assistant("In the sea."), "uid": "b"},
        {"chosen": user("Hi") + assistant("Hello.") + user("Grass?") + assistant("Green."),
         "rejected": user("Hi") + assistant("Hello.") + user("Grass?") + assistant("Blue."), "uid": "a"},
    ],
}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


WRITERS = {"jsonl": write_jsonl, "parquet": write_parquet}


def bad(tmp_path, rows, match, unit="uid", **kw):
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ValueError, match=match) as info:
        read_preferences(path, unit, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


# ------------------------------------------------------------------------------------- formats
@pytest.mark.parametrize("suffix", ["jsonl", "parquet"])
@pytest.mark.parametrize("form", FORMATS)
def test_the_four_formats_read_alike_from_jsonl_and_parquet(tmp_path, form, suffix):
    path = WRITERS[suffix](tmp_path / f"d.{suffix}", ROWS[form])
    t = read_preferences(path, "uid")
    assert isinstance(t, PreferenceTable) and t.format == form and len(t) == 3
    assert t.unit == "uid" and t.source == path and t.n_persons == 2
    assert list(t.person) == ["a", "b", "a"] and list(t.lines) == [1, 2, 3]
    assert t.where(1) == ("row 2" if suffix == "parquet" else "line 2")
    if form.startswith("standard"):
        assert t.chosen[:2] == [" blue.", " hot."] and t.rejected[:2] == [" green.", " cold."]
        assert t.prompts[0] == user("The sky is") and t.prompts[1] == user("The sun is")
    else:
        assert t.chosen[:2] == ["It is blue.", "In the sky."] and t.rejected[:2] == ["It is green.", "In the sea."]
        assert t.prompts[0] == user("What color is the sky?")
    if form == "conversational-implicit":
        assert t.prompts[2] == user("Hi") + assistant("Hello.") + user("Grass?")
    if form == "conversational-explicit":
        assert t.prompts[2][0] == {"role": "system", "content": "Be brief."}


def test_the_implicit_standard_prompt_is_cut_as_trl_cuts_it(tmp_path):
    # TRL's extract_prompt: where the texts first differ, moved back one character after a space
    rows = [{"chosen": "Q: 2+2?\nA: 4", "rejected": "Q: 2+2?\nA: 5", "uid": 1},
            {"chosen": "Say hi. Hello there", "rejected": "Say hi. Help", "uid": 2}]
    t = read_preferences(write_jsonl(tmp_path / "d.jsonl", rows), "uid")
    assert t.prompts[0] == user("Q: 2+2?\nA:") and (t.chosen[0], t.rejected[0]) == (" 4", " 5")
    assert t.prompts[1] == user("Say hi. Hel") and (t.chosen[1], t.rejected[1]) == ("lo there", "p")
    rows = [{"chosen": "The sun is in the sky.", "rejected": "The sun is in the sea.", "uid": 1}] + rows
    t = read_preferences(write_jsonl(tmp_path / "d.jsonl", rows), "uid")  # a shared first letter is prompt
    assert t.prompts[0] == user("The sun is in the s") and (t.chosen[0], t.rejected[0]) == ("ky.", "ea.")


def test_max_rows_reads_only_the_first_rows(tmp_path):
    rows = ROWS["standard-explicit"] * 3
    for write in WRITERS.values():
        path = write(tmp_path / f"d.{write.__name__[6:]}", rows)
        t = read_preferences(path, "uid", max_rows=4)
        assert len(t) == 4 and list(t.lines) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_rows"):
        read_preferences(path, "uid", max_rows=0)


def test_blank_lines_are_skipped_and_line_numbers_stay_the_files(tmp_path):
    rows = [ROWS["standard-explicit"][0], "", ROWS["standard-explicit"][1]]
    t = read_preferences(write_jsonl(tmp_path / "d.jsonl", rows), "uid")
    assert list(t.lines) == [1, 3]


# ------------------------------------------------------------------------------------- persons
def test_numeric_person_ids_are_strings_and_one_person_whatever_the_type(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[0]["uid"], rows[1]["uid"], rows[2]["uid"] = 7, "8", 7.0
    t = read_preferences(write_jsonl(tmp_path / "d.jsonl", rows), "uid")
    assert list(t.person) == ["7", "8", "7"] and t.n_persons == 2
    t = read_preferences(write_parquet(tmp_path / "d.parquet", [{**r, "uid": i % 2} for i, r in enumerate(rows)]), "uid")
    assert list(t.person) == ["0", "1", "0"]


def test_row_unit_makes_every_row_its_own_person(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{k: v for k, v in r.items() if k != "uid"}
                                               for r in ROWS["standard-implicit"]])
    t = read_preferences(path, "row")
    assert t.unit == "row" and list(t.person) == ["row-1", "row-2", "row-3"] and t.n_persons == 3


def test_an_absent_unit_column_names_the_columns_and_suggests_row(tmp_path):
    message = bad(tmp_path, ROWS["standard-explicit"], "no column 'user_id'", unit="user_id")
    assert "--privacy-unit row" in message and "'prompt', 'chosen', 'rejected', 'uid'" in message
    path = write_parquet(tmp_path / "d.parquet", ROWS["standard-explicit"])
    with pytest.raises(ValueError, match="no column 'user_id'.*--privacy-unit row"):
        read_preferences(path, "user_id")


@pytest.mark.parametrize("value, match", [(None, "line 2: the person id \\(uid\\) is null"),
                                          ("", "line 2: the person id \\(uid\\) is empty"),
                                          ("  ", "line 2: the person id \\(uid\\) is empty"),
                                          (True, "line 2: the person id \\(uid\\) must be .* got True"),
                                          (1.5, "line 2: .* got 1.5"),
                                          ([1], "line 2: .* got \\[1\\]")])
def test_a_null_empty_or_odd_person_id_names_the_line(tmp_path, value, match):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[1]["uid"] = value
    bad(tmp_path, rows, match)


def test_a_row_missing_its_person_and_a_file_of_one_person(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    del rows[2]["uid"]
    bad(tmp_path, rows, "line 3: missing field 'uid'")
    one = [{**r, "uid": "solo"} for r in ROWS["standard-explicit"]]
    bad(tmp_path, one, "every row belongs to one person \\(uid = 'solo'\\)")
    bad(tmp_path, ROWS["standard-explicit"][:1], "one person", unit="row")


# ----------------------------------------------------------------------------------- bad input
def test_a_malformed_json_line_names_the_line(tmp_path):
    rows = [ROWS["standard-explicit"][0], '{"chosen": "x", "rejected": ', ROWS["standard-explicit"][1]]
    bad(tmp_path, rows, 'line 2 is not valid JSON .*\'{"chosen": "x", "rejected":\'')
    bad(tmp_path, [ROWS["standard-explicit"][0], "[1, 2]"], "line 2 is a JSON list, not an object")


@pytest.mark.parametrize("field", ["chosen", "rejected"])
def test_a_missing_or_null_response_names_the_line_and_field(tmp_path, field):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    del rows[1][field]
    bad(tmp_path, rows, f"line 2: missing field '{field}'")
    rows[1][field] = None
    bad(tmp_path, rows, f"line 2: {field} is null")


def test_chosen_equal_to_rejected_names_the_line_and_value(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[2]["rejected"] = rows[2]["chosen"]
    bad(tmp_path, rows, "line 3: chosen equals rejected \\(' green.'\\)")
    rows = [dict(r) for r in ROWS["conversational-implicit"]]
    rows[0]["rejected"] = rows[0]["chosen"]
    bad(tmp_path, rows, "line 1: chosen equals rejected")


@pytest.mark.parametrize("form, field, value, match", [
    ("standard-explicit", "chosen", "", "line 2: chosen must be a non-empty string, got an empty text"),
    ("standard-explicit", "rejected", 5, "line 2: rejected must be a non-empty string, got a int \\(5\\)"),
    ("standard-explicit", "prompt", "  ", "line 2: prompt must be a non-empty string"),
    ("standard-implicit", "chosen", "The sun is", "line 2: chosen \\(after the shared prompt\\) must be a non-empty"),
    ("standard-implicit", "chosen", "Nothing shared", "line 2: .* share no leading text"),
    ("conversational-explicit", "chosen", assistant(""), "line 2: chosen\\[0\\].content must be a non-empty"),
    ("conversational-explicit", "chosen", [{"role": "assistant", "content": 3}], "line 2: chosen\\[0\\].content"),
    ("conversational-explicit", "prompt", [{"content": "x"}], "line 2: prompt\\[0\\] must be a message"),
    ("conversational-explicit", "rejected", assistant("a") + assistant("b"), "line 2: rejected must be one"),
    ("conversational-explicit", "rejected", user("Oops"), "line 2: .*role 'user'"),
    ("conversational-implicit", "rejected", user("Elsewhere?") + assistant("In the sea."),
     "line 2: .* share every message but the last"),
])
def test_an_empty_or_non_string_text_names_the_line_and_field(tmp_path, form, field, value, match):
    rows = [dict(r) for r in ROWS[form]]
    rows[1][field] = value
    bad(tmp_path, rows, match)


def test_drop_empty_leaves_out_rows_with_an_empty_response(tmp_path):
    rows = [dict(r) for r in ROWS["standard-implicit"]] + [{"chosen": "Say", "rejected": "Say no", "uid": "b"}]
    bad(tmp_path, rows, "line 4: chosen \\(after the shared prompt\\) .* drop_empty=True")
    t = read_preferences(write_jsonl(tmp_path / "d.jsonl", rows), "uid", drop_empty=True)
    assert len(t) == 3 and t.dropped == (4,)


@pytest.mark.parametrize("form, other, match", [
    ("standard-explicit", "conversational-explicit", "line 3 is conversational-explicit but line 1 is standard-explicit"),
    ("standard-explicit", "standard-implicit", "line 3 is standard-implicit but line 1 is standard-explicit"),
    ("conversational-implicit", "conversational-explicit", "line 3 is conversational-explicit but line 1"),
])
def test_a_file_mixing_formats_names_the_first_odd_line(tmp_path, form, other, match):
    bad(tmp_path, ROWS[form][:2] + ROWS[other][2:], match)


def test_a_row_mixing_formats_names_the_line(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[1]["rejected"] = assistant("x")
    bad(tmp_path, rows, "line 2: chosen is a string but rejected is a message list")
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[1]["prompt"] = user("x")
    bad(tmp_path, rows, "line 2: prompt is a message list but chosen is a string")


def test_files_that_are_not_preference_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_preferences(tmp_path / "absent.jsonl", "row")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        read_preferences(tmp_path / "d.csv", "row")
    (tmp_path / "d.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        read_preferences(tmp_path / "d.parquet", "row")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="has no rows"):
        read_preferences(tmp_path / "e.jsonl", "row")
    with pytest.raises(ValueError, match="privacy_unit"):
        read_preferences(tmp_path / "e.jsonl", "")


def test_parquet_errors_name_the_row(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]]
    rows[2]["uid"] = None
    path = write_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ValueError, match="d.parquet: row 3: the person id \\(uid\\) is null"):
        read_preferences(path, "uid")


# -------------------------------------------------------------------------------------- checks
def test_check_disjoint_names_the_first_shared_row_or_person(tmp_path):
    private = read_preferences(write_jsonl(tmp_path / "d.jsonl", ROWS["standard-explicit"]), "uid")
    fresh = [{**r, "uid": r["uid"] + "-pub", "chosen": r["chosen"] + "!"} for r in ROWS["standard-explicit"]]
    check_disjoint(read_preferences(write_jsonl(tmp_path / "p.jsonl", fresh), "uid"), private)
    shared_row = fresh[:2] + [{**ROWS["standard-explicit"][1], "uid": "z"}]
    public = read_preferences(write_jsonl(tmp_path / "p.jsonl", shared_row), "uid")
    with pytest.raises(ValueError, match="shares a row .*public line 3 is private line 2 \\(chosen ' hot.'\\)"):
        check_disjoint(public, private)
    shared_person = fresh[:1] + [{**fresh[1], "uid": "b"}, fresh[2]]
    public = read_preferences(write_jsonl(tmp_path / "p.jsonl", shared_person), "uid")
    with pytest.raises(ValueError, match="shares person id 'b' .*public line 2, private line 2"):
        check_disjoint(public, private)
    # row-unit ids are positions, not people: only shared rows count
    no_ids = [{k: v for k, v in r.items() if k != "uid"} for r in fresh]
    check_disjoint(read_preferences(write_jsonl(tmp_path / "p.jsonl", no_ids), "row"),
                   read_preferences(tmp_path / "d.jsonl", "row"))


def test_check_release_delta_requires_delta_below_one_over_p(tmp_path):
    table = read_preferences(write_jsonl(tmp_path / "d.jsonl", ROWS["standard-explicit"]), "uid")
    assert check_release_delta(0.1, table) == 0.1
    for persons in (table, 2, ["a", "b", "a"], np.array(["a", "b"])):
        with pytest.raises(ValueError, match=re.escape("delta=0.5 is at least 1/P = 1/2") + ".*P=2 persons"):
            check_release_delta(0.5, persons)
    assert check_release_delta(1e-6, 1000) == 1e-6
    with pytest.raises(ValueError, match="delta=0.001 is at least 1/P = 1/1000"):
        check_release_delta(1e-3, 1000)
    with pytest.raises(ValueError, match="delta"):
        check_release_delta(0, 10)


# ------------------------------------------------------------------------------------ the data
def test_the_shipped_example_reads_by_user_id_and_is_what_its_script_writes(tmp_path):
    shipped = Path(str(resources.files("privalign") / "data" / "preferences-example.jsonl"))
    t = read_preferences(shipped, "user_id")
    counts = np.unique(t.person, return_counts=True)[1]
    assert t.format == "conversational-explicit" and 200 <= len(t) <= 500 and 60 <= t.n_persons <= 100
    assert counts.min() >= 2 and counts.max() <= 8 and shipped.stat().st_size < 150_000
    spec = importlib.util.spec_from_file_location("make_example", ROOT / "examples" / "make_preferences_example.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.write(tmp_path / "again.jsonl").read_bytes() == shipped.read_bytes()


def test_the_real_hh_rlhf_file_reads_with_row_unit():
    files = sorted(HH.glob("*.jsonl")) if HH.is_dir() else []
    if not files:
        pytest.skip(f"no HH-RLHF data at {HH}")
    path = files[0]
    with pytest.raises(ValueError, match="line \\d+: chosen \\(after the shared prompt\\) .*empty text"):
        read_preferences(path, "row")  # a few rows prefer saying nothing
    t = read_preferences(path, "row", drop_empty=True)
    n = sum(1 for line in path.open() if line.strip())
    assert t.format == "standard-implicit" and len(t) + len(t.dropped) == n and len(t.dropped) < n / 100
    assert t.n_persons == len(t) and t.person[0] == f"row-{t.lines[0]}"
    assert all(p[0]["role"] == "user" and p[0]["content"].startswith("\n\nHuman:") for p in t.prompts)
    assert sum(p[0]["content"].endswith("\n\nAssistant:") for p in t.prompts) > 0.7 * len(t)
    first = read_preferences(path, "row", max_rows=100, drop_empty=True)
    assert len(first) == 100 - sum(d <= 100 for d in t.dropped) and first.chosen == t.chosen[:len(first)]


def test_the_error_names_the_first_bad_line_whatever_is_wrong_with_it(tmp_path):
    rows = [dict(r) for r in ROWS["standard-explicit"]] * 2
    rows[1], rows[4] = {**rows[1], "uid": None}, {**rows[4], "chosen": ""}
    bad(tmp_path, rows, "line 2: the person id")
    rows[1] = ROWS["conversational-explicit"][1]
    bad(tmp_path, rows, "line 2 is conversational-explicit but line 1 is standard-explicit")
