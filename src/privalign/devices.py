"""Devices, dtypes, batch sizes and out-of-memory errors for the torch-based model paths.

One place for the choices every model path makes the same way (generation, teacher-forced
features, policy-bt scoring, HF reward models):

- ``resolve_device(None)`` is CUDA when torch sees a GPU, else the CPU.
- ``resolve_dtype(name, device, checkpoint)``: ``auto`` is the checkpoint's own dtype on a GPU and
  float32 on the CPU (where bf16/fp16 matmuls are emulated and slower); ``bfloat16`` needs a device
  that runs it, ``float16`` is refused on the CPU. Features and log-probabilities are always
  accumulated in float32 (or float64) on the host, whatever the model computes in.
- ``auto_batch_size`` sizes a decoding batch from the device's free memory on CUDA (the KV cache of
  ``prompt + max_new`` tokens and a few vocabulary-wide float32 rows per sampled row), and keeps the
  CPU defaults, which ``docs/benchmarks.md`` measured, on the CPU.
- ``out_of_memory(batch_size)`` turns a CUDA out-of-memory error into a one-line ``BackendError``
  naming the batch size to try.
"""

from __future__ import annotations

import contextlib

from .errors import BackendError

DTYPES = ("auto", "bfloat16", "float16", "float32")


def resolve_device(device: str | None) -> str:
    """``device``, or ``"cuda"`` when torch sees a GPU and ``"cpu"`` otherwise."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    return str(device)


def cpu_runs_bfloat16() -> bool:
    """Whether this CPU computes a bf16 matmul (a probe: torch falls back to a slow path on CPUs
    without native bf16, and the probe fails only where no path exists)."""
    import torch

    try:
        x = torch.ones((4, 4), dtype=torch.bfloat16)
        return bool(torch.isfinite((x @ x).float()).all())
    except (RuntimeError, TypeError):
        return False


def resolve_dtype(name: str | None, device: str, checkpoint=None):
    """The torch dtype to compute in: ``name`` is one of ``DTYPES`` (None = ``auto``); ``checkpoint``
    is the checkpoint's own torch dtype when known. Raises ``ValueError`` naming the value for an
    unknown name or a dtype the device cannot run."""
    import torch

    name = "auto" if name is None else str(name)
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {name!r}")
    on_cpu = str(device).split(":")[0] == "cpu"
    if name == "auto":
        if on_cpu or checkpoint is None:
            return torch.float32
        return checkpoint if checkpoint in (torch.bfloat16, torch.float16, torch.float32) else torch.float32
    if name == "float16" and on_cpu:
        raise ValueError("dtype='float16' cannot run on the CPU: use float32 or bfloat16, or a GPU")
    if name == "bfloat16" and on_cpu and not cpu_runs_bfloat16():
        raise ValueError("dtype='bfloat16' cannot run on this CPU: use float32")
    if name == "bfloat16" and not on_cpu and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise ValueError(f"dtype='bfloat16' is not supported by {torch.cuda.get_device_name()}: use float16")
    return getattr(torch, name)


def checkpoint_dtype(config):
    """The dtype a checkpoint's config records (``dtype`` in transformers 5, ``torch_dtype`` before),
    as a torch dtype, or None."""
    import torch

    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


CPU_BATCH = {"loop": 64, "shared": 1024}


def auto_batch_size(model, device: str, sampler: str, rows: int, tokens: int, share: float = 0.5,
                    most: int = 4096) -> int:
    """Rows decoded at once: the CPU defaults on the CPU; on CUDA, as many of ``rows`` as fit in
    ``share`` of the free memory, each row needing its KV cache for ``tokens`` positions (the
    ``loop`` sampler; the ``shared`` sampler keeps one prompt copy, so only the response part
    counts, passed in ``tokens``) plus four float32 vocabulary-wide rows (logits, log-softmax,
    probabilities, the sampling scores)."""
    import torch

    if str(device).split(":")[0] != "cuda" or not torch.cuda.is_available():
        return CPU_BATCH[sampler]
    cfg = model.config
    layers = cfg.num_hidden_layers
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    width = next(model.parameters()).element_size()
    per_row = 2 * layers * kv * head * width * max(tokens, 1) + 4 * 4 * cfg.vocab_size + 8 * cfg.hidden_size * 4
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    fit = int(free * share // per_row)
    return max(1, min(rows, most, fit))


@contextlib.contextmanager
def out_of_memory(batch_size: int, option: str = "batch_size"):
    """Re-raise a torch out-of-memory error as a one-line ``BackendError`` naming a batch size to
    try (half of ``batch_size``), with the cached blocks released, instead of a traceback."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as e:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        smaller = max(1, batch_size // 2)
        hint = f"try {option}={smaller}" if batch_size > 1 else "the model does not fit with one row"
        raise BackendError(f"out of memory at {option}={batch_size}: {hint} "
                           f"({str(e).splitlines()[0][:120]})") from None
