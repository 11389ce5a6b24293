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


def reward_from_spec(spec: str, *, dtype: str | None = None, trust_remote_code: bool = False,
                batch_size: int | None = None, policy_loader=None) -> RewardModel:
    """``minilm-bt:PATH`` or ``policy-bt:PATH`` (trained certified heads, or a released head:
    ``rm release``), ``hf:PATH_OR_ID``, ``vllm:URL`` (a vLLM server's classify API) or ``http:URL``.
    ``dtype`` (``devices.DTYPES``) is what a torch model computes in: the policy of a
    policy-bt head, or an hf reward model. ``trust_remote_code`` (hf only) lets a checkpoint's own
    code run; ``batch_size`` is the hf model's rows per forward pass or vLLM's texts per request.
    ``policy_loader(base_model, **options)`` builds the policy a policy-bt head scores texts with
    (``policy_bt.PolicyFeaturizer``): without it the head scores recorded features only.
    ``pipeline.load_reward`` is this with the transformers policy attached."""
    if dtype is not None:
        from ..devices import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    kind, _, arg = spec.partition(":")
    if trust_remote_code and kind != "hf":
        raise ValueError(f"trust_remote_code applies to the hf reward kind, not {kind!r}")
    if batch_size is not None and kind not in ("hf", "vllm"):
        raise ValueError(f"batch_size applies to the hf and vllm reward kinds, not {kind!r}")
    if kind in ("minilm-bt", "policy-bt", "hf", "http", "vllm") and not arg.strip():
        what = "URL" if kind in ("http", "vllm") else "PATH_OR_ID" if kind == "hf" else "PATH"
        raise ValueError(f"reward {spec!r} needs its model: {kind}:{what} (e.g. {kind}:"
                         f"{'rm.json' if what == 'PATH' else 'http://127.0.0.1:8002/score' if kind == 'http' else 'http://127.0.0.1:8000' if kind == 'vllm' else 'OpenAssistant/reward-model-deberta-v3-large-v2'})")
    if kind == "minilm-bt":
        return EmbeddingBTReward.load(arg)
    if kind == "policy-bt":
        from .policy_bt import PolicyBTReward
        from .release import RELEASED_KIND, ReleasedHead

        head = ReleasedHead.load(arg) if _file_kind(arg) == RELEASED_KIND else PolicyBTReward.load(arg)
        return head.use_policy(policy_loader, dtype=dtype)
    if kind == "hf":
        from .hf import HFReward

        return HFReward(arg, dtype=dtype, trust_remote_code=trust_remote_code, batch_size=batch_size)
    if dtype is not None:
        raise ValueError(f"dtype applies to the policy-bt and hf reward kinds, not {kind!r}")
    if kind == "vllm":
        from .vllm import VLLMReward

        return VLLMReward(arg, **({"batch_size": batch_size} if batch_size is not None else {}))
    if kind == "http":
        return HTTPReward(arg, (-1e9, 1e9))
    raise ValueError(f"reward must be minilm-bt:PATH, policy-bt:PATH, hf:PATH_OR_ID, vllm:URL or http:URL, got {spec!r}")


__all__ = ["CallableReward", "CertifiedBT", "EmbeddingBTReward", "Embedder", "HTTPReward", "RewardModel", "Scored",
           "certified_sensitivity", "reward_from_spec", "score_checked"]
