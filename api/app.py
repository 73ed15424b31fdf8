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

The routes' parts: a request is read by `api.chat_request`, its turn run by `api.turns`, its
reply built by `api.replies` or streamed by `api.streaming`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import asdict
from typing import Annotated

from fastapi import FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_kv.errors import ConfigError, GrammarError
from agent_kv.runtime.tool_calls import ReplySpec
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionBusyError
from api.access import AccessControl
from api.body_limit import MAX_BODY_BYTES, BodyLimit
from api.chat_request import (
    check_names,
    header_text,
    image_parts,
    pin_rules,
    policy_override,
    refuse_unsupported,
    sampling_params,
)
from api.errors import APIError, error_response
from api.metrics import ServerMetrics
from api.openapi_doc import error_responses, openapi_without_validation_422
from api.replies import completion_body, native_reply, set_session_header
from api.reply_spec import check_tool_results, reply_spec
from api.request_log import CLIENT_CLOSED, RequestLine, client_closed, note_error, note_turn
from api.response_schemas import (
    ChatCompletion,
    DeletedSession,
    Health,
    ModelCard,
    ModelList,
    NativeChatResponse,
    SessionInfo,
    SessionList,
    TokenizeResponse,
)
from api.schemas import (
    SESSION_ID_CHARS,
    ChatCompletionRequest,
    NativeChatRequest,
    TokenizeChat,
    TokenizeRequest,
)
from api.streaming import SSE_EVENT, stream_reply
from api.turns import admit, run_watched

log = logging.getLogger(__name__)

