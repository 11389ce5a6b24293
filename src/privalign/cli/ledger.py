"""``privalign ledger``: inspect, account and check a durable privacy ledger."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.console import Console

from ._common import _fail, console


ledger_app = typer.Typer(no_args_is_help=True, help="Inspect a durable privacy ledger.")


@ledger_app.command("account")
def ledger_account(ledger: str = typer.Argument(..., help="a SQLite path or postgresql:// URL"),
                   budget: str = typer.Option(..., help="the budget to re-account")):
    """Re-account a budget's recorded charges under every composition."""
    from rich.table import Table

    from ..ledger import Ledger, UnknownBudget

    if not ledger.startswith(("postgresql://", "postgres://")) and not Path(ledger).exists():
        _fail(f"no ledger at {ledger}")
    try:
        res = Ledger(ledger).account(budget)
    except UnknownBudget:
        _fail(f"unknown budget {budget!r} in {ledger}")
    b = res["budget"]
    table = Table(title=escape(f"budget {budget!r} ({b['composition']}, total epsilon {b['epsilon_total']:g}, "
                        f"delta {b['delta_total']:g}): {b['queries']} settled queries"))
    for col in ("composition", "epsilon", "delta", "rho"):
        table.add_column(col, justify="right")
    for comp, a in res["accounts"].items():
        note = ""
        if a.get("missing_rho"):
            note = f" ({a['missing_rho']} charges without a rho)"
        elif a.get("derived_rho"):
            note = f" ({a['derived_rho']} pure charges given epsilon^2/2)"
        table.add_row(escape(comp + note), "-" if a["epsilon"] is None else f"{a['epsilon']:.6g}",
                      "-" if a["delta"] is None else f"{a['delta']:.3g}", "-" if a["rho"] is None else f"{a['rho']:.6g}")
    _print_table(table)


def _print_table(table) -> None:
    """A table whole: on a terminal, narrow columns fold rather than cut; elsewhere (a pipe, a file)
    as wide as its widest row, never cut at 80 columns."""
    out = Console(soft_wrap=True)
    for col in table.columns:
        col.overflow = "fold"
    if not out.is_terminal:
        out = Console(soft_wrap=True, width=max(80, out.measure(table, options=out.options.update(
            width=100_000)).maximum))
    out.print(table)


def _open_ledger(ledger: str):
    """An existing ledger (``privalign ledger`` never creates one), or a one-line error naming it."""
    from ..ledger import Ledger

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

        delta = (four("delta", ".3g") if b.get("delta_spent") is not None else  # zcdp: the conversion's delta
                 f"delta {b['delta_total']:.3g} (fixed by the zcdp conversion, not spent per query)")
        amounts = "; ".join(x for x in (four("epsilon", ".6g"), delta, four("rho", ".6g")) if x)
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

    from ..ledger import UnknownBudget

    led = _open_ledger(ledger)
    try:
        rows = led.events(budget, request_id, _when(since, "--since"), _when(until, "--until"))
    except UnknownBudget:
        _fail(f"unknown budget {budget!r} in {ledger}")
    if as_json:
        print(json.dumps({"budget": budget, "events": rows}, indent=2))
        return
    table = Table(title=escape(f"budget {budget!r}: {len(rows)} events"))
    for c in ("id", "time (UTC)", "kind", "request_id", "epsilon", "delta", "epsilon_max", "rho", "mechanism"):
        table.add_column(c, justify="right" if c in ("id", "epsilon", "delta", "epsilon_max", "rho") else "left")
    for r in rows:
        when = dt.datetime.fromtimestamp(r["time"], dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
        table.add_row(str(r["id"]), when, escape(r["kind"]), escape(r["request_id"] or "-"), f"{r['epsilon']:.6g}",
                      f"{r['delta']:.3g}", f"{r['epsilon_max']:.6g}", "-" if r["rho"] is None else f"{r['rho']:.6g}",
                      escape(r["mechanism"] or "-"))
    _print_table(table)


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
            console.print(p, highlight=False, markup=False)
    else:
        print(f"{ledger}: {len(led.budgets())} budgets consistent with their events")
    if problems:
        raise typer.Exit(1)
