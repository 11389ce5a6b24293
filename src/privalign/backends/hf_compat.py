"""What differs between the transformers releases privalign supports (``SUPPORTED``), in one place.

- A forward pass returns its KV cache as ``out.cache`` in 5.x (``past_key_values`` a deprecated
  alias) and ``out.past_key_values`` in 4.x, and takes it under the same names
  (``output_cache``, ``cache_kwarg``).
- 5.x writes a config's rotary settings as ``rope_parameters``, which 4.x ignores
  (``portable_config`` writes both spellings).
- transformers 4.x refuses a safetensors file without ``{"format": "pt"}`` metadata
  (``save_weights`` writes it; ``weights_readable`` checks it).
- A tokenizer saved by 5.x records the class ``TokenizersBackend``, which 4.x lacks; both load
  ``PreTrainedTokenizerFast`` directly.
- transformers 4.56's GGUF tokenizer conversion takes the BOS token for the EOS, adds a BOS to
  every encoding and decodes with a sentencepiece-style decoder; 5.x reads the file's metadata
  correctly. ``gguf_tokenizer`` rebuilds the tokenizer from the GGUF metadata, so that both
  releases encode and decode the embedded model identically.

The embedded model's converted cache carries ``CACHE_VERSION``; a cache without it (written by
an earlier privalign, or by a release with the bugs above) is converted again.
"""

from __future__ import annotations

import json
from pathlib import Path

SUPPORTED = ">=4.56,<6"  # pyproject's range; `make test` runs the newest, `make test-oldest` 4.56.2
CACHE_VERSION = 2


def output_cache(out):
    """The KV cache a forward pass returned: ``out.cache`` (5.x) or ``out.past_key_values`` (4.x)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


_CACHE_KWARG: dict = {}


def cache_kwarg(model) -> str:
    """The keyword a model's forward pass takes its cache under (``cache`` in 5.x,
    ``past_key_values`` before): 4.x would swallow an unknown ``cache=`` and ignore it."""
    import inspect

    kind = type(model)
    if kind not in _CACHE_KWARG:
        params = inspect.signature(model.forward).parameters
        _CACHE_KWARG[kind] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[kind]


def weights_readable(path: Path) -> bool:
    """True for a safetensors file every supported release reads: one with ``format = pt``."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("format") == "pt"
    except Exception:
        return False


def save_weights(model, path: Path) -> None:
    """The model's weights as safetensors with ``{"format": "pt"}``, each shared tensor once, under
    its first name (the input embedding, to which every release ties the output head on load)."""
    from safetensors.torch import save_file

    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        state[name] = tensor.detach().contiguous()
    save_file(state, str(path), metadata={"format": "pt"})


def portable_config(config: dict) -> dict:
    """A model config as a dict both 4.x and 5.x read the same: 5.x writes the rotary settings as
    ``rope_parameters``, which 4.x ignores (it would fall back to its default ``rope_theta`` of
    10,000 and compute another model), so the 4.x keys ``rope_theta`` / ``rope_scaling`` are
    added; likewise ``torch_dtype`` beside ``dtype``."""
    out = dict(config)
    out.pop("quantization_config", None)
    rope = out.get("rope_parameters")
    if isinstance(rope, dict):
        out.setdefault("rope_theta", rope.get("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            out.setdefault("rope_scaling", dict(rope))
    if out.get("dtype") is not None:
        out.setdefault("torch_dtype", out["dtype"])
    return out


def load_tokenizer(folder: Path):
    """A tokenizer saved by ``gguf_tokenizer`` (tokenizer.json, its special tokens and chat
    template), loaded the same way by every supported release."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def _gguf_fields(gguf: Path) -> dict:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    out = {}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.add_bos_token"):
        field = reader.fields.get(key)
        if field is None:
            continue
        value = field.parts[field.data[0]]
        out[key.rsplit(".", 1)[1]] = bytes(value).decode() if key.endswith(".model") else value.tolist()[0]
    return out


def gguf_tokenizer(converted, gguf: Path):
    """The GGUF file's tokenizer as ``PreTrainedTokenizerFast``: the vocabulary and merges transformers
    converted (``converted``), the BOS/EOS/pad/unk tokens and ``add_bos_token`` from the file's
    metadata, a byte-level decoder for ``gpt2``-model vocabularies, and the chat template."""
    from tokenizers import decoders, processors
    from transformers import PreTrainedTokenizerFast

    meta = _gguf_fields(gguf)
    backend = converted.backend_tokenizer
    if not meta.get("add_bos_token", False):
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B", special_tokens=[])
    if meta.get("model") == "gpt2":
        backend.decoder = decoders.ByteLevel()

    def token(name):
        i = meta.get(name)
        return None if i is None else backend.id_to_token(int(i))

    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=token("bos_token_id"),
                                  eos_token=token("eos_token_id"), unk_token=token("unknown_token_id"),
                                  pad_token=token("padding_token_id") or token("eos_token_id"))
    tok.chat_template = converted.chat_template
    return tok


def write_cache_marker(folder: Path) -> None:
    import transformers

    (folder / "privalign-cache.json").write_text(json.dumps({"version": CACHE_VERSION,
                                                             "transformers": transformers.__version__}))


def cache_current(folder: Path) -> bool:
    """Whether a converted model folder was written by this cache format, and is complete."""
    try:
        marker = json.loads((folder / "privalign-cache.json").read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("version") == CACHE_VERSION and (folder / "config.json").exists()
            and weights_readable(folder / "model.safetensors"))
