"""A private reward model: a certified head released once with Gaussian output perturbation.

The certificate of a ``policy-bt`` head (unit: a person, ``policy_bt.PreferenceData``) bounds how far
one person can move its weights: ||w_D - w_D'||_2 <= 4k/(m lambda) + 2 g_tol/lambda = Delta_r. The
release is

    w~ = w_D + N(0, sigma^2 I),   sigma = the analytic Gaussian scale (Balle & Wang 2018) for
                                  L2 sensitivity Delta_r at (epsilon_w, delta_w)

(Chaudhuri, Monteleoni & Sarwate 2011's output perturbation), drawn once from the secure generator.
w~ is (epsilon_w, delta_w)-DP with respect to person-level replacement, and every use of it, the
feature map being fixed without reading D, is post-processing: BoN, soft BoN at any temperature,
any n, any number of queries cost nothing more. The released file holds w~, the feature map and
the guarantee, and none of the exact weights or D-derived diagnostics, so it may be published.

No output range is needed when no per-query mechanism follows (BoN reads only the order of the
scores); a per-query mechanism on the *exact* head still charges each query, and composes with the
release in the model budget (docs/accounting.md, "A private reward model").
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .._validation import as_generator
from .base import RewardModel
from .policy_bt import FeatureMap, PolicyBTReward, PolicyScoring, feature_map_from_dict

if TYPE_CHECKING:
    from ..evaluation.release import StudyHead

RELEASED_KIND = "policy-bt-released"
PROCEDURE = ("Gaussian output perturbation of the certified head: w~ = w + N(0, sigma^2 I), sigma the analytic "
             "Gaussian scale for L2 sensitivity Delta_r at (epsilon_w, delta_w), drawn once from the secure "
             "generator; every selection with w~ is post-processing")


def check_release(model: PolicyBTReward, epsilon, delta) -> tuple[float, float]:
    """(epsilon, delta) for releasing ``model``, or a one-line ValueError naming what is wrong."""
    if not isinstance(model, PolicyBTReward):
        raise ValueError(f"only a certified policy-bt head can be released, got {type(model).__name__}")
    if model.unit != "person":
        raise ValueError(f"model {model.name!r} was trained by an older procedure (unit {model.unit!r}: each pair "
                         "counted as its own person), so its certificate does not bound one person; retrain it")
    if "head_id" not in model.meta:
        raise ValueError(f"model {model.name!r} has no head_id (trained before releases existed); retrain it")
    try:
        eps, dlt = float(epsilon), float(delta)
    except (TypeError, ValueError):
        raise ValueError(f"epsilon and delta must be numbers, got {epsilon!r} and {delta!r}") from None
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"epsilon must be positive and finite, got {epsilon!r}")
    persons = model.persons
    if not (math.isfinite(dlt) and 0 < dlt < 1 / persons):
        raise ValueError(f"delta must lie in (0, 1/P) = (0, {1 / persons:.3g}) for P = {persons} persons, "
                         f"got {delta!r}")
    return eps, dlt


def release_noise_scale(model: PolicyBTReward, epsilon: float, delta: float, persons: int | None = None,
                        pairs_per_person: int | None = None) -> float:
    """sigma: the analytic Gaussian scale for L2 sensitivity Delta_r = ``model.sensitivity``, or, with
    ``persons`` = P' (and ``pairs_per_person`` = k', default the model's k), the Delta_r of the same
    procedure on P' persons of k' pairs each (m' = P' k' pairs): 4 k' / (m' lambda) + 2 g_tol / lambda.
    This what-if keeps delta as given (checked against the model's own P): a head really trained on
    P' persons would want delta < 1/P' as well."""
    from ..accounting import gaussian_mechanism_noise_scale
    from .embedding_bt import certified_sensitivity

    eps, dlt = check_release(model, epsilon, delta)
    if persons is None and pairs_per_person is None:
        return gaussian_mechanism_noise_scale(eps, model.sensitivity, dlt)
    k = model.k if pairs_per_person is None else int(pairs_per_person)
    p = model.persons if persons is None else int(persons)
    if k < 1 or p < 1:
        raise ValueError(f"persons and pairs_per_person must be >= 1, got persons={persons!r}, "
                         f"pairs_per_person={pairs_per_person!r}")
    return gaussian_mechanism_noise_scale(eps, certified_sensitivity(p * k, model.lam, k, model.g_tol), dlt)


class ReleasedHead(PolicyScoring, RewardModel):
    """r~(x, y) = w~ . phi(raw(x, y)): a head released once (module docstring). Scoring with it costs
    no privacy; it has no exact weights, so whatever needs them (``check-sensitivity``, the query
    audit, a second release, per-query noise calibrated to the head) refuses it."""

    released = True
    output_range = (-math.inf, math.inf)  # no per-query mechanism follows, so no range is needed
    sensitivity = None

    def __init__(self, w_tilde, feature_map: FeatureMap, release: dict, base_model: str = "smollm2",
                 task: str | None = None, name: str = "policy-bt-released"):
        self.w_tilde = np.asarray(w_tilde, float)
        self.feature_map, self.release, self.base_model, self.task, self.name = (
            feature_map, dict(release), base_model, task, name)
        self._generator = None
        if self.w_tilde.shape != (feature_map.dim,):
            raise ValueError(f"w~ must have {feature_map.dim} entries, got shape {self.w_tilde.shape}")

    @property
    def epsilon(self) -> float:
        return float(self.release["epsilon"])

    @property
    def delta(self) -> float:
        return float(self.release["delta"])

    @property
    def release_id(self) -> str:
        return str(self.release["release_id"])

    def score_features(self, raw: np.ndarray) -> np.ndarray:
        return self.feature_map(raw) @ self.w_tilde

    def body(self) -> dict:
        return {"kind": RELEASED_KIND, "name": self.name, "base_model": self.base_model, "task": self.task,
                "publishable": True,
                "note": "differentially private release of a reward model: this file may be published; it holds "
                        "no exact weights and nothing else derived from the preference data without privacy",
                "guarantee": self.release, "feature_map": self.feature_map.to_dict(),
                "w_tilde": self.w_tilde.tolist()}

    def save(self, path: str | Path) -> Path:
        return PolicyBTReward._write_json(path, self.body())

    @classmethod
    def load(cls, path: str | Path) -> "ReleasedHead":
        body = json.loads(Path(path).read_text())
        if body.get("kind") != RELEASED_KIND:
            raise ValueError(f"{path} is not a released head (kind {body.get('kind')!r})")
        return cls(np.array(body["w_tilde"]), feature_map_from_dict(body["feature_map"]), body["guarantee"],
                   body.get("base_model", "smollm2"), body.get("task"), body.get("name", "policy-bt-released"))


def draw_release(w: np.ndarray, sigma: float, rng: np.random.Generator, draws: int | None = None) -> np.ndarray:
    """The release's sampling step, w + N(0, sigma^2 I): one w~ (``draws`` None, as ``release_head``
    draws it) or ``draws`` independent ones, shape (draws, w.size), for the release audit
    (``audit.audit_release``). With the same generator state the first of ``draws`` rows is the
    single draw."""
    w = np.asarray(w, float)
    return w + sigma * rng.standard_normal(w.size if draws is None else (int(draws), w.size))


def study_head(model: PolicyBTReward) -> "StudyHead":
    """What ``evaluation.release`` needs of a certified head (``check_release``'s checks on the model)."""
    from ..evaluation.release import StudyHead

    check_release(model, 1.0, 1e-12)
    return StudyHead(model.name, tuple(float(v) for v in model.w), float(model.sensitivity),
                     model.persons, int(model.k),
                     tuple(float(v) for v in model.output_range), model.meta["head_id"])


def release_head(model: PolicyBTReward, epsilon: float, delta: float,
                 rng: np.random.Generator | None = None) -> ReleasedHead:
    """Release ``model`` once at (epsilon, delta): w~ = w + N(0, sigma^2 I) (module docstring). The
    noise comes from the secure generator unless a seeded ``rng`` is passed (tests, studies)."""
    eps, dlt = check_release(model, epsilon, delta)
    sigma = release_noise_scale(model, eps, dlt)
    w_tilde = draw_release(model.w, sigma, as_generator(rng))
    persons = model.persons
    release = {"epsilon": eps, "delta": dlt, "sigma": sigma, "sensitivity": model.sensitivity,
               "adjacency": model.adjacency(), "procedure": PROCEDURE, "hyperparameters": model.hyperparameters(),
               "persons": persons, "pairs_per_person": model.k, "m": model.m, "lambda": model.lam,
               "g_tol": model.g_tol, "head_id": model.meta["head_id"], "release_id": uuid.uuid4().hex,
               "source_name": model.name, "query_epsilon": 0.0, "unit": model.unit,
               "public_inputs": model.meta.get("public_inputs", "not recorded (trained before privalign named its "
                                                                  "public inputs): retrain"),
               "composition": "every selection with w~ is post-processing (0 per query); per-query noise on the "
                              "exact head composes with this release in the model budget (epsilon_w + the "
                              "queries', delta_w + theirs)"}
    return ReleasedHead(w_tilde, model.feature_map, release, model.base_model, model.task, f"{model.name}-released")


def releases_path(model_path: str | Path) -> Path:
    """Where the releases of a model file are recorded: beside it (``<model>.releases.json``)."""
    p = Path(model_path)
    return p.with_name(p.stem + ".releases.json")


def recorded_releases(model_path: str | Path, head_id: str) -> list[dict]:
    """The releases of head ``head_id`` recorded beside its model file (oldest first)."""
    path = releases_path(model_path)
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text()).get("releases", []) if r.get("head_id") == head_id]


def compose_releases(head: ReleasedHead, earlier: list[dict]) -> dict:
    """The total that ``head``'s release and the ``earlier`` ones of the same head spend together
    (basic composition: the epsilons and deltas add), recorded in the new file's guarantee."""
    eps = head.epsilon + sum(float(r["epsilon"]) for r in earlier)
    dlt = head.delta + sum(float(r["delta"]) for r in earlier)
    return {"releases": len(earlier) + 1, "epsilon": eps, "delta": dlt, "composition": "basic (epsilons and deltas add)",
            "earlier": [r["release_id"] for r in earlier],
            "note": "every release of this head is a view of the same person's data: what they reveal together is "
                    "this total, not this file's own (epsilon, delta)"}


def record_release(model_path: str | Path, head: ReleasedHead, out: str | Path) -> Path:
    """Append ``head``'s release to the record beside its model file (atomically)."""
    path = releases_path(model_path)
    body = json.loads(path.read_text()) if path.exists() else {"releases": []}
    body["releases"].append({"head_id": head.release["head_id"], "release_id": head.release_id,
                             "epsilon": head.epsilon, "delta": head.delta, "file": str(out)})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(body, indent=1))
    tmp.replace(path)
    return path


