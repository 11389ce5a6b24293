"""The experiments behind a results directory, as numbers: the shipped pools, the reward range a
pool declares, ``reproduce``'s experiments and the large-n study over a pool's reward models, and
their headline numbers. ``report.jobs`` runs them and writes the results directory.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from ..pools import Pool
from . import experiments as X
from .harness import EvalSettings
from .reward_info import declared_reward, test_auc

if TYPE_CHECKING:
    from .release import StudyHead

Progress = Callable[[str, int, int], None]


DEFAULT_TASK = "counting"
DEFAULT_POOL = "counting-smollm2.parquet"
SHIPPED_POOLS = {"arithmetic-mix": "arithmetic-mix-smollm2.parquet", "mmlu-letters": "mmlu-letters-smollm2.parquet",
                 "counting": "counting-smollm2.parquet",
                 "arithmetic": "arithmetic-smollm2.parquet", "addition": "addition-smollm2.parquet"}


def default_pool(task: str | None = None) -> tuple[Pool, str]:
    """An embedded real pool (SmolLM2-135M-Instruct samples, graded, scored by certified reward
    models; docs/experiments.md has the commands that rebuild each): the one of ``task``, by
    default ``counting`` with its ``policy-bt`` reward."""
    if task is not None and task not in SHIPPED_POOLS:
        raise ValueError(f"no shipped pool for task {task!r}; shipped: {sorted(SHIPPED_POOLS)}")
    return _embedded(SHIPPED_POOLS[task] if task else DEFAULT_POOL)


def _embedded(name: str) -> tuple[Pool, str]:
    """A pool shipped in privalign's data folder, and its label."""
    from importlib import resources

    from ..pools import load_pool

    return load_pool(str(resources.files("privalign") / "data" / name)), f"embedded: {name}"


REPRODUCE_N = (1, 2, 4, 8, 16, 32, 64)
UTILITY_EPSILONS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class Reproduction:
    """What ``reproduce`` measured: the settings used (``settings``, with the pool's declared range),
    the n grid, the held-out / test split sizes, and each experiment's rows (see ``reproduce``)."""

    settings: EvalSettings
    n_prompts: int
    n_grid: tuple
    held_prompts: int
    test_prompts: int
    chosen: dict
    tune_rows: list
    curve_rows: list
    utility_rows: list
    abl_sigma: dict
    sweep: list
    stream_rows: list
    stream_summary: list
    headline: dict
    study: dict | None
    floors: dict | None = None       # {target epsilon: {n: PrivBoN's noise floor chosen on held-out prompts}}
    floor_rows: list | None = None   # every (tau, n) tried on the held-out prompts


