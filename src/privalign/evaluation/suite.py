"""Jobs that produce a results directory: ``run_evaluate`` and ``run_reproduce``.

A results directory holds ``summary.csv`` (one row per (algorithm, n)), ``per_prompt.csv``,
``settings.json`` (every option, the pool's metadata, the package version), the experiment tables,
figures (PNG and PDF) and ``report.html``. It is written atomically.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .. import __version__
from ..pools import Pool
from ..report import figures
from ..report.html import render
from ..report.results import SUMMARY_COLUMNS, atomic_directory, write_csv, write_json
from . import experiments as X
from .harness import METRICS, EvalResult, EvalSettings
from ..metrics import within_prompt_auc
from .parallel import evaluate

if TYPE_CHECKING:
    from .release import StudyHead

Progress = Callable[[str, int, int], None]


def _settings_record(settings: EvalSettings, pool: Pool, pool_path, result: EvalResult | None, n_prompts: int,
                     extra=None) -> dict:
    return {
        "privalign_version": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": ("privalign " + " ".join(sys.argv[1:])) if Path(sys.argv[0]).name == "privalign" else None,
        "evaluation": settings.as_dict(),
        "reward_range_used": list(result.reward_range) if result is not None else None,
        "pool": {"path": str(pool_path) if pool_path else None, "prompts": int(n_prompts),
                 "rows": pool.n_rows, "metadata": pool.metadata},
        "notes": ("Selection scores are normalised as recorded, clipped to the reward range and mapped to "
                  "[0, 1]; sigma, beta and the sensitivity are in units of that range. A deployment must "
                  "use a fixed, declared reward range rather than one observed on the data."),
        **(extra or {}),
    }


def _per_prompt_rows(result: EvalResult) -> list[dict]:
    rows = []
    for a, algo in enumerate(result.settings.algorithms):
        for j, n in enumerate(result.settings.n_grid):
            for k, pid in enumerate(result.prompt_ids):
                row = {"algorithm": algo, "n": int(n), "prompt_id": pid, "base_accuracy": result.base[k, 0]}
                row.update({m: result.per_prompt[a, j, k, i] for i, m in enumerate(METRICS)})
                rows.append(row)
    return rows


def _write_main(tmp: Path, result: EvalResult) -> list[dict]:
    summary = result.summary_rows()
    write_csv(tmp / "summary.csv", summary, SUMMARY_COLUMNS)
    write_json(tmp / "summary.json", summary)
    write_csv(tmp / "per_prompt.csv", _per_prompt_rows(result))
    figures.curves(summary, tmp, [("lift", "accuracy lift over base (points)"), ("proxy_reward", "proxy reward")],
                   "curves_accuracy", "Accuracy lift and proxy reward versus n")
    figures.curves(summary, tmp, [("win_rate", "win-rate vs base (proxy)"), ("hacking_gap", "hacking gap (proxy - true)")],
                   "curves_hacking", "Win-rate and hacking gap versus n")
    return summary


def run_evaluate(pool: Pool, settings: EvalSettings, out: str | Path, pool_path=None,
                 progress: Progress | None = None) -> Path:
    settings = declared_reward(pool, settings).check()
    grouped = pool.grouped(settings.reward)
    cb = (lambda d, t: progress("evaluate", d, t)) if progress else None
    result = evaluate(grouped, settings, progress=cb)
    with atomic_directory(out) as tmp:
        _write_main(tmp, result)
        write_json(tmp / "settings.json", _settings_record(settings, pool, pool_path, result, grouped.n_prompts))
        render(tmp)
    return Path(out)


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


REPRODUCE_N = (1, 2, 4, 8, 16, 32, 64)
UTILITY_EPSILONS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def run_reproduce(out: str | Path, pool: Pool | None = None, pool_path=None, *, settings: EvalSettings | None = None,
                  targets=(1.0, 4.0), n_ref: int = 16, n_grid=REPRODUCE_N, epsilons=UTILITY_EPSILONS,
                  beta_grid=X.BETA_GRID, sigma_grid=X.SIGMA_GRID, delta: float = 1e-5,
                  stream_total: float = 20.0, stream_delta_total: float = 1e-3, stream_seeds: int = 10,
                  release: "StudyHead | None" = None, release_draws: int = 20,
                  progress: Progress | None = None) -> Path:
    """The paper's experiments at privacy levels a reviewer would accept.

    The prompts are split once (seeded) into held-out tuning prompts and test prompts.
    1. Tuning on the held-out prompts under a privacy constraint: for each target epsilon per query,
       the best setting whose worst-case epsilon does not exceed it (``private.tune``).
    2. Accuracy versus n on the test prompts, every private method re-calibrated at each n to its
       target, with 95% bootstrap intervals over prompts.
    3. The privacy-utility curve at n = ``n_ref``; 4. ITP versus PrivITP across noise, with PrivITP's
       sigma also chosen for accuracy alone on the held-out prompts (the paper's protocol), its
       epsilon reported; 5. streams of PrivITP and Gumbel PrivBoN queries under one budget: basic,
       FSRC and zCDP; 6. with ``release`` (a certified head whose features the pool carries), the
       head released once against per-query noise over Q queries, and at every n
       (``release.release_study``).
    PrivITP spends ``delta`` per query (default 1e-5, well below 1 / the number of people).
    """
    from . import private as P

    if pool is None:
        pool, pool_path = default_pool()
    s = replace(declared_reward(pool, settings or EvalSettings()), delta=delta).check()
    grouped = pool.grouped(s.reward)
    largest = int(np.diff(grouped.offsets).min())
    n_grid = tuple(sorted({*(n for n in (*n_grid, n_ref) if n <= largest), largest}))
    steps, step = 7 + (release is not None), 0

    def tick(name):
        nonlocal step
        step += 1
        if progress:
            progress(name, step, steps)

    held_idx, test_idx = X.split_prompts(grouped.n_prompts, 0.5, s.seed)
    held, test = grouped.subset(held_idx), grouped.subset(test_idx)
    chosen, tune_rows = P.tune(held, s, targets, n_ref, beta_grid)
    tick("tuning under privacy constraints")
    curve_rows = P.curves(test, s, chosen, targets, n_grid)
    tick("curves")
    utility_rows = P.privacy_utility(test, s, chosen, epsilons, n_ref, tuned_at=targets[0])
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
    tick("headline")
    study = None
    if release is not None:
        from .release import release_study

        study = release_study(pool, release, grouped.prompt_ids[held_idx], grouped.prompt_ids[test_idx], n_ref,
                              n_grid, draws=release_draws, seed=s.seed)
        headline["release"] = release_headline(study)
        tick("released head")

    with atomic_directory(out) as tmp:
        write_csv(tmp / "summary.csv", curve_rows)
        write_json(tmp / "summary.json", curve_rows)
        write_csv(tmp / "tuning.csv", tune_rows)
        write_csv(tmp / "privacy_utility.csv", utility_rows)
        write_csv(tmp / "ablation_sigma_privitp.csv", abl_sigma["rows"])
        write_csv(tmp / "noise_sweep.csv", sweep)
        write_csv(tmp / "stream.csv", stream_rows)
        write_csv(tmp / "stream_summary.csv", stream_summary)
        write_json(tmp / "headline.json", headline)
        replicates = f"{s.replicates} replicates per prompt"
        main = [r for r in curve_rows if r["target_epsilon"] in (math.inf, targets[0])]
        figures.curves_ci(main, tmp, "headline",
                          f"Accuracy versus n at epsilon = {targets[0]:g} per query",
                          f"{len(test_idx)} test prompts, {replicates}, 95% bootstrap intervals over prompts")
        figures.curves_ci(curve_rows, tmp, "curves_all_targets",
                          "Accuracy versus n, every target (dashed: epsilon > 1)",
                          f"{len(test_idx)} test prompts, {replicates}, 95% bootstrap intervals over prompts")
        figures.privacy_utility(utility_rows, tmp, n=n_ref, note=f"{len(test_idx)} test prompts, 95% bootstrap")
        figures.noise_sweep(sweep, tmp)
        if stream_summary:
            figures.stream_bars(stream_summary, tmp)
        if study is not None:
            write_csv(tmp / "release_vs_queries.csv", study["queries"])
            write_csv(tmp / "release_vs_n.csv", study["n"])
            write_json(tmp / "release.json", {k: v for k, v in study.items() if k not in ("queries", "n")})
            figures.release_vs_queries(study["queries"], study["bon"][n_ref], study["base"], tmp,
                                       title=f"{release.name} (P = {release.persons}, k = {release.pairs_per_person}): "
                                             f"release once vs per-query noise, delta {study['delta_w']:g}")
            figures.release_vs_n(study["n"], study["bon"], study["base"], tmp)
        write_json(tmp / "settings.json", _settings_record(
            s, pool, pool_path, None, grouped.n_prompts,
            {"job": "reproduce", "evaluation": _untuned(s), "targets": list(targets), "n_ref": n_ref,
             "n_grid": list(n_grid),
             "heldout_prompts": len(held_idx), "test_prompts": len(test_idx),
             "chosen": {str(k): v for k, v in chosen.items()}, "grids": {"beta": list(beta_grid),
                                                                         "sigma": list(sigma_grid),
                                                                         "phase1_fraction": list(P.PHASE1_FRACTIONS)},
             "privitp_sigma_for_accuracy": abl_sigma["chosen"],
             "stream": {"epsilon_total": stream_total, "delta_total": stream_delta_total, "seeds": stream_seeds,
                        "n": n_ref}}))
        render(tmp)
        tick("report")
    return Path(out)


def release_headline(study: dict) -> dict:
    """The release's headline: at n_ref, per epsilon_w, the released head's mean and 5th percentile,
    the share of BoN's lift each keeps, and per-query PrivBoN's accuracy within the same total at each Q
    (``per_query_q<Q>``)."""
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
    return out


LARGE_POOLS = {"counting": "counting-large-smollm2.parquet", "arithmetic-mix": "arithmetic-mix-large-smollm2.parquet"}


def large_pool(task: str = "counting") -> tuple[Pool, str]:
    """A shipped large pool (1,024 samples per prompt, several certified reward models)."""
    if task not in LARGE_POOLS:
        raise ValueError(f"no shipped large pool for task {task!r}; shipped: {sorted(LARGE_POOLS)}")
    return _embedded(LARGE_POOLS[task])


def run_large_n(out: str | Path, pool: Pool, pool_path=None, *, rewards=None, settings: EvalSettings | None = None,
                epsilon: float = 1.0, n_ref: int = 16, n_grid=None, beta_grid=X.BETA_GRID, delta: float = 1e-5,
                prompts: int | None = None, progress: Progress | None = None) -> Path:
    """``large_n.study`` for each certified reward model of ``pool`` (or ``rewards``): curves to
    n = 1,024 and the paper's claim per reward model. ``prompts`` keeps the first that many prompts
    (a quick slice). Writes summary.csv (every curve row, with its reward), heldout.csv,
    large_n.json (the verdicts), one figure per reward model and report.html."""
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
    s = settings or EvalSettings()
    studies = []
    for i, name in enumerate(names):
        studies.append(L.study(pool, name, s, epsilon=epsilon, n_ref=n_ref, n_grid=n_grid or L.LARGE_N,
                               beta_grid=beta_grid, delta=delta))
        if progress:
            progress(f"reward model {name}", i + 1, len(names) + 1)
    with atomic_directory(out) as tmp:
        rows = [{"reward": st["reward"], **r} for st in studies for r in st["rows"]]
        write_csv(tmp / "summary.csv", rows)
        write_csv(tmp / "heldout.csv", [{"reward": st["reward"], **r} for st in studies for r in st["held_rows"]])
        write_json(tmp / "large_n.json", {"epsilon": epsilon, "n_ref": n_ref,
                                          "studies": [st["summary"] for st in studies]})
        for st in studies:
            sm = st["summary"]
            figures.curves_ci(st["rows"], tmp, f"large_n_{st['reward']}",
                              f"{st['reward']}: accuracy versus n at epsilon = {epsilon:g} per query",
                              f"{sm['test_prompts']} test prompts, {s.replicates} replicates per prompt, 95% bootstrap "
                              f"intervals over prompts; AUC {sm['auc']['auc']:.3f}, Delta_r {sm['sensitivity']:.3g}")
        write_json(tmp / "settings.json", _settings_record(
            s, pool, pool_path, None, studies[0]["summary"]["held_prompts"] + studies[0]["summary"]["test_prompts"],
            {"job": "reproduce-large", "evaluation": _untuned(s), "rewards": names, "epsilon": epsilon,
             "n_ref": n_ref, "n_grid": list(n_grid or L.LARGE_N), "grids": {"beta": list(beta_grid)},
             "delta": delta}))
        render(tmp)
        if progress:
            progress("report", len(names) + 1, len(names) + 1)
    return Path(out)


TUNED = ("sigma", "beta", "sigma_x", "sigma_z", "truncation")


def _untuned(s: EvalSettings) -> dict:
    """The settings record of a reproduce run: the per-method values (sigma, beta, ...) are tuned at
    each target and live under ``chosen``, so the base settings' defaults are not shown as if used."""
    d = {k: v for k, v in s.as_dict().items() if k not in TUNED}
    d["tuned_per_method"] = "see 'chosen' (per target epsilon) and 'privitp_sigma_for_accuracy'"
    return d


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