SessionHeader = Annotated[
    str | None, Header(min_length=1, max_length=SESSION_ID_CHARS, description="Session id")
]
HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
"""Error codes of the statuses the framework itself answers (a body it cannot parse, an
unknown route, a wrong method)."""


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

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        sweeper = None
        if sweep_interval_s is not None:
            sweeper = asyncio.create_task(_sweep(service, sweep_interval_s))
        try:
            yield
        finally:
            if sweeper is not None:
                sweeper.cancel()
            await run_in_threadpool(service.sessions.save_all)  # a restart finds them

    app = FastAPI(title="agent_kv", version="0.1.0", lifespan=lifespan)
    app.openapi = openapi_without_validation_422(app)
    engine = service.engine
    vocab_size = engine.model.config.vocab_size
    metrics = ServerMetrics(service.sessions)
    app.state.metrics = metrics  # a replica's reports read it (`api.cluster.replica`)
    routes = {
        "/v1/chat/completions", "/chat", "/tokenize", "/v1/models", "/health", "/metrics",
        "/sessions",
    }  # fmt: skip
    key_error = (401,) if api_key is not None else ()
    post_errors = (400, *key_error, 413)
    chat_errors = (*post_errors, 429, 503)

    @app.middleware("http")
    async def count_and_log_requests(request: Request, call_next):
        started = time.perf_counter()
        path = request.url.path
        endpoint = (
            path if path in routes else "/sessions" if path.startswith("/sessions/") else "other"
        )

        def ended(status: int) -> None:  # counted and logged once the response has ended
            metrics.requests.labels(endpoint, str(status)).inc()
            RequestLine.of(request, status, started).write()

        try:
            response = await call_next(request)
        except Exception as err:  # a 500: the catch-all handler answers it outside this
            note_error(request, None, f"internal error ({type(err).__name__})")
            ended(500)
            raise
        response.body_iterator = _ended(
            response.body_iterator, request, response.status_code, ended
        )
        return response

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, reject=error_response)
    app.add_middleware(
        AccessControl, reject=error_response, api_key=api_key, allowed_hosts=allowed_hosts
    )

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        note_error(request, err.code, err.message)
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError):
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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        code = HTTP_ERROR_CODES.get(err.status_code)
        note_error(request, code, str(err.detail))
        return error_response(err.status_code, str(err.detail), None, code, err.headers)

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception):
        log.error("internal error on %s", request.url.path, exc_info=err)
        message = f"internal error ({type(err).__name__}); the server's log has the details"
        return error_response(500, message, None, None)

    @app.get("/health", responses=error_responses(400))
    async def health() -> Health:
        """Liveness: the model id and the default policy (served without the API key)."""
        return Health(status="ok", model=model_name, policy=engine.policy.name)

    @app.get("/v1/models", responses=error_responses(400, *key_error))
    async def models() -> ModelList:
        """The one model served."""
        return ModelList(data=[ModelCard(id=model_name, created=0, owned_by="agent_kv")])

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **error_responses(400, *key_error),
        },
    )
    async def prometheus() -> Response:
        """Prometheus metrics in the text exposition format."""
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/sessions", responses=error_responses(400, *key_error))
    async def list_sessions() -> SessionList:
        """Every session known, in memory or on disk, least recently used first."""
        summaries = await run_in_threadpool(service.sessions.describe)
        return SessionList(data=[SessionInfo.model_validate(asdict(s)) for s in summaries])

    @app.delete("/sessions/{session_id:path}", responses=error_responses(400, *key_error, 404, 409))
    async def delete_session(session_id: str) -> DeletedSession:
        """Forget a session, in memory and on disk."""
        try:
            deleted = await run_in_threadpool(service.sessions.drop, session_id)
        except SessionBusyError as err:
            raise APIError(409, str(err), "session_id", "session_busy") from None
        if not deleted:
            raise APIError(404, f"no session {session_id!r}", "session_id", "not_found")
        return DeletedSession(id=session_id, deleted=True)

    @app.post("/tokenize", responses=error_responses(*post_errors))
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of plain text, or of a conversation as a chat turn would prefill it."""
        tokens = await run_in_threadpool(_tokenize, service, request)
        limit = engine.model.config.max_position_embeddings
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=limit)

    @app.post(
        "/v1/chat/completions",
        response_model=ChatCompletion,
        responses={
            200: {"content": {"text/event-stream": {"schema": SSE_EVENT}}},
            **error_responses(*chat_errors),
        },
    )
    async def chat_completions(
        request: ChatCompletionRequest,
        raw: Request,
        response: Response,
        x_session_id: SessionHeader = None,
    ) -> ChatCompletion:
        """OpenAI's chat completion, plain or streamed, with the cache's figures in `kv`."""
        refuse_unsupported(request)
        params = sampling_params(request, vocab_size, request.max_completion_tokens)
        check_tool_results(request.messages)
        check_names(request.messages, engine.tokenizer)
        images = image_parts(request.messages, drop_image_parts, metrics)
        messages = [m.as_dict() for m in request.messages]
        rules = None if request.pin is None else pin_rules(request)
        reply = await run_in_threadpool(reply_spec, request, engine, model_name)
        session_id = header_text(x_session_id) or request.user
        admission = admit(service)
        turn_args = {"session_id": session_id, "rules": rules, "reply": reply}
        if request.stream:
            return await stream_reply(
                service, metrics, raw, admission, messages, params, turn_args, request,
                model_name, images,
            )  # fmt: skip
        turn = await run_watched(raw, admission, metrics, service, messages, params, **turn_args)
        note_turn(raw, turn)
        set_session_header(response.headers, turn.kv.session_id)
        return completion_body(model_name, turn, images)

    @app.post(
        "/chat",
        response_model=NativeChatResponse,
        responses=error_responses(*chat_errors, 422),
    )
    async def chat(request: NativeChatRequest, raw: Request) -> NativeChatResponse:
        """One turn with agent_kv's controls: session, pin rules and a policy for the turn."""
        params = sampling_params(request, vocab_size)
        check_tool_results(request.messages)
        check_names(request.messages, engine.tokenizer)
        images = image_parts(request.messages, drop_image_parts, metrics)
        messages = [m.as_dict() for m in request.messages]
        rules = None if request.pin is None else pin_rules(request)
        policy = None if request.policy is None else policy_override(request, service)
        reply = await run_in_threadpool(reply_spec, request, engine, model_name)
        admission = admit(service)
        turn = await run_watched(
            raw, admission, metrics, service, messages, params, session_id=request.session_id,
            rules=rules, policy=policy, reply=reply,
        )  # fmt: skip
        note_turn(raw, turn)
        return native_reply(turn, images)

    return app


async def _sweep(service: ChatService, interval_s: float) -> None:
    """Expire idle sessions every `interval_s` seconds, off the event loop."""
    while True:
        await asyncio.sleep(interval_s)
        await run_in_threadpool(service.sessions.sweep)


def _tokenize(service: ChatService, request: TokenizeRequest) -> list[int]:
    """The request's token ids: its text's, or its conversation's as a chat turn would
    prefill it (the tools rendered as a chat completion renders them); a 400 for a name the
    template cannot render, tools offered twice, or a conversation the template refuses."""
    if isinstance(request, TokenizeChat):
        check_names(request.messages, service.engine.tokenizer)
        tools = request.model_dump(include={"tools"})["tools"]
        try:
            offered = ReplySpec.from_openai(tools=tools).tools
        except GrammarError as err:
            raise APIError(400, str(err), "tools", "invalid_value") from None
        try:
            return service.render([m.as_dict() for m in request.messages], offered).token_ids
        except ConfigError as err:
            raise APIError(400, str(err), "messages", "invalid_value") from None
    tokenizer = service.engine.tokenizer
    return tokenizer(request.content, add_special_tokens=request.add_special)["input_ids"]


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
