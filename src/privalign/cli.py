"""The ``privalign`` command line: a thin shell over the library (typer + rich)."""

from __future__ import annotations

import inspect
import json
import math
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Differentially private inference-time alignment: mechanisms, experiments, reports.")
pool_app = typer.Typer(no_args_is_help=True, help="Inspect and validate response pools.")
app.add_typer(pool_app, name="pool")
ledger_app = typer.Typer(no_args_is_help=True, help="Inspect a durable privacy ledger.")
app.add_typer(ledger_app, name="ledger")
console = Console(stderr=True, soft_wrap=True)  # one logical line stays one line (errors, paths)


def parse_float_list(text: str) -> list[float]:
    """Comma-separated numbers, e.g. '0.1,0.3,1'."""
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected numbers like '0.1,0.3,1', got {text!r}") from None


def parse_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers; 'a,b,c,...,z' continues the sequence up to z.

    The numbers before '...' decide: with three or more, their pattern (geometric or arithmetic);
    with two, geometric when b is a whole multiple (> 1) of a, e.g. '1,2,...,4096' = powers of 2.
    """
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        if "..." not in parts:
            return tuple(int(p) for p in parts)
        i = parts.index("...")
        if i < 2 or i != len(parts) - 2:
            raise ValueError
        head, z = [int(p) for p in parts[:i]], int(parts[-1])
    except ValueError:
        raise typer.BadParameter(f"expected integers like '1,2,4,...,4096', got {text!r}") from None
    a, b = head[-2], head[-1]
    ratios_ok = all(y == x * (b // a) for x, y in zip(head, head[1:])) if a > 0 and b % a == 0 else False
    geometric = a > 0 and b > a and b % a == 0 and ratios_ok
    seq, v = list(head), b
    while True:
        v = v * (b // a) if geometric else v + (b - a)
        if v > z or (not geometric and b <= a):
            break
        seq.append(v)
    return tuple(seq)


CLIP_WARNING = 0.05  # share of scores outside a declared range above which evaluate warns


def _version(value: bool):
    if value:
        from . import __version__

        print(f"privalign {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")):
    """Differentially private inference-time alignment: mechanisms, experiments, reports."""


def _progress():
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console)


def _fail(message: str):
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def _out_dir(out: Path, inputs=()) -> None:
    """Refuse (one line, exit 2) a results directory whose replacement could lose data."""
    from ._paths import OutputError, check_output_dir

    try:
        check_output_dir(out, inputs=inputs)
    except OutputError as e:
        _fail(str(e))


def _out_file(out: Path, kind: str, option: str = "--out") -> None:
    """Refuse (one line, exit 2) a file target that is a directory or a file privalign did not write."""
    from ._paths import OutputError, check_output_file

    try:
        check_output_file(out, kind, option=option)
    except OutputError as e:
        _fail(str(e))


@app.command()
def demo():
    """Print a worked example: each mechanism's choice and privacy cost, and a budget filter."""
    from .demo import worked_example

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
    from .simulate import simulate as sim

    _out_file(out, "pool")
    opts = ({"base_accuracy": base_accuracy, "reward_noise": reward_noise} if world == "gaussian" else
            {"base_accuracy": base_accuracy, "concentration": concentration, "margin": margin,
             "correct_noise": correct_noise, "wrong_noise": wrong_noise})
    try:
        pool = sim(world, prompts, samples, seed=seed, **opts)
    except ValueError as e:
        _fail(str(e))
    pool.save(out)
    console.print(f"wrote {out}: {pool.n_rows} responses, {prompts} prompts ({world} world, seed {seed})")


def _load(path: Path):
    from .pools import PoolError, load_pool

    try:
        return load_pool(path)
    except PoolError as e:
        _fail(str(e))


WORKERS_HELP = "processes sharing the prompts (default: every usable core); the results do not depend on it"
EXECUTOR_HELP = "local (a process pool) or dask (the cluster at --scheduler; needs the optional extra cluster)"
SCHEDULER_HELP = "Dask scheduler address for --executor dask, e.g. tcp://host:8786"


def _check_executor(executor: str) -> None:
    if executor == "dask":
        try:
            import distributed  # noqa: F401
        except ImportError:
            _fail("--executor dask needs the optional extra: pip install 'privalign[cluster]'")


@app.command()
def evaluate(pool: Path = typer.Argument(..., help="pool (Parquet or JSONL)"),
             algorithms: str = typer.Option("bon,privbon,itp,privitp",
                                            help="comma list of bon, privbon, privbon-gaussian, itp, privitp"),
             n: str = typer.Option("1,2,4,...,4096", help="candidate counts"),
             replicates: int = typer.Option(50),
             sigma: float = typer.Option(0.5, help="PrivBoN noise; PrivITP's total noise (sigma_X = sigma_Z = sigma/2)"),
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
    from .evaluation import EvalSettings
    from .report.jobs import run_evaluate

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
                                sigma_x=sigma_x, sigma_z=sigma_z, truncation=truncation, delta=delta,
                                max_rounds=max_rounds, reward=reward, normalisation=normalisation, reward_range=rr,
                                replace=not without_replacement, estimator=estimator, seed=seed,
                                workers=workers, executor=executor, scheduler=scheduler).check()
    except ValueError as e:
        _fail(str(e))
    _check_executor(executor)
    from .pools import PoolError

    if reward is not None and reward not in p.reward_names:
        _fail(f"--reward {reward!r} is not a reward column of {pool}; it has {p.reward_names}")
    _check_draws(p, settings.n_grid, without_replacement)
    if rr is not None and normalisation == "none":
        scores = np.asarray(p.reward(reward), float)
        share = float(np.mean((scores < rr[0]) | (scores > rr[1])))
        if share > CLIP_WARNING:
            console.print(f"[yellow]warning:[/yellow] {share:.0%} of the scores lie outside --reward-range "
                          f"{reward_range} and are clipped to it (ties at the edges weaken every selection)")
    try:
        with _progress() as bar:
            task = bar.add_task("prompts", total=None)
            run_evaluate(p, settings, out, pool_path=pool,
                         progress=lambda name, done, total: bar.update(task, completed=done, total=total))
    except (PoolError, ValueError) as e:
        _fail(f"{pool}: {e}")
    console.print(f"wrote {out}/summary.csv, settings.json, figures and report.html")


def _check_draws(p, n_grid, without_replacement: bool) -> None:
    """n larger than a prompt's samples: refused without replacement, said aloud with it."""
    from .pools import _codes

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
    console.print(f"[yellow]warning:[/yellow] n = {big} exceeds the samples of {int(short.sum())} prompt(s) "
                  f"({names}{more}): their candidates are drawn with replacement, so repeats are likely")


@app.command()
def report(results: Path = typer.Argument(..., help="results directory")):
    """Render RESULTS/report.html: one self-contained page with every figure and table."""
    from .report.html import render

    try:
        path = render(results)
    except FileNotFoundError as e:
        _fail(str(e))
    console.print(f"wrote {path}")


