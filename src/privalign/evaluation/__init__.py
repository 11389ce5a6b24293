"""Offline experiments on response pools: the harness and the paper's experiment suite."""

from .harness import ALGORITHMS, DEFAULT_N_GRID, METRICS, EvalResult, EvalSettings
from .parallel import evaluate

__all__ = ["ALGORITHMS", "DEFAULT_N_GRID", "METRICS", "EvalResult", "EvalSettings", "evaluate"]
