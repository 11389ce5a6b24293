"""Neighbours at the data level: one person's raw rows edited in the train pool, the whole procedure rerun.

A certified head's guarantee is checked on raw data (issue 48). A neighbour D' of the train pool D
edits the rows of one person of D (a fit prompt: its samples' grades and features), and
``rm train``'s whole procedure (``policy_bt.train_procedure``: the split, pair choice, contribution
bounding, the choice of (q, c, L, lambda), the final head) is rerun from the edited pool. Edits:

* ``flipped``: every grade of the person flipped;
* ``all-correct`` / ``all-wrong``: every grade set (the person then has no pair);
* ``removed``: the person's rows deleted, their id with them: P and m = P k drop by one, a change
  of the public roster, so not a neighbour of the guarantee (built for tests, never searched);
* ``extreme``: the person's samples replaced by ones whose features reach the edge of the feature
  map (||phi|| = 1) along a direction v, half graded correct and half wrong, so that every pair
  they give has the largest difference along v that phi allows;
* ``swapped``: the person's rows replaced by another person's (grades and features).

``search`` ranks every (person, edit) by the first-order shift of the head it predicts at w_D and
retrains the largest, so that the check and the audit meet the neighbours that move w the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import special

from ..preferences.bounding import bound_per_person
from ..preferences.pairs import preference_rows
from .policy_bt import FeatureMap, Trained

EDITS = ("flipped", "all-correct", "all-wrong", "extreme", "swapped")
# "removed" (their rows deleted, their id with them) changes P, a public input: not a neighbour of
# the guarantee (replacement, the roster public). ``edited`` still builds it, for tests that show why.
ALL_EDITS = (*EDITS, "removed")


@dataclass(frozen=True)
class Neighbour:
    """D' as a train pool: ``raw``, ``prompt_ids`` and ``correct`` with one person's rows edited."""

    edit: str
    person: str
    raw: np.ndarray
    prompt_ids: np.ndarray
    correct: np.ndarray
    detail: str = ""


def extreme_raw(fmap: FeatureMap, v: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """``size`` raw feature rows and grades, half correct, whose phi sit at the edge of the feature
    map: correct ones at [sqrt(1 - c^2) a, c b+], wrong ones at [-sqrt(1 - c^2) a, c b-], a = v's
    first q coordinates normalised, (b+, b-) = (0, -1) or (-1, 0) as v's last coordinate is >= 0 or
    not. Each (correct, wrong) pair then has phi+ - phi- = [2 sqrt(1 - c^2) a, +-c]."""
    q, hidden = fmap.components.shape[0], fmap.hidden
    a = np.asarray(v[:q], float)
    a = a / np.linalg.norm(a) if np.linalg.norm(a) > 0 else np.eye(q)[0]
    h = fmap.mu + (fmap.components.T @ (a * fmap.scales)) * math.sqrt(q) * 4.0  # ||z|| = 4: clipped to 1
    good = np.arange(size) < max(1, size // 2)
    sign = np.where(good, 1.0, -1.0)[:, None]
    hm = fmap.mu + sign * (h - fmap.mu)
    lp_good, lp_bad = (0.0, -fmap.lp_clip) if v[-1] >= 0 else (-fmap.lp_clip, 0.0)
    lp = np.where(good, lp_good, lp_bad)
    raw = np.concatenate([hm, hm, lp[:, None]], axis=1)
    assert raw.shape[1] == 2 * hidden + 1
    return raw, good.astype(float)


@dataclass(frozen=True)
class Edit:
    """One person's edit, before it is applied to the pool (``apply``): cheap to rank."""

    edit: str
    person: str
    direction: np.ndarray | None = None
    other: str | None = None
    detail: str = ""


