"""``privalign pool``: inspect and validate response pools."""

from __future__ import annotations

import json
import math
from pathlib import Path

import typer
from rich.markup import escape

from ._common import _load, console


pool_app = typer.Typer(no_args_is_help=True, help="Inspect and validate response pools.")


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
    from ..pools import load_pool

    try:
        p = load_pool(pool, validate=False)
    except Exception as e:  # unreadable file: invalid, as documented (exit 1)
        console.print(f"[red]{escape(str(pool))} is invalid:[/red] {escape(str(e))}")
        raise typer.Exit(1)
    problems = p.problems()
    if problems:
        console.print(f"[red]{escape(str(pool))} is invalid:[/red]")
        for line in problems:
            console.print(f"  - {line}", markup=False)
        raise typer.Exit(1)
    console.print(f"{pool}: valid ({p.n_rows} responses, {len(p.reward_names)} reward column(s))", markup=False)
