"""Issue 52: a preference file's features streamed to disk. The cache is a folder of parts, each
written once; memory holds one block of raw features while featurizing and while the feature map
reads them; an interrupted run resumes; the older single-file cache is moved into the folder. A stub
policy stands in for the model (its rows are a function of the text), so these run in a second."""

import hashlib
import json
import tracemalloc

import numpy as np
import pytest

from privalign import preference_features as pf
from privalign.preferences.trl import read_preferences
from privalign.rewards.policy_bt import FeatureMap

WIDTH = 2 * 24 + 1


def _row(messages, text, width=WIDTH) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(json.dumps([messages, text]).encode(), digest_size=8).digest(), "little")
    row = np.random.default_rng(seed).standard_normal(width).astype(np.float32)
    row[-1] = -abs(row[-1])
    return row


class StubPolicy:
    """featurize and featurize_many by a hash of each text; counts the texts and can fail after some."""

    def __init__(self, fail_after=None, width=WIDTH):
        self.texts, self.fail_after, self.width = [], fail_after, width

    def _check(self, n):
        if self.fail_after is not None and len(self.texts) + n > self.fail_after:
            raise KeyboardInterrupt

    def featurize(self, messages, responses):
        self._check(len(responses))
        self.texts += responses
        return np.stack([_row(messages, r, self.width) for r in responses])

    def featurize_many(self, items):
        self._check(len(items))
        self.texts += [t for _, t in items]
        return np.stack([_row(m, t, self.width) for m, t in items])


