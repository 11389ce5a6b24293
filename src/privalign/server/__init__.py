"""The private Best-of-N HTTP service (``privalign serve``)."""

from .app import Service
from .config import ServiceConfig, load_config

__all__ = ["Service", "ServiceConfig", "load_config"]
