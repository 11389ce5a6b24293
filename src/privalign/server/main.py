"""ASGI entry point for multi-worker uvicorn: the config path comes from $PRIVALIGN_CONFIG."""

import json
import os

from .config import load_config
from .http import create_app

cfg = load_config(os.environ.get("PRIVALIGN_CONFIG") or None)
if os.environ.get("PRIVALIGN_GENERATED_KEYS"):  # no config: the keys `privalign serve` generated and printed once
    cfg = cfg.model_validate({**cfg.model_dump(), **json.loads(os.environ["PRIVALIGN_GENERATED_KEYS"])})
app = create_app(cfg)
