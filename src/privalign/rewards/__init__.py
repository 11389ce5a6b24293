"""Reward models: Hugging Face classifiers, a certified embedding Bradley-Terry head, callables, HTTP."""

from .base import CallableReward, HTTPReward, RewardModel, Scored, score_checked
from .embedding_bt import CertifiedBT, EmbeddingBTReward, Embedder, certified_sensitivity


def _file_kind(path: str) -> str | None:
    import json
    from pathlib import Path

    try:
        return json.loads(Path(path).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        return None


def load_reward(spec: str) -> RewardModel:
    """``minilm-bt:PATH`` or ``policy-bt:PATH`` (trained certified heads, or a released head:
    ``rm release``), ``hf:PATH_OR_ID`` or ``http:URL``."""
    kind, _, arg = spec.partition(":")
    if kind in ("minilm-bt", "policy-bt", "hf", "http") and not arg.strip():
        what = "URL" if kind == "http" else "PATH_OR_ID" if kind == "hf" else "PATH"
        raise ValueError(f"reward {spec!r} needs its model: {kind}:{what} (e.g. {kind}:"
                         f"{'rm.json' if what == 'PATH' else 'http://127.0.0.1:8002/score' if kind == 'http' else 'OpenAssistant/reward-model-deberta-v3-large-v2'})")
    if kind == "minilm-bt":
        return EmbeddingBTReward.load(arg)
    if kind == "policy-bt":
        from .policy_bt import PolicyBTReward
        from .release import RELEASED_KIND, ReleasedHead

        if _file_kind(arg) == RELEASED_KIND:
            return ReleasedHead.load(arg)
        return PolicyBTReward.load(arg)
    if kind == "hf":
        from .hf import HFReward

        return HFReward(arg)
    if kind == "http":
        return HTTPReward(arg, (-1e9, 1e9))
    raise ValueError(f"reward must be minilm-bt:PATH, policy-bt:PATH, hf:PATH_OR_ID or http:URL, got {spec!r}")


__all__ = ["CallableReward", "CertifiedBT", "EmbeddingBTReward", "Embedder", "HTTPReward", "RewardModel", "Scored",
           "certified_sensitivity", "load_reward", "score_checked"]
