"""A released head in the harness: what w~ = w + N(0, sigma^2 I) keeps of BoN's lift (issue 28).

The numbers, given a pool's head features phi (``Pool.head_features``; the head's score is phi . w):

- the release: sigma is the analytic Gaussian scale (Balle & Wang 2018) for the certificate's L2
  sensitivity Delta_r at (epsilon_w, delta_w), delta_w < 1/P for P persons;
- BoN at n given the released scores phi . w~: its exact law (``laws.bon_exact``, n candidates drawn
  with replacement from each prompt's samples), averaged over prompts;
- soft BoN at temperature tau (scores mapped to [0, 1] by the head's declared range, as PrivBoN's
  sigma): softmax(x / tau) over ``sets`` seeded candidate sets of n per prompt, exact within a set;
- each over ``draws`` release draws: their mean and 5th percentile (a deployment lives with one).

Every selection with w~ is post-processing of the one release: n and the number of queries add
nothing to epsilon_w. ``release_study`` puts it beside per-query Gumbel PrivBoN spending the same
total over Q queries under zCDP, for ``run_reproduce``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..accounting import gaussian_mechanism_noise_scale, planner
from ..metrics import softmax_rows
from ..pools import Pool
from .laws import bon_exact, bon_exact_columns

RELEASE_EPSILONS = (0.1, 0.3, 1.0, 3.0, 10.0)
RELEASE_QUERIES = (10, 100, 1_000, 10_000)
RELEASE_TAUS = (0.003, 0.01, 0.03, 0.1)


@dataclass(frozen=True)
class StudyHead:
    """What the study needs of a certified head (``rewards.release.study_head`` builds it): its exact
    weights w, Delta_r at the person unit, P persons, k pairs per person, its declared range and id."""

    name: str
    w: tuple
    sensitivity: float
    persons: int
    pairs_per_person: int
    output_range: tuple
    head_id: str

    def sigma(self, epsilon: float, delta: float) -> float:
        """The release's noise scale at (epsilon, delta): the analytic Gaussian for L2 sensitivity Delta_r."""
        if not (math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"epsilon_w must be positive and finite, got {epsilon!r}")
        if not (0 < delta < 1 / self.persons):
            raise ValueError(f"delta_w must lie in (0, 1/P) = (0, {1 / self.persons:.3g}) for P = {self.persons} "
                             f"persons, got {delta!r}")
        return gaussian_mechanism_noise_scale(epsilon, self.sensitivity, delta)


def soft_bon(x01: np.ndarray, y: np.ndarray, n: int, tau: float, rng: np.random.Generator, sets: int) -> np.ndarray:
    """E[true reward] of soft BoN, softmax(x / tau) over n candidates drawn with replacement, on
    ``sets`` candidate sets per prompt; ``x01`` and ``y`` have shape (prompts, samples) and the result
    (prompts,). The law within a set is exact."""
    p, s = x01.shape
    idx = rng.integers(0, s, (p, sets, n))
    rows = np.arange(p)[:, None, None]
    x, v = x01[rows, idx], y[rows, idx]
    w = softmax_rows(x.reshape(p * sets, n), tau).reshape(p, sets, n)
    return (w * v).sum(axis=2).mean(axis=1)


def _grid(prompt_ids) -> list[np.ndarray]:
    pid = np.asarray(prompt_ids, str)
    return [np.flatnonzero(pid == p) for p in np.unique(pid)]


def selection_curves(scores: np.ndarray, groups: list[np.ndarray], y: np.ndarray, n_grid, taus=(),
                     output_range=(0.0, 1.0), rng: np.random.Generator | None = None, sets: int = 8,
                     bon: bool = True) -> dict:
    """{(selector, n): accuracy averaged over prompts} for one score vector: selector "bon" (exact;
    left out with ``bon=False``) and ("soft", tau) for each tau (module docstring)."""
    n_grid = tuple(n_grid)
    out = {}
    if bon:
        acc = np.mean([bon_exact(scores[r], y[r][:, None], n_grid)[:, 0] for r in groups], axis=0)
        out = {("bon", n): float(acc[j]) for j, n in enumerate(n_grid)}
    if taus:
        lo, hi = output_range
        sizes = {r.size for r in groups}
        x01 = (np.clip(scores, lo, hi) - lo) / (hi - lo)
        for t in taus:
            for n in n_grid:
                if len(sizes) == 1:  # every prompt has as many samples: one array
                    g = np.stack(groups)
                    acc = soft_bon(x01[g], y[g], n, t, rng, sets).mean()
                else:
                    acc = np.mean([soft_bon(x01[r][None], y[r][None], n, t, rng, sets)[0] for r in groups])
                out[(("soft", t), n)] = float(acc)
    return out


