"""``policy-bt``: a certified Bradley-Terry reward model on the generating policy's own features.

Raw features of a response y to a chat prompt x, read off the policy (the transformers backend
records them while sampling, ``generate --features``, or recomputes them by teacher forcing):
``raw = [h_last, h_mean, lp]``, with h_last the final hidden state at the response's closing EOS,
h_mean the mean of the final hidden states over the response tokens (EOS included) and lp the mean
token log-probability (of the sampled tokens: a response cut at ``max_new_tokens`` gets the closing
EOS's hidden state but, having sampled none, no EOS log-probability; recomputing from its text
includes one).

Feature map (fixed before training; its constants come from calibration prompts that contribute no
preference pair):

    z   = diag(1 / s) V (h_mean - mu) / sqrt(q)        (PCA whitening to q components)
    phi = [ sqrt(1 - c^2) z / max(1, ||z||),  c clip(lp, -L, 0) / L ]

so ||phi|| <= 1 for every input. The head r = w . phi is fitted exactly as ``minilm-bt``
(``embedding_bt.fit_bt``), so the same certificate holds: Delta_r = 4k/(m lambda) + 2 g_tol/lambda
under replacement of one person's k pairs, and |r| <= sqrt(2 log 2 / lambda) + g_tol/lambda.

Preference data, built the realistic way (``train_policy_bt``): graded samples of the deployed
policy on the task's train prompts; a correct answer preferred over an incorrect one to the same
prompt, at most ``pairs_per_prompt`` distinct pairs per prompt. The train prompts are split once:
"fit" prompts give D; "validation" prompts (the curator's own, not in D) calibrate the feature map
and choose (q, lambda). Test prompts are never seen.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..evaluation.experiments import within_prompt_auc
from ..evaluation.laws import softmax_rows
from .embedding_bt import CertifiedBT, fit_bt


@dataclass(frozen=True)
class FeatureMap:
    """phi(raw) for raw = [h_last (H), h_mean (H), lp]; ||phi|| <= 1 (module docstring)."""

    mu: np.ndarray          # (H,) calibration mean of h_mean
    components: np.ndarray  # (q, H) principal directions
    scales: np.ndarray      # (q,) their standard deviations
    c: float = 0.8          # weight of the log-probability coordinate
    lp_clip: float = 4.0    # L

    @property
    def hidden(self) -> int:
        return self.mu.size

    @property
    def dim(self) -> int:
        return self.components.shape[0] + 1

    @classmethod
    def fit(cls, raw: np.ndarray, q: int = 8, c: float = 0.8, lp_clip: float = 4.0) -> "FeatureMap":
        if not 0 <= c <= 1:
            raise ValueError(f"c must lie in [0, 1], got {c!r}")
        hidden = (raw.shape[1] - 1) // 2
        h = np.asarray(raw[:, hidden:2 * hidden], np.float64)
        mu = h.mean(axis=0)
        _, s, vt = np.linalg.svd(h - mu, full_matrices=False)
        q = min(q, vt.shape[0])
        scales = np.maximum(s[:q] / math.sqrt(max(h.shape[0] - 1, 1)), 1e-12)
        return cls(mu, vt[:q], scales, float(c), float(lp_clip))

    def __call__(self, raw: np.ndarray) -> np.ndarray:
        raw = np.atleast_2d(np.asarray(raw, np.float64))
        if raw.shape[1] != 2 * self.hidden + 1:
            raise ValueError(f"raw features must have {2 * self.hidden + 1} columns, got {raw.shape[1]}")
        h = raw[:, self.hidden:2 * self.hidden]
        if not np.isfinite(h).all():
            raise ValueError("raw policy features must be finite (the model produced NaN or infinite hidden states)")
        z = ((h - self.mu) @ self.components.T) / self.scales / math.sqrt(self.components.shape[0])
        norm = np.linalg.norm(z, axis=1, keepdims=True)
        z = np.where(np.isfinite(norm), z / np.maximum(1.0, norm), 0.0)  # overflowed rows: the origin
        lp = np.clip(np.nan_to_num(raw[:, -1], nan=-self.lp_clip), -self.lp_clip, 0.0) / self.lp_clip
        return np.concatenate([math.sqrt(1 - self.c ** 2) * z, self.c * lp[:, None]], axis=1)

    def to_dict(self) -> dict:
        return {"mu": self.mu.tolist(), "components": self.components.tolist(), "scales": self.scales.tolist(),
                "c": self.c, "lp_clip": self.lp_clip}

    @classmethod
    def from_dict(cls, d: dict) -> "FeatureMap":
        return cls(np.array(d["mu"]), np.array(d["components"]), np.array(d["scales"]), d["c"], d["lp_clip"])


class PolicyBTReward(CertifiedBT):
    """r(x, y) = w . phi(raw(x, y)). ``score_features`` scores recorded raw features; ``score``
    recomputes them with the base model (loaded on first use) and the task's chat format."""

    def __init__(self, w, lam: float, m: int, pairs_per_person: int, g_tol: float, feature_map: FeatureMap,
                 base_model: str = "smollm2", task: str | None = None, name: str = "policy-bt",
                 meta: dict | None = None, output_range: tuple[float, float] | None = None,
                 range_epsilon: float = 0.0):
        super().__init__(w, lam, m, pairs_per_person, g_tol, output_range, range_epsilon)
        self.feature_map, self.base_model, self.task = feature_map, base_model, task
        self.name, self.meta = name, meta or {}
        self._generator = None

    def score_features(self, raw: np.ndarray) -> np.ndarray:
        return self.feature_map(raw) @ self.w

    def _policy(self):
        if self._generator is None:
            from ..backends.transformers_backend import TransformersGenerator

            self._generator = TransformersGenerator(self.base_model)
        return self._generator

    def messages(self, prompt: str) -> list[dict]:
        from ..tasks import Problem, get_task

        if self.task is None:
            return [{"role": "user", "content": prompt}]
        return get_task(self.task).messages(Problem(id="", question=prompt, reference=""))

    def score(self, prompts, responses):
        out = np.empty(len(prompts))
        groups: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(p, []).append(i)
        for p, idx in groups.items():
            raw = self._policy().featurize(self.messages(p), [responses[i] for i in idx])
            out[idx] = self.score_features(raw)
        return out

    def save(self, path: str | Path) -> Path:
        return self._write_json(path, {"kind": "policy-bt", "base_model": self.base_model, "task": self.task,
                                       "name": self.name, **self.certificate(),
                                       "feature_map": self.feature_map.to_dict(), "meta": self.meta,
                                       "w": self.w.tolist()})

    @classmethod
    def load(cls, path: str | Path) -> "PolicyBTReward":
        body = json.loads(Path(path).read_text())
        if body.get("kind") != "policy-bt":
            raise ValueError(f"{path} is not a policy-bt reward model")
        return cls(np.array(body["w"]), body["lambda"], body["m"], body["pairs_per_person"], body["g_tol"],
                   FeatureMap.from_dict(body["feature_map"]), body.get("base_model", "smollm2"), body.get("task"),
                   body.get("name", "policy-bt"), body.get("meta"), body.get("output_range"),
                   body.get("range_epsilon", 0.0))


