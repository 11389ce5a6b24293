"""``privalign serve``: the private selection service on uvicorn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ._app import app
from ._common import _fail, console


@app.command()
def serve(config: Optional[Path] = typer.Option(None, help="TOML config (default: embedded model pair, SQLite ledger)"),
          host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8000),
          workers: int = typer.Option(1, help="uvicorn worker processes (they share the ledger)")):
    """Serve private Best-of-N over an OpenAI-compatible HTTP API with a durable privacy ledger."""
    from pydantic import ValidationError

    from ..server import load_config
    from ..server.config import config_error_message

    try:
        cfg = load_config(config)
    except ValidationError as e:  # one line: "field: problem (got value)", unknown keys with the nearest known
        _fail(f"invalid config {config}: {config_error_message(e)}")
    except Exception as e:
        _fail(f"invalid config {config}: {e}")
    from ..server.charges import check_unit, file_unit

    unit = file_unit(cfg.reward.kind, cfg.reward.path)
    try:
        check_unit(cfg, unit)
    except ValueError as e:
        _fail(str(e))
    sock = _bind(host, port)  # before any model loads and before the ledger (or its folder) is created
    from ..server.config import check_ledger_path
    from ..server.startup import cheap_reward, preflight

    try:  # every check that needs no model, before anything is loaded or created (issue 50)
        check_ledger_path(cfg.ledger)
        preflight(cfg, cheap_reward(cfg))
    except ValueError as e:
        _fail(str(e))
    service = _service(cfg) if workers == 1 else None  # its own checks run before it opens the ledger
    try:
        budgets, model, notes = _ledger_settings(cfg, service)
    except ValueError as e:
        _fail(str(e))
    _print_banner(cfg, config, host, port, workers, budgets, model, notes, unit)
    _run(cfg, config, sock, host, port, workers, service)


def _service(cfg):
    from ..server.app import Service

    try:
        return Service(cfg)
    except (ValueError, OSError) as e:  # e.g. the model budget cannot cover the range release
        _fail(f"cannot start: {e}")


def _print_banner(cfg, config: Optional[Path], host: str, port: int, workers: int, budgets, model, notes,
                  unit: str = "declared") -> None:
    """What is served, and the privacy each budget gives, as the ledger holds it, to the reward
    model's unit (a person, or a pair for a legacy head); the keys when generated."""
    from ..server.charges import SUBJECTS

    subject = SUBJECTS[unit]
    keys = "from " + str(config.resolve()) if config else "generated for this run (no config file): pass --config to fix them"
    console.print(f"privalign serve on http://{host}:{port}/v1 ({workers} worker(s))\n"
                  f"  generator: {cfg.generator.backend} {cfg.generator.model}, max_tokens cap {cfg.token_cap}"
                  + (" (short answers: raise [generator] max_new_tokens for longer ones); " if cfg.token_cap <= 16
                     else "; ")
                  + f"requests name the model {cfg.served_model_name!r}"
                  + "".join(f" (or {a!r})" for a in cfg.model_aliases) + "\n"
                  f"  reward: {_reward_shown(cfg)} (unit of privacy: {unit})\n"
                  + ("  opt-in: [reward] allow_pair_unit = true serves a pair-unit head: the guarantee below is per "
                     "preference pair, not per person\n" if unit == "pair" and cfg.reward.allow_pair_unit else "")
                  + f"  mechanism: {cfg.mechanism.name}, n = {cfg.mechanism.n}\n"
                  f"  ledger: {cfg.ledger}\n"
                  + "".join(f"  budget {b.name!r} (tenant {b.tenant}): epsilon {b.total.epsilon:g}, delta "
                            f"{b.total.delta:g}, {b.composition}; spent {b.spent_privacy.epsilon:g}\n" for b in budgets)
                  + (f"  model budget {model.name!r}: epsilon {model.total.epsilon:g}, delta {model.total.delta:g}, "
                     f"{model.composition}; spent {model.spent_privacy.epsilon:g}: every query of every tenant is "
                     f"charged here; {subject} gets this guarantee\n"
                     if model else
                     f"  no model budget: {subject} gets only the sum over all budgets "
                     f"(epsilon {sum(b.total.epsilon for b in budgets):g} now, more with each budget created)\n")
                  + "".join(f"  note: {n}\n" for n in notes)
                  + f"  keys {keys}", markup=False)
    if not config:
        console.print(f"  admin key: {cfg.admin_keys[0]}\n  client key: {next(iter(cfg.clients))}", markup=False)
    if cfg.generator.backend in ("transformers", "llamacpp") and cfg.token_cap > 64 and not _has_gpu():
        console.print(f"[yellow]warning:[/yellow] max_tokens cap {cfg.token_cap:d} on an embedded model without a GPU: "
                      f"a request of n = {cfg.mechanism.n:d} can take minutes (docs/deploy.md, latency on a CPU)")


def _reward_shown(cfg) -> str:
    """The reward model's kind and file (absolute); the embedded default's file when none is named."""
    r = cfg.reward
    if r.path:
        return f"{r.kind} {Path(r.path).resolve()}"
    if r.kind == "minilm-bt":
        from importlib import resources

        return f"minilm-bt {resources.files('privalign') / 'data' / 'arithmetic-minilm-bt.json'} (the embedded default)"
    return r.kind


def _run(cfg, config: Optional[Path], sock, host: str, port: int, workers: int, service=None) -> None:
    """uvicorn on the bound socket (one worker), or ``workers`` processes that bind it themselves."""
    import os

    import uvicorn

    if workers > 1:
        sock.close()  # uvicorn's workers bind it themselves
        os.environ["PRIVALIGN_CONFIG"] = str(config) if config else ""
        if not config:
            os.environ["PRIVALIGN_GENERATED_KEYS"] = json.dumps(
                {"admin_keys": cfg.admin_keys, "clients": {k: v.model_dump() for k, v in cfg.clients.items()}})
        uvicorn.run("privalign.server.main:app", host=host, port=port, workers=workers, **UVICORN)
    else:
        from ..server.http import create_app

        web = create_app(cfg, service)
        uvicorn.Server(uvicorn.Config(web, host=host, port=port, **UVICORN)).run(sockets=[sock])


def _ledger_settings(cfg, service=None):
    """(tenant budgets, the model budget or None, notes) as the ledger holds them once this config is
    applied (``server.deployment.configure``, by ``service`` or here): the banner shows the ledger,
    not the config."""
    from ..ledger import Ledger
    from ..server.config import prepare_ledger
    from ..server.deployment import configure

    if service is not None:
        led, d = service.ledger, service.deployment
        states = led.budgets()
    else:
        prepare_ledger(cfg.ledger)
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
