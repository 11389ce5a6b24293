"""``privalign reproduce``: the paper's experiments, the release study and the audit on a pool,
or the large-n study on a large pool."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ._app import app
from ._common import _one_writer, _said_left_alone
from ._common import EXECUTOR_HELP, SCHEDULER_HELP, WORKERS_HELP, _check_executor, _fail, _load, _out_dir, _progress, console


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
    from ..evaluation import EvalSettings
    from ..evaluation.suite import default_pool
    from ..report.jobs import run_reproduce

    if pool and task:
        _fail("give --pool or --task, not both")
    _out_dir(out, inputs=[pool, audit, release_head])
    _one_writer(out)
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
    from ..evaluation import EvalSettings
    from ..evaluation.large_n import claim_sentence
    from ..evaluation.suite import large_pool
    from ..report.jobs import run_large_n

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
    _said_left_alone(out)


def _study_head(p, path: Optional[Path], embedded: bool, reward: Optional[str]):
    """The head whose release ``reproduce`` studies: ``--release-head``, or for an embedded pool the
    shipped head of its default reward when the pool carries that head's features; None otherwise."""
    from importlib import resources

    from ..rewards.policy_bt import PolicyBTReward
    from ..rewards.release import study_head

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

    from ..evaluation.suite import DEFAULT_TASK

    path = Path(str(resources.files("privalign") / "data" / f"{task or DEFAULT_TASK}-audit.json"))
    return path if path.exists() else None


def _attach_audit(out: Path, record: dict) -> None:
    """Add an audit record and its figure to a reproduce results directory, list them in its manifest
    as privalign's own (so a rerun replaces them and never reports them as a user's), and re-render
    its report."""
    from .._paths import owned_files, write_manifest
    from ..report.figures import audit_bars
    from ..report.html import render
    from ..report.results import write_json

    write_json(out / "audit.json", record)
    files = {"audit.json", *audit_bars(record["rows"], out)}
    write_manifest(out, (owned_files(out) or set()) | files)
    render(out)


def _print_headline(out: Path) -> None:
    from ..report.html import headline_sentences

    h = json.loads((out / "headline.json").read_text())
    console.print("\n".join([f"wrote {out} (open {out}/report.html); base accuracy {h['base_accuracy']:.3g}",
                              *(f"- {line}" for line in headline_sentences(h))]), markup=False)
    _said_left_alone(out)