# ---------------------------------------------------------------------------------- training


def split_train_prompts(prompt_ids, fit_fraction: float = 0.6, seed: int = 0) -> tuple[set, set]:
    """A seeded split of the train prompts into (fit: preference data D, validation)."""
    if not 0 < fit_fraction < 1:
        raise ValueError(f"fit_fraction must lie in (0, 1), got {fit_fraction!r}")
    ids = np.unique(np.asarray(prompt_ids, str))
    perm = np.random.default_rng(seed).permutation(ids.size)
    k = max(1, min(ids.size - 1, int(round(fit_fraction * ids.size))))
    return set(ids[perm[:k]]), set(ids[perm[k:]])


def preference_rows(prompt_ids, correct, prompts: set, pairs_per_prompt: int, seed: int = 0
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Row indices (chosen, rejected): for each prompt in ``prompts`` with correct and incorrect
    samples, up to ``pairs_per_prompt`` distinct (correct, incorrect) pairs drawn at random."""
    rng = np.random.default_rng(seed)
    pid = np.asarray(prompt_ids, str)
    good = np.asarray(correct, float) >= 0.5
    chosen, rejected = [], []
    for p in sorted(prompts):
        rows = np.flatnonzero(pid == p)
        c, w = rows[good[rows]], rows[~good[rows]]
        if c.size == 0 or w.size == 0:
            continue
        pick = rng.choice(c.size * w.size, size=min(pairs_per_prompt, c.size * w.size), replace=False)
        chosen += c[pick // w.size].tolist()
        rejected += w[pick % w.size].tolist()
    return np.array(chosen, int), np.array(rejected, int)


def softmax_selection_accuracy(scores, correct, prompt_ids, temperature: float, n: int = 16, draws: int = 400,
                               seed: int = 0) -> float:
    """Mean accuracy of Gumbel PrivBoN (softmax at ``temperature`` over n candidates drawn with
    replacement from each prompt's samples), exact given the draws, averaged over prompts."""
    rng = np.random.default_rng(seed)
    pid = np.asarray(prompt_ids, str)
    y = np.asarray(correct, float)
    s = np.asarray(scores, float)
    accs = []
    for p in np.unique(pid):
        rows = np.flatnonzero(pid == p)
        pick = rows[rng.integers(0, rows.size, (draws, n))]
        prob = softmax_rows(s[pick], temperature)
        accs.append(float(np.mean((prob * y[pick]).sum(axis=1))))
    return float(np.mean(accs))


def train_policy_bt(raw: np.ndarray, prompt_ids, correct, *, task: str | None = None, base_model: str = "smollm2",
                    lambdas=(0.01, 0.03, 0.1, 0.3, 1.0), components=(8, 16), cs=(0.6, 0.8, 0.95),
                    pairs_per_prompt: int = 16, pairs_per_person: int = 1, fit_fraction: float = 0.6,
                    target_epsilon: float = 1.0, n_select: int = 16, g_tol: float = 1e-9, seed: int = 0,
                    range_epsilon: float = 0.1, rng: np.random.Generator | None = None,
                    name: str = "policy-bt") -> tuple[PolicyBTReward, list[dict]]:
    """Train ``policy-bt`` on graded policy samples of the train prompts; returns (model, grid).

    (q, c, lambda) is chosen on the validation prompts by the accuracy of Gumbel PrivBoN at
    ``target_epsilon`` per query and n = ``n_select`` (its noise follows from each candidate's own
    certified Delta_r), which weighs fit against the sensitivity that a small lambda costs; the
    within-prompt AUC and the log-probability's AUC are reported beside it. With
    ``range_epsilon > 0`` the declared output range is then released privately
    (``CertifiedBT.release_range``; OS entropy unless ``rng`` is given): the data-independent bound
    1/lambda is far wider than the scores, which starves ITP and PrivITP of acceptance mass.
    """
    pid = np.asarray(prompt_ids, str)
    y = np.asarray(correct, float)
    fit_p, val_p = split_train_prompts(pid, fit_fraction, seed)
    is_val = np.isin(pid, list(val_p))
    ci, ri = preference_rows(pid, y, fit_p, pairs_per_prompt, seed)
    if ci.size == 0:
        raise ValueError("no preference pair: no fit prompt has both a correct and an incorrect sample")
    lp_auc = within_prompt_auc(raw[is_val, -1], y[is_val], pid[is_val])
    grid, best = [], None
    for q, c in ((q, c) for q in components for c in cs):
        fmap = FeatureMap.fit(raw[is_val], q=q, c=c)
        phi = fmap(raw)
        d = phi[ci] - phi[ri]
        for lam in lambdas:
            w, g = fit_bt(d, lam, g_tol)
            model = PolicyBTReward(w, lam, d.shape[0], pairs_per_person, g_tol, fmap, base_model, task, name)
            s = phi[is_val] @ w
            temp = 2 * model.sensitivity / target_epsilon
            row = {"components": q, "c": c, "lambda": lam, "m": d.shape[0], "sensitivity": model.sensitivity,
                   "range_width": model.output_range[1] - model.output_range[0],
                   "val_auc": within_prompt_auc(s, y[is_val], pid[is_val]),
                   "val_privbon_accuracy": softmax_selection_accuracy(s, y[is_val], pid[is_val], temp, n_select,
                                                                      seed=seed),
                   "val_bon_accuracy": softmax_selection_accuracy(s, y[is_val], pid[is_val], 1e-9, n_select,
                                                                  seed=seed),
                   "train_pair_accuracy": float(np.mean(d @ w > 0)), "achieved_grad_norm": g}
            grid.append(row)
            if best is None or row["val_privbon_accuracy"] > best[0]["val_privbon_accuracy"]:
                best = (row, model)
    row, model = best
    if range_epsilon > 0:
        model.release_range(range_epsilon, rng)  # a one-time, private, tighter output range
    lo, hi = min(lambdas), max(lambdas)
    model.meta = {"task": task, "fit_prompts": len(fit_p), "validation_prompts": len(val_p),
                  "pairs_per_prompt": pairs_per_prompt, "seed": seed, "fit_fraction": fit_fraction,
                  "target_epsilon": target_epsilon, "n_select": n_select,
                  "val_auc": row["val_auc"], "val_logprob_auc": lp_auc,
                  "val_privbon_accuracy": row["val_privbon_accuracy"], "val_bon_accuracy": row["val_bon_accuracy"],
                  "val_base_accuracy": float(y[is_val].mean()), "train_pair_accuracy": row["train_pair_accuracy"],
                  "achieved_grad_norm": row["achieved_grad_norm"], "components": row["components"], "c": row["c"],
                  "lambda_on_grid_edge": row["lambda"] in (lo, hi) and lo < hi,
                  "on_grid_edge": [name for name, v, grid in (("q", row["components"], components), ("c", row["c"], cs),
                                                              ("lambda", row["lambda"], lambdas))
                                   if len(grid) > 1 and v in (min(grid), max(grid))]}
    return model, grid


ADVERSARIES = ("flipped", "extreme-norm", "duplicated")


def training_differences(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct) -> np.ndarray:
    """The preference differences d_i = phi(chosen) - phi(rejected) of the model's data D, rebuilt
    from the train pool with the split and seeds recorded in the model."""
    meta = model.meta
    pid = np.asarray(prompt_ids, str)
    fit_p, _ = split_train_prompts(pid, meta["fit_fraction"], meta["seed"])
    ci, ri = preference_rows(pid, correct, fit_p, meta["pairs_per_prompt"], meta["seed"])
    phi = model.feature_map(raw)
    return phi[ci] - phi[ri]


def check_sensitivity(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct, trials: int = 24,
                      seed: int = 0) -> list[dict]:
    """Retrain with one person's k pairs replaced by adversarial ones, ``trials`` times, cycling
    through ``ADVERSARIES``: their pairs flipped; pairs of the largest possible norm (phi+ = -phi- =
    a unit vector along +-w, or a random one); another person's pairs duplicated. Each row reports
    max |r_D - r_D'| over every train sample and ||w_D - w_D'||, the supremum over all inputs with
    ||phi|| <= 1, beside the certified Delta_r."""
    d = training_differences(model, raw, prompt_ids, correct)
    if d.shape[0] != model.m:
        raise ValueError(f"the train pool gives {d.shape[0]} pairs, the model was trained on m={model.m}")
    k = model.k
    w_d, _ = fit_bt(d, model.lam, model.g_tol)
    probe = model.feature_map(raw)
    rng = np.random.default_rng(seed)
    rows = []
    for trial in range(trials):
        kind = ADVERSARIES[trial % len(ADVERSARIES)]
        person = int(rng.integers(0, d.shape[0] // k))
        block = slice(person * k, person * k + k)
        d2 = d.copy()
        if kind == "flipped":
            d2[block] = -d[block]
        elif kind == "extreme-norm":
            u = w_d if trial % 2 else rng.standard_normal(d.shape[1])
            u = u / (np.linalg.norm(u) or 1.0) * (1 if rng.random() < 0.5 else -1)
            d2[block] = 2 * u
        else:
            other = int(rng.integers(0, d.shape[0] // k))
            d2[block] = d[other * k:other * k + k]
        w2, _ = fit_bt(d2, model.lam, model.g_tol)
        rows.append({"trial": trial, "adversary": kind, "person": person,
                     "max_score_change": float(np.max(np.abs(probe @ (w_d - w2)))),
                     "weight_change": float(np.linalg.norm(w_d - w2)), "certified": model.sensitivity})
    return rows
