"""Errors shared by the floors that talk to models and servers (backends, rewards, the service)."""


class BackendError(RuntimeError):
    """A model backend failed: an HTTP error, retries exhausted, a malformed answer, out of memory."""