@app.command()
def reproduce(pool: Optional[Path] = typer.Option(None, help="pool (default: the embedded counting pool)"),
              task: Optional[str] = typer.Option(None, help="use the embedded pool of this task "
                                                            "(counting, arithmetic-mix, mmlu-letters, arithmetic, addition)"),
              reward: Optional[str] = typer.Option(None, help="reward column (default: the pool's default)"),
              targets: str = typer.Option("1,4", help="target epsilons per query (worst case)"),
              replicates: int = typer.Option(50),
              seed: int = typer.Option(0),
              workers: Optional[int] = typer.Option(None, min=1, help=WORKERS_HELP),
              executor: str = typer.Option("local", help=EXECUTOR_HELP),
              scheduler: Optional[str] = typer.Option(None, help=SCHEDULER_HELP),
              audit: Optional[Path] = typer.Option(None, help="an audit.json of `privalign audit` on the pool's reward "
                                                              "model, shown in the report (default: the shipped "
                                                              "audit of the embedded pool's model)"),
              large: bool = typer.Option(False, "--large", help="the large-n study instead: curves to n = 1,024 and "
                                                                "the paper's claim for every certified reward model "
                                                                "(--reward: a comma list); default pool: the task's "
                                                                "shipped large pool"),
              prompts: Optional[int] = typer.Option(None, min=2, help="--large: only the first N prompts (a slice)"),
              release_head: Optional[Path] = typer.Option(
                  None, help="a certified policy-bt head whose features the pool carries (score --head-features): "
                             "study its one-time release against per-query noise (default: the embedded pool's "
                             "shipped person-unit head, when the pool carries its features)"),
              out: Path = typer.Option(..., help="results directory")):
    """Run the paper's experiments at fixed privacy levels and write a report.

    Tuning under a privacy constraint on held-out prompts, curves with 95% intervals,
    privacy-utility, ITP vs PrivITP, the FSRC stream, the certified head released once against
    per-query noise (when the pool carries the head's features), and the empirical audit when one
    is attached."""
    from .evaluation import EvalSettings
    from .evaluation.suite import default_pool
    from .report.jobs import run_reproduce

    if pool and task:
        _fail("give --pool or --task, not both")
    _out_dir(out, inputs=[pool, audit, release_head])
    try:
        target_eps = tuple(float(v) for v in targets.split(",") if v.strip())
        if not target_eps or min(target_eps) <= 0:
            raise ValueError
    except ValueError:
        _fail(f"--targets must be positive numbers like '1,4', got {targets!r}")
    if large and release_head is not None:
        _fail("--release-head applies to the reproduce study, not to --large (see benchmarks/release_large_n.py)")
    if large:
        return _reproduce_large(pool, task, reward, target_eps[0], replicates, seed, workers, executor, scheduler,
                                prompts, out)
    if prompts is not None:
        _fail("--prompts applies to --large only")
    p, label = _pool_or_embedded(pool, lambda: default_pool(task))
    if reward is not None and reward not in p.reward_names:
        _fail(f"--reward {reward!r} is not a reward column of {label}; it has {p.reward_names}")
    if audit is None and not pool and reward in (None, p.metadata.get("default_reward")):
        audit = shipped_audit(task)  # the audit of the embedded pool's own reward model
    try:
        audit_record = json.loads(audit.read_text()) if audit else None
        if audit_record is not None and not isinstance(audit_record.get("rows"), list):
            raise ValueError("it has no 'rows'")
    except (OSError, ValueError) as e:
        _fail(f"--audit {audit} is not an audit.json written by `privalign audit --out` "
              f"({type(e).__name__}: {str(e)[:80]})")
    try:
        settings = EvalSettings(replicates=replicates, seed=seed, reward=reward, workers=workers,
                                executor=executor, scheduler=scheduler).check()
    except ValueError as e:
        _fail(str(e))
    _check_executor(executor)
    study = _study_head(p, release_head, embedded=not pool, reward=reward)
    with _progress() as bar:
        job = bar.add_task("experiments", total=7 + (study is not None))
        run_reproduce(out, p, label, settings=settings, targets=target_eps, release=study,
                      progress=lambda name, done, total: bar.update(job, completed=done, total=total,
                                                                    description=name))
    if audit_record is not None:
        _attach_audit(out, audit_record)
    _print_headline(out)


def _pool_or_embedded(pool: Optional[Path], embedded):
    """(pool, label): the given pool file, or the shipped pool ``embedded()`` loads."""
    if pool:
        return _load(pool), pool
    try:
        return embedded()
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))


def _reproduce_large(pool, task, reward, eps, replicates, seed, workers, executor, scheduler, prompts, out):
    """``reproduce --large``: the large-n study at the first target epsilon."""
    from .evaluation import EvalSettings
    from .evaluation.large_n import claim_sentence
    from .evaluation.suite import large_pool
    from .report.jobs import run_large_n

    p, label = _pool_or_embedded(pool, lambda: large_pool(task or "counting"))
    names = [r.strip() for r in reward.split(",") if r.strip()] if reward else None
    try:
        settings = EvalSettings(replicates=replicates, seed=seed, workers=workers, executor=executor,
                                scheduler=scheduler).check()
        _check_executor(executor)
        with _progress() as bar:
            job = bar.add_task("large-n study", total=None)
            run_large_n(out, p, label, rewards=names, settings=settings, epsilon=eps, prompts=prompts,
                        progress=lambda name, done, total: bar.update(job, completed=done, total=total,
                                                                      description=name))
    except ValueError as e:
        _fail(str(e))
    body = json.loads((out / "large_n.json").read_text())
    console.print("\n".join([f"wrote {out} (open {out}/report.html)",
                              *(f"- {claim_sentence(sm)}" for sm in body["studies"])]), markup=False)


def _study_head(p, path: Optional[Path], embedded: bool, reward: Optional[str]):
    """The head whose release ``reproduce`` studies: ``--release-head``, or for an embedded pool the
    shipped head of its default reward when the pool carries that head's features; None otherwise."""
    from importlib import resources

    from .rewards.policy_bt import PolicyBTReward
    from .rewards.release import study_head

    recorded = p.metadata.get("head_features") or {}
    if path is None:
        name = reward or p.metadata.get("default_reward")
        if not embedded or name not in recorded:
            return None
        path = Path(str(resources.files("privalign") / "data" / f"{p.metadata.get('task')}-{name}.json"))
        if not path.exists():
            return None
    try:
        head = study_head(PolicyBTReward.load(path))
    except (OSError, ValueError, KeyError) as e:
        _fail(f"--release-head {path}: {e}")
    if head.name not in recorded:
        _fail(f"--release-head {path}: the pool carries no features of head {head.name!r} (it has "
              f"{sorted(recorded) or 'none'}); add them with privalign score --reward policy-bt:{path} --head-features")
    if recorded[head.name].get("head_id") != head.head_id:
        _fail(f"--release-head {path}: head_id {head.head_id!r} is not the head whose features the pool carries "
              f"({recorded[head.name].get('head_id')!r})")
    return head


def shipped_audit(task: Optional[str]) -> Optional[Path]:
    """The shipped audit record of an embedded pool's reward model (data/TASK-audit.json), if any."""
    from importlib import resources

    from .evaluation.suite import DEFAULT_TASK

    path = Path(str(resources.files("privalign") / "data" / f"{task or DEFAULT_TASK}-audit.json"))
    return path if path.exists() else None


def _attach_audit(out: Path, record: dict) -> None:
    """Add an audit record and its figure to a reproduce results directory, and re-render its report."""
    from .report.figures import audit_bars
    from .report.html import render
    from .report.results import write_json

    write_json(out / "audit.json", record)
    audit_bars(record["rows"], out)
    render(out)


def _print_headline(out: Path) -> None:
    from .report.html import headline_sentences

    h = json.loads((out / "headline.json").read_text())
    console.print("\n".join([f"wrote {out} (open {out}/report.html); base accuracy {h['base_accuracy']:.3g}",
                              *(f"- {line}" for line in headline_sentences(h))]))


rm_app = typer.Typer(no_args_is_help=True, help="Train reward models.")
app.add_typer(rm_app, name="rm")


def _check_dtype(dtype: Optional[str]) -> None:
    """A one-line error for an unknown --dtype, or one this machine's device cannot run, before any
    model is loaded."""
    from .devices import DTYPES, resolve_device, resolve_dtype

    if dtype is None:
        return
    if dtype not in DTYPES:
        _fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        resolve_dtype(dtype, resolve_device(None))
    except ValueError as e:
        _fail(f"--dtype: {e}")


def _generator(model: str, backend: str, base_url: Optional[str], **options):
    from .backends import make_generator

    try:
        return make_generator(backend, model, base_url, **options)
    except ValueError as e:
        _fail(str(e))


