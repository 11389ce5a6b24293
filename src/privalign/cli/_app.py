"""The root ``privalign`` app and its ``--version`` callback; the command modules register on it."""

from __future__ import annotations

import typer


app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Differentially private inference-time alignment: mechanisms, experiments, reports.")


def _version(value: bool):
    if value:
        from .. import __version__

        print(f"privalign {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="print the version and exit")):
    """Differentially private inference-time alignment: mechanisms, experiments, reports."""
