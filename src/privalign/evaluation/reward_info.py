"""What a pool says about its reward models: the output range and certified sensitivity a reward
model declares (``declared_reward``), and how well the selection reward ranks responses within a
prompt (``test_auc``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..metrics import within_prompt_auc
from ..pools import Pool
from .harness import EvalSettings


def declared_reward(pool: Pool, settings: EvalSettings) -> EvalSettings:
    """Use the reward model's declared output range and certified sensitivity when the pool records
    them (and the scores are not re-normalised): a fixed range, as a deployment would declare."""
    info = pool.metadata.get("reward_model_info", {})
    name = settings.reward or pool.metadata.get("default_reward") or (pool.reward_names or [None])[0]
    rm = info.get(name) if name else None
    if not rm or settings.normalisation != "none" or settings.reward_range is not None:
        return settings
    lo, hi = rm["output_range"]
    out = replace(settings, reward=name, reward_range=(lo, hi))
    if settings.sensitivity is None and rm.get("sensitivity"):
        out = replace(out, sensitivity=min(1.0, rm["sensitivity"] / (hi - lo)))
    return out


def test_auc(pool: Pool, reward: str | None, test_ids) -> dict:
    """Within-prompt AUC of the selection reward, and of the policy's log-probability when the pool
    has it, on the test prompts (target: >= 0.65 and above the log-probability)."""
    rows = np.isin(pool.columns["prompt_id"], test_ids)
    y, pid = pool.columns["true_reward"][rows], pool.columns["prompt_id"][rows]
    name = reward or pool.metadata.get("default_reward") or pool.reward_names[0]
    out = {"reward": name, "auc": within_prompt_auc(pool.reward(name)[rows], y, pid)}
    if "logprob" in pool.reward_names and name != "logprob":
        out["logprob_auc"] = within_prompt_auc(pool.reward("logprob")[rows], y, pid)
        out["met"] = bool(out["auc"] >= 0.65 and out["auc"] > out["logprob_auc"])
    return out
