"""FastAPI application: `POST /v1/chat/completions` (OpenAI-compatible, plain or streamed as
server-sent events), `POST /chat` (native), `GET /v1/models`, `GET /health`, `GET /metrics`
(Prometheus) and `DELETE /sessions/{id}`.

Every turn runs through `agent_kv.service.ChatService`: in a session named by the request
(`X-Session-Id` header or the body's `user`; `session_id` for `/chat`) or, without one, in
the anonymous session the conversation continues (prefix match). Only the tokens the
session's cache lacks are prefilled. Replies carry the cache's figures under `kv`.

Client errors are 4xx with an OpenAI-shaped body `{"error": {"message", "type", "param",
"code"}}`, never a 500: 400 for malformed or unsupported input and prompts over the context,
404 for unknown routes and sessions, 409 for deleting a session in use, 413 for a body over
`max_body_bytes`, 422 for well-formed `/chat` pin rules or policy overrides that cannot be
applied, 429 when too many requests wait for the model, 503 when one waited too long. A
server-side failure is a 500 with the same shape.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import asdict
from typing import Annotated

from fastapi import FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_kv.engine import check_policy_precision
from agent_kv.errors import ConfigError, ContextOverflowError
from agent_kv.policies import Policy, make_policy
from agent_kv.protection import PinRules
from agent_kv.sampling import SamplingParams
from agent_kv.service import ChatService, ChatTurn, QueueFullError, QueueTimeoutError
from agent_kv.sessions import SessionBusyError
from api.body_limit import BodyLimit
from api.metrics import ServerMetrics
from api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ErrorDetail,
    ErrorResponse,
    KVStats,
    NativeChatRequest,
    NativeChatResponse,
    PromptTokensDetails,
    SamplingFields,
    Timing,
    Usage,
)

DEFAULT_MAX_TOKENS = 256
MAX_BODY_BYTES = 8 * 2**20
"""Request bodies above this many bytes are refused with a 413."""
RETRY_AFTER_S = 5
"""The `Retry-After` a 429 or 503 suggests, in seconds."""


class APIError(Exception):
    """A client error with its HTTP status and the offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None):
    """A JSONResponse with an OpenAI-shaped error body (and `Retry-After` on 429 and 503)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status in (429, 503) else None
    return JSONResponse(status_code=status, content=body.model_dump(), headers=headers)


def create_app(
    service: ChatService, model_name: str, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    """The API serving `service`'s engine under the model id `model_name`."""
    app = FastAPI(title="agent_kv", version="0.1.0")
    engine = service.engine
    metrics = ServerMetrics(service.sessions)
    routes = {"/v1/chat/completions", "/chat", "/v1/models", "/health", "/metrics"}

    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        response = await call_next(request)
        path = request.url.path
        endpoint = (
            path if path in routes else "/sessions" if path.startswith("/sessions/") else "other"
        )
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, reject=error_response)

    @app.exception_handler(APIError)
    async def api_error(_: Request, err: APIError):
        return error_response(err.status, err.message, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, err: RequestValidationError):
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, "request body is not valid JSON", None, "invalid_json")
        param = _param_name(first["loc"])
        return error_response(400, f"{param or 'body'}: {first['msg']}", param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, err: StarletteHTTPException):
        return error_response(err.status_code, str(err.detail), None, None)

    @app.exception_handler(Exception)
    async def server_error(_: Request, err: Exception):
        return error_response(500, f"internal error: {type(err).__name__}: {err}", None, None)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": model_name, "policy": engine.policy.name}

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": model_name, "object": "model", "created": 0, "owned_by": "agent_kv"}
        return {"object": "list", "data": [entry]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict:
        try:
            deleted = service.sessions.drop(session_id)
        except SessionBusyError as err:
            raise APIError(409, str(err), "session_id", "session_busy") from None
        if not deleted:
            raise APIError(404, f"no session {session_id!r}", "session_id", "not_found")
        return {"id": session_id, "deleted": True}

    async def run_turn(*args, **kwargs) -> ChatTurn:
        turn = await run_in_threadpool(_run, service, *args, **kwargs)
        metrics.observe(turn)
        return turn

    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(
        request: ChatCompletionRequest,
        response: Response,
        x_session_id: Annotated[str | None, Header()] = None,
    ) -> ChatCompletion:
        _refuse_unsupported(request)
        params = _sampling(request, request.max_completion_tokens)
        messages = [m.as_dict() for m in request.messages]
        session_id = x_session_id or request.user
        _check_fits(service, messages, params)
        if request.stream:
            if service.queue_full():
                raise APIError(429, "too many requests are waiting for the model", None, "busy")
            stream = _stream(service, metrics, session_id, messages, params, request, model_name)
            return StreamingResponse(stream, media_type="text/event-stream")
        turn = await run_turn(messages, params, session_id)
        if turn.kv.session_id.isascii() and turn.kv.session_id.isprintable():
            response.headers["X-Session-Id"] = turn.kv.session_id  # also in the body's `kv`
        return _completion(model_name, turn)

    @app.post("/chat", response_model=NativeChatResponse)
    async def chat(request: NativeChatRequest) -> NativeChatResponse:
        params = _sampling(request)
        messages = [m.as_dict() for m in request.messages]
        rules = None if request.pin is None else _pin_rules(request)
        policy = None if request.policy is None else _policy(request, service)
        _check_fits(service, messages, params, policy)
        turn = await run_turn(messages, params, request.session_id, rules, policy)
        return NativeChatResponse(
            session_id=turn.kv.session_id,
            message=AssistantMessage(content=turn.reply.text),
            finish_reason=turn.reply.finish_reason,
            usage=_usage(turn),
            kv=KVStats.model_validate(asdict(turn.kv)),
            timing=Timing(
                wait_s=turn.wait_s,
                ttft_s=turn.ttft_s,
                decode_tokens_per_s=turn.reply.decode_tokens_per_s,
            ),
        )

    return app


def _pin_rules(request: NativeChatRequest) -> PinRules:
    """The request's pin rules; a 422 for rules that cannot be applied."""
    pin = request.pin
    rules = PinRules(
        roles=frozenset(pin.roles),
        latest_observations=pin.latest_observations,
        observation_roles=frozenset(pin.observation_roles),
        patterns=tuple(pin.patterns),
    )
    try:
        rules.validate()
    except ConfigError as err:
        raise APIError(422, str(err), "pin.patterns", "unprocessable") from None
    return rules


def _policy(request: NativeChatRequest, service: ChatService) -> Policy:
    """The request's policy override; a 422 for one that cannot be built or cannot run on
    the server's store."""
    spec = request.policy
    try:
        policy = make_policy(spec.name, spec.budget, **spec.params)
        check_policy_precision(policy, service.engine.store_options["int8"])
        return policy
    except ConfigError as err:
        raise APIError(422, str(err), "policy", "unprocessable") from None


def _run(service: ChatService, *args, **kwargs) -> ChatTurn:
    """`service.run` with its errors as API errors."""
    try:
        return service.run(*args, **kwargs)
    except ContextOverflowError as err:
        raise APIError(400, str(err), "messages", "context_length_exceeded") from None
    except ConfigError as err:  # e.g. a policy override the session's cache cannot take
        raise APIError(422, str(err), "policy", "unprocessable") from None
    except QueueFullError as err:
        raise APIError(429, str(err), None, "busy") from None
    except QueueTimeoutError as err:
        raise APIError(503, str(err), None, "timeout") from None


def _check_fits(service, messages, params, policy=None) -> None:
    """A 400 for a prompt that cannot fit the model's context, before any compute."""
    try:
        service.check_fits(len(service.prompt_ids(messages)), params.max_new_tokens, policy)
    except ContextOverflowError as err:
        raise APIError(400, str(err), "messages", "context_length_exceeded") from None


def _usage(turn: ChatTurn) -> Usage:
    completion = len(turn.reply.token_ids)
    return Usage(
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=completion,
        total_tokens=turn.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=turn.sync.reused_tokens),
    )