@app.command()
def generate(task: str = typer.Option(..., help="gsm8k, math500, mmlu[:subject], mmlu-letters, "
                                                 "arithmetic, arithmetic-mix, addition or counting"),
             split: str = typer.Option("test"),
             limit: Optional[int] = typer.Option(None, help="first N problems"),
             samples: int = typer.Option(64, help="responses per prompt"),
             model: str = typer.Option("smollm2", help="'smollm2' (embedded), a path, a .gguf file or a Hub id"),
             backend: str = typer.Option("transformers", help="transformers, llamacpp, vllm or openai"),
             base_url: Optional[str] = typer.Option(None, help="openai backend: server URL"),
             temperature: float = typer.Option(1.0),
             max_new_tokens: Optional[int] = typer.Option(None, help="default: the task's"),
             seed: int = typer.Option(0),
             shard_size: int = typer.Option(10, help="prompts per shard (the unit of resumption)"),
             data_dir: Optional[str] = typer.Option(None, help="datasets folder (default: ../shared/data)"),
             features: bool = typer.Option(False, "--features", help="also record policy features (OUT.features.npz) for policy-bt"),
             threads: Optional[int] = typer.Option(None, help="torch threads (transformers backend)"),
             sampler: str = typer.Option("loop", help="transformers backend: 'loop' (built the 64-sample pools) or "
                                                      "'shared' (one copy of the prompt's cache for all samples: "
                                                      "several times faster for hundreds of short samples)"),
             batch_size: Optional[int] = typer.Option(None, help="transformers backend: rows decoded together "
                                                                 "(default on the CPU 64 for loop, 1024 for "
                                                                 "shared; on a GPU what its memory holds)"),
             dtype: Optional[str] = typer.Option(None, help="transformers backend: auto (the checkpoint's dtype "
                                                            "on a GPU, float32 on the CPU), bfloat16, float16 "
                                                            "or float32"),
             out: Path = typer.Option(..., help="output pool (Parquet)")):
    """Sample responses with a real model, grade them, and write a pool (sharded, resumable)."""
    from .pipeline import generate_pool
    from .tasks import get_task

    _out_file(out, "pool")
    try:
        t = get_task(task, data_dir)
        problems = t.load(split, limit)
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    if threads:
        import torch

        torch.set_num_threads(threads)
    if dtype is not None and backend != "transformers":
        _fail(f"--dtype applies to the transformers backend, not {backend!r}")
    _check_dtype(dtype)
    gen = _generator(model, backend, base_url, **({"sampler": sampler, "batch_size": batch_size, "dtype": dtype}
                                                  if backend == "transformers" else {}))
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                  console=console) as bar:
        job = bar.add_task("prompts", total=len(problems), info="")

        def show(st):
            rate = st["tokens"] / st["gen_seconds"] if st["gen_seconds"] else 0.0
            bar.update(job, completed=st["prompts_done"], info=f"{st['samples']} samples, {rate:.0f} tok/s")

        pool = generate_pool(t, problems, gen, out, samples=samples, temperature=temperature,
                             max_new_tokens=max_new_tokens, seed=seed, shard_size=shard_size, split=split,
                             progress=show, features=features)
    console.print(f"wrote {out}: {pool.n_rows} responses, mean accuracy {float(np.mean(pool.columns['true_reward'])):.3f}")


@app.command()
def score(pool: Path = typer.Argument(...),
          reward: list[str] = typer.Option(..., help="minilm-bt:PATH, policy-bt:PATH, hf:PATH_OR_ID, vllm:URL (a "
                                                     "vLLM server's classify API) or http:URL (repeatable)"),
          dtype: Optional[str] = typer.Option(None, help="policy-bt (its policy) and hf: auto (the checkpoint's "
                                                         "dtype on a GPU, float32 on the CPU), bfloat16, float16 "
                                                         "or float32"),
          trust_remote_code: bool = typer.Option(False, "--trust-remote-code",
                                                 help="hf: run the checkpoint's own modelling code (ArmoRM, ...)"),
          batch_size: Optional[int] = typer.Option(None, help="hf: rows per forward pass (default: 16 on the CPU, "
                                                              "from free memory on a GPU); vllm: texts per request"),
          head_features: bool = typer.Option(False, "--head-features",
                                             help="policy-bt heads: also keep their feature coordinates phi "
                                                  "(phi:<name>:<j> columns), for the release study of reproduce")):
    """Score a pool's responses with reward models: adds one reward:<name> column each."""
    from .backends.base import BackendError
    from .pipeline import load_reward, score_pool

    _check_dtype(dtype)
    try:
        models = [load_reward(r, dtype=dtype, trust_remote_code=trust_remote_code, batch_size=batch_size)
                  for r in reward]
    except (ValueError, OSError, BackendError) as e:
        _fail(str(e))
    try:
        with _progress() as bar:
            job = bar.add_task("scoring", total=None)
            p = score_pool(pool, models, progress=lambda d, t: bar.update(job, completed=d, total=t),
                           head_features=head_features)
    except (ValueError, BackendError) as e:
        _fail(f"scoring {pool}: {e}")
    console.print(f"scored {pool}: rewards {p.reward_names}, clipped {p.metadata.get('clipped')}")


@app.command()
def featurize(pool: Path = typer.Argument(..., help="a pool generated by a transformers model"),
              model: str = typer.Option("smollm2", help="the policy that generated the pool: 'smollm2', a path "
                                                        "or a Hub id"),
              dtype: Optional[str] = typer.Option(None, help="auto (the checkpoint's dtype on a GPU, float32 on "
                                                             "the CPU), bfloat16, float16 or float32; features "
                                                             "are float32 whatever it is")):
    """Record a pool's policy features by teacher forcing (POOL.features.npz), for policy-bt."""
    from .backends.transformers_backend import TransformersGenerator
    from .pipeline import featurize_pool

    _check_dtype(dtype)
    p = _load(pool)
    name = model
    try:
        gen = TransformersGenerator(name, dtype=dtype)
    except (OSError, ValueError) as e:
        _fail(f"cannot load the policy {name!r}: {e}")
    with _progress() as bar:
        job = bar.add_task("featurizing", total=None)
        out = featurize_pool(pool, gen, progress=lambda d, t: bar.update(job, completed=d, total=t))
    console.print(f"wrote {out}: features of {p.n_rows} responses (teacher forcing through {name})")


@rm_app.command("train")
def rm_train(task: str = typer.Option("gsm8k", help="the task: minilm-bt builds pairs from its train split; "
                                                    "policy-bt needs it for the chat format"),
             features: str = typer.Option("minilm", help="minilm (sentence embeddings of reference pairs) or "
                                                         "policy (the policy's own features, from --pool)"),
             pool: Optional[Path] = typer.Option(None, help="policy: a pool of graded policy samples on the TRAIN "
                                                            "prompts, generated with --features"),
             limit: Optional[int] = typer.Option(None, help="minilm: first N training problems (one pair each)"),
             lam: Optional[str] = typer.Option(None, help="L2 regularisation lambda (policy: a comma list to choose "
                                                          "from on validation prompts)"),
             components: Optional[str] = typer.Option(None, help="policy: PCA sizes q to choose from (default 8,16; "
                                                                  "--objective release: 2,4,8,16)"),
             cs: Optional[str] = typer.Option(None, help="policy: weights c of the log-probability coordinate to "
                                                         "choose from (default 0.6,0.8,0.95; release: up to 0.99)"),
             lp_clips: Optional[str] = typer.Option(None, help="policy: log-probability clips L to choose from "
                                                               "(default 4; release: 1,2,4)"),
             objective: str = typer.Option("privbon", help="policy: what the choice of (q, c, L, lambda) maximises "
                                                           "on validation prompts: privbon (PrivBoN at "
                                                           "--target-epsilon per query) or release (BoN with the "
                                                           "head released at --release-epsilon, mean and 5th "
                                                           "percentile over draws)"),
             pairs_per_prompt: int = typer.Option(64, help="policy: at most this many pairs per train prompt"),
             pairs_per_person: Optional[int] = typer.Option(None, help="k: at most this many pairs per person "
                                                                       "(policy: a person is a train prompt's grader, "
                                                                       "default 16, the excess dropped; minilm: 1)"),
             max_persons: Optional[int] = typer.Option(None, help="policy: keep a seeded random P of D's persons "
                                                                  "(a smaller deployment)"),
             release_epsilon: Optional[float] = typer.Option(None, help="policy: also release the head once with "
                                                                        "Gaussian noise at this epsilon (rm release)"),
             release_delta: float = typer.Option(1e-6, help="with --release-epsilon: its delta"),
             target_epsilon: float = typer.Option(1.0, help="policy: epsilon per query that the choice of "
                                                            "(q, lambda) optimises PrivBoN accuracy for"),
             range_epsilon: float = typer.Option(0.1, help="policy: one-time epsilon to release a tight output "
                                                           "range privately (0: the data-independent 1/lambda)"),
             seed: int = typer.Option(0),
             name: Optional[str] = typer.Option(None, help="reward name (default: minilm-bt or policy-bt)"),
             data_dir: Optional[str] = typer.Option(None),
             out: Path = typer.Option(..., help="output model (JSON)")):
    """Train a certified Bradley-Terry reward model and print its certificate."""
    _out_file(out, "model")
    _out_file(private_path(out), "model")
    if features == "policy":
        if objective not in ("privbon", "release"):
            _fail(f"--objective must be 'privbon' or 'release', got {objective!r}")
        if objective == "release" and release_epsilon is None:
            _fail("--objective release needs --release-epsilon: the epsilon_w the choice is made for")
        if release_epsilon is not None:
            _check_release_args(release_epsilon, release_delta)
            _out_file(released_path(out), "model")
        grid = {"lambdas": lam, "components": components, "cs": cs, "lp_clips": lp_clips}
        model = _rm_train_policy(task, pool, grid, pairs_per_prompt, pairs_per_person or 16, target_epsilon,
                                 range_epsilon, seed, name or "policy-bt", out, max_persons,
                                 {"objective": objective, "release_epsilon": release_epsilon,
                                  "release_delta": release_delta} if objective == "release" else {})
        if release_epsilon is not None:
            _release(model, release_epsilon, release_delta, released_path(out))
        return
    if features != "minilm":
        _fail(f"--features must be 'minilm' or 'policy', got {features!r}")
    from .rewards import EmbeddingBTReward
    from .rewards.preferences import preference_pairs

    try:
        lam_value = float(lam) if lam else 1e-2
        prompts, chosen, rejected = preference_pairs(task, limit, seed, data_dir)
        model = EmbeddingBTReward.train(prompts, chosen, rejected, lam=lam_value, pairs_per_person=pairs_per_person or 1,
                                        name=name or "minilm-bt", meta={"task": task, "pairs": len(prompts), "seed": seed})
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    model.save(out)
    private = model.save_private(private_path(out))
    lo, hi = model.output_range
    console.print(f"wrote {out}: {len(prompts)} pairs, lambda = {lam_value:g} (given, not chosen on D), "
                  f"certified Delta_r = {model.sensitivity:.4g} on output range [{lo:.3g}, {hi:.3g}] "
                  f"({model.sensitivity / (hi - lo):.3%} of its width); keep it with the operator")
    console.print(f"wrote {private} (private, derived from D: train pair accuracy "
                  f"{model.private['train_pair_accuracy']:.3f})")


