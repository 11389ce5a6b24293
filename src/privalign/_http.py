"""HTTP retry rules shared by the OpenAI-compatible backend and the vLLM reward: which statuses are
retried, and how long a ``Retry-After`` header asks a client to wait."""

from __future__ import annotations

import email.utils
import time

RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


def retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