def _completion(model_name: str, turn: ChatTurn) -> ChatCompletion:
    """The response body of a finished `/v1/chat/completions` request."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=model_name,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=turn.reply.text),
                finish_reason=turn.reply.finish_reason,
            )
        ],
        usage=_usage(turn),
        kv=KVStats.model_validate(asdict(turn.kv)),
    )


async def _stream(service, metrics, session_id, messages, params, request, model_name):
    """Server-sent events of one request: a role chunk, content chunks as the reply grows, a
    final chunk with the finish reason and the cache's figures (`kv`, as in a plain reply), a
    usage chunk when `stream_options.include_usage`, then `data: [DONE]`. The model runs in a
    worker thread; its text reaches this generator through a queue. An error after the stream
    began is sent as an `error` event with the status's type and code (`busy`, `timeout`,
    `context_length_exceeded`)."""
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def event(choices: list, **extra) -> str:
        body = {"id": chunk_id, "object": "chat.completion.chunk", "created": created}
        body |= {"model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def delta(content: dict, finish: str | None = None) -> list:
        return [{"index": 0, "delta": content, "finish_reason": finish}]

    abandoned = threading.Event()  # the client went away: stop decoding at the next piece

    def on_text(text: str) -> None:
        if abandoned.is_set():
            raise StreamAbandoned
        loop.call_soon_threadsafe(queue.put_nowait, ("text", text))

    def work():
        try:
            turn = _run(service, messages, params, session_id, on_text=on_text)
            loop.call_soon_threadsafe(queue.put_nowait, ("done", turn))
        except StreamAbandoned:
            return
        except Exception as err:  # sent to the client as an error event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", err))

    yield event(delta({"role": "assistant", "content": ""}))
    task = loop.run_in_executor(None, work)
    try:
        async for chunk in _events(queue, metrics, request, event, delta):
            yield chunk
    finally:  # also when the client disconnects and this generator is closed
        abandoned.set()
    await task
    yield "data: [DONE]\n\n"


class StreamAbandoned(Exception):
    """Raised inside a streamed turn's decode loop once its client has gone, to free the
    model; the session keeps every token decoded so far."""


async def _events(queue: asyncio.Queue, metrics, request, event, delta):
    """The stream's events after the role chunk, from the worker's queue, up to the finish
    (or error) event."""
    while True:
        kind, value = await queue.get()
        if kind == "text":
            yield event(delta({"content": value}))
            continue
        if kind == "error":
            known = isinstance(value, APIError)
            error = ErrorDetail(
                message=value.message if known else str(value),
                type="invalid_request_error" if known and value.status < 500 else "server_error",
                param=value.param if known else None,
                code=value.code if known else None,
            )
            yield f"data: {json.dumps({'error': error.model_dump()})}\n\n"
        else:
            metrics.observe(value)
            kv = KVStats.model_validate(asdict(value.kv)).model_dump()
            yield event(delta({}, value.reply.finish_reason), kv=kv)
            if request.stream_options and request.stream_options.include_usage:
                yield event([], usage=_usage(value).model_dump())
        return


UNSUPPORTED_FIELDS = (
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "logprobs",
    "top_logprobs",
)
"""Request fields refused with a 400 unless empty or one of `NO_OP_VALUES`."""
NO_OP_VALUES = {
    "tool_choice": ["none"],
    "function_call": ["none"],
    "response_format": [{"type": "text"}],
}
"""Values of unsupported fields that ask for nothing beyond plain text, so are accepted."""


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_name(loc: tuple) -> str | None:
    """`("body", "messages", 0, "role")` -> "messages.0.role"; union type tags are dropped."""
    parts = [
        str(part)
        for part in loc[1:]
        if not (isinstance(part, str) and ("[" in part or part in _TYPE_TAGS))
    ]
    return ".".join(parts) or None


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    """A 400 for `n > 1` and the OpenAI features this server does not implement."""
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported")
    extra = request.model_extra or {}
    for field in UNSUPPORTED_FIELDS:
        value = extra.get(field)
        if value and value not in NO_OP_VALUES.get(field, []):
            raise APIError(400, f"{field} is not supported by this server", field, "unsupported")


def _sampling(request: SamplingFields, max_tokens: int | None = None) -> SamplingParams:
    """The request's sampling parameters; a 400 for invalid ones."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens or request.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=stop,
    )
    try:
        params.validate()
    except ConfigError as err:
        raise APIError(400, str(err), None, "invalid_value") from None
    return params