def private_path(out: Path) -> Path:
    """Where ``rm train`` writes a model's D-derived diagnostics: beside it, marked private."""
    return out.with_name(out.stem + ".private.json")


def _train_pool(pool: Optional[Path]):
    from .pipeline import pool_features

    if pool is None:
        _fail("--features policy needs --pool: graded policy samples of the train prompts (privalign generate "
              "--split train --features ...)")
    p = _load(pool)
    raw = pool_features(p, pool)
    if raw is None:
        _fail(f"{pool} has no recorded policy features ({pool}.features.npz); regenerate it with --features")
    return p, raw


def _grid_values(name: str, text: Optional[str], parse=parse_float_list):
    if text is None:
        return None
    try:
        return tuple(parse(text))
    except typer.BadParameter:
        _fail(f"--{name} must be a comma list of numbers, got {text!r}")


def _rm_train_policy(task, pool, grid, pairs_per_prompt, pairs_per_person, target_epsilon, range_epsilon,
                     seed, name, out, max_persons=None, objective=None):
    from rich.table import Table

    from .rewards.policy_bt import train_policy_bt

    p, raw = _train_pool(pool)
    settings = {"lambdas": _grid_values("lam", grid["lambdas"]), "cs": _grid_values("cs", grid["cs"]),
                "components": _grid_values("components", grid["components"], parse_int_list),
                "lp_clips": _grid_values("lp-clips", grid["lp_clips"])}
    try:
        model, grid = train_policy_bt(raw, p.columns["prompt_id"], p.columns["true_reward"], task=task,
                                      pairs_per_prompt=pairs_per_prompt, pairs_per_person=pairs_per_person,
                                      target_epsilon=target_epsilon, range_epsilon=range_epsilon, seed=seed,
                                      name=name, max_persons=max_persons,
                                      **{key: v for key, v in settings.items() if v is not None}, **(objective or {}))
    except ValueError as e:
        _fail(str(e))
    meta, lo_hi = model.meta, model.output_range
    release = bool(objective)
    table = Table(title=f"(q, c, L, lambda): heads trained on {meta['selection_fit_prompts']} and scored on "
                        f"{meta['selection_score_prompts']} validation prompts (never D, never test)")
    score = (f"release eps_w={objective['release_epsilon']:g}: mean, p5 (n=16)" if release
             else f"PrivBoN eps={target_epsilon:g} (n=16)")
    for col in ("q", "c", "L", "lambda", "Delta_r", "AUC", score, "BoN (n=16)"):
        table.add_column(col, justify="right")
    for r in grid:
        table.add_row(str(r["components"]), f"{r['c']:g}", f"{r['lp_clip']:g}", f"{r['lambda']:g}",
                      f"{r['sensitivity']:.3g}", f"{r['selection_auc']:.3f}",
                      f"{r['selection_release_mean']:.3f}, {r['selection_release_p5']:.3f}" if release
                      else f"{r['selection_privbon_accuracy']:.3f}", f"{r['selection_bon_accuracy']:.3f}")
    console.print(table)
    model.save(out)
    private = model.save_private(private_path(out))
    console.print(
        f"wrote {out}: P = {meta['persons']} persons (one per fit prompt) of at most k = {model.k} pairs each "
        f"({model.private['pairs']} pairs kept, {model.private['pairs_dropped_beyond_k']} beyond k dropped), "
        f"m = P k = {model.m}, "
        f"q = {meta['components']}, c = {meta['c']:g}, L = {meta['lp_clip']:g}, lambda = {model.lam:g}"
        f"{' (on the edge of its grid: ' + ', '.join(meta['on_grid_edge']) + ')' if meta['on_grid_edge'] else ''}, "
        f"chosen without reading D; certified Delta_r = {model.sensitivity:.3g} on [{lo_hi[0]:.3g}, {lo_hi[1]:.3g}] "
        f"{f'(released privately, one-time epsilon {range_epsilon:g}) ' if range_epsilon > 0 else ''}"
        f"({model.sensitivity / (lo_hi[1] - lo_hi[0]):.3%} of its width); selection AUC {meta['selection_auc']:.3f} "
        f"(log-probability alone {meta['selection_logprob_auc']:.3f}); keep the model file with the operator")
    console.print(f"wrote {private} (private, derived from D: the final head's validation AUC "
                  f"{model.private['val_auc']:.3f}, train pair accuracy {model.private['train_pair_accuracy']:.3f})")
    return model


def released_path(out: Path) -> Path:
    """Where ``rm train --release-epsilon`` writes the released head: beside the model."""
    return out.with_name(out.stem + ".released.json")


def _check_release_args(epsilon: float, delta: float) -> None:

    if not (math.isfinite(epsilon) and epsilon > 0):
        _fail(f"--epsilon must be positive and finite, got {epsilon!r}")
    if not (math.isfinite(delta) and 0 < delta < 1):
        _fail(f"--delta must lie in (0, 1), got {delta!r}")


def _release(model, epsilon: float, delta: float, out: Path) -> None:
    from .rewards.release import release_head

    try:
        head = release_head(model, epsilon, delta)
    except ValueError as e:
        _fail(str(e))
    head.save(out)
    g = head.release
    console.print(f"wrote {out}: {model.name} released once at (epsilon_w, delta_w) = ({g['epsilon']:g}, "
                  f"{g['delta']:g}) for P = {g['persons']} persons, k = {g['pairs_per_person']}: w~ = w + "
                  f"N(0, sigma^2 I), sigma = {g['sigma']:.4g} for L2 sensitivity Delta_r = {g['sensitivity']:.4g} "
                  f"(||w|| = {np.linalg.norm(model.w):.4g}); every selection with it is free; this file may be "
                  f"published")


@rm_app.command("release")
def rm_release(model: Path = typer.Argument(..., help="a certified policy-bt model (the operator's exact file)"),
               epsilon: float = typer.Option(..., help="epsilon_w of the one-time release"),
               delta: float = typer.Option(..., help="delta_w of the one-time release (below 1/P)"),
               out: Path = typer.Option(..., help="the released head (JSON): publishable")):
    """Release a certified head once with differential privacy: w~ = w + N(0, sigma^2 I).

    sigma is the analytic Gaussian scale for the certificate's L2 sensitivity Delta_r at (epsilon_w,
    delta_w), drawn from the secure generator. Every selection made with the released head (BoN, soft
    BoN, any n, any number of queries) is post-processing and costs nothing more; serve it with
    mechanism "bon" and the model budget is charged the release once."""
    from .rewards.policy_bt import PolicyBTReward

    _check_release_args(epsilon, delta)
    _out_file(out, "model")
    if out.expanduser().resolve() == model.expanduser().resolve():
        _fail(f"--out {out} is the model itself; the exact weights must stay with the operator")
    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    _release(m, epsilon, delta, out)