def reproduce(pool: Pool, settings: EvalSettings | None = None, *, targets=(1.0, 4.0), n_ref: int = 16,
              n_grid=REPRODUCE_N, epsilons=UTILITY_EPSILONS, beta_grid=X.BETA_GRID, sigma_grid=X.SIGMA_GRID,
              delta: float = 1e-5, stream_total: float = 20.0, stream_delta_total: float = 1e-3,
              stream_seeds: int = 10, release: "StudyHead | None" = None, release_draws: int = 20,
              tick: Callable[[str], None] = lambda name: None) -> Reproduction:
    """The paper's experiments at privacy levels a reviewer would accept.

    The prompts are split once (seeded) into held-out tuning prompts and test prompts.
    1. Tuning on the held-out prompts under a privacy constraint: for each target epsilon per query,
       the best setting whose worst-case epsilon does not exceed it (``private.tune``).
    2. Accuracy versus n on the test prompts, every private method re-calibrated at each n to its
       target, with 95% bootstrap intervals over prompts.
    3. The privacy-utility curve at n = ``n_ref`` (Gumbel PrivBoN also at its noise floor, tau
       chosen on the held-out prompts at each epsilon); 4. ITP versus PrivITP across noise, with PrivITP's
       sigma also chosen for accuracy alone on the held-out prompts (the paper's protocol), its
       epsilon reported; 5. streams of PrivITP and Gumbel PrivBoN queries under one budget: basic,
       FSRC and zCDP; 6. with ``release`` (a certified head whose features the pool carries), the
       head released once against per-query noise over Q queries, and at every n
       (``release.release_study``).
    PrivITP spends ``delta`` per query (default 1e-5, well below 1 / the number of people).
    ``tick(name)`` is called after each of the 6 (7 with ``release``) steps.
    """
    from . import private as P

    s = replace(declared_reward(pool, settings or EvalSettings()), delta=delta).check()
    grouped = pool.grouped(s.reward)
    largest = int(np.diff(grouped.offsets).min())
    n_grid = tuple(sorted({*(n for n in (*n_grid, n_ref) if n <= largest), largest}))
    held_idx, test_idx = X.split_prompts(grouped.n_prompts, 0.5, s.seed)
    held, test = grouped.subset(held_idx), grouped.subset(test_idx)
    chosen, tune_rows = P.tune(held, s, targets, n_ref, beta_grid)
    floors, floor_rows = P.tune_temperatures(held, s, targets, n_grid)  # PrivBoN's noise floor per n (issue 51)
    tick("tuning under privacy constraints")
    curve_rows = P.curves(test, s, chosen, targets, n_grid, floors)
    tick("curves")
    utility_rows = P.privacy_utility(test, s, chosen, epsilons, n_ref, tuned_at=targets[0], held=held)
    tick("privacy-utility")
    s_paper = replace(s, beta=chosen["itp"]["beta"])
    abl_sigma = X.ablation(grouped, s_paper, "privitp", "sigma", sigma_grid, n_ref=n_ref)
    sweep = X.noise_sweep(test, s_paper, sigmas=sigma_grid, n=n_ref)
    tick("ITP vs PrivITP")
    stream_rows = P.stream(grouped, s, chosen, targets[0], n_ref, stream_total, stream_delta_total, stream_seeds)
    stream_summary = P.summarise_stream(stream_rows)
    tick("FSRC stream")
    headline = headline_numbers(curve_rows, utility_rows, sweep, abl_sigma, stream_summary, chosen, targets, n_ref)
    headline["auc"] = test_auc(pool, s.reward, grouped.prompt_ids[test_idx])
    headline["noise_floor"] = floor_headline(curve_rows, targets)
    tick("headline")
    study = None
    if release is not None:
        from .release import release_study

        study = release_study(pool, release, grouped.prompt_ids[held_idx], grouped.prompt_ids[test_idx], n_ref,
                              n_grid, draws=release_draws, seed=s.seed)
        headline["release"] = release_headline(study)
        tick("released head")
    return Reproduction(s, grouped.n_prompts, n_grid, len(held_idx), len(test_idx), chosen, tune_rows, curve_rows,
                        utility_rows, abl_sigma, sweep, stream_rows, stream_summary, headline, study, floors, floor_rows)


def floor_headline(curve_rows, targets) -> dict:
    """Per target epsilon and n, on the test prompts: Gumbel PrivBoN at the minimum noise and at the
    noise floor tau chosen on the held-out prompts, the epsilon each spends, and BoN."""
    from .private import LABELS, TUNED

    out = {}
    for eps in targets:
        at = {}
        for r in curve_rows:
            if r["method"] == f"{LABELS['privbon']} eps={eps:g}{TUNED}":
                plain, bon = _at(curve_rows, f"{LABELS['privbon']} eps={eps:g}", r["n"]), _at(curve_rows, "BoN", r["n"])
                binds = bool(plain and r["sigma"] > plain["sigma"])
                at[str(r["n"])] = {"temperature": r["temperature"], "sigma": r["sigma"],
                                   "epsilon_spent": r["epsilon_spent"], "accuracy": r["accuracy"],
                                   "minimum_noise_accuracy": plain and plain["accuracy"],
                                   "bon_accuracy": bon and bon["accuracy"], "binds": binds,
                                   # privacy is free above epsilon* = 2 Delta_r / tau, where the floor binds;
                                   # where it does not, epsilon* lies above the target
                                   "epsilon_star": r["epsilon_spent"] if binds else None}
        out[f"{eps:g}"] = at
    return out


