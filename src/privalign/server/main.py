"""ASGI entry point for multi-worker uvicorn: the config path comes from $PRIVALIGN_CONFIG."""

import os

from .config import load_config
from .http import create_app

app = create_app(load_config(os.environ.get("PRIVALIGN_CONFIG") or None))
