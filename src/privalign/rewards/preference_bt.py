"""A certified head on a user's own preference data (``rm train --preferences``).

The data are TRL preference rows (``preferences.trl``), each with its person (the privacy-unit
column, or the row itself with ``--privacy-unit row``), and the raw policy features of both
responses (``preference_features``: teacher forcing through the deployed policy). The procedure:

1. *Public data for every choice.* The feature map (mu, components, scales) is fitted on the
   public file's responses, and (q, c, L, lambda) are chosen on it: its persons are split by a
   keyed hash of their ids into two halves, a candidate head is trained on one half (at most k pairs
   per person, loss normalised by P_half k, as the final head) and scored on the other by the
   accuracy of its top choice among each public prompt's responses (``selection_sets``: the head
   serves selection, BoN; on a file with one pair per prompt, this is the pairwise accuracy) that it
   keeps once released at (target_epsilon, 1e-6) with the final head's Delta_r (mean over seeded
   draws; P, D's number of persons, is a public count), or exactly without a target. The public file shares no row and no person with D (``preferences.trl.check_disjoint``).
2. *Contribution bounding.* Each person of D keeps at most k pairs, a uniform choice from the
   stream of (seed, person id) (``preferences.bounding``); how many lost pairs goes to the private
   report only.
3. *The final head* is trained once on D with the chosen settings, loss normalised by m = P k, P
   the persons of D (their ids are the public roster): ||w_D - w_D'|| <= 4k/(m lambda) + 2 g_tol /
   lambda for one person's rows replaced or emptied, the roster public (docs/accounting.md).

The head is a ``PolicyBTReward`` (unit: person), so ``rm release``, ``privalign serve`` and the
planner take it as they take a head trained on privalign's own pools.

With ``features="embedding"`` the raw features are sentence embeddings of each pair
(``embedding_bt.EmbeddingFeaturizer``: all-MiniLM-L6-v2 of "prompt\nresponse") and the feature map is
``embedding_bt.EmbeddingMap``, which fits nothing: step 1 chooses lambda alone on the public file,
and steps 2-3 and the certificate are the same (||phi|| <= 1).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import numpy as np

from ..preferences.bounding import bound_per_person
from ..preferences.persons import roster_digest
from ..preferences.splits import split_ids
from .embedding_bt import EmbeddingMap, certified_sensitivity, fit_bt
from .policy_bt import FeatureMap, PolicyBTReward

DEFAULT_GRID = {"components": (4, 8, 16), "cs": (0.6, 0.8, 0.95), "lp_clips": (4.0,),
                "lambdas": (0.01, 0.03, 0.1, 0.3, 1.0)}
EMBEDDING_GRID = {"components": (None,), "cs": (None,), "lp_clips": (None,)}  # EmbeddingMap has no settings
FEATURE_MAPS = {"policy": FeatureMap, "embedding": EmbeddingMap}


@dataclass(frozen=True)
class PreferencePairs:
    """Raw policy features of each pair's chosen and rejected response, the pair's person, and
    (optionally) a key of its prompt, which the public choice of settings uses to score selection."""

    chosen: np.ndarray    # (N, 2H + 1)
    rejected: np.ndarray  # (N, 2H + 1)
    person: np.ndarray    # (N,) str
    prompt: np.ndarray | None = None  # (N,) str

    def __post_init__(self):
        if self.chosen.shape != self.rejected.shape or self.chosen.shape[0] != len(self.person) or (
                self.prompt is not None and len(self.prompt) != len(self.person)):
            raise ValueError(f"chosen {self.chosen.shape}, rejected {self.rejected.shape}, person "
                             f"({len(self.person)}) and prompt must describe the same pairs")

    def rows(self, mask) -> "PreferencePairs":
        return PreferencePairs(self.chosen[mask], self.rejected[mask], self.person[mask],
                               None if self.prompt is None else self.prompt[mask])

    @property
    def persons(self) -> int:
        return int(np.unique(self.person).size)


def accuracy_interval(correct: np.ndarray) -> tuple[float, float, float]:
    """Pairwise accuracy and its 95% Wilson interval (ties count half)."""
    n = max(int(np.size(correct)), 1)
    p = float(np.mean(correct)) if np.size(correct) else 0.0
    z = 1.959963984540054
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, float(centre - half), float(centre + half)


def pair_diffs(fmap: FeatureMap, pairs: PreferencePairs) -> np.ndarray:
    """phi(chosen) - phi(rejected) of each pair: a head w scores the chosen response higher where d . w > 0."""
    return fmap(pairs.chosen) - fmap(pairs.rejected)


def pair_correct(w: np.ndarray, diffs: np.ndarray) -> np.ndarray:
    """1 where the head scores the chosen response above the rejected one, 0.5 on a tie, else 0
    (``diffs`` from ``pair_diffs``)."""
    margin = diffs @ w
    return np.where(margin > 0, 1.0, np.where(margin < 0, 0.0, 0.5))


def _bounded_diffs(fmap: FeatureMap, pairs: PreferencePairs, k: int, seed: int) -> tuple[np.ndarray, int]:
    keep = bound_per_person(pairs.person, k, seed)
    return fmap(pairs.chosen[keep]) - fmap(pairs.rejected[keep]), int(pairs.person.size - keep.size)


def released_accuracies(w, diffs: np.ndarray, sigma: float, rng: np.random.Generator, draws: int) -> np.ndarray:
    """Pairwise accuracy of each of ``draws`` releases w + sigma Z (Z from ``rng``) on the pairs of
    ``diffs`` (``pair_diffs``)."""
    z = rng.standard_normal((draws, w.size))
    return np.mean((diffs @ (w + sigma * z).T) > 0, axis=0)


@dataclass(frozen=True)
class SelectionSets:
    """The public prompts on which a head's top choice can be right or wrong: each prompt's distinct
    responses (``raw``, one row each, grouped by prompt from ``starts``), and whether each was never
    the rejected side of that prompt's pairs (``good``). Prompts whose responses are all good or all
    rejected are left out."""

    raw: np.ndarray
    starts: np.ndarray
    good: np.ndarray

    def accuracy(self, scores: np.ndarray) -> np.ndarray:
        """Per column of ``scores`` (one row per response: one head, or one release draw, a column),
        the share of prompts whose highest-scored response is a good one (a tie with a good one
        counts as right)."""
        top = np.maximum.reduceat(scores, self.starts, axis=0)
        good_top = np.maximum.reduceat(np.where(self.good[:, None], scores, -np.inf), self.starts, axis=0)
        return np.mean(good_top >= top, axis=0)


def selection_sets(pairs: PreferencePairs) -> SelectionSets | None:
    """``SelectionSets`` of public pairs that name their prompts, or None (no prompt keys, or no prompt
    with both a good and a rejected response). A response is identified by its features, so the same
    text in two pairs of a prompt is one candidate; on a file with one pair per prompt the top-choice
    accuracy is the pairwise accuracy."""
    if pairs.prompt is None or not len(pairs.person):
        return None
    raw = np.concatenate([np.asarray(pairs.chosen), np.asarray(pairs.rejected)])
    prompt = np.concatenate([pairs.prompt, pairs.prompt]).astype(str)
    rejected = np.r_[np.zeros(len(pairs.person), bool), np.ones(len(pairs.person), bool)]
    _, text = np.unique(raw, axis=0, return_inverse=True)
    _, pid = np.unique(prompt, return_inverse=True)
    keys, first, cand = np.unique(np.stack([pid, text.ravel()], 1), axis=0, return_index=True, return_inverse=True)
    cand = cand.ravel()
    bad = np.zeros(len(keys), bool)
    bad[cand[rejected]] = True
    by_prompt = keys[:, 0]
    has_good = np.bincount(by_prompt, weights=~bad, minlength=by_prompt.max() + 1) > 0
    has_bad = np.bincount(by_prompt, weights=bad, minlength=by_prompt.max() + 1) > 0
    keep = (has_good & has_bad)[by_prompt]
    if not keep.any():
        return None
    by_prompt, first, good = by_prompt[keep], first[keep], ~bad[keep]  # keys are sorted by prompt
    starts = np.flatnonzero(np.r_[True, by_prompt[1:] != by_prompt[:-1]])
    return SelectionSets(raw[first], starts, good)


def choose_settings(public: PreferencePairs, grid: dict, k: int, seed: int, g_tol: float = 1e-9,
                    persons: int | None = None, target_epsilon: float | None = 1.0, draws: int = 50,
                    map_type=FeatureMap):
    """Step 1 (module docstring), on the public pairs only: (the best row, its feature map, every row).
    With ``target_epsilon``, a candidate is scored as it would be released at (target_epsilon, 1e-6)
    with the noise of the final head's Delta_r (``persons`` = D's P, a public count), mean over
    ``draws`` draws; else exactly. The score is the top-choice accuracy on the public prompts
    (``selection_sets``) when the pairs name their prompts, else the pairwise accuracy. ``map_type``
    (``FEATURE_MAPS``) is fitted on the public rows."""
    from ..accounting import gaussian_mechanism_noise_scale

    if public.persons < 2:
        raise ValueError(f"the public file needs at least 2 persons to choose settings on, got {public.persons}")
    # read into memory once (the feature map's SVD needs every public row), then mapped per candidate
    public = PreferencePairs(np.asarray(public.chosen), np.asarray(public.rejected), public.person, public.prompt)
    half_a, half_b = split_ids(public.person, 0.5, seed)
    in_a = np.isin(public.person, sorted(half_a))
    fit, score = public.rows(in_a), public.rows(~in_a)
    sets = selection_sets(score)
    full = map_type.fit(np.concatenate([public.chosen, public.rejected]), q=max(grid["components"]))
    rows, best = [], None
    for q in grid["components"]:
        for c in grid["cs"]:
            for lp_clip in grid["lp_clips"]:
                fmap = full.with_settings(q, c, lp_clip)
                d, _ = _bounded_diffs(fmap, fit, k, seed)
                score_d = pair_diffs(fmap, score)
                phi = None if sets is None else fmap(sets.raw)
                for lam in grid["lambdas"]:
                    w, _ = fit_bt(d, lam, g_tol, normalizer=fit.persons * k)
                    exact = float(np.mean(pair_correct(w, score_d)))
                    acc = exact if sets is None else float(sets.accuracy(phi @ w[:, None])[0])
                    exact_pairwise = exact
                    exact = acc
                    if target_epsilon is not None and persons:
                        sigma = gaussian_mechanism_noise_scale(
                            target_epsilon, certified_sensitivity(persons * k, lam, k, g_tol), 1e-6)
                        # the same seeded draws for every candidate, and for both scores (so that on one
                        # pair a prompt the top choice and the pairwise accuracy choose alike)
                        rng = np.random.default_rng([seed, 7])
                        acc = float(released_accuracies(w, score_d, sigma, rng, draws).mean() if sets is None else
                                    sets.accuracy(phi @ (w[:, None] + sigma * rng.standard_normal((draws, w.size)).T))
                                    .mean())
                    row = {"components": q, "c": c, "lp_clip": lp_clip, "lambda": lam, "selection_accuracy": acc,
                           "selection_exact_accuracy": exact, "selection_exact_pairwise": exact_pairwise,
                           "selection_metric": "pairwise" if sets is None else "top-choice"}
                    rows.append(row)
                    if best is None or (acc, lam) > (best[0]["selection_accuracy"], best[0]["lambda"]):
                        best = (row, fmap)
    return best[0], best[1], rows


def train_preference_bt(d: PreferencePairs, public: PreferencePairs, *, k: int = 16, seed: int = 0,
                        grid: dict | None = None, g_tol: float = 1e-9, base_model: str = "smollm2",
                        name: str = "policy-bt", privacy_unit: str = "person", source: str = "",
                        target_epsilon: float | None = 1.0, features: str = "policy"
                        ) -> tuple[PolicyBTReward, list[dict]]:
    """Steps 1-3 (module docstring): the certified head on D and the public choice's rows. ``features``:
    ``policy`` (raw policy features) or ``embedding`` (sentence embeddings; lambda alone is chosen)."""
    if k < 1:
        raise ValueError(f"max_pairs_per_person (k) must be >= 1, got {k!r}")
    if d.persons < 2:
        raise ValueError(f"the preference data need at least 2 persons, got {d.persons}")
    if features not in FEATURE_MAPS:
        raise ValueError(f"features must be one of {sorted(FEATURE_MAPS)}, got {features!r}")
    grid = {**DEFAULT_GRID, **{key: tuple(v) for key, v in (grid or {}).items() if v},
            **(EMBEDDING_GRID if features == "embedding" else {})}
    row, fmap, rows = choose_settings(public, grid, k, seed, g_tol, d.persons, target_epsilon,
                                      map_type=FEATURE_MAPS[features])
    diffs, dropped = _bounded_diffs(fmap, d, k, seed)
    m = d.persons * k
    w, g = fit_bt(diffs, row["lambda"], g_tol, normalizer=m)
    unit_text = ("each row (one preference pair) is its own person (--privacy-unit row)" if privacy_unit == "row"
                 else f"everyone named by one value of the column {privacy_unit!r}: all of their rows")
    meta = {"task": None, "source": "preferences", "features": features, "persons": d.persons, "privacy_unit": privacy_unit,
            "person_definition": unit_text, "components": row["components"], "c": row["c"],
            "lp_clip": row["lp_clip"], "selection_accuracy": row["selection_accuracy"],
            "public_persons": public.persons, "public_pairs": int(public.person.size),
            "procedure": {"unit": "person", "source": "preferences", "pairs_per_person": k, "seed": seed,
                          "g_tol": g_tol, "target_epsilon": target_epsilon, "target_delta": 1e-6,
                          **{key: list(v) for key, v in grid.items()}},
            "public_inputs": {
                "public_file": source or "the --public preference file: every row of it, unprotected",
                "public_use": ("chooses lambda (the sentence-embedding feature map fits nothing)" if features ==
                               "embedding" else "fits the feature map (mu, components, scales, published in a "
                               "released file) and chooses (q, c, L, lambda)") + "; the curator must hold its "
                              "persons' consent or use public data",
                "person_ids": {"count": d.persons, "blake2b": roster_digest(d.person),
                               "use": "the roster of D's persons: it fixes P and each person's stream"},
                "seed": seed, "settings_grid": "the candidate (q, c, L, lambda) and k, chosen by the operator"},
            "head_id": uuid.uuid4().hex}
    private = {"pairs": int(diffs.shape[0]), "pairs_dropped_beyond_k": dropped,
               "persons_bounded": int(np.sum(np.unique(d.person, return_counts=True)[1] > k)),
               "train_pair_accuracy": float(np.mean(diffs @ w > 0)), "achieved_grad_norm": g,
               "weight_norm": float(np.linalg.norm(w)),
               "certified_sensitivity": certified_sensitivity(m, row["lambda"], k, g_tol)}
    model = PolicyBTReward(w, row["lambda"], m, k, g_tol, fmap, base_model, None, name, meta, private=private)
    return model, rows


def pairwise_share(head: PolicyBTReward, diffs: np.ndarray, epsilon: float, delta: float, draws: int = 60,
                   seed: int = 0, persons: int | None = None) -> dict:
    """The held-out pairwise accuracy of ``head``'s release at (epsilon, delta), over ``draws`` draws
    from ``default_rng(seed)`` (the same Z for every ``persons``): its mean and 5th percentile, and the
    share of the exact head's gain over chance (accuracy - 1/2) each keeps, None without a gain. With
    ``persons`` = P', the noise is that of the same procedure on P' persons of the head's k pairs
    (``release_noise_scale``) while w stays the head's own: what more persons buy through the noise
    alone. ``diffs``: the held-out pairs' ``pair_diffs``."""
    from .release import release_noise_scale

    sigma = release_noise_scale(head, epsilon, delta, persons)
    exact = float(np.mean(pair_correct(head.w, diffs)))
    accs = released_accuracies(head.w, diffs, sigma, np.random.default_rng(seed), draws)
    mean, p5, gain = float(accs.mean()), float(np.percentile(accs, 5)), exact - 0.5
    share = (lambda a: (a - 0.5) / gain) if gain > 0 else (lambda a: None)
    return {"persons": head.persons if persons is None else int(persons), "epsilon_w": float(epsilon),
            "delta_w": float(delta), "sigma": sigma, "draws": draws, "exact": exact, "mean": mean, "p5": p5,
            "share_mean": share(mean), "share_p5": share(p5)}


def persons_for_pairwise_share(head: PolicyBTReward, diffs: np.ndarray, epsilon: float, delta: float,
                               target: float = 0.9, tail: float = 0.8, draws: int = 60, seed: int = 0,
                               most: int = 10_000) -> dict:
    """The fewest persons P' (of the head's k pairs each) whose release at (epsilon, delta) keeps at
    least ``target`` of the exact head's held-out gain over chance on average and ``tail`` at the 5th
    percentile, w held fixed (``pairwise_share``): ``log_bisect`` on P' from 2 to ``most`` times the
    head's own P, as ``release.pairs_for_share`` sizes BoN's lift on a pool. Returns {"persons" (None
    when not even the most persons reach it, or the head has no gain), "result" (``pairwise_share``
    there, or at the most)}."""
    from ..evaluation.release import log_bisect, meets_target

    persons, _, result = log_bisect(lambda p: pairwise_share(head, diffs, epsilon, delta, draws, seed, p),
                                    lambda r: meets_target(r, target, tail), 2, head.persons * most, integer=True)
    return {"persons": persons, "result": result}
