"""The model layer across dtypes, devices and transformers releases (issue 29).

These tests also run under the oldest supported transformers (``make test-oldest``). The GPU half of
``benchmarks/gpu_check.py`` needs a GPU; its CPU half (tiny random Llamas, float32 and bf16) runs here.
"""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_model_path_runs_clean_on_the_cpu_in_each_dtype(dtype):
    """The GPU check's CPU half: the loop, shared and merged samplers with and without features,
    featurize, policy-bt scoring through its policy, HF rewards and the service, on random-init
    Llamas saved in ``dtype`` (a bf16 checkpoint is what a hub model is). Before issue 29 a bf16
    model failed here (index_put dtype mismatch in the shared sampler, numpy of a bf16 tensor in the
    loop sampler)."""
    res = _gpu_check().run(device="cpu", dtype=dtype, size="tiny")
    paths = {r["path"] for r in res}
    assert {"hf-generate", "loop", "loop+features", "shared", "shared+features", "merged-batches", "featurize",
            "policy-bt-score", "hf-reward", "service"} <= paths
    assert all(r["ok"] for r in res), [r for r in res if not r["ok"]]


def test_policy_bt_scores_from_a_bf16_policy_agree_with_float32(smollm2):
    """The shipped counting head scoring 16 shipped responses through its policy computed in bf16
    and in float32: within a tenth of the scores' spread, and correlated above 0.995 (measured:
    max difference 0.0014 against a spread of 0.031, correlation 0.9998)."""
    from importlib import resources

    from privalign.pools import load_pool
    from privalign.pipeline import load_reward

    data = resources.files("privalign") / "data"
    pool = load_pool(str(data / "counting-smollm2.parquet"))
    prompts, responses = list(pool.columns["prompt"][:64:4]), list(pool.columns["response"][:64:4])
    scores = {}
    for dtype in ("float32", "bfloat16"):
        head = load_reward(f"policy-bt:{data / 'counting-policy-bt.json'}", dtype=dtype)
        if dtype == "float32":
            head._generator = smollm2  # the session's float32 model
        scores[dtype] = head.score(prompts, responses)
    a, b = scores["float32"], scores["bfloat16"]
    assert np.abs(a - b).max() < 0.1 * a.std()
    assert np.corrcoef(a, b)[0, 1] > 0.995


def test_scoring_through_the_policy_reproduces_the_shipped_pools_rewards(smollm2):
    """The shipped counting pool's policy-bt column was computed under transformers 5; the same
    responses scored through the policy now (``make test-oldest``: under 4.56) give the same scores:
    tokenizer, converted weights, config and features all agree across releases."""
    from importlib import resources

    from privalign.pools import load_pool
    from privalign.pipeline import load_reward

    data = resources.files("privalign") / "data"
    pool = load_pool(str(data / "counting-smollm2.parquet"))
    n_tok = np.asarray(pool.columns["n_tokens"])
    rows = np.flatnonzero(n_tok < n_tok.max())[:400:20]  # closed by a sampled EOS (score() cannot know a cut)
    head = load_reward(f"policy-bt:{data / 'counting-policy-bt.json'}")
    head._generator = smollm2
    col = {k: np.asarray(pool.columns[k], dtype=object if k in ("prompt", "response") else float)[rows]
           for k in ("prompt", "response", "reward:policy-bt")}
    got = head.score(list(col["prompt"]), list(col["response"]))
    assert len(got) == 20 and np.abs(got - col["reward:policy-bt"]).max() < 1e-5


def test_dtypes_the_device_cannot_run_and_unknown_ones_are_refused_by_name():
    import torch

    from privalign.devices import resolve_dtype

    assert resolve_dtype(None, "cpu", torch.bfloat16) is torch.float32  # auto on the CPU
    assert resolve_dtype("auto", "cuda", torch.bfloat16) is torch.bfloat16  # the checkpoint's own on a GPU
    assert resolve_dtype("bfloat16", "cpu") is torch.bfloat16
    with pytest.raises(ValueError, match="'float16' cannot run on the CPU"):
        resolve_dtype("float16", "cpu")
    with pytest.raises(ValueError, match="got 'half'"):
        resolve_dtype("half", "cpu")


def test_cli_refuses_a_bad_dtype_in_one_line_before_loading_anything(tmp_path):
    from typer.testing import CliRunner

    from privalign.cli import app

    for args in (["score", str(tmp_path / "p.parquet"), "--reward", "policy-bt:x.json", "--dtype", "half"],
                 ["featurize", str(tmp_path / "p.parquet"), "--dtype", "float16"],
                 ["generate", "--task", "counting", "--dtype", "fp8", "--out", str(tmp_path / "o.parquet")]):
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2, res.output
        assert res.output.count("\n") == 1 and "dtype" in res.output
    assert not any(tmp_path.iterdir())


