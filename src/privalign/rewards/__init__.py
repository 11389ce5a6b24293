"""Reward models: Hugging Face classifiers, a certified embedding Bradley-Terry head, callables, HTTP."""

from .base import CallableReward, HTTPReward, RewardModel, Scored, score_checked
from .embedding_bt import CertifiedBT, EmbeddingBTReward, Embedder, certified_sensitivity


def load_reward(spec: str) -> RewardModel:
    """``minilm-bt:PATH`` or ``policy-bt:PATH`` (trained certified heads), ``hf:PATH_OR_ID`` or
    ``http:URL``."""
    kind, _, arg = spec.partition(":")
    if kind == "minilm-bt":
        return EmbeddingBTReward.load(arg)
    if kind == "policy-bt":
        from .policy_bt import PolicyBTReward

        return PolicyBTReward.load(arg)
    if kind == "hf":
        from .hf import HFReward

        return HFReward(arg)
    if kind == "http":
        return HTTPReward(arg, (-1e9, 1e9))
    raise ValueError(f"reward must be minilm-bt:PATH, policy-bt:PATH, hf:PATH_OR_ID or http:URL, got {spec!r}")


__all__ = ["CallableReward", "CertifiedBT", "EmbeddingBTReward", "Embedder", "HTTPReward", "RewardModel", "Scored",
           "certified_sensitivity", "load_reward", "score_checked"]
