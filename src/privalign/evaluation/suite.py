"""Jobs that produce a results directory: ``run_evaluate`` and ``run_reproduce``.

A results directory holds ``summary.csv`` (one row per (algorithm, n)), ``per_prompt.csv``,
``settings.json`` (every option, the pool's metadata, the package version), the experiment tables,
figures (PNG and PDF) and ``report.html``. It is written atomically.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from .. import __version__
from ..pools import Pool
from ..report import figures
from ..report.html import render
from ..report.results import SUMMARY_COLUMNS, atomic_directory, write_csv, write_json
from . import experiments as X
from .harness import METRICS, EvalResult, EvalSettings, evaluate

Progress = Callable[[str, int, int], None]


def _settings_record(settings: EvalSettings, pool: Pool, pool_path, result: EvalResult | None, n_prompts: int,
                     extra=None) -> dict:
    return {
        "privalign_version": __version__,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
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


DEFAULT_POOL = "arithmetic-smollm2.parquet"


def default_pool() -> tuple[Pool, str]:
    """The embedded default pool of ``reproduce``: a real pool built with the embedded models
    (SmolLM2-135M-Instruct on the arithmetic family, scored by the certified MiniLM reward model;
    docs/pipeline.md has the commands that rebuild it)."""
    from importlib import resources

    from ..pools import load_pool

    path = resources.files("privalign") / "data" / DEFAULT_POOL
    return load_pool(str(path)), f"embedded default: {DEFAULT_POOL}"


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


def run_reproduce(out: str | Path, pool: Pool | None = None, pool_path=None, *, settings: EvalSettings | None = None,
                  sigma_grid=X.SIGMA_GRID, beta_grid=X.BETA_GRID, n_ref: int = 64, mq_sigmas=(0.5, 1.0, 2.0, 4.0),
                  mq_seeds: int = 10, progress: Progress | None = None) -> Path:
    """The paper's experiment suite on one pool.

    1. Ablations on held-out prompts choose sigma (PrivBoN) and beta (ITP, PrivITP).
    2. The main curves of all four algorithms on the remaining prompts with the chosen values
       (PrivITP uses the chosen PrivBoN sigma as its total noise, as in the paper).
    3. ITP versus PrivITP across noise; 4. the multi-query FSRC experiment; 5. the budget table.
    """
    if pool is None:
        pool, pool_path = default_pool()
    s = declared_reward(pool, settings or EvalSettings()).check()
    grouped = pool.grouped(s.reward)
    steps = 7
    step = 0

    def tick(name):
        nonlocal step
        step += 1
        if progress:
            progress(name, step, steps)

    abl_sigma = X.ablation(grouped, s, "privbon", "sigma", sigma_grid, n_ref=n_ref)
    tick("ablation sigma")
    abl_beta_itp = X.ablation(grouped, s, "itp", "beta", beta_grid, n_ref=n_ref)
    tick("ablation beta (itp)")
    s_priv = replace(s, sigma=abl_sigma["chosen"], sigma_x=None, sigma_z=None)
    abl_beta_priv = X.ablation(grouped, s_priv, "privitp", "beta", beta_grid, n_ref=n_ref)
    tick("ablation beta (privitp)")

    _, eval_prompts = X.split_prompts(grouped.n_prompts, 0.5, s.seed)
    test = grouped.subset(eval_prompts)
    main = {}
    for algo, beta in (("bon", s.beta), ("privbon", s.beta), ("itp", abl_beta_itp["chosen"]),
                       ("privitp", abl_beta_priv["chosen"])):
        main[algo] = evaluate(test, replace(s_priv, algorithms=(algo,), beta=beta))
    result = _merge(main, s_priv)
    tick("main curves")
    sweep = X.noise_sweep(test, replace(s, beta=abl_beta_priv["chosen"]), sigmas=sigma_grid, n=n_ref)
    tick("noise sweep")
    mq = X.multi_query(grouped, s, sigmas=mq_sigmas, seeds=mq_seeds)
    mq_summary = X.summarise_multi_query(mq)
    tick("multi-query")
    halting = {r["sigma"]: r["mean_halting_time"] for r in mq_summary if r["composition"] == "fsrc"}
    budget = X.budget_table(sigmas=tuple(mq_sigmas), mean_halting=halting)

    with atomic_directory(out) as tmp:
        _write_main(tmp, result)
        for name, abl in (("ablation_sigma", abl_sigma), ("ablation_beta_itp", abl_beta_itp),
                          ("ablation_beta_privitp", abl_beta_priv)):
            write_csv(tmp / f"{name}.csv", abl["rows"])
            figures.ablation(abl["rows"], abl["chosen"], tmp, name,
                             f"{abl['algorithm']}: {abl['parameter']} (chosen {abl['chosen']:g})")
        write_csv(tmp / "noise_sweep.csv", sweep)
        figures.noise_sweep(sweep, tmp)
        write_csv(tmp / "multi_query.csv", mq)
        write_csv(tmp / "multi_query_summary.csv", mq_summary)
        figures.fsrc_bars(mq_summary, tmp)
        write_csv(tmp / "budget_table.csv", budget)
        chosen = {"privbon_sigma": abl_sigma["chosen"], "itp_beta": abl_beta_itp["chosen"],
                  "privitp_beta": abl_beta_priv["chosen"], "n_ref": n_ref,
                  "heldout_prompts": abl_sigma["heldout_prompts"], "eval_prompts": abl_sigma["eval_prompts"]}
        write_json(tmp / "settings.json", _settings_record(
            s, pool, pool_path, result, grouped.n_prompts, {"job": "reproduce", "chosen": chosen,
                                         "grids": {"sigma": list(sigma_grid), "beta": list(beta_grid)},
                                         "multi_query": {"sigmas": list(mq_sigmas), "seeds": mq_seeds, "n": 16,
                                                         "beta": 0.05, "epsilon_total": 50.0, "delta": 1e-2}}))
        render(tmp)
        tick("report")
    return Path(out)


def _merge(results: dict[str, EvalResult], s: EvalSettings) -> EvalResult:
    algos = tuple(results)
    first = results[algos[0]]
    per_prompt = np.concatenate([results[a].per_prompt for a in algos], axis=0)
    return EvalResult(replace(s, algorithms=algos), per_prompt, first.base, first.reward_range, first.prompt_ids)