def test_out_of_memory_is_one_line_naming_the_batch_size_to_try(smollm2, monkeypatch):
    import torch

    from privalign.backends import BackendError

    def boom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(smollm2, "_prefill", boom)
    with pytest.raises(BackendError, match=r"out of memory at batch_size=64: try batch_size=32"):
        smollm2.generate([{"role": "user", "content": "hi"}], 4, max_new_tokens=2)


def test_the_config_file_is_read_alike_by_every_release():
    """transformers 5 writes the rotary base under rope_parameters, which 4.x ignores: 4.56 reading
    a 5.x-written cache computed another model (rope_theta 10,000 instead of 100,000)."""
    from privalign.backends.hf_compat import portable_config

    cfg = portable_config({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}, "dtype": "float32",
                           "quantization_config": {"q": 1}})
    assert cfg["rope_theta"] == 1e5 and "rope_scaling" not in cfg and cfg["torch_dtype"] == "float32"
    assert "quantization_config" not in cfg
    scaled = portable_config({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}})
    assert scaled["rope_scaling"]["rope_type"] == "llama3"


def test_the_embedded_models_cache_is_portable_and_its_tokenizer_right(tmp_path, monkeypatch):
    """A fresh conversion writes safetensors with format metadata, a config with rope_theta, a
    versioned marker and a tokenizer whose EOS is <|im_end|> and which adds no BOS (4.56's GGUF
    conversion took <|im_start|> for both); a cache without the marker is converted again."""
    from safetensors import safe_open

    from privalign.backends import hf_compat
    from privalign.backends.base import smollm2_gguf
    from privalign.backends.hf_loading import _load_gguf_cached

    monkeypatch.setenv("PRIVALIGN_CACHE", str(tmp_path))
    model, tok = _load_gguf_cached(smollm2_gguf())
    folder = tmp_path / "models" / smollm2_gguf().stem
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt"
    assert json.loads((folder / "config.json").read_text())["rope_theta"] == 100000.0
    assert hf_compat.cache_current(folder)
    for t in (tok, hf_compat.load_tokenizer(folder)):
        assert (t.eos_token, t.bos_token, t.pad_token) == ("<|im_end|>", "<|im_start|>", "<|im_end|>")
        assert t.encode("hi") == t.encode("hi", add_special_tokens=False)
        assert t.decode(t.encode("naïve café ▁x")) == "naïve café ▁x"
    (folder / "privalign-cache.json").unlink()
    assert not hf_compat.cache_current(folder)
    _load_gguf_cached(smollm2_gguf())
    assert hf_compat.cache_current(folder)


def test_the_service_config_takes_dtype_device_and_batch_size_where_they_apply():
    from pydantic import ValidationError

    from privalign.server.config import ServiceConfig

    g = ServiceConfig.model_validate({"generator": {"backend": "transformers", "dtype": "bfloat16", "device": "cuda",
                                                    "batch_size": 256},
                                      "reward": {"kind": "policy-bt", "path": "x.json", "dtype": "float32"}})
    assert (g.generator.dtype, g.generator.device, g.generator.batch_size, g.reward.dtype) == (
        "bfloat16", "cuda", 256, "float32")
    for bad, match in (({"generator": {"backend": "stub", "dtype": "bfloat16"}}, "apply to the transformers backend"),
                       ({"reward": {"kind": "minilm-bt", "dtype": "bfloat16"}}, "not 'minilm-bt'"),
                       ({"generator": {"dtype": "half"}}, "half")):
        with pytest.raises(ValidationError, match=match):
            ServiceConfig.model_validate(bad)


def test_a_model_without_a_chat_template_is_refused_by_name(tmp_path):
    gc = _gpu_check()
    tok = gc.smollm2_tokenizer()
    path = gc.build_model(tmp_path, "tiny", tok, dtype="float32")
    from privalign.backends.hf_compat import load_tokenizer

    bare = load_tokenizer(path)
    bare.chat_template = None
    bare.save_pretrained(path)
    (Path(path) / "chat_template.jinja").unlink(missing_ok=True)
    from privalign.backends.transformers_backend import TransformersGenerator

    with pytest.raises(ValueError, match="has no chat template"):
        TransformersGenerator(path)
