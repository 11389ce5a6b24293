"""Helpers shared by the command modules: the error console and one-line failures, progress bars,
list parsing, output-path checks, loading pools."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


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


def _progress(on_interrupt: Optional[str] = None, info: bool = False):
    """A progress bar on a terminal; elsewhere a line every 30 s to stderr (done/total, rate, ETA).
    Ctrl-C prints ``on_interrupt`` (default: nothing was written, a rerun starts over), exit 130."""
    from . import _progress as P

    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               *((TextColumn("{task.fields[info]}"),) if info else ()), TimeElapsedColumn(), TextColumn("ETA"),
               TimeRemainingColumn())
    return P.progress(console, columns, on_interrupt or P.STARTS_OVER)


def _working(description: str):
    """A spinner on a terminal; elsewhere a line every 30 s that the job still works. Ctrl-C: exit 130."""
    from . import _progress as P

    return P.working(console, description)


def _fail(message: str):
    from rich.markup import escape

    console.print(f"[red]error:[/red] {escape(message)}", highlight=False)
    raise typer.Exit(2)


def _out_dir(out: Path, inputs=()) -> None:
    """Refuse (one line, exit 2) a results directory whose replacement could lose data."""
    from .._paths import OutputError, check_output_dir

    try:
        check_output_dir(out, inputs=inputs)
    except OutputError as e:
        _fail(str(e))


def _said_left_alone(out: Path) -> None:
    """After a run wrote the results folder ``out``: the files there that are not privalign's, kept."""
    from .._paths import left_alone

    kept = left_alone(out)
    if kept:
        console.print(f"left alone in {out} (not privalign's): {', '.join(kept[:10])}"
                      + (f" and {len(kept) - 10} more" if len(kept) > 10 else ""), markup=False)


_HELD: dict = {}  # output -> the function that lets it go (at exit, or when this process takes it again)


def _one_writer(out: Path, option: str = "--out") -> None:
    """Hold ``out`` for this command alone (``_paths.hold_output``) until the process ends; a second
    run on it is one line naming the holder's pid (exit 2). A command run again in the same process
    (tests) takes it over from its own earlier run, which has ended."""
    import atexit

    from .._paths import OutputError, hold_output

    key = Path(out).expanduser().resolve()
    if key in _HELD:
        _HELD.pop(key)()
    try:
        _HELD[key] = hold_output(out, option=option)
    except OutputError as e:
        _fail(str(e))
    if len(_HELD) == 1:
        atexit.register(lambda: [_HELD.pop(k)() for k in list(_HELD)])


def _out_file(out: Path, kind: str, option: str = "--out") -> None:
    """Refuse (one line, exit 2) a file target that is a directory or a file privalign did not write."""
    from .._paths import OutputError, check_output_file

    try:
        check_output_file(out, kind, option=option)
    except OutputError as e:
        _fail(str(e))


def _load(path: Path):
    from ..pools import PoolError, load_pool

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


def _train_pool(pool: Optional[Path]):
    from ..pipeline import pool_features

    if pool is None:
        _fail("--features policy needs --pool: graded policy samples of the train prompts (privalign generate "
              "--split train --features ...)")
    p = _load(pool)
    raw = pool_features(p, pool)
    if raw is None:
        _fail(f"{pool} has no recorded policy features ({pool}.features.npz); regenerate it with --features")
    return p, raw


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


def private_path(out: Path) -> Path:
    """Where ``rm train`` writes a model's D-derived diagnostics: beside it, marked private."""
    return out.with_name(out.stem + ".private.json")
