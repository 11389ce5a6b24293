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

Preference data, built the realistic way (``train_procedure``): graded samples of the deployed
policy on the task's train prompts; a correct answer preferred over an incorrect one to the same
prompt, at most ``pairs_per_prompt`` distinct pairs per prompt. The train prompts are split once:
"fit" prompts give D; "validation" prompts (the curator's own, not in D) calibrate the feature map
and are split again to choose (q, c, lambda): candidate heads are trained on one half's pairs and
scored on the other half. D is read once, by the final head, with the chosen settings fixed: so
the certificate, which holds for fixed settings and a fixed feature map, covers the whole
procedure (docs/pipeline.md, "Why the certificate covers the choice"). Test prompts are never seen.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from ..metrics import softmax_rows, within_prompt_auc
from ..preferences.bounding import bound_per_person
from ..preferences.pairs import preference_rows
from ..preferences.persons import person_ids, roster_digest
from ..preferences.splits import split_ids, subsample_ids
from .embedding_bt import CertifiedBT, EmbeddingMap, bt_output_range, certified_sensitivity, fit_bt

MAP_ROWS = 4096  # rows that FeatureMap maps at a time (float64 of one block, never of the whole input)


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

    def with_settings(self, q: int, c: float, lp_clip: float) -> "FeatureMap":
        """``fit(raw, q, c, lp_clip)`` on the rows this map was fitted on, for q up to its own: its first
        q directions and scales, so that one SVD serves a grid of settings."""
        if not 0 <= c <= 1:
            raise ValueError(f"c must lie in [0, 1], got {c!r}")
        return replace(self, components=self.components[:q], scales=self.scales[:q], c=float(c),
                       lp_clip=float(lp_clip))

    def __call__(self, raw) -> np.ndarray:
        """phi of each row of ``raw``, mapped a block of rows at a time: an array (float32 or float64,
        a memory map) is never copied whole to float64, and rows that read themselves block by block
        (``map_rows``, as ``preference_features.CachedRows``) are read that way."""
        if hasattr(raw, "map_rows"):
            return raw.map_rows(self._map)
        raw = raw if getattr(raw, "ndim", 0) == 2 else np.atleast_2d(np.asarray(raw, np.float64))
        return np.concatenate([self._map(raw[lo:lo + MAP_ROWS]) for lo in range(0, max(len(raw), 1), MAP_ROWS)])

    def _map(self, raw: np.ndarray) -> np.ndarray:
        raw = np.asarray(raw, np.float64)
        if raw.shape[1] != 2 * self.hidden + 1:
            raise ValueError(f"raw features must have {2 * self.hidden + 1} columns, got {raw.shape[1]}")
        h = raw[:, self.hidden:2 * self.hidden]
        bad = ~np.isfinite(h).all(axis=1)  # a NaN or infinite hidden state: that row sits at the origin
        h = np.where(bad[:, None], self.mu, h)  # (an error would depend on one person's rows: issue 48)
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


def feature_map_from_dict(d: dict):
    """The feature map a head's file records: a ``FeatureMap`` of policy features, or the
    ``embedding_bt.EmbeddingMap`` of a head on sentence embeddings (``"kind": "embedding"``)."""
    return EmbeddingMap.from_dict(d) if d.get("kind") == EmbeddingMap.kind else FeatureMap.from_dict(d)


class PolicyFeaturizer(Protocol):
    """What a policy-bt head needs from its base model: the raw features of each response to one
    chat prompt, by teacher forcing (float32, one row per response). ``backends.TransformersGenerator``
    implements it; the floors above pass its class as the ``loader`` of ``use_policy``."""

    def featurize(self, messages: list[dict], responses: list[str]) -> np.ndarray: ...


class PolicyScoring:
    """Scoring through the policy's own features: ``score`` recomputes raw features of each response
    by teacher forcing with the base model in the task's chat format, then calls ``score_features``.
    Needs ``base_model``, ``task``, ``_generator`` and ``score_features``. ``use_policy(loader,
    dtype=, device=)`` says how the policy is built on first use: ``loader(base_model, **options)``
    returns a ``PolicyFeaturizer`` (the rewards floor never imports a backend itself); the features
    come back in float32 whatever the dtype."""

    policy_options: dict = {}
    policy_loader: Callable[..., PolicyFeaturizer] | None = None

    def use_policy(self, loader: Callable[..., PolicyFeaturizer] | None = None, **options):
        """Build the policy with ``loader(base_model, **options)`` (options such as ``dtype``,
        ``device``, ``batch_size``; None values are dropped) on first use; returns self."""
        self.policy_loader = loader
        self.policy_options = {k: v for k, v in options.items() if v is not None}
        self._generator = None
        return self

    @property
    def reads_policy_features(self) -> bool:
        """Whether the head's raw features are its base policy's (a pool's recorded features fit it);
        False for a head on sentence embeddings, whose feature map embeds the texts itself."""
        return not hasattr(self.feature_map, "featurizer")

    def _policy(self) -> PolicyFeaturizer:
        own = getattr(self.feature_map, "featurizer", None)  # a head on sentence embeddings embeds them itself
        if self._generator is None and own is not None:
            self._generator = own()
        if self._generator is None:
            if self.policy_loader is None:
                raise RuntimeError(f"{self.name}: scoring texts needs the base model {self.base_model!r}; attach "
                                   "it with use_policy(loader) (privalign's CLI and service pass "
                                   "backends.TransformersGenerator)")
            self._generator = self.policy_loader(self.base_model, **self.policy_options)
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


class PolicyBTReward(PolicyScoring, CertifiedBT):
    """r(x, y) = w . phi(raw(x, y)). ``score_features`` scores recorded raw features; ``score``
    recomputes them with the base model (loaded on first use) and the task's chat format."""

    def __init__(self, w, lam: float, m: int, pairs_per_person: int, g_tol: float, feature_map: FeatureMap,
                 base_model: str = "smollm2", task: str | None = None, name: str = "policy-bt",
                 meta: dict | None = None, output_range: tuple[float, float] | None = None,
                 range_epsilon: float = 0.0, private: dict | None = None):
        super().__init__(w, lam, m, pairs_per_person, g_tol, output_range, range_epsilon, private)
        self.feature_map, self.base_model, self.task = feature_map, base_model, task
        self.name, self.meta = name, meta or {}
        self._generator = None

    def hyperparameters(self) -> str:
        if self.meta.get("source") == "preferences" and self.meta.get("features") == "embedding":
            return ("lambda chosen on the public preference file only (--public); the feature map is the fixed "
                    "sentence embedding (nothing fitted); the final head trained once on D with that lambda")
        if self.meta.get("source") == "preferences":
            return ("(q, c, L, lambda) and the feature map chosen on the public preference file only (--public); the "
                    "final head trained once on D with those fixed settings")
        if "procedure" in self.meta:
            return ("(q, c, lambda) chosen without reading D: candidate heads trained and scored on the curator's "
                    "validation prompts only; the final head trained once on D with those fixed settings")
        return "unknown: trained by privalign < 0.2, whose choice of (q, c, lambda) read D (not covered; retrain)"

    @property
    def unit(self) -> str:
        """The unit of privacy of the certificate: ``person`` (``PreferenceData``) or the legacy ``pair``."""
        return ((self.meta or {}).get("procedure") or {}).get("unit", "pair")

    @property
    def persons(self) -> int:
        """P, the persons in D (the certificate's ``persons``), or m // k for a file that does not record it."""
        return int(self.meta.get("persons", self.m // self.k))

    def adjacency(self) -> str:
        if self.unit != "person":
            return (super().adjacency() + "; legacy unit: each pair counted as its own person, which under-states "
                    "one person's effect when they gave several pairs (retrain with unit 'person')")
        persons = self.persons
        return (f"person-level replacement: D and D' differ in one person's rows, replaced by any others or "
                f"emptied (their pairs: at most k = {self.k}, replaced by at most {self.k} others), P = {persons} "
                f"persons either way (the roster of ids is public), loss normalised by m = P k = {self.m}; adding "
                f"or removing an id changes P, a public input, and is not covered; a person is "
                f"{self.meta.get('person_definition', PERSON)}")

    def guarantee(self) -> dict:
        return {**super().guarantee(), "unit": self.unit,
                "public_inputs": self.meta.get("public_inputs", "not recorded (trained before privalign named its "
                                                                "public inputs): retrain")}

    def score_features(self, raw: np.ndarray) -> np.ndarray:
        return self.feature_map(raw) @ self.w

    def save(self, path: str | Path) -> Path:
        return self._write_json(path, {"kind": "policy-bt", "base_model": self.base_model, "task": self.task,
                                       "name": self.name, **self.certificate(),
                                       "guarantee": self.guarantee(),
                                       "feature_map": self.feature_map.to_dict(), "meta": self.meta,
                                       "w": self.w.tolist()})

    @classmethod
    def load(cls, path: str | Path) -> "PolicyBTReward":
        body = json.loads(Path(path).read_text())
        if body.get("kind") == "policy-bt-released":
            raise ValueError(f"{path} is a released head (w~, no exact weights): this needs the exact weights; pass "
                             "the operator's model file it was released from")
        if body.get("kind") != "policy-bt":
            raise ValueError(f"{path} is not a policy-bt reward model")
        return cls(np.array(body["w"]), body["lambda"], body["m"], body["pairs_per_person"], body["g_tol"],
                   feature_map_from_dict(body["feature_map"]), body.get("base_model", "smollm2"), body.get("task"),
                   body.get("name", "policy-bt"), body.get("meta"), body.get("output_range"),
                   body.get("range_epsilon", 0.0))


# ---------------------------------------------------------------------------------- training


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


PROCEDURE_DEFAULTS = {"lambdas": (0.01, 0.03, 0.1, 0.3, 1.0), "components": (8, 16), "cs": (0.6, 0.8, 0.95),
                      "lp_clips": (4.0,), "pairs_per_prompt": 16, "pairs_per_person": 16, "fit_fraction": 0.6,
                      "select_fraction": 0.5, "target_epsilon": 1.0, "n_select": 16, "g_tol": 1e-9, "seed": 0,
                      "max_pairs": None, "unit": "person", "max_persons": None, "objective": "privbon",
                      "release_epsilon": None, "release_delta": 1e-6, "release_draws": 50, "select_folds": 1}
OBJECTIVES = ("privbon", "release")
# objective "release": the grid's defaults widen towards what the release's noise rewards (fewer
# dimensions, more weight and spread on the log-probability, a larger lambda: a smaller Delta_r)
RELEASE_GRID = {"lambdas": (0.1, 0.3, 1.0, 3.0, 10.0), "components": (2, 4, 8, 16), "cs": (0.6, 0.8, 0.95, 0.99),
                "lp_clips": (1.0, 2.0, 4.0)}
# select_folds = 2 cross-fits its release score (each validation half scored by the candidate trained
# on the other); one fold stays the default, since two measured no better (docs/experiments.md)
RELEASE_DEFAULTS = {"select_folds": 1}
UNITS = ("person", "pair")
PERSON = ("the person who wrote and graded one train prompt's answers: every preference pair built from that "
          "prompt's graded samples is theirs")


@dataclass(frozen=True)
class PreferenceData:
    """D as the final head reads it: pairs (chosen, rejected) of row indices, each with its person.

    Unit ``person`` (the default): each fit prompt is one person (``PERSON``), P = the number of fit
    prompts (a seeded ``max_persons`` of them when set), fixed by the public prompt split whatever
    the grades; each person keeps at most k of their pairs (a seeded choice, before training, the
    excess dropped and counted) and the loss is normalised by m = P k, so one person's whole
    contribution moves the head by at most 4k/(m lambda) = 4/(P lambda). Unit ``pair`` (privalign
    <= 0.2 files only): every pair is its own person and m = the number of pairs."""

    chosen: np.ndarray
    rejected: np.ndarray
    person: np.ndarray      # the person (fit prompt id) of each pair
    persons: int            # P
    m: int                  # the loss normaliser: P k (person) or the number of pairs (pair)
    dropped: int            # pairs beyond k per person, dropped before training (D-derived: private)
    roster: tuple = ()      # D's persons by id (public: fixed by the prompt ids, whatever the grades)


def preference_data(prompt_ids, correct, fit_prompts: set, proc: dict) -> PreferenceData:
    """Build D from the fit prompts' graded samples under the procedure's unit (``PreferenceData``)."""
    pid = np.asarray(prompt_ids, str)
    if proc["unit"] == "pair":
        ci, ri = preference_rows(pid, correct, fit_prompts, proc["pairs_per_prompt"], proc["seed"])
        if proc["max_pairs"] is not None and ci.size > proc["max_pairs"]:  # a smaller deployment: fewer people
            keep = np.sort(np.random.default_rng([proc["seed"], 2]).choice(ci.size, proc["max_pairs"], replace=False))
            ci, ri = ci[keep], ri[keep]
        return PreferenceData(ci, ri, np.arange(ci.size).astype(str), int(ci.size), int(ci.size), 0,
                              tuple(sorted(fit_prompts)))
    people = sorted(fit_prompts)
    if proc["max_persons"] is not None:  # a smaller deployment: a keyed-hash subsample of the public ids
        people = subsample_ids(people, proc["max_persons"], proc["seed"])
    ci, ri = preference_rows(pid, correct, set(people), proc["pairs_per_prompt"], proc["seed"])
    person = pid[ci]
    keep = bound_per_person(person, proc["pairs_per_person"], proc["seed"])
    k = proc["pairs_per_person"]
    return PreferenceData(ci[keep], ri[keep], person[keep], len(people), len(people) * k, int(ci.size - keep.size),
                          tuple(people))


@dataclass
class Trained:
    """One run of the training procedure (``train_procedure``): the chosen settings, the feature map,
    the final head on D, and what it was chosen from. ``grid`` and ``public`` read only the curator's
    validation prompts; ``private`` is derived from D without privacy."""

    components: int
    c: float
    lam: float
    feature_map: FeatureMap
    w: np.ndarray
    m: int
    grid: list[dict]
    public: dict
    private: dict
    data: PreferenceData | None = None

    @property
    def settings(self) -> tuple[int, float, float, float]:
        """(q, c, L, lambda): everything the procedure chose."""
        return self.components, self.c, self.feature_map.lp_clip, self.lam


def _check_procedure(proc: dict) -> dict:
    unknown = set(proc) - set(PROCEDURE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown training settings {sorted(unknown)}; known: {sorted(PROCEDURE_DEFAULTS)}")
    objective = proc.get("objective", PROCEDURE_DEFAULTS["objective"])
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    grid = {key: v for key, v in proc.items() if key in RELEASE_GRID and v is not None}
    proc = {**PROCEDURE_DEFAULTS, **({**RELEASE_GRID, **RELEASE_DEFAULTS} if objective == "release" else {}),
            **{key: v for key, v in proc.items() if key not in RELEASE_GRID}, **grid}
    for key in ("lambdas", "components", "cs", "lp_clips"):
        proc[key] = tuple(proc[key])
        if not proc[key]:
            raise ValueError(f"{key} must name at least one value, got {proc[key]!r}")
    if min(proc["lambdas"]) <= 0:
        raise ValueError(f"lambdas must be positive, got {proc['lambdas']!r}")
    if min(proc["lp_clips"]) <= 0:
        raise ValueError(f"lp_clips must be positive, got {proc['lp_clips']!r}")
    if objective == "release":
        eps, dlt = proc["release_epsilon"], proc["release_delta"]
        if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            raise ValueError(f"objective 'release' needs a positive, finite release_epsilon, got {eps!r}")
        if not (isinstance(dlt, (int, float)) and 0 < dlt < 1):
            raise ValueError(f"release_delta must lie in (0, 1), got {dlt!r}")
        if not (isinstance(proc["release_draws"], int) and proc["release_draws"] >= 1):
            raise ValueError(f"release_draws must be an integer >= 1, got {proc['release_draws']!r}")
        if proc["unit"] != "person":
            raise ValueError(f"objective 'release' needs unit 'person' (a release bounds one person), got "
                             f"{proc['unit']!r}")
    if proc["select_folds"] not in (1, 2) or isinstance(proc["select_folds"], bool):
        raise ValueError(f"select_folds must be 1 (score on one validation half) or 2 (cross-fitted), got "
                         f"{proc['select_folds']!r}")
    if proc["select_folds"] == 2 and objective != "release":
        raise ValueError("select_folds=2 cross-fits the release objective's score; objective 'privbon' scores "
                         "one validation half (select_folds=1)")
    if proc["pairs_per_person"] < 1:
        raise ValueError(f"pairs_per_person must be >= 1, got {proc['pairs_per_person']!r}")
    if proc["max_pairs"] is not None and proc["max_pairs"] < 1:
        raise ValueError(f"max_pairs must be >= 1 or None, got {proc['max_pairs']!r}")
    if proc["unit"] not in UNITS:
        raise ValueError(f"unit must be one of {UNITS}, got {proc['unit']!r}")
    if proc["unit"] == "person" and proc["max_pairs"] is not None:
        raise ValueError(f"max_pairs={proc['max_pairs']!r} counts pairs; with unit 'person' use max_persons")
    if proc["max_persons"] is not None and (proc["unit"] != "person" or proc["max_persons"] < 1):
        raise ValueError(f"max_persons must be >= 1 (unit 'person') or None, got {proc['max_persons']!r}")
    return proc


RELEASE_SCORES = ("selection_release_mean", "selection_release_p5")


def _release_score(phis: list, ws: list, sensitivity: float, corrects: list, prompt_ids: list, proc: dict) -> dict:
    """A candidate head as its release would be: BoN at n = ``n_select`` with w + sigma Z over
    ``release_draws`` seeded draws Z (the same draws for every candidate of a dimension, and for
    every fold), sigma the analytic Gaussian scale at the *final* head's Delta_r and
    (release_epsilon, release_delta). Each fold f scores its own prompts with its own head w_f; a
    draw's accuracy is the prompt-weighted mean over the folds (cross-fitted: every scored prompt by
    a head not trained on it). Returns the draws' mean accuracy and their 5th percentile: the choice
    maximises the 5th percentile, the lower tail a deployment lives with (it draws the noise once)."""
    from ..accounting import gaussian_mechanism_noise_scale
    from ..evaluation.release import release_curves

    sigma = gaussian_mechanism_noise_scale(proc["release_epsilon"], sensitivity, proc["release_delta"])
    total, prompts = 0.0, 0
    for phi, w, y, pid in zip(phis, ws, corrects, prompt_ids):
        r = release_curves(phi, w, sigma, pid, y, (proc["n_select"],), proc["release_draws"],
                           np.random.default_rng([proc["seed"], 5]))
        count = np.unique(np.asarray(pid, str)).size
        total, prompts = total + count * r["draws"][("bon", proc["n_select"])], prompts + count
    acc = total / prompts
    return dict(zip(RELEASE_SCORES, (float(acc.mean()), float(np.percentile(acc, 5)))))


def train_procedure(raw: np.ndarray, prompt_ids, correct, choices: dict | None = None, **settings) -> Trained:
    """The whole training procedure, selection included (``train_policy_bt`` builds the model from it).

    1. The train prompts are split (seed) into fit prompts, whose preference pairs are D (a seeded
       random ``max_pairs`` of them when set: what a smaller deployment has), and the curator's
       validation prompts; the validation prompts are split again (seed + 1) into a
       selection-fit half and a selection-score half.
    2. For every (q, c) the feature map is calibrated on the validation prompts; for every lambda a
       candidate head is trained on the selection-fit prompts' pairs and scored on the
       selection-score prompts by the accuracy of Gumbel PrivBoN at ``target_epsilon`` and n =
       ``n_select``, its noise set by the Delta_r the *final* head will have (4k/(m lambda) +
       2 g_tol/lambda, with m = |D|, which replacement adjacency keeps fixed). The best is kept.
       With ``objective="release"`` the grid is ``RELEASE_GRID`` (log-probability clips L too),
       candidates are trained like the final head (k pairs per person, loss normalised by P_sel k)
       and scored by BoN with the head released at (release_epsilon, release_delta): the 5th
       percentile over ``release_draws`` draws, then the mean (``_release_score``). With
       ``select_folds=2`` the halves also swap roles, and the
       release score pools both: each validation prompt scored by a candidate not trained on it.
       None of this reads D, so the choice (q, c, lambda) and the feature map are the same for every
       D' ~ D: they are fixed, data-independent settings from D's point of view.
    3. The one final head is trained on D with those settings (``fit_bt``), so the certificate
       Delta_r = 4k/(m lambda) + 2 g_tol/lambda covers the procedure as a whole.

    ``choices`` (a dict kept between calls: the neighbour search, the audit) reuses step 2 when the
    validation rows, m and the settings are byte for byte the same: step 2 reads exactly those.
    """
    proc = _check_procedure(settings)
    pid = person_ids(prompt_ids)
    y = np.asarray(correct, float)
    fit_p, val_p = split_ids(pid, proc["fit_fraction"], proc["seed"])
    sel_fit, sel_score = split_ids(val_p, proc["select_fraction"], proc["seed"] + 1)
    data = preference_data(pid, y, fit_p, proc)
    if data.chosen.size == 0:
        raise ValueError("no preference pair: no fit prompt has both a correct and an incorrect sample")
    release = proc["objective"] == "release"
    if release and not proc["release_delta"] < 1 / data.persons:
        raise ValueError(f"release_delta must lie in (0, 1/P) = (0, {1 / data.persons:.3g}) for P = {data.persons} "
                         f"persons, got {proc['release_delta']!r}")
    halves = [(sel_fit, sel_score), (sel_score, sel_fit)][:proc["select_folds"]]
    folds = [_selection_fold(pid, y, fit, score, proc, i) for i, (fit, score) in enumerate(halves)]
    is_val = np.isin(pid, list(val_p))
    key = _choice_key(raw, pid, y, is_val, data.m, proc) if choices is not None else None
    if key is None or key not in choices:
        chosen = _choose_settings(raw, pid, y, is_val, folds, data.m, proc)
        if key is not None:
            choices[key] = chosen
    row, fmap, grid = chosen if key is None else choices[key]
    # the final head: D, once, with the settings chosen above
    phi = fmap(raw)
    d = phi[data.chosen] - phi[data.rejected]
    w, g = fit_bt(d, row["lambda"], proc["g_tol"], normalizer=data.m)
    sizes = {"fit_prompts": len(fit_p), "persons": data.persons, "validation_prompts": len(val_p),
             "selection_fit_prompts": len(sel_fit), "selection_score_prompts": len(sel_score),
             "selection_pairs": int(folds[0].chosen.size)}
    is_sc = folds[0].scored
    public = _public_record(row, proc, sizes, raw[is_sc, -1], y[is_sc], pid[is_sc])
    public["public_inputs"] = public_inputs(val_p, data.roster, proc)
    private = _private_record(phi[is_val] @ w, y[is_val], pid[is_val], d, w, g, row, data, proc)
    return Trained(row["components"], row["c"], row["lambda"], fmap, w, data.m, grid, public, private, data)


def _private_record(s_val, y_val, pid_val, d, w, g, row: dict, data, proc: dict) -> dict:
    """Diagnostics that read D (kept in the operator's file only): the final head on the validation
    prompts, its accuracy on its own pairs, the achieved gradient norm, the pairs used and dropped."""
    sens = certified_sensitivity(data.m, row["lambda"], proc["pairs_per_person"], proc["g_tol"])
    return {"val_auc": within_prompt_auc(s_val, y_val, pid_val),
            "val_privbon_accuracy": softmax_selection_accuracy(s_val, y_val, pid_val, 2 * sens / proc["target_epsilon"],
                                                               proc["n_select"], seed=proc["seed"]),
            "train_pair_accuracy": float(np.mean(d @ w > 0)), "achieved_grad_norm": g,
            "pairs": int(data.chosen.size), "pairs_dropped_beyond_k": data.dropped,
            "weight_norm": float(np.linalg.norm(w))}


@dataclass(frozen=True)
class SelectionFold:
    """One fold of the choice: candidate heads are trained on ``chosen``/``rejected`` (pairs of one
    validation half) and scored on the rows ``scored`` (the other half), with loss normaliser ``norm``."""

    chosen: np.ndarray
    rejected: np.ndarray
    scored: np.ndarray  # a row mask
    norm: float | None


def _selection_fold(pid, y, fit: set, score: set, proc: dict, index: int) -> SelectionFold:
    """Fold ``index`` of the choice: the pairs of the validation half ``fit`` and the rows of ``score``.
    With the release objective, candidates mimic the final head: at most k pairs per person and the
    loss normalised by P_fit k."""
    si, sr = preference_rows(pid, y, fit, proc["pairs_per_prompt"], proc["seed"])
    if si.size == 0:
        half = "selection-fit" if index == 0 else "selection-score (select_folds=2 trains on it too)"
        raise ValueError(f"no selection pair: no validation prompt of the {half} half has both a correct and an "
                         "incorrect sample (more train prompts, or a larger select_fraction)")
    norm = None
    if proc["objective"] == "release":
        keep = bound_per_person(pid[si], proc["pairs_per_person"], proc["seed"])
        si, sr, norm = si[keep], sr[keep], len(fit) * proc["pairs_per_person"]
    return SelectionFold(si, sr, np.isin(pid, list(score)), norm)


def _choose_settings(raw, pid, y, is_val, folds: list[SelectionFold], m: int, proc: dict):
    """Step 2 of ``train_procedure``, on the validation prompts only: every (q, c, L) feature map and
    every lambda's candidate head, trained and scored on each fold. The row's AUC and PrivBoN / BoN
    accuracies are the first fold's; the release score pools every fold's (``_release_score``).
    Returns (the best row, its feature map, every row)."""
    release = proc["objective"] == "release"
    k, g_tol = proc["pairs_per_person"], proc["g_tol"]

    def rank(row):  # release: the 5th percentile, then the mean; else PrivBoN at target_epsilon
        return (row["selection_release_p5"], row["selection_release_mean"]) if release else \
            (row["selection_privbon_accuracy"],)

    grid, best = [], None
    for q in proc["components"]:
        for c in proc["cs"]:
            for lp_clip in proc["lp_clips"]:
                fmap = FeatureMap.fit(raw[is_val], q=q, c=c, lp_clip=lp_clip)
                diffs = [fmap(raw[f.chosen]) - fmap(raw[f.rejected]) for f in folds]
                phis = [fmap(raw[f.scored]) for f in folds]
                for lam in proc["lambdas"]:
                    ws = [fit_bt(d, lam, g_tol, normalizer=f.norm)[0] for d, f in zip(diffs, folds)]
                    sc = folds[0].scored
                    row = _candidate_row(phis[0] @ ws[0], q, c, lp_clip, lam, certified_sensitivity(m, lam, k, g_tol),
                                         y[sc], pid[sc], proc)
                    row["selection_weight_norm"] = float(np.linalg.norm(ws[0]))
                    if release:
                        row.update(_release_score(phis, ws, row["sensitivity"], [y[f.scored] for f in folds],
                                                  [pid[f.scored] for f in folds], proc))
                    grid.append(row)
                    if best is None or rank(row) > rank(best[0]):
                        best = (row, fmap)
    return best[0], best[1], grid


def _candidate_row(s, q, c, lp_clip, lam, sens, y, pid, proc: dict) -> dict:
    """A candidate head's scores ``s`` on the selection-score prompts: AUC, and the accuracy of
    Gumbel PrivBoN at target_epsilon (noise at the final head's Delta_r ``sens``) and of BoN."""
    return {"components": q, "c": c, "lp_clip": lp_clip, "lambda": lam, "sensitivity": sens,
            "range_width": 2 * bt_output_range(lam, proc["g_tol"])[1],
            "selection_auc": within_prompt_auc(s, y, pid),
            "selection_privbon_accuracy": softmax_selection_accuracy(
                s, y, pid, 2 * sens / proc["target_epsilon"], proc["n_select"], seed=proc["seed"]),
            "selection_bon_accuracy": softmax_selection_accuracy(s, y, pid, 1e-9, proc["n_select"], seed=proc["seed"])}


def public_inputs(validation: set, roster, proc: dict) -> dict:
    """Every input the guarantee assumes public, named: it protects none of them (docs/accounting.md,
    "Public inputs")."""
    return {"validation_persons": sorted(map(str, validation)),
            "validation_use": "their grades and the policy's features of their samples fit the feature map (mu, "
                              "components, scales: published in this file) and choose (q, c, L, lambda); they get "
                              "no protection, so the curator must hold their consent or use public data",
            "person_ids": {"count": len(set(map(str, roster))), "blake2b": roster_digest(roster),
                           "use": "the roster of D's persons (fit prompt ids): it fixes P, the split and each "
                                  "person's stream; which persons are in D is public, their rows are protected"},
            "prompt_ids": "every train prompt id (the fit / validation split is a keyed hash of the id)",
            "seed": proc["seed"], "settings_grid": "the candidate (q, c, L, lambda) and k, chosen by the operator"}


def _choice_key(raw, pid, y, is_val, m: int, proc: dict) -> str:
    """A digest of everything step 2 reads: the validation rows (features, ids, grades), m and the settings."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for part in (np.ascontiguousarray(raw[is_val]), pid[is_val].astype("U"), np.asarray(y, float)[is_val]):
        h.update(part.tobytes())
    h.update(repr((int(m), sorted((k, repr(v)) for k, v in proc.items()))).encode())
    return h.hexdigest()


def _public_record(row: dict, proc: dict, sizes: dict, logprob_sc, y_sc, pid_sc) -> dict:
    """What the model file may say about the procedure: the split's sizes, the chosen settings and
    their validation scores, and whether a choice lies on its grid's edge (nothing read from D)."""
    grids = {"q": proc["components"], "c": proc["cs"], "lp_clip": proc["lp_clips"], "lambda": proc["lambdas"]}
    chosen = {"q": row["components"], "c": row["c"], "lp_clip": row["lp_clip"], "lambda": row["lambda"]}
    return {**sizes, "components": row["components"], "c": row["c"], "lp_clip": row["lp_clip"],
            "selection_auc": row["selection_auc"], "selection_privbon_accuracy": row["selection_privbon_accuracy"],
            "selection_bon_accuracy": row["selection_bon_accuracy"],
            **({name: row[name] for name in RELEASE_SCORES} if proc["objective"] == "release" else {}),
            "selection_logprob_auc": within_prompt_auc(logprob_sc, y_sc, pid_sc),
            "selection_base_accuracy": float(y_sc.mean()),
            "on_grid_edge": [n for n, v in chosen.items() if len(grids[n]) > 1 and v in (min(grids[n]), max(grids[n]))],
            "procedure": {key: list(v) if isinstance(v, tuple) else v for key, v in proc.items()}}


def train_policy_bt(raw: np.ndarray, prompt_ids, correct, *, task: str | None = None, base_model: str = "smollm2",
                    range_epsilon: float = 0.1, rng: np.random.Generator | None = None, name: str = "policy-bt",
                    **settings) -> tuple[PolicyBTReward, list[dict]]:
    """Train ``policy-bt`` on graded policy samples of the train prompts; returns (model, grid).

    ``train_procedure`` chooses (q, c, lambda) without reading D and trains the final head on D
    (``settings``: any of ``PROCEDURE_DEFAULTS``). With ``range_epsilon > 0`` the declared output
    range is then released privately (``CertifiedBT.release_range``; OS entropy unless ``rng`` is
    given): the data-independent bound 1/lambda is far wider than the scores, which starves ITP and
    PrivITP of acceptance mass. The model's ``meta`` holds only what does not read D (and the
    procedure, so that ``check_sensitivity`` can rerun it); ``model.private`` holds D-derived
    diagnostics, written apart by ``save_private``.
    """
    t = train_procedure(raw, prompt_ids, correct, **settings)
    proc = t.public["procedure"]
    model = PolicyBTReward(t.w, t.lam, t.m, proc["pairs_per_person"], proc["g_tol"], t.feature_map, base_model, task,
                           name, {"task": task, **t.public, "head_id": uuid.uuid4().hex}, private=t.private)
    if range_epsilon > 0:
        model.release_range(range_epsilon, rng)  # a one-time, private, tighter output range
    return model, t.grid


def model_procedure(model: PolicyBTReward) -> dict:
    """The training settings recorded in a model file (refuses files trained by the old procedure)."""
    proc = (model.meta or {}).get("procedure")
    if (model.meta or {}).get("source") == "preferences":
        raise ValueError("this head was trained on a preference file (rm train --preferences), not on a train "
                         "pool: its procedure reruns from that file (rewards.preference_bt), not from a pool")
    if proc is None:
        raise ValueError("this model file records no training procedure: it was trained by privalign < 0.2, whose "
                         "choice of (q, c, lambda) read D, so its certificate does not cover it; retrain it")
    # files before the person unit counted each pair as a person; before cross-fitting, one fold scored
    return {"unit": "pair", "select_folds": 1, **proc}


def retrain(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct, *, neighbour: bool = False,
            choices: dict | None = None) -> Trained:
    """Rerun the model's whole training procedure (selection included) on a train pool: its own, which
    must reproduce the model's settings and weights, or (``neighbour``) a neighbour's, which must keep
    the settings (the choice never reads D)."""
    t = train_procedure(raw, prompt_ids, correct, choices, **model_procedure(model))
    chosen = (model.meta["components"], model.meta["c"], model.feature_map.lp_clip, model.lam)
    if not neighbour and (t.m != model.m or t.settings != chosen
                          or not np.allclose(t.w, model.w, rtol=0, atol=1e-6)):
        raise ValueError(f"the train pool does not reproduce the model (m = {t.m} against {model.m}, settings "
                         f"{t.settings}): pass the pool it was trained on, with a model trained by this privalign")
    return t


