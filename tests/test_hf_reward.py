"""Hub reward models read correctly by construction (issue 29, item 4), on small local models built
with the known traps: a tokenizer that adds a BOS under a template that starts with one, pad == eos
with the text ending in eos, a tokenizer that pads on the left, more than one logit, custom code.

These tests also run under the oldest supported transformers (``make test-oldest``)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]
BOS = "<|endoftext|>"
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>"
            "{% endfor %}")
PROMPTS = ["How many r's are in 'strawberry'?", "What is 12 + 30?", "Name a prime number.",
           "Count the letter e in 'excellence'.", "Is 91 prime?"]
RESPONSES = ["There are three r's. Answer: 3", "42", "7 is prime, and so is 11, 13 and 17; take 7.", "", "No: 7 x 13."]


def _smollm2_tokenizer():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod.smollm2_tokenizer()


@pytest.fixture(scope="module")
def trap_tokenizer(tmp_path_factory):
    """SmolLM2's tokenizer made to add a BOS itself, under a template that starts with {{ bos_token }}
    and ends each turn with <|im_end|>, which is both its eos and its pad; saved padding on the left."""
    from tokenizers.processors import TemplateProcessing

    tok = _smollm2_tokenizer()
    tok.bos_token = BOS
    bos_id = tok.convert_tokens_to_ids(BOS)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, bos_id)])
    tok.chat_template = TEMPLATE
    folder = tmp_path_factory.mktemp("trap-tokenizer")
    tok.save_pretrained(folder)
    cfg = folder / "tokenizer_config.json"
    cfg.write_text(json.dumps({**json.loads(cfg.read_text()), "padding_side": "left"}))
    assert tok.pad_token_id == tok.eos_token_id
    return folder


def _build(folder: Path, tokenizer_folder: Path, num_labels: int = 1, custom: bool = False) -> str:
    import shutil

    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(tokenizer_folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      num_labels=num_labels)
    model = LlamaForSequenceClassification(cfg)
    torch.nn.init.normal_(model.score.weight, std=1.0)  # scores that differ visibly between positions
    model.save_pretrained(folder)
    for f in tokenizer_folder.iterdir():
        shutil.copy(f, folder / f.name)
    if custom:
        (folder / "modeling_custom.py").write_text(CUSTOM_CODE)
        config = json.loads((folder / "config.json").read_text())
        config["auto_map"] = {"AutoModelForSequenceClassification": "modeling_custom.CustomRewardModel"}
        (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


CUSTOM_CODE = '''
from dataclasses import dataclass

import torch
from transformers import LlamaForSequenceClassification
from transformers.modeling_outputs import ModelOutput


@dataclass
class RewardOutput(ModelOutput):
    score: torch.FloatTensor = None
    logits: torch.FloatTensor = None


class CustomRewardModel(LlamaForSequenceClassification):
    """ArmoRM-like: several objectives at the last real token, and their sum as ``score``."""

    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(1) - 1
        objectives = self.score(hidden)[torch.arange(hidden.shape[0]), last]
        return RewardOutput(score=objectives.sum(-1, keepdim=True), logits=objectives)
'''


def _messages(p, r):
    return [{"role": "user", "content": p}, {"role": "assistant", "content": r}]


def _template_ids(path: str, prompt: str, response: str) -> list[int]:
    """The ids transformers' own chat template gives (no second tokenizer pass)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return list(tok.apply_chat_template(_messages(prompt, response), tokenize=True, return_dict=False))


