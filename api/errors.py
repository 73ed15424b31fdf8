"""The API's client error (an HTTP status, a message and the offending parameter) and the
OpenAI-shaped error response every refusal is answered with."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from api.response_schemas import ErrorDetail, ErrorResponse

RETRY_AFTER_S = 5
"""The `Retry-After` a 429 or 503 suggests, in seconds."""


class APIError(Exception):
    """A client error with its HTTP status and the offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict | None = None,
):
    """A JSONResponse with an OpenAI-shaped error body (and `Retry-After` on 429 and 503)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    headers = dict(headers or {})
    if status in (429, 503):
        headers["Retry-After"] = str(RETRY_AFTER_S)
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers or None)
