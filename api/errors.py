"""The API's client error: an HTTP status, a message and the offending parameter, answered
with an OpenAI-shaped error body."""

from __future__ import annotations


class APIError(Exception):
    """A client error with its HTTP status and the offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