def head_phi(model: PolicyBTReward, raw: np.ndarray | None, phi: np.ndarray | None = None) -> np.ndarray:
    """The head's feature coordinates phi(x, y): ``phi`` as given (a pool's stored ones), or the
    feature map of the raw policy features ``raw``; a one-line ValueError when neither fits."""
    if phi is None:
        if raw is None:
            raise ValueError("give the raw policy features or the head's feature coordinates phi")
        return model.feature_map(raw)
    phi, dim = np.asarray(phi, float), model.feature_map.dim
    if phi.ndim != 2 or phi.shape[1] != dim:
        raise ValueError(f"phi must have shape (rows, {dim}) for head {model.name!r}, got {phi.shape}")
    return phi


def release_accuracy(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct, epsilon: float, delta: float,
                     n: int = 16, draws: int = 60, rng: np.random.Generator | None = None,
                     persons: int | None = None, phi: np.ndarray | None = None,
                     pairs_per_person: int | None = None) -> dict:
    """What a release at (epsilon, delta) keeps of BoN's lift on a pool, over ``draws`` release draws.

    For each draw w~ = w + sigma Z, BoN's accuracy at n (candidates drawn with replacement from each
    prompt's samples) is exact given the scores phi . w~ (``evaluation.laws.bon_exact``), averaged over
    prompts. Returns the mean, the 5th percentile and every draw's accuracy, beside BoN with the exact
    head and the base policy, and the share of BoN's lift (acc - base) / (bon - base) each keeps. A
    deployment lives with one draw: the 5th percentile is its lower tail. With ``persons`` = P', the
    noise is that of a head on P' persons (``release_noise_scale``) while w stays the head's own: what
    more preference data buys through the noise alone (a head on more data is also a better head,
    which this leaves out); ``pairs_per_person`` = k' makes them P' persons of k' pairs each.
    ``phi``, the head's own feature coordinates (``Pool.head_features``), stands in for ``raw``
    (``head_phi``)."""
    from ..evaluation.release import release_share

    eps, dlt = check_release(model, epsilon, delta)
    sigma = release_noise_scale(model, eps, dlt, persons, pairs_per_person)
    r = release_share(head_phi(model, raw, phi), study_head(model), prompt_ids, correct, eps, n, delta_w=dlt,
                      draws=draws, sigma=sigma, rng=as_generator(rng))
    return {"epsilon": eps, "delta": dlt, "sigma": sigma, "n": n, "draws": draws, "mean": r["mean"], "p5": r["p5"],
            "accuracies": r["accuracies"].tolist(), "bon": r["bon"], "base": r["base"],
            "share_mean": r["share_mean"], "share_p5": r["share_p5"]}


