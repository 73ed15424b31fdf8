"""A streamed `/v1/chat/completions` reply: server-sent events of `chat.completion.chunk`s
as the reply grows (`stream_reply`), tool calls split out of the text as they close, an error
after the stream began sent as an `error` event."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid

from fastapi.responses import StreamingResponse

from agent_kv.runtime.replies.tool_calls import ToolCallStream, call_check
from api.errors import APIError
from api.request_log import note_client_closed, note_error, note_turn
from api.response_bodies import kv_stats, reply_usage, set_session_header
from api.response_schemas import ErrorDetail
from api.schemas import ToolCallBody
from api.turns import run_turn, watch_disconnect

SSE_EVENT = {
    "type": "object",
    "description": "One server-sent event: `data` is a `chat.completion.chunk` as JSON, an "
    "`error` object as JSON, or `[DONE]`.",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}
"""The OpenAPI schema of one event of a streamed reply."""


async def stream_reply(
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
            turn = run_turn(
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

    watcher = asyncio.create_task(watch_disconnect(raw, cancel))
    worker = loop.run_in_executor(None, work)
    try:
        sid = await started
    except BaseException:
        cancel.set()
        raise
    finally:
        watcher.cancel()
    headers: dict[str, str] = {}
    set_session_header(headers, sid)
    reply = turn_args["reply"]
    calls = reply.call_format(service.engine.tokenizer)
    check = call_check(reply, calls, service.engine.grammars)
    splitter = ToolCallStream(reply, calls, check)
    body = _events(queue, metrics, request, model_name, cancel, worker, splitter, images, raw)
    return StreamingResponse(body, media_type="text/event-stream", headers=headers)


async def _events(
    queue: asyncio.Queue, metrics, request, model_name, cancel, worker, splitter, images, raw
):
    """The stream's events, from the worker's queue up to the finish (or error) event and
    `data: [DONE]`; leaving early (the client went away) cancels the turn and notes the
    request `raw` as client-closed (`note_client_closed`: a 499 in the log and metrics). The
    reply's text goes through `splitter` (the turn's `ToolCallStream`): each call is one
    `tool_calls` delta (index, id, type, name and the whole arguments) once its closing
    marker is decoded, and the finish reason is then "tool_calls"."""
    chunk_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())

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

    ended = False
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
                kv = kv_stats(value, images).model_dump()
                finish = "tool_calls" if splitter.calls else value.reply.finish_reason
                yield event(delta({}, finish), kv=kv)
                if request.stream_options and request.stream_options.include_usage:
                    yield event([], usage=reply_usage(value).model_dump())
            ended = True
            break
    finally:  # also when the client disconnects and this generator is closed
        cancel.set()
        if not ended:
            note_client_closed(raw)
    await worker
    yield "data: [DONE]\n\n"


def _error_detail(err: Exception) -> ErrorDetail:
    """The error body of an exception raised after a stream began."""
    if isinstance(err, APIError):
        kind = "invalid_request_error" if err.status < 500 else "server_error"
        return ErrorDetail(message=err.message, type=kind, param=err.param, code=err.code)
    return ErrorDetail(message=str(err), type="server_error", param=None, code=None)
