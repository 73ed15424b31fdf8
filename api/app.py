"""FastAPI application: `POST /v1/chat/completions` (OpenAI-compatible, plain or streamed as
server-sent events), `POST /chat` (native), `POST /tokenize`, `GET /v1/models`,
`GET /health`, `GET /metrics` (Prometheus), `GET /sessions` and `DELETE /sessions/{id}`.

Every turn runs through `agent_kv.serving.chat_service.ChatService`: in a session named by
the request (`X-Session-Id` header or the body's `user`; `session_id` for `/chat`) or,
without one, in the anonymous session the conversation continues (prefix match). Only the tokens the
session's cache lacks are prefilled. Replies carry the cache's figures under `kv`.

A chat request is admitted first (a 429 at once when `max_waiting` wait already); its
templating, tokenizing and length check run in a worker thread, never on the event loop,
so no body stalls other requests. A client that disconnects stops its turn, streamed or not,
whether it is waiting for the model, prefilling or decoding.

Client errors are 4xx with an OpenAI-shaped body `{"error": {"message", "type", "param",
"code"}}`, never a 500: 400 for malformed or unsupported input (a field a request body does
not define: "Unrecognized request argument supplied", as OpenAI says it), a Host not allowed and
prompts over the context or the KV cap, 401 without the API key (when one is set), 404 for
unknown routes and sessions, 405 (with `Allow`) for a wrong method, 409 for deleting a
session in use, 413 for a body over `max_body_bytes`, 422 for well-formed `/chat` pin rules or
policy overrides that cannot be applied, 429 when too many requests wait for the model, 503
when one waited too long. A server-side failure is a 500 with the same shape. The OpenAPI
document (`/openapi.json`) lists these per route (`api.openapi_doc`).

The route handlers are `api.routes`'s, named functions registered here; a request is read by
`api.chat_request`, its turn run by `api.turns`, its reply built by `api.response_bodies` or
streamed by `api.streaming`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_kv.serving.chat_service import ChatService
from api import routes
from api.access import AccessControl
from api.body_limit import MAX_BODY_BYTES, BodyLimit
from api.errors import APIError, error_response
from api.metrics import ServerMetrics
from api.openapi_doc import error_responses, openapi_without_validation_422
from api.request_log import CLIENT_CLOSED, RequestLine, client_closed, note_error
from api.response_schemas import ChatCompletion, NativeChatResponse
from api.routes import ServerState
from api.streaming import SSE_EVENT

log = logging.getLogger(__name__)

HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
"""Error codes of the statuses the framework itself answers (a body it cannot parse, an
unknown route, a wrong method)."""
ROUTE_PATHS = {
    "/v1/chat/completions", "/chat", "/tokenize", "/v1/models", "/health", "/metrics",
    "/sessions",
}  # fmt: skip
"""The paths requests are counted under in `/metrics` (`/sessions/{id}` as `/sessions`, any
other as `other`)."""


def create_app(
    service: ChatService,
    model_name: str,
    max_body_bytes: int = MAX_BODY_BYTES,
    api_key: str | None = None,
    allowed_hosts: list[str] | None = None,
    sweep_interval_s: float | None = None,
    drop_image_parts: bool = False,
) -> FastAPI:
    """The API serving `service`'s engine under the model id `model_name`.

    Args:
        service: runs the chat turns.
        model_name: the id `/v1/models` and replies give.
        max_body_bytes: larger request bodies are a 413.
        api_key: every route but `/health` needs `Authorization: Bearer <api_key>`; None for
            no key.
        allowed_hosts: `Host` names served (`api.access`); None serves any.
        sweep_interval_s: how often, in seconds, idle sessions are expired while the server
            runs (`SessionStore.sweep`); default a quarter of the session TTL, at most 60 s;
            no sweeping without a TTL.
        drop_image_parts: drop the image parts of messages, unread, instead of refusing the
            request with a 400 (for clients that also send the page as text); each is counted
            in `/metrics` and the reply's `kv.image_parts_dropped`.
    """
    ttl = service.sessions.idle_ttl_s
    if sweep_interval_s is None and ttl is not None:
        sweep_interval_s = min(max(ttl / 4, 0.05), 60.0)
    app = FastAPI(
        title="agent_kv",
        version="0.1.0",
        lifespan=partial(_lifespan, service=service, sweep_interval_s=sweep_interval_s),
    )
    app.openapi = openapi_without_validation_422(app)
    metrics = ServerMetrics(service.sessions)
    app.state.server = ServerState(service, model_name, metrics, drop_image_parts)
    app.middleware("http")(_count_and_log_requests)
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, reject=error_response)
    app.add_middleware(
        AccessControl, reject=error_response, api_key=api_key, allowed_hosts=allowed_hosts
    )
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _server_error)

    key_error = (401,) if api_key is not None else ()
    get_errors = error_responses(400, *key_error)
    post_errors = (400, *key_error, 413)
    chat_errors = (*post_errors, 429, 503)
    app.add_api_route("/health", routes.health, methods=["GET"], responses=error_responses(400))
    app.add_api_route("/v1/models", routes.models, methods=["GET"], responses=get_errors)
    app.add_api_route(
        "/metrics",
        routes.prometheus,
        methods=["GET"],
        response_class=PlainTextResponse,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **get_errors},
    )
    app.add_api_route("/sessions", routes.list_sessions, methods=["GET"], responses=get_errors)
    app.add_api_route(
        "/sessions/{session_id:path}",
        routes.delete_session,
        methods=["DELETE"],
        responses=error_responses(400, *key_error, 404, 409),
    )
    app.add_api_route(
        "/tokenize", routes.tokenize, methods=["POST"], responses=error_responses(*post_errors)
    )
    app.add_api_route(
        "/v1/chat/completions",
        routes.chat_completions,
        methods=["POST"],
        response_model=ChatCompletion,
        responses={
            200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **error_responses(*chat_errors),
        },
    )
    app.add_api_route(
        "/chat",
        routes.chat,
        methods=["POST"],
        response_model=NativeChatResponse,
        responses=error_responses(*chat_errors, 422),
    )
    return app


@contextlib.asynccontextmanager
async def _lifespan(_: FastAPI, service: ChatService, sweep_interval_s: float | None):
    """While the app runs: expire idle sessions every `sweep_interval_s` seconds (none when
    None); at shutdown, save every session so that a restart finds them."""
    sweeper = None
    if sweep_interval_s is not None:
        sweeper = asyncio.create_task(_sweep(service, sweep_interval_s))
    try:
        yield
    finally:
        if sweeper is not None:
            sweeper.cancel()
        await run_in_threadpool(service.sessions.save_all)


async def _count_and_log_requests(request: Request, call_next):
    """Count each request in `/metrics` by route and status, and log its line, once its
    response has ended."""
    started = time.perf_counter()
    path = request.url.path
    endpoint = (
        path if path in ROUTE_PATHS else "/sessions" if path.startswith("/sessions/") else "other"
    )
    metrics = request.app.state.server.metrics

    def ended(status: int) -> None:
        metrics.requests.labels(endpoint, str(status)).inc()
        RequestLine.of(request, status, started).write()

    try:
        response = await call_next(request)
    except Exception as err:  # a 500: the catch-all handler answers it outside this
        note_error(request, None, f"internal error ({type(err).__name__})")
        ended(500)
        raise
    response.body_iterator = _ended(response.body_iterator, request, response.status_code, ended)
    return response


async def _api_error(request: Request, err: APIError):
    """An `APIError`, as its OpenAI-shaped error response."""
    note_error(request, err.code, err.message)
    return error_response(err.status, err.message, err.param, err.code)


async def _validation_error(request: Request, err: RequestValidationError):
    """A body pydantic refused, as a 400: invalid JSON, a field the body does not define
    (OpenAI's "Unrecognized request argument supplied"), or the most specific invalid value."""
    errors = err.errors()
    if any(e["type"] == "json_invalid" for e in errors):
        note_error(request, "invalid_json", "request body is not valid JSON")
        return error_response(400, "request body is not valid JSON", None, "invalid_json")
    unknown = [e for e in errors if e["type"] == "extra_forbidden"]
    if unknown:  # OpenAI's answer, for the outermost field a body does not define
        param = _param_name(min(unknown, key=lambda e: len(e["loc"]))["loc"])
        message = f"Unrecognized request argument supplied: {param}"
        note_error(request, "unrecognized_argument", message)
        return error_response(400, message, param, "unrecognized_argument")
    # the deepest location is the most specific: of a union's branches, the one that
    # got furthest (a list of text parts rather than "not a string")
    first = max(errors, key=lambda e: len(e["loc"]))
    param = _param_name(first["loc"])
    if first["type"] == "invalid_role":  # the message union could not pick a kind
        param = f"{param}.role"
    message = f"{param or 'body'}: {first['msg']}"
    note_error(request, "invalid_value", message)
    return error_response(400, message, param, "invalid_value")


async def _http_error(request: Request, err: StarletteHTTPException):
    """A status the framework answers itself (unknown route, wrong method, ...)."""
    code = HTTP_ERROR_CODES.get(err.status_code)
    note_error(request, code, str(err.detail))
    return error_response(err.status_code, str(err.detail), None, code, err.headers)


async def _server_error(request: Request, err: Exception):
    """Anything else: a 500 of the same shape, the details in the server's log."""
    log.error("internal error on %s", request.url.path, exc_info=err)
    message = f"internal error ({type(err).__name__}); the server's log has the details"
    return error_response(500, message, None, None)


async def _sweep(service: ChatService, interval_s: float) -> None:
    """Expire idle sessions every `interval_s` seconds, off the event loop."""
    while True:
        await asyncio.sleep(interval_s)
        await run_in_threadpool(service.sessions.sweep)


async def _ended(body, request: Request, status: int, ended):
    """`body` (a response's body iterator), then `ended(status)` once it ends (the request is
    counted and logged): `status`, or `CLIENT_CLOSED` when the client left before the last
    chunk, or left a stream before it ended (`request_log.client_closed`; a streamed
    response's status was sent with its first chunk)."""
    finished = False
    try:
        async for chunk in body:
            yield chunk
        finished = True
    finally:
        ended(status if finished and not client_closed(request) else CLIENT_CLOSED)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_name(loc: tuple) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; union tags (type names such as
    `str` or `list[TextPart]`, and model names such as `TokenizeText`) are dropped."""
    parts = [
        str(part)
        for part in loc[1:]
        if not (isinstance(part, str) and ("[" in part or part in _TYPE_TAGS or part[:1].isupper()))
    ]
    return ".".join(parts) or None