def pairs_for_share(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct, epsilon: float, delta: float,
                    target: float = 0.9, tail: float = 0.8, n: int = 16, draws: int = 60, seed: int = 0,
                    most: int = 10_000, phi: np.ndarray | None = None, pairs_per_person: int | None = None) -> dict:
    """The fewest preference pairs m' = P' k for which a release at (epsilon, delta) keeps at least
    ``target`` of BoN's lift on average and ``tail`` at the 5th percentile of the draws
    (``release_accuracy`` with ``persons`` = P', the same draws for every P'; k = ``pairs_per_person``
    when given, else the model's). Bisection on log P' between the head's own P and ``most`` times
    it, to 5%; returns {"pairs", "persons", "result"}, with ``pairs`` None when not even ``most``
    times the data reaches the target."""
    from ..evaluation.release import log_bisect, meets_target

    own = model.persons
    k = model.k if pairs_per_person is None else int(pairs_per_person)
    persons, _, result = log_bisect(
        lambda p: release_accuracy(model, raw, prompt_ids, correct, epsilon, delta, n, draws,
                                   np.random.default_rng(seed), persons=p, phi=phi, pairs_per_person=k),
        lambda r: meets_target(r, target, tail), own, own * most, integer=True)
    return {"pairs": None if persons is None else persons * k, "persons": persons, "result": result}


def epsilon_for_share(model: PolicyBTReward, raw: np.ndarray, prompt_ids, correct, delta: float,
                      target: float = 0.9, tail: float = 0.8, n: int = 16, draws: int = 60, seed: int = 0,
                      most: float = 1000.0, phi: np.ndarray | None = None) -> dict:
    """The smallest epsilon_w at which ``model``, on its own data, released at (epsilon_w, delta)
    keeps ``target`` of BoN's lift on average and ``tail`` at the 5th percentile, searched up to
    ``most`` (``evaluation.release.smallest_epsilon``; its "epsilon_w" is None when not met)."""
    from ..evaluation.release import smallest_epsilon

    check_release(model, 1.0, delta)
    return smallest_epsilon(head_phi(model, raw, phi), study_head(model), prompt_ids, correct, n, target=target,
                            tail=tail, delta_w=delta, draws=draws, seed=seed, hi=most)
