"""Experiments on response pools: ``demo``, ``simulate``, ``evaluate`` and ``report``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.markup import escape

from ._app import app
from ._common import _said_left_alone
from ._common import EXECUTOR_HELP, SCHEDULER_HELP, WORKERS_HELP, _check_executor, _fail, _load, _out_dir, _out_file, _progress, console, parse_int_list


CLIP_WARNING = 0.05  # share of scores outside a declared range above which evaluate warns


@app.command()
def demo():
    """Print a worked example: each mechanism's choice and privacy cost, and a budget filter."""
    from ..demo import worked_example

    print(worked_example())


@app.command()
def simulate(world: str = typer.Argument(..., help="gaussian or hackable"),
             prompts: int = typer.Option(100, help="number of prompts"),
             samples: int = typer.Option(1000, help="responses per prompt"),
             seed: int = typer.Option(0),
             out: Path = typer.Option(..., help="output Parquet file"),
             base_accuracy: float = typer.Option(0.3, help="true accuracy (gaussian: every prompt's; hackable: mean)"),
             reward_noise: float = typer.Option(0.5, help="gaussian: std of the proxy's error"),
             concentration: float = typer.Option(4.0, help="hackable: Beta concentration of per-prompt accuracy"),
             margin: float = typer.Option(1.0, help="hackable: proxy shift of correct answers"),
             correct_noise: float = typer.Option(0.2, help="hackable: proxy error std on correct answers"),
             wrong_noise: float = typer.Option(0.6, help="hackable: proxy error std on wrong answers")):
    """Draw a response pool from a simulation world (reproducible from --seed)."""
    from ..simulate import simulate as sim

    _out_file(out, "pool")
    opts = ({"base_accuracy": base_accuracy, "reward_noise": reward_noise} if world == "gaussian" else
            {"base_accuracy": base_accuracy, "concentration": concentration, "margin": margin,
             "correct_noise": correct_noise, "wrong_noise": wrong_noise})
    try:
        pool = sim(world, prompts, samples, seed=seed, **opts)
    except ValueError as e:
        _fail(str(e))
    pool.save(out)
    console.print(f"wrote {out}: {pool.n_rows} responses, {prompts} prompts ({world} world, seed {seed})", markup=False)