def person_rows(edit: Edit, raw_p, y_p, raw_other=None, y_other=None, fmap: FeatureMap | None = None):
    """The person's rows after ``edit``: (raw, grades), from their own rows (and, for ``swapped``, the
    other person's)."""
    if edit.edit in ("flipped", "all-correct", "all-wrong"):
        return raw_p, {"flipped": 1 - y_p, "all-correct": np.ones_like(y_p), "all-wrong": np.zeros_like(y_p)}[edit.edit]
    if edit.edit == "removed":
        return raw_p[:0], y_p[:0]
    if edit.edit == "extreme":
        if fmap is None or edit.direction is None:
            raise ValueError("edit 'extreme' needs the feature map and a direction")
        return extreme_raw(fmap, np.asarray(edit.direction, float), len(y_p))
    if edit.edit == "swapped":
        if raw_other is None:
            raise ValueError(f"edit 'swapped' needs another person of the pool, got {edit.other!r}")
        return raw_other, y_other
    raise ValueError(f"edit must be one of {ALL_EDITS}, got {edit.edit!r}")


def apply(edit: Edit, raw, prompt_ids, correct, fmap: FeatureMap | None = None) -> Neighbour:
    """The whole pool with ``edit.person``'s rows replaced by ``person_rows`` (module docstring)."""
    pid = np.asarray(prompt_ids, str)
    y = np.asarray(correct, float)
    raw = np.asarray(raw)
    mine = pid == edit.person
    if not mine.any():
        raise ValueError(f"person {edit.person!r} has no rows in the pool")
    theirs = pid == edit.other if edit.other is not None else None
    if edit.edit == "swapped" and (theirs is None or not theirs.any() or edit.other == edit.person):
        raise ValueError(f"edit 'swapped' needs another person of the pool, got {edit.other!r}")
    r2, y2 = person_rows(edit, raw[mine], y[mine], *((raw[theirs], y[theirs]) if theirs is not None else ()),
                         fmap=fmap)
    keep = ~mine
    return Neighbour(edit.edit, edit.person, np.concatenate([raw[keep].astype(np.float64), r2]),
                     np.concatenate([pid[keep], np.full(len(y2), edit.person)]), np.concatenate([y[keep], y2]),
                     edit.detail)


def edited(raw, prompt_ids, correct, person: str, edit: str, *, fmap: FeatureMap | None = None,
           direction=None, other: str | None = None) -> Neighbour:
    """The pool with ``person``'s rows edited by ``edit`` (module docstring)."""
    return apply(Edit(edit, str(person), direction, other), raw, prompt_ids, correct, fmap)


def _pairs(phi, y, person: str, proc: dict) -> np.ndarray:
    """The pair differences one person contributes from their rows' phi and grades (their own
    stream, as ``preference_data`` draws them)."""
    pid = np.full(len(y), person)
    ci, ri = preference_rows(pid, y, {person}, proc["pairs_per_prompt"], proc["seed"])
    keep = bound_per_person(pid[ci], proc["pairs_per_person"], proc["seed"])
    return phi[ci[keep]] - phi[ri[keep]]


def candidates(base: Trained, raw, prompt_ids, correct, proc: dict, rng: np.random.Generator,
               persons: int | None = None) -> list[tuple[float, Edit]]:
    """Every edit of every person of D (or of a seeded ``persons`` of them), each with the head's
    first-order shift it predicts at w_D: ||H^-1 (g_p - g_p')|| / m, g the summed loss gradient of a
    person's pairs; largest first."""
    pid, y = np.asarray(prompt_ids, str), np.asarray(correct, float)
    fmap, w, m = base.feature_map, base.w, base.m
    d = fmap(raw[base.data.chosen]) - fmap(raw[base.data.rejected])
    z = d @ w
    hess = (d * (special.expit(z) * special.expit(-z))[:, None]).T @ d / m + base.lam * np.eye(w.size)

    def grad(pairs):
        return -(special.expit(-(pairs @ w)) @ pairs) if pairs.size else np.zeros(w.size)

    people = np.unique(base.data.person)
    if persons is not None and persons < people.size:
        people = rng.choice(people, persons, replace=False)
    norm = np.linalg.norm(w)
    against = -w / norm if norm > 0 else np.eye(w.size)[0]
    out = []
    for person in map(str, people):
        mine = pid == person
        raw_p, y_p = raw[mine], y[mine]
        g_p = grad(_pairs(fmap(raw_p), y_p, person, proc))
        dirs = [("against the head", against), ("random", rng.standard_normal(w.size))]
        if np.linalg.norm(g_p) > 0:
            dirs.append(("along the person's gradient", g_p / np.linalg.norm(g_p)))
        edits = [Edit(e, person) for e in ("flipped", "all-correct", "all-wrong")]
        edits += [Edit("extreme", person, v, detail=f"v {name}") for name, v in dirs]
        others = people[people != person]
        if others.size:
            other = str(rng.choice(others))
            edits.append(Edit("swapped", person, other=other, detail=f"given {other}'s rows"))
        for e in edits:
            theirs = pid == e.other if e.other is not None else None
            r2, y2 = person_rows(e, raw_p, y_p, *((raw[theirs], y[theirs]) if theirs is not None else ()), fmap=fmap)
            g2 = grad(_pairs(fmap(r2), y2, person, proc))
            out.append((float(np.linalg.norm(np.linalg.solve(hess, g_p - g2))) / m, e))
    out.sort(key=lambda r: -r[0])
    return out


