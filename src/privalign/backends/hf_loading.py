"""Loading a causal language model for the transformers generator: the embedded SmolLM2 GGUF
(converted once and cached as safetensors), a GGUF file, a local folder or a Hub id, on its
device in its dtype, with a pad token and a chat template."""

from __future__ import annotations

import json
from pathlib import Path

from . import hf_compat
from .base import cache_dir, smollm2_gguf
from ..devices import checkpoint_dtype, resolve_dtype


def _load_gguf_cached(gguf: Path):
    """The GGUF model in float32 and its tokenizer, converted once and cached as safetensors (in a
    format every supported transformers release reads; ``hf_compat``)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir() / "models" / gguf.stem
    if hf_compat.cache_current(target):
        return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32), hf_compat.load_tokenizer(target)
    tok = hf_compat.gguf_tokenizer(AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name), gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, getattr(tok, name))
        if getattr(model, "generation_config", None) is not None:
            setattr(model.generation_config, name, getattr(tok, name))
    tmp = target.with_name(target.name + ".tmp")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    hf_compat.save_weights(model, tmp / "model.safetensors")  # save_pretrained refuses GGUF-loaded models
    (tmp / "config.json").write_text(json.dumps(hf_compat.portable_config(model.config.to_dict())))
    tok.save_pretrained(tmp)
    hf_compat.write_cache_marker(tmp)
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    return model, tok


def load_model(model: str, device: str, dtype: str | None):
    """(model, tokenizer, display name, torch dtype): ``smollm2`` (the embedded GGUF), a ``.gguf``
    path, or a checkpoint (local or Hub) in ``dtype`` (``devices.resolve_dtype``) on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf() if model == "smollm2" else Path(model) if str(model).endswith(".gguf") else None
    if gguf is not None:
        torch_dtype = resolve_dtype(dtype, device)  # validated before the minutes of loading
        lm, tokenizer = _load_gguf_cached(gguf)
        name = "SmolLM2-135M-Instruct (GGUF Q4_1, transformers)" if model == "smollm2" else gguf.stem
    else:
        torch_dtype = resolve_dtype(dtype, device, checkpoint_dtype(AutoConfig.from_pretrained(model)))
        lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model)
        name = str(model)
    lm.to(device=device, dtype=torch_dtype).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"model {name!r} has no chat template: privalign sends prompts as chat messages, "
                         "so it needs an instruction-tuned model (or a tokenizer with chat_template set)")
    return lm, tokenizer, name, torch_dtype
