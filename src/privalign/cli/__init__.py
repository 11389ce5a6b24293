"""The ``privalign`` command line: a thin shell over the library (typer + rich).

One module per command group, each registered on the root app of ``_app``: ``experiments``
(demo, simulate, evaluate, report), ``reproduce``, ``models`` (generate, score, featurize),
``reward_models`` (``rm``), ``audit``, ``service`` (serve), ``plan``, ``ledger`` and ``pools``
(``pool``); ``_common`` holds the helpers they share.
"""

from __future__ import annotations

import typer

from ._app import app
from .ledger import ledger_app
from .pools import pool_app

app.add_typer(pool_app, name="pool")
app.add_typer(ledger_app, name="ledger")

from . import experiments, reproduce  # noqa: E402,F401  (register demo, simulate, evaluate, report, reproduce)
from .reward_models import rm_app  # noqa: E402
from .rm_preferences import rm_evaluate  # noqa: E402

rm_app.command("evaluate")(rm_evaluate)

app.add_typer(rm_app, name="rm")

from . import models  # noqa: E402,F401  (registers generate, score, featurize)
from . import audit, service, plan  # noqa: E402,F401,I001  (register audit, serve, plan)
from ._common import unwrap_help  # noqa: E402


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