def release_curves(phi: np.ndarray, w, sigma: float, prompt_ids, correct, n_grid, draws: int,
                   rng: np.random.Generator, taus=(), output_range=(0.0, 1.0), sets: int = 8) -> dict:
    """``selection_curves`` with the exact head (phi . w) and with each of ``draws`` releases
    w~ = w + sigma Z (Z drawn first, all at once, shape (d, draws)). Returns {"exact": {key: acc},
    "draws": {key: array of draws}, "base": the base policy's accuracy}."""
    w = np.asarray(w, float)
    y = np.asarray(correct, float)
    groups = _grid(prompt_ids)
    z = rng.standard_normal((w.size, draws))
    scores = phi @ (w[:, None] + sigma * z)
    exact = selection_curves(phi @ w, groups, y, n_grid, taus, output_range, rng, sets)
    per = [selection_curves(scores[:, j], groups, y, n_grid, taus, output_range, rng, sets, bon=False)
           for j in range(draws)] if taus else []
    bon = np.mean([bon_exact_columns(scores[r], y[r], n_grid) for r in groups], axis=0)  # (n, draws)
    out = {("bon", n): bon[j] for j, n in enumerate(n_grid)}
    out.update({k: np.array([d[k] for d in per]) for k in exact if k[0] != "bon"})
    return {"exact": exact, "draws": out, "base": _base(groups, y)}


def _base(groups: list[np.ndarray], y: np.ndarray) -> float:
    """The base policy's accuracy (one sample), averaged over prompts."""
    return float(np.mean([y[r].mean() for r in groups]))


def bon_accuracy(scores: np.ndarray, prompt_ids, correct, n: int) -> dict:
    """BoN's accuracy at n with ``scores`` (its exact law, n candidates drawn with replacement from each
    prompt's samples, averaged over prompts) and the base policy's: {"bon", "base", "prompts"}."""
    groups, y = _grid(prompt_ids), np.asarray(correct, float)
    return {"bon": selection_curves(np.asarray(scores, float), groups, y, (n,))[("bon", n)], "base": _base(groups, y),
            "prompts": len(groups)}


def release_share(phi: np.ndarray, head: StudyHead, prompt_ids, correct, epsilon: float, n: int, *,
                  delta_w: float = 1e-6, draws: int = 60, seed: int = 0, sigma: float | None = None,
                  rng: np.random.Generator | None = None) -> dict:
    """BoN at n with the head released at (epsilon, delta_w) (or at noise scale ``sigma``), over
    ``draws`` releases drawn from ``default_rng(seed)``: the mean, 5th percentile and sd of its accuracy,
    and the share of the exact head's lift each keeps, (acc - base) / (bon - base), None without a lift.
    The same seed gives the same Z for every epsilon (common random numbers); ``rng``, when given,
    draws them instead."""
    s = head.sigma(epsilon, delta_w) if sigma is None else sigma
    r = release_curves(phi, head.w, s, prompt_ids, correct, (n,), draws,
                       np.random.default_rng(seed) if rng is None else rng)
    acc, bon, base = r["draws"][("bon", n)], r["exact"][("bon", n)], r["base"]
    lift, spread = bon - base, _spread(acc)
    share = (lambda a: float((a - base) / lift)) if lift > 0 else (lambda a: None)
    return {"epsilon_w": epsilon, "sigma": s, "n": n, "draws": draws, **spread, "bon": float(bon),
            "base": float(base), "share_mean": share(spread["mean"]), "share_p5": share(spread["p5"]),
            "accuracies": acc}


