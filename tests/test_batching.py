"""Cross-request batching (backends/batching.py): concurrent calls merged into one batched call,
each caller answered with its own results, a failed merged call retried member by member (a
failure stays with the call that causes it); and the real
transformers backend's multi-prompt ``generate_many``."""

import threading

import numpy as np
import pytest
import torch

from privalign.backends.base import Generation
from privalign.backends.batching import BatchingGenerator, BatchingReward
from privalign.rewards import CallableReward, score_checked


class FakeGenerator:
    """Records its calls; each sample's text names its prompt and its index."""

    name = "fake"

    def __init__(self, fail=False):
        self.calls, self.fail, self.active, self.max_active = [], fail, 0, 0
        self.lock = threading.Lock()

    def _enter(self):
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)

    def _leave(self):
        with self.lock:
            self.active -= 1

    def generate(self, messages, k, *, max_new_tokens=8, temperature=1.0, seed=None):
        self._enter()
        try:
            self.calls.append(("generate", [(messages[-1]["content"], k)], seed))
            threading.Event().wait(0.01)  # long enough for overlapping callers to show up as concurrency
            return [Generation(f"{messages[-1]['content']}#{i}", 1) for i in range(k)]
        finally:
            self._leave()


class FakeBatchedGenerator(FakeGenerator):
    def generate_many(self, requests, *, max_new_tokens=8, temperature=1.0, seed=None):
        self.calls.append(("generate_many", [(m[-1]["content"], k) for m, k in requests], seed))
        if self.fail:
            raise RuntimeError("out of memory")
        return [[Generation(f"{m[-1]['content']}#{i}", 1) for i in range(k)] for m, k in requests]


def hammer(fn, n):
    """Run fn(i) in n threads released together; (results by i, exceptions by i). Fails if any hangs."""
    barrier = threading.Barrier(n)
    results, errors = {}, {}

    def work(i):
        barrier.wait()
        try:
            results[i] = fn(i)
        except Exception as e:
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a caller hung"
    return results, errors


def msgs(text):
    return [{"role": "user", "content": text}]


def test_concurrent_calls_share_one_batched_call_and_each_gets_its_own_samples():
    fake = FakeBatchedGenerator()
    # the batch leaves as soon as all 8 x 3 sequences wait (or after 2 s): generous for a loaded machine
    gen = BatchingGenerator(fake, max_batch=24, max_wait_ms=2000)
    results, errors = hammer(lambda i: gen.generate(msgs(f"p{i}"), 3, max_new_tokens=8, temperature=1.0), 8)
    assert not errors
    assert len(fake.calls) <= 2 and all(c[0] == "generate_many" for c in fake.calls)
    assert sorted(p for c in fake.calls for p, _ in c[1]) == sorted(f"p{i}" for i in range(8))
    for i in range(8):
        assert [g.text for g in results[i]] == [f"p{i}#{j}" for j in range(3)]
    assert gen.name == "fake"


def test_different_settings_are_batched_apart_and_seeded_calls_run_alone():
    fake = FakeBatchedGenerator()
    gen = BatchingGenerator(fake, max_batch=64, max_wait_ms=300)

    def call(i):
        if i == 5:
            return gen.generate(msgs(f"p{i}"), 2, max_new_tokens=8, temperature=1.0, seed=7)
        return gen.generate(msgs(f"p{i}"), 2, max_new_tokens=8, temperature=0.5 if i % 2 else 1.0)

    results, errors = hammer(call, 6)
    assert not errors
    for i in range(6):
        assert [g.text for g in results[i]] == [f"p{i}#0", f"p{i}#1"]
    seeded = [c for c in fake.calls if c[2] == 7]
    assert seeded == [("generate", [("p5", 2)], 7)]
    for kind, reqs, _ in fake.calls:  # no batched call mixes temperatures
        assert len({int(p[1:]) % 2 for p, _ in reqs}) == 1


class PoisonableGenerator(FakeBatchedGenerator):
    """Fails on any prompt containing POISON, alone or merged (as a tokenizer that chokes would)."""

    def generate(self, messages, k, **kw):
        if "POISON" in messages[-1]["content"]:
            raise ValueError("cannot tokenize this prompt")
        return super().generate(messages, k, **kw)

    def generate_many(self, requests, **kw):
        if any("POISON" in m[-1]["content"] for m, _ in requests):
            self.calls.append(("generate_many", [(m[-1]["content"], k) for m, k in requests], None))
            raise ValueError("cannot tokenize this prompt")
        return super().generate_many(requests, **kw)