@app.command()
def evaluate(pool: Path = typer.Argument(..., help="pool (Parquet or JSONL)"),
             algorithms: str = typer.Option("bon,privbon,itp,privitp",
                                            help="comma list of bon, privbon, privbon-gaussian, itp, privitp"),
             n: str = typer.Option("1,2,4,...,4096", help="candidate counts"),
             replicates: int = typer.Option(50),
             sigma: float = typer.Option(0.5, help="PrivBoN noise; PrivITP's total noise (sigma_X = sigma_Z = sigma/2)"),
             epsilon: Optional[float] = typer.Option(None, help="calibrate every private method to this epsilon "
                                                                "per query at each n (instead of --sigma)"),
             temperature: float = typer.Option(0.0, help="PrivBoN's noise floor tau (units of the range): sigma = "
                                                         "max(the noise, tau); summary.csv's epsilon_spent is its cost"),
             beta: float = typer.Option(0.05, help="ITP/PrivITP chi^2 regularisation"),
             sigma_x: Optional[float] = typer.Option(None, help="PrivITP Phase-1 noise (default sigma/2)"),
             sigma_z: Optional[float] = typer.Option(None, help="PrivITP Phase-2 noise (default sigma/2)"),
             truncation: Optional[float] = typer.Option(None, help="PrivITP L (default sqrt(2 ln T))"),
             max_rounds: Optional[int] = typer.Option(None, min=1, help="PrivITP: Phase 2 examines at most "
                                                                        "T = min(max_rounds, n) candidates "
                                                                        "(default: T = n, uncapped)"),
             delta: float = typer.Option(1e-2, help="PrivITP Phase-1 delta"),
             reward: Optional[str] = typer.Option(None, help="reward column (default: the pool's first)"),
             normalisation: str = typer.Option("none", help="none, global or per-prompt z-scores"),
             reward_range: Optional[str] = typer.Option(None, help="declared 'lo,hi' (default: observed min,max)"),
             without_replacement: bool = typer.Option(False, "--without-replacement", help="draw candidates without replacement"),
             estimator: str = typer.Option("exact", help="exact (selection laws) or mc (one draw per replicate)"),
             seed: int = typer.Option(0),
             workers: Optional[int] = typer.Option(None, min=1, help=WORKERS_HELP),
             executor: str = typer.Option("local", help=EXECUTOR_HELP),
             scheduler: Optional[str] = typer.Option(None, help=SCHEDULER_HELP),
             out: Path = typer.Option(..., help="results directory")):
    """Replay selection algorithms on bootstrap replicates of a pool; write tables, figures, report."""
    from ..evaluation import EvalSettings
    from ..report.jobs import run_evaluate

    _out_dir(out, inputs=[pool])
    p = _load(pool)
    rr = None
    if reward_range:
        try:
            lo, hi = (float(v) for v in reward_range.split(","))
            rr = (lo, hi)
        except ValueError:
            _fail(f"--reward-range must be 'lo,hi', got {reward_range!r}")
        if not lo < hi:
            _fail(f"--reward-range must satisfy lo < hi, got {reward_range!r}")
    try:
        settings = EvalSettings(algorithms=tuple(a.strip() for a in algorithms.split(",") if a.strip()),
                                n_grid=parse_int_list(n), replicates=replicates, sigma=sigma, beta=beta,
                                epsilon=epsilon, temperature=temperature,
                                sigma_x=sigma_x, sigma_z=sigma_z, truncation=truncation, delta=delta,
                                max_rounds=max_rounds, reward=reward, normalisation=normalisation, reward_range=rr,
                                replace=not without_replacement, estimator=estimator, seed=seed,
                                workers=workers, executor=executor, scheduler=scheduler).check()
    except ValueError as e:
        _fail(str(e))
    _check_executor(executor)
    from ..pools import PoolError

    if reward is not None and reward not in p.reward_names:
        _fail(f"--reward {reward!r} is not a reward column of {pool}; it has {p.reward_names}")
    _check_draws(p, settings.n_grid, without_replacement)
    if rr is not None and normalisation == "none":
        scores = np.asarray(p.reward(reward), float)
        share = float(np.mean((scores < rr[0]) | (scores > rr[1])))
        if share > CLIP_WARNING:
            console.print(f"[yellow]warning:[/yellow] {share:.0%} of the scores lie outside --reward-range "
                          f"{escape(str(reward_range))} and are clipped to it (ties at the edges weaken every "
                          "selection)")
    try:
        with _progress() as bar:
            task = bar.add_task("prompts", total=None)
            run_evaluate(p, settings, out, pool_path=pool,
                         progress=lambda name, done, total: bar.update(task, completed=done, total=total))
    except (PoolError, ValueError) as e:
        _fail(f"{pool}: {e}")
    console.print(f"wrote {out}/summary.csv, settings.json, figures and report.html", markup=False)
    _said_left_alone(out)


def _check_draws(p, n_grid, without_replacement: bool) -> None:
    """n larger than a prompt's samples: refused without replacement, said aloud with it."""
    from ..pools import _codes

    pid = np.asarray(p.columns["prompt_id"])
    codes = _codes(pid)  # vectorised: a full grid's pool has 13 million rows
    counts = np.bincount(codes)
    big = max(n_grid)
    short = counts < big
    if not short.any():
        return
    ids = pid[np.unique(codes, return_index=True)[1]]
    names = ", ".join(f"{ids[i]} ({counts[i]})" for i in np.flatnonzero(short)[:5])
    more = f" and {int(short.sum()) - 5} more" if short.sum() > 5 else ""
    if without_replacement:
        _fail(f"--without-replacement cannot draw n = {big} from prompts with fewer samples: {names}{more}")
    console.print(f"[yellow]warning:[/yellow] n = {big:d} exceeds the samples of {int(short.sum()):d} prompt(s) "
                  f"({escape(names + more)}): their candidates are drawn with replacement, so repeats are likely")


@app.command()
def report(results: Path = typer.Argument(..., help="results directory")):
    """Render RESULTS/report.html: one self-contained page with every figure and table."""
    from ..report.html import render

    try:
        path = render(results)
    except FileNotFoundError as e:
        _fail(str(e))
    console.print(f"wrote {path}", markup=False)
