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
"code"}}`, never a 500: 400 for malformed or unsupported input, a Host not allowed and
prompts over the context or the KV cap, 401 without the API key (when one is set), 404 for
unknown routes and sessions, 405 (with `Allow`) for a wrong method, 409 for deleting a
session in use, 413 for a body over `max_body_bytes`, 422 for well-formed `/chat` pin rules or
policy overrides that cannot be applied, 429 when too many requests wait for the model, 503
when one waited too long. A server-side failure is a 500 with the same shape. The OpenAPI
document (`/openapi.json`) lists these per route (`api.openapi_doc`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from dataclasses import asdict
from typing import Annotated

from fastapi import FastAPI, Header, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from agent_kv.errors import (
    ConfigError,
    ContextOverflowError,
    GrammarError,
    KVCapacityError,
    QueueTimeoutError,
    TurnCancelled,
)
from agent_kv.kv.policies import Policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.policy_setup import policy_from_spec
from agent_kv.runtime.pin_rules import PinRules
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.tool_calls import ToolCallStream
from agent_kv.serving.chat_service import (
    Admission,
    ChatService,
    ChatTurn,
    QueueFullError,
)
from agent_kv.serving.session_store import SessionBusyError
from api.access import AccessControl
from api.body_limit import MAX_BODY_BYTES, BodyLimit
from api.errors import APIError, error_response
from api.metrics import ServerMetrics
from api.openapi_doc import error_responses, openapi_without_validation_422
from api.reply_spec import check_tool_results, reply_spec
from api.request_log import CLIENT_CLOSED, RequestLine, note_error, note_turn
from api.schemas import (
    SESSION_ID_CHARS,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatMessage,
    DeletedSession,
    ErrorDetail,
    Health,
    KVStats,
    ModelCard,
    ModelList,
    NativeChatRequest,
    NativeChatResponse,
    PromptTokensDetails,
    SamplingFields,
    SessionInfo,
    SessionList,
    Timing,
    TokenizeChat,
    TokenizeRequest,
    TokenizeResponse,
    ToolCallBody,
    Usage,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 256
SessionHeader = Annotated[
    str | None, Header(min_length=1, max_length=SESSION_ID_CHARS, description="Session id")
]
HTTP_ERROR_CODES = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}
"""Error codes of the statuses the framework itself answers (a body it cannot parse, an
unknown route, a wrong method)."""
SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a `chat.completion.chunk` as JSON, an "
    "`error` object as JSON, or `[DONE]`.",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
"""The OpenAPI schema of one event of a streamed reply."""


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
        try:
            response = await call_next(request)
        except Exception as err:  # a 500: the catch-all handler answers it outside this
            metrics.requests.labels(endpoint, "500").inc()
            note_error(request, None, f"internal error ({type(err).__name__})")
            RequestLine.of(request, 500, started).write()
            raise
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        response.body_iterator = _logged(
            response.body_iterator, request, response.status_code, started
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
        _refuse_unsupported(request)
        params = _sampling(request, vocab_size, request.max_completion_tokens)
        check_tool_results(request.messages)
        images = _image_parts(request.messages, drop_image_parts, metrics)
        messages = [m.as_dict() for m in request.messages]
        rules = None if request.pin is None else _pin_rules(request)
        reply = await run_in_threadpool(reply_spec, request, engine.grammars)
        session_id = _header_text(x_session_id) or request.user
        admission = _admit(service)
        turn_args = {"session_id": session_id, "rules": rules, "reply": reply}
        if request.stream:
            return await _stream(
                service, metrics, raw, admission, messages, params, turn_args, request,
                model_name, images,
            )  # fmt: skip
        turn = await _run_watched(raw, admission, metrics, service, messages, params, **turn_args)
        note_turn(raw, turn)
        _set_session_header(response.headers, turn.kv.session_id)
        return _completion(model_name, turn, images)

    @app.post(
        "/chat",
        response_model=NativeChatResponse,
        responses=error_responses(*chat_errors, 422),
    )
    async def chat(request: NativeChatRequest, raw: Request) -> NativeChatResponse:
        """One turn with agent_kv's controls: session, pin rules and a policy for the turn."""
        params = _sampling(request, vocab_size)
        check_tool_results(request.messages)
        images = _image_parts(request.messages, drop_image_parts, metrics)
        messages = [m.as_dict() for m in request.messages]
        rules = None if request.pin is None else _pin_rules(request)
        policy = None if request.policy is None else _policy(request, service)
        reply = await run_in_threadpool(reply_spec, request, engine.grammars)
        admission = _admit(service)
        turn = await _run_watched(
            raw, admission, metrics, service, messages, params, session_id=request.session_id,
            rules=rules, policy=policy, reply=reply,
        )  # fmt: skip
        note_turn(raw, turn)
        return NativeChatResponse(
            session_id=turn.kv.session_id,
            message=_assistant_message(turn),
            finish_reason=turn.finish_reason,
            usage=_usage(turn),
            kv=_kv_stats(turn, images),
            timing=Timing(
                wait_s=turn.wait_s,
                ttft_s=turn.ttft_s,
                decode_tokens_per_s=turn.reply.decode_tokens_per_s,
            ),
        )

    return app


async def _sweep(service: ChatService, interval_s: float) -> None:
    """Expire idle sessions every `interval_s` seconds, off the event loop."""
    while True:
        await asyncio.sleep(interval_s)
        await run_in_threadpool(service.sessions.sweep)


def _admit(service: ChatService) -> Admission:
    """The request's place in the queue; a 429 when it is full."""
    try:
        return service.admit()
    except QueueFullError as err:
        raise APIError(429, str(err), None, "busy") from None


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (the body has been read, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


async def _run_watched(
    raw: Request, admission: Admission, metrics, service, *args, **kwargs
) -> ChatTurn:
    """Run a turn (`ChatService.run`'s arguments) in a worker thread, cancelled if the client
    disconnects meanwhile."""
    cancel = threading.Event()
    watcher = asyncio.create_task(_watch_disconnect(raw, cancel))
    try:
        turn = await run_in_threadpool(
            _run, service, *args, cancel=cancel, admission=admission, **kwargs
        )
    finally:
        watcher.cancel()
        admission.release()
    metrics.observe(turn)
    return turn


def _header_text(value: str | None) -> str | None:
    """A header value as the client wrote it: HTTP hands header bytes over as Latin-1, so a
    UTF-8 session id is read back as UTF-8 (and so names the same session as in a body)."""
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8")
    except UnicodeError:
        return value


def _set_session_header(headers, session_id: str) -> None:
    """`X-Session-Id: session_id` (also in the body's `kv`), when a header can carry it."""
    if session_id.isascii() and session_id.isprintable():
        headers["X-Session-Id"] = session_id


def _tokenize(service: ChatService, request: TokenizeRequest) -> list[int]:
    if isinstance(request, TokenizeChat):
        try:
            return service.render([m.as_dict() for m in request.messages]).token_ids
        except ConfigError as err:
            raise APIError(400, str(err), "messages", "invalid_value") from None
    tokenizer = service.engine.tokenizer
    return tokenizer(request.content, add_special_tokens=request.add_special)["input_ids"]


def _pin_rules(request: NativeChatRequest | ChatCompletionRequest) -> PinRules:
    """The request's pin rules; a 422 for rules that cannot be applied."""
    try:
        return PinRules.from_fields(**request.pin.model_dump())
    except ConfigError as err:
        raise APIError(422, str(err), "pin.patterns", "unprocessable") from None


def _policy(request: NativeChatRequest, service: ChatService) -> Policy:
    """The request's policy override (`PolicySpec.checked`, built for the engine's model); a
    422 for one that cannot be built or cannot run on the server's store."""
    spec = request.policy
    engine = service.engine
    try:
        checked = PolicySpec.checked(
            spec.name,
            spec.budget,
            params=spec.params,
            int8=engine.store_options["int8"],
            recall=spec.recall,
        )
        return policy_from_spec(checked, engine.model)
    except ConfigError as err:
        raise APIError(422, str(err), "policy", "unprocessable") from None


def _run(service: ChatService, *args, **kwargs) -> ChatTurn:
    """`service.run` with its errors as API errors."""
    try:
        return service.run(*args, **kwargs)
    except GrammarError as err:  # `reply_spec` built the grammar: only the matcher's limits
        raise APIError(400, str(err), "tools", "invalid_value") from None
    except ContextOverflowError as err:
        raise APIError(400, str(err), "messages", "context_length_exceeded") from None
    except KVCapacityError as err:
        raise APIError(400, str(err), "messages", "kv_capacity_exceeded") from None
    except ConfigError as err:  # e.g. a policy override the session's cache cannot take
        raise APIError(422, str(err), "policy", "unprocessable") from None
    except QueueFullError as err:
        raise APIError(429, str(err), None, "busy") from None
    except QueueTimeoutError as err:
        raise APIError(503, str(err), None, "timeout") from None
    except TurnCancelled as err:
        raise APIError(CLIENT_CLOSED, str(err), None, "client_closed") from None


def _usage(turn: ChatTurn) -> Usage:
    completion = len(turn.reply.token_ids)
    return Usage(
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=completion,
        total_tokens=turn.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=turn.sync.reused_tokens),
    )


def _assistant_message(turn: ChatTurn) -> AssistantMessage:
    """The reply: its text, or its tool calls with content null."""
    if turn.tool_calls:
        calls = [ToolCallBody.of(call) for call in turn.tool_calls]
        return AssistantMessage(content=None, tool_calls=calls)
    return AssistantMessage(content=turn.content)


def _image_parts(messages: list[ChatMessage], drop: bool, metrics: ServerMetrics) -> int:
    """The image parts of `messages`, which the model cannot read: with `drop`, how many
    (counted in `metrics`; `ChatMessage.text` leaves them out); else a 400.

    Raises:
        APIError: 400 naming the first image part, when not `drop`.
    """
    found = [(i, j) for i, message in enumerate(messages) for j in message.image_parts()]
    if found and not drop:
        i, j = found[0]
        raise APIError(
            400,
            f"messages[{i}].content[{j}] is an image: the model reads text only, and image "
            "parts are not supported (a server started with --drop-image-parts drops them "
            "unread)",
            f"messages.{i}.content.{j}",
            "unsupported",
        )
    metrics.image_parts_dropped.inc(len(found))
    return len(found)


def _kv_stats(turn: ChatTurn, images: int) -> KVStats:
    """The reply's `kv`: the turn's cache figures and the image parts dropped."""
    return KVStats.model_validate({**asdict(turn.kv), "image_parts_dropped": images})


def _completion(model_name: str, turn: ChatTurn, images: int) -> ChatCompletion:
    """The response body of a finished `/v1/chat/completions` request (`images`: the image
    parts dropped)."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=model_name,
        choices=[
            ChatChoice(
                index=0,
                message=_assistant_message(turn),
                finish_reason=turn.finish_reason,
            )
        ],
        usage=_usage(turn),
        kv=_kv_stats(turn, images),
    )


async def _stream(
    service, metrics, raw, admission, messages, params, turn_args, request, model_name, images
) -> StreamingResponse:
    """Start a streamed turn and answer once it holds the model and its session, so errors
    before that (bad text, context or KV cap, queue timeout) keep their HTTP status and the
    response carries `X-Session-Id`.

    The stream: a role chunk, content chunks as the reply grows, a final chunk with the
    finish reason and the cache's figures (`kv`, as in a plain reply), a usage chunk when
    `stream_options.include_usage`, then `data: [DONE]`. The model runs in a worker thread;
    its text reaches the stream through a queue. An error after the stream began is sent as
    an `error` event with the status's type and code. A client that leaves, before or during
    the stream, cancels the turn at its next check; the session keeps every token decoded."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    started: asyncio.Future = loop.create_future()
    cancel = threading.Event()

    def put(kind: str, value) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

    def begin(sid: str) -> None:
        loop.call_soon_threadsafe(lambda: started.done() or started.set_result(sid))

    def fail_start(err: Exception) -> None:
        loop.call_soon_threadsafe(lambda: started.done() or started.set_exception(err))

    def work() -> None:
        try:
            turn = _run(
                service, messages, params, on_text=lambda text: put("text", text),
                cancel=cancel, admission=admission, on_start=begin, **turn_args,
            )  # fmt: skip
            note_turn(raw, turn)
            put("done", turn)
        except Exception as err:  # before the stream began: the response; after: an event
            detail = _error_detail(err)
            note_error(raw, detail.code, detail.message)
            fail_start(err)
            put("error", err)
        finally:
            admission.release()

    watcher = asyncio.create_task(_watch_disconnect(raw, cancel))
    worker = loop.run_in_executor(None, work)
    try:
        sid = await started
    except BaseException:
        cancel.set()
        raise
    finally:
        watcher.cancel()
    headers: dict[str, str] = {}
    _set_session_header(headers, sid)
    reply = turn_args["reply"]
    body = _events(queue, metrics, request, model_name, cancel, worker, reply, images)
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _events(
    queue: asyncio.Queue, metrics, request, model_name, cancel, worker, reply, images
):
    """The stream's events, from the worker's queue up to the finish (or error) event and
    `data: [DONE]`; leaving early (the client went away) cancels the turn. Under a
    `ReplySpec` offering tools, the reply's text goes through `ToolCallStream`: each call
    is one `tool_calls` delta (index, id, type, name and the whole arguments) once its
    closing tag is decoded, and the finish reason is then "tool_calls"."""
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    splitter = ToolCallStream(reply)

    def event(choices: list, **extra) -> str:
        body = {"id": chunk_id, "object": "chat.completion.chunk", "created": created}
        body |= {"model": model_name, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    def delta(content: dict, finish: str | None = None) -> list:
        return [{"index": 0, "delta": content, "finish_reason": finish}]

    def settled(events: list[tuple]) -> list[str]:
        out = []
        for kind, *rest in events:
            if kind == "text":
                out.append(event(delta({"content": rest[0]})))
                continue
            index, call = rest
            body = {"index": index, **ToolCallBody.of(call).model_dump()}
            out.append(event(delta({"tool_calls": [body]})))
        return out

    try:
        yield event(delta({"role": "assistant", "content": ""}))
        while True:
            kind, value = await queue.get()
            if kind == "text":
                for chunk in settled(splitter.feed(value)):
                    yield chunk
                continue
            if kind == "error":
                yield f"data: {json.dumps({'error': _error_detail(value).model_dump()})}\n\n"
            else:
                for chunk in settled(splitter.finish()):
                    yield chunk
                metrics.observe(value)
                kv = _kv_stats(value, images).model_dump()
                finish = "tool_calls" if splitter.calls else value.reply.finish_reason
                yield event(delta({}, finish), kv=kv)
                if request.stream_options and request.stream_options.include_usage:
                    yield event([], usage=_usage(value).model_dump())
            break
    finally:  # also when the client disconnects and this generator is closed
        cancel.set()
    await worker
    yield "data: [DONE]\n\n"


async def _logged(body, request: Request, status: int, started: float):
    """`body` (a response's body iterator), and the request's log line once it ends: with
    `status`, or `CLIENT_CLOSED` when the client left before the last chunk."""
    finished = False
    try:
        async for chunk in body:
            yield chunk
        finished = True
    finally:
        RequestLine.of(request, status if finished else CLIENT_CLOSED, started).write()


def _error_detail(err: Exception) -> ErrorDetail:
    """The error body of an exception raised after a stream began."""
    if isinstance(err, APIError):
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        return ErrorDetail(message=err.message, type=kind, param=err.param, code=err.code)
    return ErrorDetail(message=str(err), type="server_error", param=None, code=None)


UNSUPPORTED_FIELDS = (
    "functions", "function_call", "logprobs", "top_logprobs", "audio", "modalities",
    "prediction", "reasoning_effort", "verbosity", "web_search_options",
)  # fmt: skip
"""OpenAI request fields that change the reply and this server does not implement, refused
with a 400 unless empty or one of `NO_OP_VALUES` (`functions` and `function_call` are
OpenAI's deprecated forms of `tools` and `tool_choice`). OpenAI's fields that change nothing
the model writes (`store`, `metadata`, `service_tier`, `prompt_cache_key`,
`safety_identifier`) are accepted and have no effect."""
NO_OP_VALUES = {"function_call": ["none"], "modalities": [["text"]], "verbosity": ["medium"]}
"""Values of unsupported fields that ask for nothing beyond plain text, so are accepted."""


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


def _refuse_unsupported(request: ChatCompletionRequest) -> None:
    """A 400 for `n > 1` and the OpenAI features this server does not implement."""
    if request.n != 1:
        raise APIError(400, "only n=1 is supported", "n", "unsupported")
    extra = request.model_extra or {}
    for field in UNSUPPORTED_FIELDS:
        value = extra.get(field)
        if value and value not in NO_OP_VALUES.get(field, []):
            hint = " (use tools and tool_choice)" if field.startswith("function") else ""
            raise APIError(
                400, f"{field} is not supported by this server{hint}", field, "unsupported"
            )


def _sampling(
    request: SamplingFields, vocab_size: int, max_tokens: int | None = None
) -> SamplingParams:
    """The request's sampling parameters; a 400 for invalid ones (naming the field), a
    `logit_bias` token outside the model's `vocab_size` included."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    params = SamplingParams(
        max_new_tokens=max_tokens or request.max_tokens or DEFAULT_MAX_TOKENS,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=stop,
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logit_bias={int(token): bias for token, bias in (request.logit_bias or {}).items()},
    )
    try:
        params.validate(vocab_size)
    except ConfigError as err:
        field = str(err).split(" ", 1)[0]
        param = field if field in SamplingFields.model_fields else None
        raise APIError(400, str(err), param, "invalid_value") from None
    return params
