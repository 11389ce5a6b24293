"""Jobs that produce a results directory: ``run_evaluate``, ``run_reproduce`` and ``run_large_n``.
Each runs its experiments (``evaluation``), then writes the directory: ``summary.csv`` (one row per
(algorithm, n)), the experiment tables, ``settings.json`` (every option, the pool's metadata, the
package version), figures (PNG and PDF) and ``report.html``, atomically.
"""

from __future__ import annotations

import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

from .. import __version__
from ..evaluation import experiments as X
from ..evaluation import suite
from ..evaluation.harness import METRICS, EvalResult, EvalSettings
from ..evaluation.parallel import evaluate
from ..evaluation.private import PHASE1_FRACTIONS, TEMPERATURE_GRID
from ..evaluation.reward_info import declared_reward
from ..evaluation.suite import REPRODUCE_N, UTILITY_EPSILONS, Progress, Reproduction
from ..pools import Pool
from . import figures
from .html import render
from .results import SUMMARY_COLUMNS, atomic_directory, write_csv, write_json


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


def run_reproduce(out: str | Path, pool: Pool | None = None, pool_path=None, *, settings: EvalSettings | None = None,
                  targets=(1.0, 4.0), n_ref: int = 16, n_grid=REPRODUCE_N, epsilons=UTILITY_EPSILONS,
                  beta_grid=X.BETA_GRID, sigma_grid=X.SIGMA_GRID, delta: float = 1e-5,
                  stream_total: float = 20.0, stream_delta_total: float = 1e-3, stream_seeds: int = 10,
                  release=None, release_draws: int = 20, progress: Progress | None = None) -> Path:
    """``evaluation.suite.reproduce`` on ``pool`` (default: the embedded counting pool), written to
    ``out``: its tables, figures, settings and report."""
    if pool is None:
        pool, pool_path = suite.default_pool()
    steps, step = 7 + (release is not None), 0

    def tick(name):
        nonlocal step
        step += 1
        if progress:
            progress(name, step, steps)

    r = suite.reproduce(pool, settings, targets=targets, n_ref=n_ref, n_grid=n_grid, epsilons=epsilons,
                        beta_grid=beta_grid, sigma_grid=sigma_grid, delta=delta, stream_total=stream_total,
                        stream_delta_total=stream_delta_total, stream_seeds=stream_seeds, release=release,
                        release_draws=release_draws, tick=tick)
    with atomic_directory(out) as tmp:
        _write_reproduce_tables(tmp, r)
        _reproduce_figures(tmp, r, targets, n_ref, release)
        write_json(tmp / "settings.json", _settings_record(r.settings, pool, pool_path, None, r.n_prompts, {
            "job": "reproduce", "evaluation": _untuned(r.settings), "targets": list(targets), "n_ref": n_ref,
            "n_grid": list(r.n_grid), "heldout_prompts": r.held_prompts, "test_prompts": r.test_prompts,
            "chosen": {str(k): v for k, v in r.chosen.items()},
            "grids": {"beta": list(beta_grid), "sigma": list(sigma_grid), "temperature": list(TEMPERATURE_GRID),
                      "phase1_fraction": list(PHASE1_FRACTIONS)},
            "privitp_sigma_for_accuracy": r.abl_sigma["chosen"],
            "noise_floor": {f"{k:g}": {str(n): c for n, c in v.items()} for k, v in (r.floors or {}).items()},
            "stream": {"epsilon_total": stream_total, "delta_total": stream_delta_total, "seeds": stream_seeds,
                       "n": n_ref}}))
        render(tmp)
        tick("report")
    return Path(out)


def _write_reproduce_tables(tmp: Path, r: Reproduction) -> None:
    write_csv(tmp / "summary.csv", r.curve_rows)
    write_json(tmp / "summary.json", r.curve_rows)
    write_csv(tmp / "tuning.csv", r.tune_rows)
    if r.floor_rows:
        write_csv(tmp / "noise_floor.csv", r.floor_rows)
    write_csv(tmp / "privacy_utility.csv", r.utility_rows)
    write_csv(tmp / "ablation_sigma_privitp.csv", r.abl_sigma["rows"])
    write_csv(tmp / "noise_sweep.csv", r.sweep)
    write_csv(tmp / "stream.csv", r.stream_rows)
    write_csv(tmp / "stream_summary.csv", r.stream_summary)
    write_json(tmp / "headline.json", r.headline)
    if r.study is not None:
        write_csv(tmp / "release_vs_queries.csv", r.study["queries"])
        write_csv(tmp / "release_vs_n.csv", r.study["n"])
        write_json(tmp / "release.json", {k: v for k, v in r.study.items() if k not in ("queries", "n")})


def _reproduce_figures(tmp: Path, r: Reproduction, targets, n_ref: int, release) -> None:
    note = f"{r.test_prompts} test prompts, {r.settings.replicates} replicates per prompt, 95% bootstrap intervals over prompts"
    main = [row for row in r.curve_rows if row["target_epsilon"] in (math.inf, targets[0])]
    figures.curves_ci(main, tmp, "headline", f"Accuracy versus n at epsilon = {targets[0]:g} per query", note)
    figures.curves_ci(r.curve_rows, tmp, "curves_all_targets", "Accuracy versus n, every target (dashed: epsilon > 1)",
                      note)
    figures.privacy_utility(r.utility_rows, tmp, n=n_ref, note=f"{r.test_prompts} test prompts, 95% bootstrap")
    figures.noise_sweep(r.sweep, tmp)
    if r.stream_summary:
        figures.stream_bars(r.stream_summary, tmp)
    if r.study is not None:
        study = r.study
        figures.release_vs_queries(study["queries"], study["bon"][n_ref], study["base"], tmp,
                                   title=f"{release.name} (P = {release.persons}, k = {release.pairs_per_person}): "
                                         f"release once vs per-query noise, delta {study['delta_w']:g}")
        figures.release_vs_n(study["n"], study["bon"], study["base"], tmp)


def run_large_n(out: str | Path, pool: Pool, pool_path=None, *, rewards=None, settings: EvalSettings | None = None,
                epsilon: float = 1.0, n_ref: int = 16, n_grid=None, beta_grid=X.BETA_GRID, delta: float = 1e-5,
                prompts: int | None = None, progress: Progress | None = None) -> Path:
    """``evaluation.suite.large_n_studies`` written to ``out``: summary.csv (every curve row, with
    its reward), heldout.csv, large_n.json (the verdicts), one figure per reward model and report.html."""
    from ..evaluation.large_n import LARGE_N

    s = settings or EvalSettings()
    pool, studies = suite.large_n_studies(pool, rewards=rewards, settings=s, epsilon=epsilon, n_ref=n_ref,
                                          n_grid=n_grid, beta_grid=beta_grid, delta=delta, prompts=prompts,
                                          progress=progress)
    names = [st["reward"] for st in studies]
    with atomic_directory(out) as tmp:
        write_csv(tmp / "summary.csv", [{"reward": st["reward"], **r} for st in studies for r in st["rows"]])
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
             "n_ref": n_ref, "n_grid": list(n_grid or LARGE_N), "grids": {"beta": list(beta_grid)},
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