def _audit_release(m, model: Path, pool: Path, p, raw, epsilon_w: float, delta_w: float, noise_factor: float,
                   runs: int, seed: Optional[int], out: Optional[Path]) -> None:
    """``privalign audit --release``: ``audit.audit_release``, its rows printed, exit 1 if caught."""
    from .audit import audit_release
    from .rewards.release import check_release, release_noise_scale

    try:
        check_release(m, epsilon_w, delta_w)
        sigma = release_noise_scale(m, epsilon_w, delta_w) * noise_factor
        with console.status("auditing the release"):
            res = audit_release(m, raw, p.columns["prompt_id"], p.columns["true_reward"], epsilon_w=epsilon_w,
                                delta_w=delta_w, runs=runs, seed=seed,
                                noise_scale=None if noise_factor == 1.0 else sigma)
    except ValueError as e:
        _fail(f"{model}: {e}")
    console.print(f"neighbours: {res['person']}'s {res['persons_pairs']} pairs replaced by {res['canary']}; "
                  f"realised ||w_D - w_D'|| = {res['realised_shift']:.4g}, certified Delta_r = "
                  f"{res['certified_sensitivity']:.4g} ({res['shift_share']:.1%} of it)")
    console.print(f"release: sigma = {res['sigma']:.4g} ({res['noise_factor']:g} x the calibrated "
                  f"{res['calibrated_sigma']:.4g}) in d = {res['dimension']}, claimed (epsilon_w, delta_w) = "
                  f"({res['epsilon_w']:g}, {res['delta_w']:g}); projected on w_D' - w_D the draws are N(0, 1) vs "
                  f"N(mu, 1), mu = {res['mu']:.4g}")
    rows = [("95% lower bound on epsilon_w", res["epsilon_lower_bound"],
             f"{runs} draws per side, event x {res['direction']} {res['threshold']:.4g} chosen on a pilot of "
             f"{res['pilot_per_side']}: {res['events_D']} under D vs {res['events_D_prime']} under D'"),
            ("expected at this many draws", res["expected_lower_bound"], "this test with expected counts"),
            ("epsilon of the realised pair", res["epsilon_of_realised_pair"],
             "the most any test on these neighbours can show"),
            (f"the most {runs} draws can show", res["largest_bound_for_runs"], f"{runs} vs 0 events"),
            ("true epsilon at Delta_r and sigma", res["epsilon_at_certified_sensitivity"],
             f"the claim is {res['epsilon_w']:g}")]
    for label, value, note in rows:
        console.print(f"  {label:<36} {value:>8.4g}  ({note})")
    if out:
        from . import __version__
        from ._paths import write_manifest
        from .report.results import write_json

        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out)
        write_json(out / "release-audit.json", {"model": str(model), "pool": str(pool), "seed": seed,
                                                 "privalign_version": __version__,
                                                 "command": "privalign " + " ".join(sys.argv[1:]), **res})
        console.print(f"wrote {out}/release-audit.json")
    if res["realised_shift"] > res["certified_sensitivity"]:
        console.print(f"[red]the certificate was exceeded: realised ||w_D - w_D'|| {res['realised_shift']:.4g} > "
                      f"Delta_r {res['certified_sensitivity']:.4g}[/red]")
        raise typer.Exit(1)
    if res["epsilon_lower_bound"] > res["epsilon_w"]:
        console.print(f"[red]caught: the release's 95% lower bound {res['epsilon_lower_bound']:.4g} exceeds its "
                      f"claimed epsilon_w {res['epsilon_w']:g}[/red]")
        raise typer.Exit(1)
    console.print(f"the bound stays below the claimed epsilon_w {res['epsilon_w']:g}")


@rm_app.command("check-sensitivity")
def rm_check_sensitivity(model: Path = typer.Argument(..., help="a policy-bt model (JSON)"),
                         pool: Path = typer.Option(..., help="the train pool it was trained on"),
                         trials: int = typer.Option(24, help="retrainings (>= 20)"),
                         seed: int = typer.Option(0)):
    """Check a certified reward model's sensitivity by adversarial retraining.

    Rerun the whole training procedure (the choice of q, c, lambda included) with one person's
    pairs replaced by adversarial ones and compare the score change with the certified Delta_r
    (exit 1 if it is ever exceeded or the choice ever changes)."""
    from .rewards.policy_bt import PolicyBTReward, check_sensitivity

    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p, raw = _train_pool(pool)
    try:
        rows = check_sensitivity(m, raw, p.columns["prompt_id"], p.columns["true_reward"], trials, seed)
    except ValueError as e:
        _fail(str(e))
    worst_score = max(r["max_score_change"] for r in rows)
    worst_w = max(r["weight_change"] for r in rows)
    for kind in sorted({r["adversary"] for r in rows}):
        sub = [r for r in rows if r["adversary"] == kind]
        console.print(f"  {kind:<13} {len(sub):>3} retrainings: max |r_D - r_D'| = "
                      f"{max(r['max_score_change'] for r in sub):.4g}, max ||w_D - w_D'|| = "
                      f"{max(r['weight_change'] for r in sub):.4g}")
    changed = sum(r["settings_changed"] for r in rows)
    console.print(f"{len(rows)} retrainings of the whole procedure: the chosen (q, c, lambda) changed in {changed}; "
                  f"max |r_D - r_D'| on the train samples {worst_score:.4g}, over all inputs "
                  f"(||w_D - w_D'||) {worst_w:.4g}; certified Delta_r {m.sensitivity:.4g} "
                  f"({worst_w / m.sensitivity:.1%} of it)")
    if worst_w > m.sensitivity or worst_score > m.sensitivity or changed:
        console.print("[red]the certificate was exceeded[/red]")
        raise typer.Exit(1)


@app.command()
def audit(model: Path = typer.Option(..., help="a policy-bt reward model (JSON)"),
          pool: Path = typer.Option(..., help="the train pool it was trained on (with recorded features)"),
          epsilon: float = typer.Option(1.0, help="claimed epsilon per query of the private mechanisms"),
          delta: float = typer.Option(1e-5, help="PrivITP's delta per query"),
          runs: int = typer.Option(200_000, help="mechanism runs per side (D and D')"),
          seed: Optional[int] = typer.Option(None),
          release: Optional[float] = typer.Option(None, "--release", metavar="EPS_W",
                                                  help="audit the head's one-time release w~ = w + N(0, sigma^2 I) "
                                                       "claimed at epsilon_w instead of the per-query mechanisms"),
          release_delta: float = typer.Option(1e-6, "--release-delta", metavar="DELTA_W",
                                              help="delta_w of the audited release (below 1/P)"),
          noise_factor: float = typer.Option(1.0, "--noise-factor",
                                             help="with --release: draw the release at this multiple of its calibrated "
                                                  "sigma while it still claims epsilon_w (0.01: 100 times too little "
                                                  "noise, which the audit must catch)"),
          out: Optional[Path] = typer.Option(None, help="write audit.json and audit.png here (with --release: "
                                                        "release-audit.json)")):
    """Audit the privacy claims empirically: 95% lower bounds on epsilon.

    A canary in the preference data, the model retrained on both neighbours, each mechanism run
    many times; 95% Clopper-Pearson lower bounds on epsilon (exit 1 if one exceeds its claim).
    With --release EPS_W: the head's one-time release, drawn RUNS times on each side and projected
    on w_D' - w_D (exit 1 if the bound exceeds epsilon_w)."""
    from .audit import audit as run_audit
    from .rewards.policy_bt import PolicyBTReward

    if release is None and noise_factor != 1.0:
        _fail(f"--noise-factor {noise_factor!r} applies only to a release audit (--release EPS_W)")
    if release is not None:
        if not (math.isfinite(release) and release > 0):
            _fail(f"--release must be a positive and finite epsilon_w, got {release!r}")
        if not (math.isfinite(release_delta) and 0 < release_delta < 1):
            _fail(f"--release-delta must lie in (0, 1), got {release_delta!r}")
        if not (math.isfinite(noise_factor) and noise_factor > 0):
            _fail(f"--noise-factor must be positive and finite, got {noise_factor!r}")
        if runs < 1000:
            _fail(f"--runs must be at least 1000 release draws per side, got {runs}")
    if out:
        _out_dir(out, inputs=[model, pool])
    try:
        m = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p, raw = _train_pool(pool)
    if release is not None:
        _audit_release(m, model, pool, p, raw, release, release_delta, noise_factor, runs, seed, out)
        return
    with console.status("auditing"):
        res = run_audit(m, raw, p.columns["prompt_id"], p.columns["true_reward"], epsilon=epsilon, delta=delta,
                        runs=runs, seed=seed)
    console.print(f"realised max |r_D - r_D'| = {res['realised_sensitivity']:.4g}, certified Delta_r = "
                  f"{res['certified_sensitivity']:.4g}")
    ok = res["realised_sensitivity"] <= res["certified_sensitivity"]
    for r in res["rows"]:
        claimed = r["claimed_epsilon"]
        ok &= r["epsilon_lower_bound"] <= claimed
        console.print(f"  {r['mechanism']:<17} claimed epsilon {claimed:<6.3g} 95% lower bound "
                      f"{r['epsilon_lower_bound']:.3g} ({r['runs_per_side']} runs per side, "
                      f"{r['successes_D']} vs {r['successes_D_prime']} selections of the target)")
    if out:
        from . import __version__
        from .report.figures import audit_bars
        from ._paths import write_manifest
        from .report.results import write_json

        out.mkdir(parents=True, exist_ok=True)
        write_manifest(out)
        write_json(out / "audit.json", {"model": str(model), "pool": str(pool), "epsilon": epsilon, "delta": delta,
                                         "seed": seed, "privalign_version": __version__,
                                         "command": "privalign " + " ".join(sys.argv[1:]), **res})
        audit_bars(res["rows"], out)
        console.print(f"wrote {out}/audit.json and audit.png")
    if not ok:
        console.print("[red]a lower bound exceeds its claim, or the realised sensitivity its certificate[/red]")
        raise typer.Exit(1)