def test_a_failed_merged_call_is_retried_member_by_member():
    """Issue 22: one request's failure stays its own; the others merged with it are answered."""
    fake = PoisonableGenerator()
    gen = BatchingGenerator(fake, max_batch=16, max_wait_ms=2000)
    results, errors = hammer(lambda i: gen.generate(msgs("POISON" if i == 3 else f"p{i}"), 2), 8)
    assert set(errors) == {3} and isinstance(errors[3], ValueError) and "tokenize" in str(errors[3])
    assert sorted(results) == [0, 1, 2, 4, 5, 6, 7]
    assert all([g.text for g in results[i]] == [f"p{i}#0", f"p{i}#1"] for i in results)
    assert fake.calls[0][0] == "generate_many" and len(fake.calls[0][1]) == 8  # they were merged
    assert gen.batcher.retried == 8
    # a backend that fails whatever it is given: every caller gets its own error, the worker survives
    broken = BatchingGenerator(FakeBatchedGenerator(fail=True), max_batch=16, max_wait_ms=2000)
    broken.generator.generate = lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("out of memory"))
    results, errors = hammer(lambda i: broken.generate(msgs(f"q{i}"), 2), 8)
    assert not results and len(errors) == 8 and all("out of memory" in str(e) for e in errors.values())
    results, errors = hammer(lambda i: gen.generate(msgs(f"r{i}"), 1), 4)
    assert not errors and len(results) == 4


def test_a_backend_without_generate_many_is_called_per_request_one_at_a_time():
    fake = FakeGenerator()
    gen = BatchingGenerator(fake, max_batch=64, max_wait_ms=50)
    results, errors = hammer(lambda i: gen.generate(msgs(f"p{i}"), 2, max_new_tokens=8, temperature=1.0), 6)
    assert not errors and fake.max_active == 1 and len(fake.calls) == 6
    assert all([g.text for g in results[i]] == [f"p{i}#0", f"p{i}#1"] for i in range(6))


def test_batching_reward_merges_calls_returns_each_callers_scores_and_keeps_attributes():
    seen = []

    def fn(prompts, responses):
        seen.append(len(responses))
        return np.array([float(r.split("-")[1]) for r in responses])

    inner = CallableReward(fn, (0.0, 100.0), name="len", sensitivity=0.5)
    rm = BatchingReward(inner, max_batch=28, max_wait_ms=2000)
    assert (rm.name, rm.output_range, rm.sensitivity) == ("len", (0.0, 100.0), 0.5)
    results, errors = hammer(lambda i: score_checked(rm, ["q"] * (i + 1),
                                                     [f"r-{10 * i + j}" for j in range(i + 1)]).scores, 7)
    assert not errors and len(seen) <= 2 and sum(seen) == 28
    for i in range(7):
        assert results[i].tolist() == [10 * i + j for j in range(i + 1)]
    rm.output_range = (0.0, 1.0)  # the service applies the config's declared range on top
    rm.batcher.max_wait = 0.0  # a lone call need not wait for company
    assert inner.output_range == (0.0, 1.0) and score_checked(rm, ["q"], ["r-5"]).n_clipped == 1

    def broken(prompts, responses):
        raise ValueError("reward server down")

    rm = BatchingReward(CallableReward(broken, (0.0, 1.0)), max_batch=4, max_wait_ms=2000)
    results, errors = hammer(lambda i: rm.score(["q"], ["r"]), 4)
    assert not results and all(isinstance(e, ValueError) for e in errors.values()) and len(errors) == 4

    def poisoned(prompts, responses):  # a reward model that raises on one caller's input
        if any("POISON" in r for r in responses):
            raise ValueError("cannot score this response")
        return np.array([float(len(r)) for r in responses])

    rm = BatchingReward(CallableReward(poisoned, (0.0, 100.0)), max_batch=64, max_wait_ms=2000)
    results, errors = hammer(lambda i: rm.score(["q"] * 2, ["POISON", "x"] if i == 1 else ["ab", "abc"]), 5)
    assert set(errors) == {1} and sorted(results) == [0, 2, 3, 4]
    assert all(results[i].tolist() == [2.0, 3.0] for i in results) and rm.batcher.retried == 5


def test_batched_real_minilm_scores_equal_unbatched_scores():
    from importlib import resources

    from privalign.pipeline import load_reward

    model = load_reward("minilm-bt:" + str(resources.files("privalign") / "data" / "arithmetic-minilm-bt.json"))
    calls = [(["What is 2 + 3?"] * 3, ["5", "The answer is 5.", "6"]),
             (["What is 7 - 4?"] * 2, ["3", "It is four, since seven minus four is four"]),
             (["What is 1 + 1?"], ["2"])]
    alone = [model.score(p, r) for p, r in calls]
    rm = BatchingReward(model, max_batch=6, max_wait_ms=2000)
    results, errors = hammer(lambda i: rm.score(*calls[i]), 3)
    assert not errors and rm.batcher.batches <= 2
    for i in range(3):
        np.testing.assert_allclose(results[i], alone[i], rtol=0, atol=1e-5)