def _reference(path: str, ids: list[int]) -> float:
    """The head at the last token of one unpadded sequence, by a plain forward pass."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state
        return float(model.score(hidden[:, -1])[0, 0])


def test_the_chat_template_is_tokenized_once_with_one_bos(tmp_path, trap_tokenizer):
    from transformers import AutoTokenizer

    from privalign.rewards.hf import HFReward

    path = _build(tmp_path / "rm", trap_tokenizer)
    rm = HFReward(path)
    tok = AutoTokenizer.from_pretrained(path)
    bos = tok.bos_token_id
    text = tok.apply_chat_template(_messages(PROMPTS[0], RESPONSES[0]), tokenize=False)
    assert tok(text)["input_ids"][:2] == [bos, bos]  # the trap is live: render then tokenize doubles the BOS
    ids = rm.encode(PROMPTS[0], RESPONSES[0])
    assert ids[0] == bos and ids[1] != bos
    assert ids == list(tok.apply_chat_template(_messages(PROMPTS[0], RESPONSES[0]), tokenize=True, return_dict=False))


def test_a_text_alone_equals_it_in_a_mixed_padded_batch_and_a_reference_pass(tmp_path, trap_tokenizer):
    """pad == eos, every text ends in eos, the tokenizer pads on the left: the score is read at the
    last real token, alone, in a batch of mixed lengths, and in a plain unpadded forward pass."""
    from transformers import AutoModelForSequenceClassification

    from privalign.rewards.hf import HFReward

    path = _build(tmp_path / "rm", trap_tokenizer)
    rm = HFReward(path, batch_size=5, output_range=(-50.0, 50.0))
    batched = rm.score(PROMPTS, RESPONSES)
    alone = np.array([rm.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)])
    ids = [_template_ids(path, p, r) for p, r in zip(PROMPTS, RESPONSES)]
    lengths = {len(i) for i in ids}
    assert len(lengths) == len(PROMPTS)  # a mixed batch: every row padded differently
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    reference = np.array([_reference(path, i) for i in ids])
    np.testing.assert_allclose(batched, reference, atol=1e-5)
    assert np.ptp(reference) > 0.1
    # the trap is live: the model's own pooling (it looks for the pad id, here the eos) reads another token
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        own = float(model(input_ids=torch.tensor([ids[0]])).logits[0, 0])
    assert abs(own - reference[0]) > 1e-3
    # batching by length keeps the caller's order, at any batch size
    np.testing.assert_allclose(HFReward(path, batch_size=2).score(PROMPTS, RESPONSES), batched, atol=1e-5)


def test_dtype_and_batch_size_options(tmp_path, trap_tokenizer):
    from privalign.pipeline import load_reward
    from privalign.rewards.hf import HFReward

    path = _build(tmp_path / "rm", trap_tokenizer)
    full = load_reward(f"hf:{path}", dtype="float32").score(PROMPTS, RESPONSES)
    half = load_reward(f"hf:{path}", dtype="bfloat16")
    assert half.dtype == torch.bfloat16
    scores = half.score(PROMPTS, RESPONSES)
    assert scores.dtype == np.float64 and np.corrcoef(full, scores)[0, 1] > 0.99
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        HFReward(path, batch_size=0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        HFReward(path, dtype="int8")
    with pytest.raises(ValueError, match="text 0 is .* tokens, over the reward model's max_length=4"):
        HFReward(path, max_length=4).score(PROMPTS[:1], RESPONSES[:1])


def test_more_than_one_logit_is_refused_by_name(tmp_path, trap_tokenizer):
    from privalign.rewards.hf import HFReward

    path = _build(tmp_path / "rm3", trap_tokenizer, num_labels=3)
    with pytest.raises(ValueError, match="has 3 output logits"):
        HFReward(path)


def test_custom_code_runs_only_when_trusted_and_its_score_is_read(tmp_path, trap_tokenizer):
    from privalign.rewards.hf import HFReward

    path = _build(tmp_path / "armo", trap_tokenizer, num_labels=3, custom=True)
    with pytest.raises(ValueError, match="runs custom code .*trust_remote_code=True"):
        HFReward(path)
    rm = HFReward(path, trust_remote_code=True, batch_size=5, output_range=(-50.0, 50.0))
    batched = rm.score(PROMPTS, RESPONSES)
    alone = np.array([rm.score([p], [r])[0] for p, r in zip(PROMPTS, RESPONSES)])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, trust_remote_code=True).eval()
    ids = rm.encode(PROMPTS[0], RESPONSES[0])
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long)).score
    assert batched[0] == pytest.approx(float(ref[0, 0]), abs=1e-5)


def test_the_cli_scores_a_pool_with_a_hub_style_reward_model(tmp_path, trap_tokenizer):
    """``privalign score --reward hf:PATH`` on a small pool, and a one-line error for custom code."""
    from typer.testing import CliRunner

    from privalign.cli import app
    from privalign.pools import Pool, load_pool

    path = _build(tmp_path / "rm", trap_tokenizer)
    armo = _build(tmp_path / "armo", trap_tokenizer, num_labels=3, custom=True)
    n = len(PROMPTS)
    pool = Pool({"prompt_id": np.arange(n), "sample_id": np.zeros(n, dtype=int), "true_reward": np.zeros(n),
                 "reward:length": np.array([len(r) for r in RESPONSES], dtype=float),
                 "prompt": np.array(PROMPTS, dtype=object), "response": np.array(RESPONSES, dtype=object)})
    pool.save(tmp_path / "pool.parquet")
    res = CliRunner().invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"hf:{path}"])
    assert res.exit_code == 0, res.output
    scored = load_pool(tmp_path / "pool.parquet")
    assert any(c.startswith("reward:") for c in scored.columns)
    res = CliRunner().invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"hf:{armo}"])
    assert res.exit_code != 0 and "trust-remote-code" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["score", str(tmp_path / "pool.parquet"), "--reward", f"hf:{armo}",
                                   "--trust-remote-code"])
    assert res.exit_code == 0, res.output