def meets_target(r: dict, target: float, tail: float) -> bool:
    """Whether a ``release_share`` result keeps >= ``target`` of the lift on average and >= ``tail``
    at the 5th percentile (never, when the head has no lift)."""
    return r["share_mean"] is not None and r["share_mean"] >= target and r["share_p5"] >= tail


def log_bisect(run, ok, lo, hi, rel: float = 1.05, integer: bool = False) -> tuple:
    """The smallest x in [lo, hi] with ``ok(run(x))``, for ``ok`` monotone in x: bisection on log x
    (the geometric mean, rounded with ``integer``) until hi / lo <= ``rel`` (and hi - lo <= 1 with
    ``integer``). Returns (x, below, run(x)): x = lo and below = None when ``lo`` already holds;
    x = None, below = hi and run(hi) when not even ``hi`` does; otherwise ``below`` is the largest
    point tried that fails."""
    first = run(lo)
    if ok(first):
        return lo, None, first
    last = run(hi)
    if not ok(last):
        return None, hi, last
    a, b = lo, hi
    while b / a > rel and (not integer or b - a > 1):
        mid = math.sqrt(a * b)
        mid = int(round(mid)) if integer else mid
        r = run(mid)
        if ok(r):
            b, last = mid, r
        else:
            a = mid
    return b, a, last


def smallest_epsilon(phi: np.ndarray, head: StudyHead, prompt_ids, correct, n: int, *, target: float = 0.9,
                     tail: float = 0.8, delta_w: float = 1e-6, draws: int = 60, seed: int = 0,
                     lo: float = 0.01, hi: float = 1000.0, rel: float = 1.05) -> dict:
    """The smallest epsilon_w in [lo, hi] whose release keeps >= ``target`` of BoN's lift at n on
    average and >= ``tail`` at the 5th percentile (``release_share``, the same draws for every
    epsilon_w): ``log_bisect`` on epsilon_w until hi / lo <= ``rel``. Returns {"epsilon_w" (None when
    not even ``hi`` meets it, or the head has no lift), "met", "at" (the release_share at that
    epsilon_w, or at ``hi``), "below" (an epsilon_w within a factor ``rel`` under it that does not
    meet it; None when ``lo`` does), "target", "tail", "delta_w", "bounds": (lo, hi)}. The share is measured
    against the head's own exact BoN; this is a measurement on the prompts given, and chooses nothing."""
    if not (0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"the search needs 0 < lo < hi < inf, got lo={lo!r}, hi={hi!r}")
    eps, below, at = log_bisect(
        lambda e: release_share(phi, head, prompt_ids, correct, e, n, delta_w=delta_w, draws=draws, seed=seed),
        lambda r: meets_target(r, target, tail), lo, hi, rel)
    return {"target": target, "tail": tail, "delta_w": delta_w, "n": n, "draws": draws, "bounds": (lo, hi),
            "epsilon_w": eps, "met": eps is not None, "below": below, "at": _short(at)}


def _short(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "accuracies"}


def _spread(acc: np.ndarray, prefix: str = "") -> dict:
    """The mean of the draws' accuracies, their 5th percentile and standard deviation (None for one draw)."""
    return {f"{prefix}mean": float(acc.mean()), f"{prefix}p5": float(np.percentile(acc, 5)),
            f"{prefix}sd": float(acc.std(ddof=1)) if acc.size > 1 else None}


def _head_features(pool: Pool, head: StudyHead) -> np.ndarray:
    phi = pool.head_features(head.name)
    recorded = (pool.metadata.get("head_features") or {}).get(head.name, {})
    if phi is None:
        raise ValueError(f"the pool has no head features for {head.name!r} (privalign score --head-features)")
    if recorded.get("head_id") != head.head_id:
        raise ValueError(f"the pool's features for {head.name!r} belong to head {recorded.get('head_id')!r}, "
                         f"not to {head.head_id!r}")
    if phi.shape[1] != len(head.w):
        raise ValueError(f"the pool's features for {head.name!r} have {phi.shape[1]} coordinates, the head {len(head.w)}")
    return phi