@app.command()
def serve(config: Optional[Path] = typer.Option(None, help="TOML config (default: embedded model pair, SQLite ledger)"),
          host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8000),
          workers: int = typer.Option(1, help="uvicorn worker processes (they share the ledger)")):
    """Serve private Best-of-N over an OpenAI-compatible HTTP API with a durable privacy ledger."""
    import os

    import uvicorn

    from pydantic import ValidationError

    from .server import load_config
    from .server.config import config_error_message

    try:
        cfg = load_config(config)
    except ValidationError as e:  # one line: "field: problem (got value)", unknown keys with the nearest known
        _fail(f"invalid config {config}: {config_error_message(e)}")
    except Exception as e:
        _fail(f"invalid config {config}: {e}")
    sock = _bind(host, port)  # before any model loads and before the ledger (or its folder) is created
    from .server.config import prepare_ledger

    try:
        prepare_ledger(cfg.ledger)
        budgets, model, notes = _ledger_settings(cfg)
    except ValueError as e:
        _fail(str(e))
    keys = "from " + str(config.resolve()) if config else "generated for this run (no config file): pass --config to fix them"
    console.print(f"privalign serve on http://{host}:{port}/v1 ({workers} worker(s))\n"
                  f"  generator: {cfg.generator.backend} {cfg.generator.model}, max_tokens cap {cfg.token_cap}"
                  + (" (short answers: raise [generator] max_new_tokens for longer ones); " if cfg.token_cap <= 16
                     else "; ")
                  + f"requests name the model {cfg.served_model_name!r}"
                  + "".join(f" (or {a!r})" for a in cfg.model_aliases) + "\n"
                  f"  reward: {cfg.reward.kind} {Path(cfg.reward.path).resolve() if cfg.reward.path else ''}\n"
                  f"  mechanism: {cfg.mechanism.name}, n = {cfg.mechanism.n}\n"
                  f"  ledger: {cfg.ledger}\n"
                  + "".join(f"  budget {b.name!r} (tenant {b.tenant}): epsilon {b.total.epsilon:g}, delta "
                            f"{b.total.delta:g}, {b.composition}; spent {b.spent_privacy.epsilon:g}\n" for b in budgets)
                  + (f"  model budget {model.name!r}: epsilon {model.total.epsilon:g}, delta {model.total.delta:g}, "
                     f"{model.composition}; spent {model.spent_privacy.epsilon:g}: every query of every tenant is "
                     f"charged here; a person in the reward model's data gets this guarantee\n"
                     if model else
                     f"  no model budget: a person in the reward model's data gets only the sum over all budgets "
                     f"(epsilon {sum(b.total.epsilon for b in budgets):g} now, more with each budget created)\n")
                  + "".join(f"  note: {n}\n" for n in notes)
                  + f"  keys {keys}")
    if not config:
        console.print(f"  admin key: {cfg.admin_keys[0]}\n  client key: {next(iter(cfg.clients))}")
    if cfg.generator.backend in ("transformers", "llamacpp") and cfg.token_cap > 64 and not _has_gpu():
        console.print(f"[yellow]warning:[/yellow] max_tokens cap {cfg.token_cap} on an embedded model without a GPU: "
                      f"a request of n = {cfg.mechanism.n} can take minutes (docs/deploy.md, latency on a CPU)")
    if workers > 1:
        sock.close()  # uvicorn's workers bind it themselves
        os.environ["PRIVALIGN_CONFIG"] = str(config) if config else ""
        if not config:
            os.environ["PRIVALIGN_GENERATED_KEYS"] = json.dumps(
                {"admin_keys": cfg.admin_keys, "clients": {k: v.model_dump() for k, v in cfg.clients.items()}})
        uvicorn.run("privalign.server.main:app", host=host, port=port, workers=workers, **UVICORN)
    else:
        from .server.http import create_app

        try:
            web = create_app(cfg)
        except (ValueError, OSError) as e:  # e.g. the model budget cannot cover the range release
            _fail(f"cannot start: {e}")
        uvicorn.Server(uvicorn.Config(web, host=host, port=port, **UVICORN)).run(sockets=[sock])


def _ledger_settings(cfg):
    """(tenant budgets, the model budget or None, notes) as the ledger holds them once this config is
    applied (``server.deployment.configure``): the banner shows the ledger, not the config."""
    from .ledger import Ledger
    from .server.deployment import configure

    try:
        led = Ledger(cfg.ledger, synchronous=cfg.ledger_synchronous, lease=cfg.ledger_lease_s)
    except Exception as e:
        raise ValueError(f"ledger: cannot open {cfg.ledger} ({type(e).__name__}: {e})") from None
    try:
        d = configure(led, cfg)
        states = led.budgets()
    finally:
        led.close()
    model = next((b for b in states if b.name == d.model_budget), None)
    return [b for b in states if b.name != d.model_budget], model, d.notes


