"""The service's HTTP errors: a status, an OpenAI-style type, a one-line message and extra fields."""

from __future__ import annotations


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, **extra):
        self.status, self.kind, self.message, self.extra = status, kind, message, extra
        super().__init__(message)

    def body(self) -> dict:
        return {"error": {"type": self.kind, "message": self.message, **self.extra}}