def _file(path, pairs: int, shared: int = 0):
    """``pairs`` rows, each its own prompt, but the first ``shared`` on one prompt with a common chosen."""
    rows = []
    for i in range(pairs):
        prompt = "What is 2 + 2?" if i < shared else f"Question {i}?"
        rows.append({"prompt": prompt, "chosen": " 4." if i < shared else f" yes {i}.", "rejected": f" no {i}.",
                     "user_id": f"u{i % 7}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_preferences(path, "user_id")


def _expected(table):
    return (np.stack([_row(p, c) for p, c in zip(table.prompts, table.chosen)]),
            np.stack([_row(p, r) for p, r in zip(table.prompts, table.rejected)]))


def test_the_cache_is_a_folder_of_parts_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(pf, "FLUSH_EVERY", 32)
    table = _file(tmp_path / "d.jsonl", 100, shared=6)
    policy = StubPolicy()
    chosen, rejected = pf.featurize_table(table, policy, "stub")
    assert len(policy.texts) == 195  # " 4." once for its 6 pairs
    folder = tmp_path / "d.jsonl.features-stub"
    parts = sorted(folder.glob("part-*.keys.npy"))
    assert len(parts) == 6 and not list(folder.glob("*.tmp"))  # a part once 32 texts wait: 195 in 6
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    want_c, want_r = _expected(table)
    np.testing.assert_array_equal(np.asarray(chosen), want_c)
    np.testing.assert_array_equal(np.asarray(rejected), want_r)
    # a second run reads every row from the parts and writes nothing
    again = StubPolicy(fail_after=0)
    chosen2, _ = pf.featurize_table(table, None, "stub", load_policy=lambda: again)
    np.testing.assert_array_equal(np.asarray(chosen2), want_c)
    assert {p: p.stat().st_mtime_ns for p in folder.iterdir()} == stamps
    # more rows: one new part, the old ones untouched
    bigger = _file(tmp_path / "d.jsonl", 110, shared=6)
    policy = StubPolicy()
    chosen3, _ = pf.featurize_table(bigger, policy, "stub")
    assert len(policy.texts) == 20 and len(list(folder.glob("part-*.keys.npy"))) == 7
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())
    np.testing.assert_array_equal(np.asarray(chosen3), _expected(bigger)[0])


def test_an_interrupted_run_resumes_from_its_finished_parts(tmp_path, monkeypatch):
    monkeypatch.setattr(pf, "FLUSH_EVERY", 32)
    table = _file(tmp_path / "d.jsonl", 100)
    with pytest.raises(KeyboardInterrupt):
        pf.featurize_table(table, StubPolicy(fail_after=100), "stub")
    (tmp_path / "d.jsonl.features-stub" / "part-unfinished.npy").write_bytes(b"half a part")  # no keys file
    policy = StubPolicy()
    done = []
    chosen, rejected = pf.featurize_table(table, policy, "stub", progress=lambda d, t: done.append((d, t)))
    assert len(policy.texts) == 200 - 96 and done[-1] == (104, 104)  # 96 = 3 batches of 32, flushed on Ctrl-C
    np.testing.assert_array_equal(np.asarray(rejected), _expected(table)[1])


def test_an_old_single_file_cache_moves_into_the_folder(tmp_path):
    table = _file(tmp_path / "d.jsonl", 20)
    want_c, want_r = _expected(table)
    keys = [pf.text_key("stub", p, t) for p, c, r in zip(table.prompts, table.chosen, table.rejected) for t in (c, r)]
    old = tmp_path / "d.jsonl.features-stub.npz"
    np.savez(old, keys=np.array(keys, dtype="U32"), raw=np.stack([want_c, want_r], 1).reshape(40, WIDTH))
    chosen, rejected = pf.featurize_table(table, StubPolicy(fail_after=0), "stub")
    assert not old.exists() and len(list((tmp_path / "d.jsonl.features-stub").glob("part-*.keys.npy"))) == 1
    np.testing.assert_array_equal(np.asarray(rejected), want_r)


def test_cached_rows_select_read_and_map_like_an_array(tmp_path, monkeypatch):
    monkeypatch.setattr(pf, "FLUSH_EVERY", 16)
    monkeypatch.setattr(pf, "CHUNK", 5)
    table = _file(tmp_path / "d.jsonl", 60)
    chosen, _ = pf.featurize_table(table, StubPolicy(), "stub")
    want = _expected(table)[0]
    assert chosen.shape == want.shape and len(chosen) == 60
    pick = np.array([59, 3, 3, 17, 40])
    np.testing.assert_array_equal(np.asarray(chosen[pick]), want[pick])
    np.testing.assert_array_equal(np.asarray(chosen[want[:, 0] > 0]), want[want[:, 0] > 0])
    np.testing.assert_array_equal(chosen[10:20][:, -1], want[10:20, -1])
    np.testing.assert_array_equal(chosen[-1], want[-1])
    fmap = FeatureMap.fit(want, q=4)
    np.testing.assert_allclose(fmap(chosen[pick]), fmap(want[pick]), rtol=0, atol=1e-12)
    monkeypatch.setattr("privalign.rewards.policy_bt.MAP_ROWS", 7)  # an array is mapped in blocks too
    np.testing.assert_allclose(fmap(want), fmap(chosen), rtol=0, atol=1e-12)
    assert fmap(want[:0]).shape == (0, 5) and fmap(chosen[:0]).shape == (0, 5)


def _peaks(folder, pairs: int, fmap) -> tuple[int, int]:
    """Peak traced bytes while featurizing ``pairs`` pairs (1,153 float32 a text) and while mapping them."""
    table = _file(folder / f"d{pairs}.jsonl", pairs)
    tracemalloc.start()
    try:
        chosen, rejected = pf.featurize_table(table, StubPolicy(width=1153), "stub")
        featurizing = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        assert (fmap(chosen) - fmap(rejected)).shape == (pairs, 9)
        return featurizing, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_stays_flat_while_featurizing_and_mapping(tmp_path):
    """From 2,000 to 8,000 texts (9 to 37 MB of raw features), the peak while featurizing to disk and
    while mapping the rows back grows by the keys' bookkeeping only, not by the rows."""
    fmap = FeatureMap.fit(np.stack([_row([], str(i), 1153) for i in range(300)]), q=8)
    small, large = _peaks(tmp_path, 1000, fmap), _peaks(tmp_path, 4000, fmap)
    grown = 6000 * 1153 * 4
    assert large[0] - small[0] < grown / 5 and large[1] - small[1] < grown / 5, (small, large, grown)