def _bind(host: str, port: int):
    """The listening socket, bound now: a port in use is a one-line error before anything loads."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        _fail(f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e}); is another server running there? "
              "(nothing was loaded or created)")
    sock.set_inheritable(True)
    return sock


# uvicorn's own access log is off (the service writes its own, with tenant, budget and epsilon), and
# so are the per-response Server and Date headers and X-Forwarded-* parsing: less work per request
UVICORN = {"log_level": "warning", "access_log": False, "proxy_headers": False, "server_header": False,
           "date_header": False}


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


@app.command()
def plan(epsilon_total: float = typer.Option(..., help="the budget's epsilon"),
         delta_total: float = typer.Option(1e-6, help="the budget's delta"),
         mechanism: str = typer.Option("privbon", help="privbon, privbon-gaussian or privitp"),
         epsilon: Optional[float] = typer.Option(None, help="epsilon per query: how many queries?"),
         queries: Optional[int] = typer.Option(None, help="queries to serve: what epsilon each?"),
         n: int = typer.Option(16, help="candidates per query"),
         sensitivity: Optional[float] = typer.Option(None, help="Delta_r / range (default: --pool's, or 0.01)"),
         delta: float = typer.Option(1e-8, help="privitp: delta per query"),
         beta: float = typer.Option(0.05, help="privitp: beta"),
         max_rounds: Optional[int] = typer.Option(16, min=1, help="privitp: Phase 2 examines at most min(T, n) "
                                                                  "candidates (the service's default 16); 0 rounds "
                                                                  "are refused, --max-rounds n for the uncapped"),
         pool: Optional[Path] = typer.Option(None, help="a scored pool: add the accuracy each gives"),
         reward: Optional[str] = typer.Option(None, help="its certified reward column"),
         pairs: Optional[int] = typer.Option(None, help="rescale Delta_r to a head on this many pairs"),
         model: Optional[Path] = typer.Option(None, help="a certified policy-bt head (exact file) and --pool with its "
                                                         "features: add the release-then-BoN mode"),
         release_epsilon: Optional[str] = typer.Option(None, help="with --model: epsilon_w values to compare "
                                                                  "(default: the budget's epsilon)"),
         draws: int = typer.Option(60, help="with --model: release draws averaged (and their 5th percentile)"),
         seed: int = typer.Option(0, help="with --model: seed of the studied release draws"),
         target_share: Optional[float] = typer.Option(None, help="with --model: how many preference pairs make the "
                                                                 "release keep this share of BoN's lift on average "
                                                                 "(and --tail-share at the 5th percentile)?"),
         tail_share: Optional[float] = typer.Option(None, help="with --target-share: the share the 5th percentile "
                                                               "must keep (default: target - 0.1)")):
    """Plan a budget: queries per composition, or epsilon per query.

    basic, FSRC and zcdp side by side, with the Gaussian limit no zCDP accountant can pass. With
    --model, also the head released once at epsilon_w (then BoN, free for any number of queries):
    its accuracy averaged over release draws and the 5th percentile a single deployment may get."""
    from rich.table import Table

    from .accounting import planner

    if (epsilon is None) == (queries is None):
        _fail("give exactly one of --epsilon (how many queries?) and --queries (what epsilon per query?)")
    if mechanism not in planner.MECHANISMS:
        _fail(f"--mechanism must be one of {', '.join(planner.MECHANISMS)}, got {mechanism!r}")
    base = refs = desc = None
    if pool is not None:
        from .evaluation.planning import accuracy_at, plan_base, reference_accuracies

        try:
            base, desc = plan_base(_load(pool), reward, pairs, delta, beta, max_rounds)
        except (ValueError, KeyError) as e:
            _fail(str(e))
        sensitivity = desc["sensitivity"] if sensitivity is None else sensitivity
    elif pairs is not None:
        _fail("--pairs needs --pool (the reward model whose Delta_r it rescales)")
    sens = 0.01 if sensitivity is None else sensitivity
    kw = dict(n=n, sensitivity=sens, beta=beta, delta=delta, max_rounds=max_rounds)
    try:
        if epsilon is not None:
            event = planner.query_event(mechanism, epsilon, **kw)
            counts = planner.plan_counts(epsilon_total, delta_total, event)
            eps_of = {c: epsilon for c in ("basic", "fsrc", "zcdp")}
        else:
            with console.status("planning"):
                eps_of = planner.plan_epsilons(epsilon_total, delta_total, queries, mechanism, **kw)
            counts = None
    except ValueError as e:
        _fail(str(e))
    title = (f"{mechanism} at epsilon {epsilon:g} per query" if epsilon is not None
             else f"{queries} {mechanism} queries") + f" within epsilon {epsilon_total:g}, delta {delta_total:g}"
    table = Table(title=title)
    table.add_column("composition")
    table.add_column("queries" if counts else "epsilon per query", justify="right")
    if pool is not None:
        table.add_column(f"accuracy (n={n})", justify="right")
        with console.status("accuracy by the exact laws"):
            refs = reference_accuracies(_load(pool), base, n)
            acc = {c: accuracy_at(_load(pool), base, mechanism, eps_of.get(c), n) for c in ("basic", "fsrc", "zcdp")}
    table.add_column("note")

    def fmt(v, digits=4):
        return "-" if v is None else (str(v) if isinstance(v, int) else f"{v:.{digits}g}")

    for comp, note in (("basic", ""), ("fsrc", counts["fsrc_note"] if counts else ""),
                       ("zcdp", "fully adaptive (Renyi filter), CKS conversion")):
        value = counts[comp] if counts else eps_of.get(comp)
        # an epsilon per query is printed as planned (the shortest decimal the filter admits Q times at):
        # rounding it to fewer digits could round it up, and the filter would then admit Q - 1
        row = [comp, fmt(value) if counts or value is None else repr(value)] + ([fmt(acc[comp], 3)] if pool is not None else []) + [note]
        table.add_row(*row)
    if counts and counts.get("zcdp_limit") is not None:
        table.add_row("(limit)", fmt(counts["zcdp_limit"]), *([""] if pool is not None else []),
                      "no zCDP accountant admits more (Gaussian profile)")
    print_console = Console(soft_wrap=True)
    print_console.print(table)
    if counts and counts.get("zcdp") is not None and counts["zcdp"] < counts["basic"]:
        print_console.print(f"zcdp admits fewer queries than basic here ({counts['zcdp']} < {counts['basic']}): its "
                            "conversion costs more than it saves at large epsilons per query and small totals")
    if model is not None:
        _plan_release(print_console, model, pool, release_epsilon, epsilon_total, delta_total, n, draws, seed,
                      acc if pool is not None and desc is not None else None, pairs, target_share, tail_share)
    elif target_share is not None:
        _fail("--target-share needs --model (the head whose release it sizes) and --pool")
    if refs is not None:
        print_console.print(f"reward {desc['reward']}: m = {desc['m']} pairs"
                            f"{' (rescaled from ' + str(desc['rescaled_from']) + ')' if 'rescaled_from' in desc else ''}"
                            f", Delta_r = {desc['sensitivity']:.3g} of the range; BoN (n={n}) {refs['bon']:.3f}, "
                            f"base policy {refs['base']:.3f}")


def _plan_release(out, model: Path, pool: Optional[Path], release_epsilon, epsilon_total, delta_total, n, draws,
                  seed, per_query: dict | None, pairs: Optional[int] = None, target_share: Optional[float] = None,
                  tail_share: Optional[float] = None) -> None:
    """``plan --model``: the release-then-BoN mode beside per-query noise, and which to use; with
    ``--pairs`` the release's noise is that of a head on that many pairs; with ``--target-share``
    the fewest pairs for which the release keeps that share of BoN's lift."""
    import math

    from rich.table import Table

    from .pipeline import pool_features
    from .rewards.policy_bt import PolicyBTReward
    from .rewards.release import pairs_for_share, release_accuracy

    if target_share is not None and not 0 < target_share <= 1:
        _fail(f"--target-share must lie in (0, 1], got {target_share!r}")
    tail = (target_share - 0.1) if tail_share is None and target_share is not None else tail_share

    if pool is None:
        _fail("--model needs --pool: a pool of the head's policy with recorded features (privalign featurize)")
    try:
        head = PolicyBTReward.load(model)
    except (ValueError, OSError, KeyError) as e:
        _fail(f"{model}: {e}")
    p = _load(pool)
    raw = pool_features(p, pool)
    if raw is None:
        _fail(f"{pool} has no recorded policy features ({pool}.features.npz): run privalign featurize {pool}")
    eps_list = parse_float_list(release_epsilon) if release_epsilon else [epsilon_total]
    persons = None if pairs is None else max(1, math.ceil(pairs / head.k))
    table = Table(title=f"release once at (epsilon_w, {delta_total:g}), then BoN (n={n}): queries unlimited; "
                        f"{draws} release draws" + ("" if persons is None else
                                                    f"; noise of a head on {persons * head.k} pairs ({persons} persons)"))
    for col in ("epsilon_w", "accuracy (mean)", "5th percentile", "share of BoN's lift (mean / 5th pct)"):
        table.add_column(col, justify="right")
    rows = []
    with console.status("release draws"):
        for e in eps_list:
            try:
                r = release_accuracy(head, raw, p.columns["prompt_id"], p.columns["true_reward"], e, delta_total, n,
                                     draws, np.random.default_rng(seed), persons=persons)
            except ValueError as err:
                _fail(str(err))
            rows.append(r)
            share = ("-" if r["share_mean"] is None else f"{r['share_mean']:.0%} / {r['share_p5']:.0%}")
            table.add_row(f"{e:g}", f"{r['mean']:.3f}", f"{r['p5']:.3f}", share)
    out.print(table)
    r0 = rows[0]
    out.print(f"exact head: BoN (n={n}) {r0['bon']:.3f}, base policy {r0['base']:.3f}; P = "
              f"{head.meta.get('persons')} persons, k = {head.k}, Delta_r = {head.sensitivity:.3g}")
    if target_share is not None:
        with console.status("sizing the preference data"):
            for e in eps_list:
                got = pairs_for_share(head, raw, p.columns["prompt_id"], p.columns["true_reward"], e, delta_total,
                                      target_share, tail, n, draws, seed)
                r = got["result"]
                if got["pairs"] is None:
                    out.print(f"epsilon_w {e:g}: even {int(head.meta.get('persons', head.m // head.k)) * 10_000 * head.k}"
                              f" pairs do not keep {target_share:.0%} of the lift ({r['share_mean']:.0%} on average, "
                              f"{r['share_p5']:.0%} at the 5th percentile)")
                else:
                    out.print(f"epsilon_w {e:g}: {got['pairs']} pairs ({got['persons']} persons of k = {head.k}) keep "
                              f"{r['share_mean']:.0%} of the lift on average and {r['share_p5']:.0%} at the 5th "
                              f"percentile (target {target_share:.0%} / {tail:.0%}; noise only, w held fixed)")
    best = max((v, c) for c, v in (per_query or {}).items() if v is not None) if per_query else None
    full = next((r for r in rows if r["epsilon"] == epsilon_total), None)
    if best is not None and full is not None:
        mode = "release then BoN" if full["p5"] >= best[0] else f"per-query noise ({best[1]})"
        out.print(f"recommended: {mode} (release at the whole budget: {full['mean']:.3f} on average, "
                  f"{full['p5']:.3f} at the 5th percentile; per-query at its best {best[0]:.3f})")