def strongest(ranked: list[tuple[float, Edit]], count: int) -> list[tuple[float, Edit]]:
    """The ``count`` largest predicted shifts, the strongest of every edit first (each edit is tried)."""
    first = {}
    for pred, e in ranked:
        first.setdefault(e.edit, (pred, e))
    picked = sorted(first.values(), key=lambda r: -r[0])[:count]
    seen = {id(e) for _, e in picked}
    picked += [(p, e) for p, e in ranked if id(e) not in seen][:max(0, count - len(picked))]
    return picked


def search(model, raw, prompt_ids, correct, trials: int, seed: int = 0, persons: int | None = None,
           choices: dict | None = None, progress=None) -> tuple[Trained, list[dict]]:
    """Rerun the model's whole procedure on its pool (which must reproduce it) and on the ``trials``
    data-level neighbours predicted to move w the most (``candidates``, ``strongest``); one row each:
    the edit, the person, the predicted and realised ||w_D - w_D'||, the largest score change over the
    train samples (each head with its own feature map), whether the chosen settings changed, and the
    certified Delta_r. ``choices`` (default: a fresh dict) shares step 2 of the procedure between
    reruns whose validation rows are the same (``train_procedure``). ``progress(done, total)``, when
    given, is called after each retraining (the model's own first: ``trials`` + 1 in all)."""
    from .policy_bt import model_procedure, retrain

    tick = progress or (lambda done, total: None)

    choices = {} if choices is None else choices
    raw = np.asarray(raw)
    base = retrain(model, raw, prompt_ids, correct, choices=choices)
    tick(1, trials + 1)
    proc = model_procedure(model)
    rng = np.random.default_rng(seed)
    ranked = candidates(base, raw, prompt_ids, correct, proc, rng, persons)
    probe = base.feature_map(raw) @ base.w
    rows = []
    for trial, (predicted, e) in enumerate(strongest(ranked, trials)):
        nb = apply(e, raw, prompt_ids, correct, base.feature_map)
        t = retrain(model, nb.raw, nb.prompt_ids, nb.correct, neighbour=True, choices=choices)
        same = t.settings == base.settings
        rows.append({"trial": trial, "adversary": e.edit, "person": e.person, "detail": e.detail,
                     "predicted_change": predicted, "settings_changed": not same, "persons": t.data.persons,
                     "max_score_change": float(np.max(np.abs(probe - t.feature_map(raw) @ t.w))),
                     "weight_change": float(np.linalg.norm(base.w - t.w)) if same else math.inf,
                     "w_neighbour": t.w, "certified": model.sensitivity})
        tick(trial + 2, trials + 1)
    return base, rows


def check_sensitivity(model, raw, prompt_ids, correct, trials: int = 24, seed: int = 0,
                      persons: int | None = None, progress=None) -> list[dict]:
    """``search``'s rows without the neighbours' weights: the whole procedure rerun on the ``trials``
    data-level neighbours of the train pool that move w the most, beside the certified Delta_r."""
    return [{k: v for k, v in r.items() if k != "w_neighbour"}
            for r in search(model, raw, prompt_ids, correct, trials, seed, persons, progress=progress)[1]]