def release_headline(study: dict) -> dict:
    """The release's headline: at n_ref, per epsilon_w, the released head's mean and 5th percentile,
    the share of BoN's lift each keeps, and per-query PrivBoN's accuracy within the same total at each Q
    (``per_query_q<Q>``); ``smallest``: the smallest epsilon_w that meets the target, or the shares at
    the search's upper end when none does (``release.smallest_epsilon``)."""
    n, base = study["n_ref"], study["base"]
    lift = study["bon"][n] - base
    out = {"n": n, "delta_w": study["delta_w"], "persons": study["head"]["persons"],
           "pairs_per_person": study["head"]["pairs_per_person"], "name": study["head"]["name"],
           "bon": study["bon"][n], "base": base, "at": {}}
    for r in study["queries"]:
        e = r["epsilon_w"]
        row = out["at"].setdefault(str(e), {"epsilon_w": e, "mean": r["release_mean"], "p5": r["release_p5"],
                                            "share_mean": (r["release_mean"] - base) / lift if lift > 0 else None,
                                            "share_p5": (r["release_p5"] - base) / lift if lift > 0 else None})
        row[f"per_query_q{r['queries']}"] = r["per_query_accuracy"]
    if study.get("smallest"):
        sm = study["smallest"]
        out["smallest"] = {"epsilon_w": sm["epsilon_w"], "met": sm["met"], "target": sm["target"], "tail": sm["tail"],
                           "draws": sm["draws"], "bounds": list(sm["bounds"]),
                           **{k: sm["at"][k] for k in ("mean", "p5", "share_mean", "share_p5")},
                           "at_epsilon_w": sm["at"]["epsilon_w"]}
    return out


LARGE_POOLS = {"counting": "counting-large-smollm2.parquet", "arithmetic-mix": "arithmetic-mix-large-smollm2.parquet"}


def large_pool(task: str = "counting") -> tuple[Pool, str]:
    """A shipped large pool (1,024 samples per prompt, several certified reward models)."""
    if task not in LARGE_POOLS:
        raise ValueError(f"no shipped large pool for task {task!r}; shipped: {sorted(LARGE_POOLS)}")
    return _embedded(LARGE_POOLS[task])


def large_n_studies(pool: Pool, *, rewards=None, settings: EvalSettings | None = None, epsilon: float = 1.0,
                    n_ref: int = 16, n_grid=None, beta_grid=X.BETA_GRID, delta: float = 1e-5,
                    prompts: int | None = None, progress: Progress | None = None) -> tuple[Pool, list[dict]]:
    """``large_n.study`` for each certified reward model of ``pool`` (or ``rewards``, the served model
    first): curves to n = 1,024 and the paper's claim per reward model. ``prompts`` keeps the first
    that many prompts (a quick slice). Returns the pool studied and the studies."""
    from . import large_n as L

    if prompts is not None:
        pid = np.asarray(pool.columns["prompt_id"], str)
        keep = np.isin(pid, list(dict.fromkeys(pid.tolist()))[:prompts])
        pool = Pool({c: np.asarray(v)[keep] for c, v in pool.columns.items()}, pool.metadata)
    names = list(rewards) if rewards else L.certified_rewards(pool)
    default = pool.metadata.get("default_reward")
    if not rewards and default in names:  # the served model first, then the others as the pool lists them
        names = [default] + [n for n in names if n != default]
    if not names:
        raise ValueError("the pool has no certified reward model (reward_model_info with a sensitivity); name one "
                         "with --reward")
    unknown = [r for r in names if r not in pool.reward_names]
    if unknown:
        raise ValueError(f"rewards {unknown} are not in the pool; it has {pool.reward_names}")
    studies = []
    for i, name in enumerate(names):
        studies.append(L.study(pool, name, settings or EvalSettings(), epsilon=epsilon, n_ref=n_ref,
                               n_grid=n_grid or L.LARGE_N, beta_grid=beta_grid, delta=delta))
        if progress:
            progress(f"reward model {name}", i + 1, len(names) + 1)
    return pool, studies


def _at(rows, method, n):
    return next((r for r in rows if r["method"] == method and r["n"] == n), None)