@ledger_app.command("account")
def ledger_account(ledger: str = typer.Argument(..., help="a SQLite path or postgresql:// URL"),
                   budget: str = typer.Option(..., help="the budget to re-account")):
    """Re-account a budget's recorded charges under every composition."""
    from rich.table import Table

    from .ledger import Ledger, UnknownBudget

    if not ledger.startswith(("postgresql://", "postgres://")) and not Path(ledger).exists():
        _fail(f"no ledger at {ledger}")
    try:
        res = Ledger(ledger).account(budget)
    except UnknownBudget:
        _fail(f"unknown budget {budget!r} in {ledger}")
    b = res["budget"]
    table = Table(title=f"budget {budget!r} ({b['composition']}, total epsilon {b['epsilon_total']:g}, "
                        f"delta {b['delta_total']:g}): {b['queries']} settled queries")
    for col in ("composition", "epsilon", "delta", "rho"):
        table.add_column(col, justify="right")
    for comp, a in res["accounts"].items():
        note = ""
        if a.get("missing_rho"):
            note = f" ({a['missing_rho']} charges without a rho)"
        elif a.get("derived_rho"):
            note = f" ({a['derived_rho']} pure charges given epsilon^2/2)"
        table.add_row(comp + note, "-" if a["epsilon"] is None else f"{a['epsilon']:.6g}",
                      "-" if a["delta"] is None else f"{a['delta']:.3g}", "-" if a["rho"] is None else f"{a['rho']:.6g}")
    Console(soft_wrap=True).print(table)


def _open_ledger(ledger: str):
    """An existing ledger (``privalign ledger`` never creates one), or a one-line error naming it."""
    from .ledger import Ledger

    if not ledger.startswith(("postgresql://", "postgres://")) and not Path(ledger).is_file():
        _fail(f"no ledger at {ledger}")
    try:
        return Ledger(ledger)
    except Exception as e:
        _fail(f"cannot open the ledger {ledger}: {type(e).__name__}: {e}")


def _when(value: Optional[str], option: str) -> Optional[float]:
    """A time given as epoch seconds or ISO 8601 (UTC unless it names a zone), as epoch seconds."""
    import datetime as dt

    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        t = dt.datetime.fromisoformat(value)
    except ValueError:
        _fail(f"{option} must be epoch seconds or an ISO 8601 time such as 2026-12-05T13:00, got {value!r}")
    return (t if t.tzinfo else t.replace(tzinfo=dt.timezone.utc)).timestamp()


@ledger_app.command("show")
def ledger_show(ledger: str = typer.Argument(..., help="a SQLite path or postgresql:// URL"),
                as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Every budget: totals, and what is spent, reserved and left, in epsilon, delta and rho."""
    states = [b.as_dict() for b in _open_ledger(ledger).budgets()]
    if as_json:
        print(json.dumps({"ledger": ledger, "budgets": states}, indent=2))
        return
    print(f"{ledger}: {len(states)} budgets")
    for b in states:  # one line each: a narrow terminal wraps, it does not cut
        def four(k, fmt):
            vals = [b.get(f"{k}_{x}") for x in ("total", "spent", "reserved", "remaining")]
            return (f"{k} " + " / ".join(format(v, fmt) for v in vals)) if vals[0] is not None else None

        amounts = "; ".join(x for x in (four("epsilon", ".6g"), four("delta", ".3g"), four("rho", ".6g")) if x)
        print(f"{b['name']} ({'tenant ' + b['tenant'] if b['tenant'] else 'model budget'}, {b['composition']}): "
              f"{amounts} (total / spent / reserved / left); {b['queries']} queries, {b['refusals']} refusals, "
              f"{b['open_reservations']} open")


@ledger_app.command("events")
def ledger_events(ledger: str = typer.Argument(..., help="a SQLite path or postgresql:// URL"),
                  budget: str = typer.Option(..., help="the budget whose events to list"),
                  request_id: Optional[str] = typer.Option(None, help="only this request's events"),
                  since: Optional[str] = typer.Option(None, help="from this time (epoch seconds or ISO 8601, UTC)"),
                  until: Optional[str] = typer.Option(None, help="up to this time"),
                  as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """A budget's reservations and charges, oldest first, filterable by request id and time."""
    import datetime as dt

    from rich.table import Table

    from .ledger import UnknownBudget

    led = _open_ledger(ledger)
    try:
        rows = led.events(budget, request_id, _when(since, "--since"), _when(until, "--until"))
    except UnknownBudget:
        _fail(f"unknown budget {budget!r} in {ledger}")
    if as_json:
        print(json.dumps({"budget": budget, "events": rows}, indent=2))
        return
    table = Table(title=f"budget {budget!r}: {len(rows)} events")
    for c in ("id", "time (UTC)", "kind", "request_id", "epsilon", "delta", "epsilon_max", "rho", "mechanism"):
        table.add_column(c, justify="right" if c in ("id", "epsilon", "delta", "epsilon_max", "rho") else "left")
    for r in rows:
        when = dt.datetime.fromtimestamp(r["time"], dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        table.add_row(str(r["id"]), when, r["kind"], r["request_id"] or "-", f"{r['epsilon']:.6g}",
                      f"{r['delta']:.3g}", f"{r['epsilon_max']:.6g}", "-" if r["rho"] is None else f"{r['rho']:.6g}",
                      r["mechanism"] or "-")
    Console(soft_wrap=True).print(table)


@ledger_app.command("check")
def ledger_check(ledger: str = typer.Argument(..., help="a SQLite path or postgresql:// URL"),
                 as_json: bool = typer.Option(False, "--json", help="print JSON")):
    """Recompute every budget from its events; exit 1 and name each inconsistency if any."""
    led = _open_ledger(ledger)
    problems = led.check()
    if as_json:
        print(json.dumps({"ledger": ledger, "ok": not problems, "budgets": len(led.budgets()), "problems": problems},
                         indent=2))
    elif problems:
        for p in problems:
            console.print(p, highlight=False)
    else:
        print(f"{ledger}: {len(led.budgets())} budgets consistent with their events")
    if problems:
        raise typer.Exit(1)


@pool_app.command("info")
def pool_info(pool: Path):
    """Print what a pool holds."""
    print(json.dumps(_rounded(_load(pool).info()), indent=2, default=str))


def _rounded(obj, digits: int = 6):
    """Floats to ``digits`` significant digits for display (0.10250000000000001 reads 0.1025)."""
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else obj
    if isinstance(obj, dict):
        return {k: _rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v, digits) for v in obj]
    return obj


@pool_app.command("validate")
def pool_validate(pool: Path):
    """Check a pool; exit 1 with the offending rows named if it is malformed."""
    from .pools import load_pool

    try:
        p = load_pool(pool, validate=False)
    except Exception as e:  # unreadable file: invalid, as documented (exit 1)
        console.print(f"[red]{pool} is invalid:[/red] {e}")
        raise typer.Exit(1)
    problems = p.problems()
    if problems:
        console.print(f"[red]{pool} is invalid:[/red]")
        for line in problems:
            console.print(f"  - {line}")
        raise typer.Exit(1)
    console.print(f"{pool}: valid ({p.n_rows} responses, {len(p.reward_names)} reward column(s))")


def unwrap_help(text: str | None) -> str | None:
    """A docstring as help text: each paragraph on one line, so the terminal wraps it at its own
    width (typer keeps the source's line breaks after the first paragraph); bullet lines stay."""
    if not text:
        return text
    out = []
    for para in inspect.cleandoc(text).split("\n\n"):
        lines = para.split("\n")
        merged: list[str] = []
        for line in lines:
            if merged and not line.lstrip().startswith(("- ", "* ")):
                merged[-1] += " " + line.strip()
            else:
                merged.append(line.strip())
        out.append("\n".join(merged))
    return "\n\n".join(out)


def _unwrap_all(t: typer.Typer) -> None:
    for cmd in t.registered_commands:
        if cmd.help is None and cmd.callback is not None:
            cmd.help = unwrap_help(cmd.callback.__doc__)
    for group in t.registered_groups:
        _unwrap_all(group.typer_instance)


_unwrap_all(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
