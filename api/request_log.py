"""One structured log line per request, written when its response ends (a streamed one
after its last event; a client that left, with status 499): route, status, error code and
message, session, prompt and cached tokens, and time.

Handlers note what they know on `request.state` (`note_turn`, `note_error`); the app's
middleware calls `RequestLine.write` once the body is sent. The line is JSON on the
`agent_kv.requests` logger: INFO for success, WARNING for a 4xx, ERROR for a 5xx.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from starlette.requests import Request

from agent_kv.serving.chat_service import ChatTurn

log = logging.getLogger("agent_kv.requests")

CLIENT_CLOSED = 499
"""The status of a request whose client went away before its response ended; nobody reads
the response."""


def note_turn(request: Request, turn: ChatTurn) -> None:
    """The request ran `turn` (its session and tokens go into the line)."""
    request.state.turn = turn


def note_error(request: Request, code: str | None, message: str) -> None:
    """The request failed with this error body's `code` and `message`."""
    request.state.error = (code, message)


def note_client_closed(request: Request) -> None:
    """The client went away before the request's response ended (a stream it left): logged
    and counted as `CLIENT_CLOSED`, whatever status was sent."""
    request.state.client_closed = True
    note_error(request, "client_closed", "the client went away before the reply ended")


def client_closed(request: Request) -> bool:
    """Whether `note_client_closed` was called for the request."""
    return getattr(request.state, "client_closed", False)


@dataclass
class RequestLine:
    """The log line of one request.

    Attributes:
        method, route: the request's method and path.
        status: the HTTP status sent (499 when the client left first).
        ms: milliseconds from the request's arrival to the end of its response.
        session: the session id the turn ran in (else the `X-Session-Id` header), or None.
        prompt_tokens, cached_tokens, completion_tokens: the turn's, None without a turn.
        rebuild: how the prompt met the session's history (`HistorySync.rebuild`), or None.
        error_code, error: the error body's code and message, None on success.
    """

    method: str
    route: str
    status: int
    ms: float
    session: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    rebuild: str | None = None
    error_code: str | None = None
    error: str | None = None

    @classmethod
    def of(cls, request: Request, status: int, started: float) -> RequestLine:
        """The line of `request`, answered with `status`, which arrived at `started`
        (`time.perf_counter()`)."""
        line = cls(
            method=request.method,
            route=request.url.path,
            status=status,
            ms=round((time.perf_counter() - started) * 1000, 1),
            session=request.headers.get("x-session-id"),
        )
        turn: ChatTurn | None = getattr(request.state, "turn", None)
        if turn is not None:
            line.session = turn.kv.session_id
            line.prompt_tokens = turn.prompt_tokens
            line.cached_tokens = turn.sync.reused_tokens
            line.completion_tokens = len(turn.reply.token_ids)
            line.rebuild = turn.sync.rebuild
        line.error_code, line.error = getattr(request.state, "error", (None, None))
        return line

    def write(self) -> None:
        """Log the line as JSON, at the level its status calls for."""
        level = logging.INFO
        if self.status >= 500:
            level = logging.ERROR
        elif self.status >= 400:
            level = logging.WARNING
        log.log(level, json.dumps(asdict(self), ensure_ascii=False))
