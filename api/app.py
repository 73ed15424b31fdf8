"""FastAPI application: `/health`, `/v1/models`, `POST /v1/chat/completions` (plain or
streamed as server-sent events) and `DELETE /sessions/{id}`.

A request naming a session (`X-Session-Id` header or the body's `user`) runs in that
session's managed KV cache (`agent_kv.sessions`): its tokens are matched against the
session's history and only the new suffix is prefilled; without an id it gets a fresh cache.
The reply carries the cache's memory figures under `kv`. Model calls run one at a time (the
engine owns one model). Client errors are 4xx with an OpenAI-shaped body
`{"error": {"message", "type", "param", "code"}}`, never a 500; a server-side failure (a
model whose chat template cannot be extended, say) is a 500 with the same shape.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_kv.engine import Engine
from agent_kv.errors import ConfigError, ContextOverflowError
from agent_kv.protection import PinRules, apply_pins, protected_spans
from agent_kv.sampling import SamplingParams
from agent_kv.sessions import SessionBusyError, SessionStore, sync_history
from api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ErrorDetail,
    ErrorResponse,
    KVStats,
    PromptTokensDetails,
    Usage,
)

DEFAULT_MAX_TOKENS = 256
PIN_RULES = PinRules()
"""Pins applied to every session: the system message and the latest tool message."""


class APIError(Exception):
    """A client error with its HTTP status and the offending parameter."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None):
    """A JSONResponse with an OpenAI-shaped error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = ErrorResponse(error=ErrorDetail(message=message, type=kind, param=param, code=code))
    return JSONResponse(status_code=status, content=body.model_dump())


def create_app(engine: Engine, model_name: str, sessions: SessionStore | None = None) -> FastAPI:
    """The API serving `engine` under the model id `model_name`; `sessions` keeps the caches
    of requests that name a session (default: an uncapped store without TTL)."""
    app = FastAPI(title="agent_kv", version="0.1.0")
    lock = asyncio.Lock()
    sessions = sessions or SessionStore(engine)

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

    @app.delete("/sessions/{session_id}")
    async def delete_session(session_id: str) -> dict:
        try:
            deleted = sessions.drop(session_id)
        except SessionBusyError as err:
            raise APIError(409, str(err), "session_id", "session_busy") from None
        if not deleted:
            raise APIError(404, f"no session {session_id!r}", "session_id", "not_found")
        return {"id": session_id, "deleted": True}

    @app.post("/v1/chat/completions", response_model=ChatCompletion)
    async def chat_completions(
        request: ChatCompletionRequest,
        x_session_id: Annotated[str | None, Header()] = None,
    ) -> ChatCompletion:
        params = _sampling(request)
        session_id = x_session_id or request.user
        prepared = _prepare(engine, request, params)
        if request.stream:
            return StreamingResponse(
                _stream(lock, engine, sessions, session_id, prepared, params, request, model_name),
                media_type="text/event-stream",
            )
        async with lock:
            store, reply, sync = await run_in_threadpool(
                _complete, engine, sessions, session_id, prepared, params
            )
        return _completion(engine, model_name, session_id, store, reply, sync)

    return app


def _completion(engine, model_name, session_id, store, reply, sync) -> ChatCompletion:
    """The response body of a finished request."""
    completion = len(reply.token_ids)
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=model_name,
        choices=[
            ChatChoice(
                index=0,
                message=AssistantMessage(content=reply.text),
                finish_reason=reply.finish_reason,
            )
        ],
        usage=Usage(
            prompt_tokens=sync.reused_tokens + sync.prefilled_tokens,
            completion_tokens=completion,
            total_tokens=sync.reused_tokens + sync.prefilled_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sync.reused_tokens),
        ),
        kv=KVStats(
            policy=engine.policy.name,
            session_id=session_id,
            rebuild=sync.rebuild,
            peak_kv_bytes=store.peak_bytes,
            kv_bytes=store.nbytes(),
            full_kv_bytes=store.full_kv_nbytes(),
            evicted_tokens=store.evicted_tokens,
            quantized_tokens=store.quantized_tokens,
        ),
    )


async def _stream(lock, engine, sessions, session_id, prepared, params, request, model_name):
    """Server-sent events of one request: a role chunk, content chunks as the reply grows, a
    final chunk with the finish reason, a usage chunk when `stream_options.include_usage`,
    then `data: [DONE]`. The model runs in a worker thread; its text reaches this generator
    through a queue. An error after the stream began is sent as an `error` event."""
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def event(choices: list, **extra) -> str:
        body = {"id": chunk_id, "object": "chat.completion.chunk", "created": created}
        body |= {"model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def delta(content: dict, finish: str | None = None) -> list:
        return [{"index": 0, "delta": content, "finish_reason": finish}]

    def work():
        try:
            result = _complete(
                engine, sessions, session_id, prepared, params,
                lambda text: loop.call_soon_threadsafe(queue.put_nowait, ("text", text)),
            )  # fmt: skip
            loop.call_soon_threadsafe(queue.put_nowait, ("done", result))
        except Exception as err:  # sent to the client as an error event
            loop.call_soon_threadsafe(queue.put_nowait, ("error", err))

    async with lock:
        yield event(delta({"role": "assistant", "content": ""}))
        task = loop.run_in_executor(None, work)
        while True:
            kind, value = await queue.get()
            if kind == "text":
                yield event(delta({"content": value}))
                continue
            if kind == "error":
                message = value.message if isinstance(value, APIError) else str(value)
                error = ErrorDetail(message=message, type="server_error", param=None, code=None)
                yield f"data: {json.dumps({'error': error.model_dump()})}\n\n"
            else:
                store, reply, sync = value
                yield event(delta({}, reply.finish_reason))
                if request.stream_options and request.stream_options.include_usage:
                    usage = _completion(engine, model_name, session_id, store, reply, sync).usage
                    yield event([], usage=usage.model_dump())
            break
        await task
    yield "data: [DONE]\n\n"


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


def _sampling(request: ChatCompletionRequest) -> SamplingParams:
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported")
    extra = request.model_extra or {}
    for field in UNSUPPORTED_FIELDS:
        value = extra.get(field)
        if value and value not in NO_OP_VALUES.get(field, []):
            raise APIError(400, f"{field} is not supported by this server", field, "unsupported")
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        max_new_tokens=request.max_completion_tokens or request.max_tokens or DEFAULT_MAX_TOKENS,
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


def _prepare(engine: Engine, request: ChatCompletionRequest, params: SamplingParams):
    """The request's messages and prompt tokens; raises `APIError` for a prompt that cannot
    fit the model's context (before any compute)."""
    messages = [{"role": m.role, "content": m.text} for m in request.messages]
    prompt = engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    limit = engine.model.config.max_position_embeddings
    # rerotate positions with a budget keep every position inside the context, whatever the
    # length; otherwise a request past it is refused before any compute
    rerotating = engine.store_options["rerotate"] and engine.policy.budget(None) is not None
    if not rerotating and len(prompt_ids) + params.max_new_tokens > limit:
        raise APIError(
            400,
            f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_new_tokens} "
            f"exceeds the model's context of {limit} tokens",
            "messages",
            "context_length_exceeded",
        )
    return messages, prompt_ids


def _complete(
    engine: Engine,
    sessions: SessionStore,
    session_id: str | None,
    prepared: tuple[list[dict], list[int]],
    params: SamplingParams,
    on_text: Callable[[str], None] | None = None,
):
    """Run one request in its session (a fresh cache without a session id); returns the
    store, the reply and how the prompt was matched against the session's history."""
    messages, prompt_ids = prepared
    session_scope = sessions.use(session_id) if session_id else nullcontext(engine.new_session())
    try:
        with session_scope as session:
            sync = sync_history(engine, session, prompt_ids)
            apply_pins(session.store, protected_spans(engine.tokenizer, messages, PIN_RULES))
            reply = engine.generate(session, [], params, on_text)
            return session.store, reply, sync
    except ContextOverflowError as err:
        raise APIError(400, str(err), "messages", "context_length_exceeded") from None