def release_study(pool: Pool, head: StudyHead, held_ids, test_ids, n_ref: int, n_grid, *,
                  epsilons=RELEASE_EPSILONS, queries=RELEASE_QUERIES, taus=RELEASE_TAUS, delta_w: float = 1e-6,
                  draws: int = 20, sets: int = 8, seed: int = 0, target: tuple = (0.9, 0.8),
                  target_draws: int = 60) -> dict:
    """The release against per-query noise, and at every n, on the test prompts.

    - ``queries`` rows: for each total epsilon_w and each workload of Q queries, the head released
      once at (epsilon_w, delta_w) then BoN at ``n_ref`` (mean and 5th percentile over draws; flat in
      Q), beside Gumbel PrivBoN at the largest epsilon per query that the zCDP filter admits Q times
      within (epsilon_w, delta_w), by the harness's exact law with the head's Delta_r and range.
      ``release_sd`` (and ``sd`` below) is the standard deviation over draws: the mean's standard
      error is sd / sqrt(draws).
    - ``n`` rows: BoN and soft BoN on the released head at each n of ``n_grid``, tau chosen per
      epsilon_w on the held-out prompts (best mean at the largest n; it is not a privacy parameter).
    - ``smallest``: the smallest epsilon_w whose release keeps ``target`` = (mean share, 5th
      percentile share) of BoN's lift at ``n_ref`` on the test prompts, over ``target_draws`` draws
      (``smallest_epsilon``).
    """
    from .planning import accuracy_at, plan_base

    phi = _head_features(pool, head)
    pid = np.asarray(pool.columns["prompt_id"], str)
    y = np.asarray(pool.columns["true_reward"], float)
    held = np.isin(pid, np.asarray(held_ids, str))
    test = np.isin(pid, np.asarray(test_ids, str))
    test_pool = pool.subset_rows(test)
    base_s, desc = plan_base(test_pool, head.name)
    rng = np.random.default_rng(seed)
    n_grid = tuple(n_grid)
    largest = max(n_grid)
    q_rows, n_rows, chosen = [], [], {}
    for e in epsilons:
        sigma = head.sigma(e, delta_w)
        tuned = release_curves(phi[held], head.w, sigma, pid[held], y[held], (largest,), draws, rng, taus,
                               head.output_range, sets)
        tau = max(taus, key=lambda t: tuned["draws"][(("soft", t), largest)].mean()) if taus else None
        chosen[e] = tau
        r = release_curves(phi[test], head.w, sigma, pid[test], y[test], n_grid, draws, rng,
                           (tau,) if tau else (), head.output_range, sets)
        at_ref = r["draws"][("bon", n_ref)]
        for q in queries:
            eq = planner.plan_epsilons(e, delta_w, q, "privbon", n=n_ref, sensitivity=desc["sensitivity"])["zcdp"]
            q_rows.append({"epsilon_w": e, "delta_w": delta_w, "sigma": sigma, "queries": q, "n": n_ref,
                           **_spread(at_ref, "release_"), "per_query_epsilon": eq,
                           "per_query_accuracy": accuracy_at(test_pool, base_s, "privbon", eq, n_ref)})
        for key, acc in r["draws"].items():
            sel, n = key
            n_rows.append({"epsilon_w": e, "delta_w": delta_w, "sigma": sigma,
                           "selector": "bon" if sel == "bon" else "soft", "tau": None if sel == "bon" else sel[1],
                           "n": n, **_spread(acc), "exact_head": r["exact"][key]})
    exact_bon = {n: r["exact"][("bon", n)] for n in n_grid}
    smallest = smallest_epsilon(phi[test], head, pid[test], y[test], n_ref, target=target[0], tail=target[1],
                                delta_w=delta_w, draws=target_draws, seed=seed)
    return {"queries": q_rows, "n": n_rows, "tau": chosen, "base": r["base"], "bon": exact_bon, "smallest": smallest,
            "head": {"name": head.name, "persons": head.persons, "pairs_per_person": head.pairs_per_person,
                     "sensitivity": head.sensitivity, "head_id": head.head_id, "dim": len(head.w)},
            "draws": draws, "sets": sets, "delta_w": delta_w, "n_ref": n_ref}