A = [{"role": "user", "content": "What is 2 + 2?"}]
B = [{"role": "system", "content": "You are a helpful assistant who answers in one word."},
     {"role": "user", "content": "Name a colour of the sky on a clear day."}]
C = [{"role": "user", "content": "Name a colour of the sky on a clear day."}]  # A's default system prompt


def test_generate_many_on_real_smollm2_matches_each_prompt_alone(smollm2):
    ids = {name: smollm2._prompt_ids(m)[0] for name, m in zip("ABC", [A, B, C])}
    assert len(ids["A"]) != len(ids["B"]) and len(ids["A"]) != len(ids["C"])  # so batches are padded
    assert (ids["A"][:20] == ids["C"][:20]).all() and (ids["A"][:8] != ids["B"][:8]).any()
    # (A, B): plain left padding; (A, C): their shared system prompt encoded once, padding after it
    for pair in ([A, B], [A, C]):
        # near-greedy (T = 0.01): each row of the padded batch decodes exactly as its prompt alone
        many = smollm2.generate_many([(pair[0], 2), (pair[1], 2)], max_new_tokens=4, temperature=0.01, seed=0)
        assert [len(x) for x in many] == [2, 2]
        for messages, got in zip(pair, many):
            alone = smollm2.generate(messages, 2, max_new_tokens=4, temperature=0.01, seed=0)
            assert [g.text for g in got] == [g.text for g in alone]
            assert [g.n_tokens for g in got] == [g.n_tokens for g in alone]
    # T = 1: each sample's recorded log-probability equals its prompt's own teacher-forced score.
    # (Texts are compared through re-tokenisation, so only samples that round-trip are checked.)
    eos, checked = smollm2.tokenizer.eos_token_id, 0
    for group in ([A, B, C], [A, C]):
        many = smollm2.generate_many([(m, 2) for m in group], max_new_tokens=4, temperature=1.0, seed=1)
        for messages, got in zip(group, many):
            prompt = smollm2._prompt_ids(messages)
            for g in got:
                assert 1 <= g.n_tokens <= 4 and g.logprob is not None and g.logprob < 0
                toks = smollm2.tokenizer.encode(g.text, add_special_tokens=False)
                toks += [eos] * (g.n_tokens - len(toks) == 1)  # a sampled EOS counts as a token
                if len(toks) != g.n_tokens:
                    continue
                with torch.no_grad():
                    logits = smollm2.model(torch.cat([prompt, torch.tensor([toks])], dim=1)).logits[0].float()
                logp = torch.log_softmax(logits[prompt.shape[1] - 1:-1], dim=-1)
                expected = float(logp.gather(1, torch.tensor(toks)[:, None]).sum())
                assert g.logprob == pytest.approx(expected, abs=1e-3)
                checked += 1
    assert checked >= 5


def test_the_service_batches_embedded_generators_and_real_reward_models(monkeypatch):
    from privalign import backends
    from privalign.server.app import (
        StubGenerator,
        StubReward,
        build_generator,
        build_reward,
    )
    from privalign.server.config import ServiceConfig

    monkeypatch.setattr(backends, "make_generator", lambda backend, model, base_url, **o: FakeBatchedGenerator())
    cfg = ServiceConfig.model_validate({"generator": {"backend": "transformers", "batch_max": 32, "batch_wait_ms": 2},
                                        "reward": {"kind": "minilm-bt", "output_range": [-2, 2], "sensitivity": 0.3}})
    gen = build_generator(cfg)
    assert isinstance(gen, BatchingGenerator) and isinstance(gen.generator, FakeBatchedGenerator)
    assert (gen.batcher.max_batch, gen.batcher.max_wait, gen.max_concurrency) == (32, 0.002, 32)
    rm = build_reward(cfg)  # the shipped certified model; its embedder loads only when it scores
    assert isinstance(rm, BatchingReward) and rm.name == rm.model.name
    assert rm.output_range == (-2.0, 2.0) and rm.sensitivity == 0.3 and rm.certificate()["lambda"] > 0
    stub = ServiceConfig.model_validate({"generator": {"backend": "stub"},
                                         "reward": {"kind": "stub", "output_range": [0, 1]}})
    assert isinstance(build_generator(stub), StubGenerator) and isinstance(build_reward(stub), StubReward)