def headline_numbers(curve_rows, utility_rows, sweep, abl_sigma, stream_summary, chosen, targets, n_ref) -> dict:
    """The issue's targets, measured on the test prompts, each with its figure and a verdict."""
    from .private import LABELS

    eps = targets[0]
    bon, itp = _at(curve_rows, "BoN", n_ref), _at(curve_rows, "ITP", n_ref)
    gum = _at(curve_rows, f"{LABELS['privbon']} eps={eps:g}", n_ref)
    out = {"n_ref": n_ref, "target_epsilon": eps, "base_accuracy": bon["base_accuracy"] if bon else None}
    if bon:
        out["bon_lift"] = {"points": bon["lift"], "ci": [bon["lift_lo"], bon["lift_hi"]],
                           "excludes_zero": bon["lift_lo"] > 0}
    if bon and gum:
        kept = gum["lift"] / bon["lift"] if bon["lift"] > 0 else math.nan
        out["privbon_keeps"] = {"share": kept, "privbon_lift": gum["lift"], "bon_lift": bon["lift"],
                                "met": bool(kept >= 0.5)}
    priv = next((r for r in sweep if r["algorithm"] == "privitp" and r["sigma"] == abl_sigma["chosen"]), None)
    itp_sweep = next((r for r in sweep if r["algorithm"] == "itp"), None)
    if priv and itp_sweep:
        gap = 100 * (itp_sweep["accuracy"] - priv["accuracy"])
        out["privitp_vs_itp"] = {"sigma": abl_sigma["chosen"], "gap_points": gap, "epsilon": priv["epsilon"],
                                 "met": bool(gap <= 2.0)}
    itp_c = chosen.get(eps, {}).get("privitp")
    priv_c = _at(curve_rows, f"{LABELS['privitp']} eps={eps:g}", n_ref)
    if itp and priv_c:
        gap = 100 * (itp["accuracy"] - priv_c["accuracy"])
        out["privitp_at_target_vs_itp"] = {"gap_points": gap, "beta": itp_c and itp_c["beta"], "met": bool(gap <= 2.0)}
    largest = max(r["n"] for r in curve_rows)
    bon_l = _at(curve_rows, "BoN", largest)
    best = None
    for t in targets:
        if t <= 2:
            r = _at(curve_rows, f"{LABELS['privbon']} eps={t:g}", largest)
            if r and (best is None or r["accuracy"] > best["accuracy"]):
                best = r
    if bon_l and best:
        out["regularisation"] = {"n": largest, "bon": bon_l["accuracy"], "privbon": best["accuracy"],
                                 "epsilon": best["target_epsilon"], "difference_points": 100 * (best["accuracy"] - bon_l["accuracy"]),
                                 "met": bool(best["accuracy"] >= bon_l["accuracy"])}
    fs = {r["composition"]: r for r in stream_summary if r.get("algorithm", "privitp") == "privitp"}
    if "fsrc" in fs and "basic" in fs and fs["basic"]["queries_mean"] > 0:
        out["fsrc"] = {"fsrc_queries": fs["fsrc"]["queries_mean"], "basic_queries": fs["basic"]["queries_mean"],
                       "zcdp_queries": fs.get("zcdp", {}).get("queries_mean"),
                       "ratio": fs["fsrc"]["queries_mean"] / fs["basic"]["queries_mean"],
                       "met": bool(fs["fsrc"]["queries_mean"] > fs["basic"]["queries_mean"])}
    zb = {r["composition"]: r for r in stream_summary if r.get("algorithm") == "privbon"}
    if "zcdp" in zb and "basic" in zb and zb["basic"]["queries_mean"] > 0:
        out["zcdp"] = {"epsilon": zb["zcdp"]["epsilon_max"], "zcdp_queries": zb["zcdp"]["queries_mean"],
                       "basic_queries": zb["basic"]["queries_mean"], "zcdp_accuracy": zb["zcdp"]["accuracy"],
                       "epsilon_total": zb["zcdp"]["epsilon_total"], "delta_total": zb["zcdp"]["delta_total"],
                       "ratio": zb["zcdp"]["queries_mean"] / zb["basic"]["queries_mean"],
                       "met": bool(zb["zcdp"]["queries_mean"] > zb["basic"]["queries_mean"])}
    out["edges"] = {str(k): v for k, v in chosen.items()}
    return out
