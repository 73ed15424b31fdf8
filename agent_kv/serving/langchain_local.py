"""A `ChatAgentKV` turn run in-process, as LangChain's reply: the whole `AIMessage`
(`turn_message`) or, streamed, chunks as the reply grows (`local_stream`, `alocal_stream`).

A streamed turn runs in a worker thread and reports to the reader through a queue: its text
goes through `ToolCallStream`, so each tool call is one chunk once its closing tag is
decoded; an error in the worker is raised where the chunks are read.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.outputs import ChatGenerationChunk

from agent_kv.runtime.replies.tool_calls import ReplySpec, ToolCallStream, call_check
from agent_kv.serving.chat_service import ChatTurn
from agent_kv.serving.langchain_messages import call_chunk, call_fields, usage_metadata
from agent_kv.serving.langchain_tools import reply_spec

TurnRunner = Callable[[Callable[[str], None] | None, ReplySpec | None], ChatTurn]
"""Runs one call's in-process turn given its `on_text` callback and its `ReplySpec` (None:
the call's own, built from its keyword arguments)."""


def turn_message(turn: ChatTurn, model_name: str) -> AIMessage:
    """The reply of an in-process turn: its text, its tool calls (`call_fields`), its usage
    and its response metadata (finish reason, model name, the cache's `KVReport` as `kv`)."""
    return AIMessage(
        content=turn.content, **call_fields(turn.tool_calls), **_turn_fields(turn, model_name)
    )


def _turn_fields(turn: ChatTurn, model_name: str) -> dict:
    """The usage and response metadata of an in-process turn."""
    usage = usage_metadata(turn.prompt_tokens, len(turn.reply.token_ids), turn.sync.reused_tokens)
    metadata = {"finish_reason": turn.finish_reason, "model_name": model_name}
    return {"usage_metadata": usage, "response_metadata": {**metadata, "kv": asdict(turn.kv)}}


def local_stream(
    run: TurnRunner, kwargs: dict, model_name: str, engine
) -> Iterator[ChatGenerationChunk]:
    """The chunks of one turn that `run` runs in a worker thread (`kwargs`: the call's keyword
    arguments, whose `REPLY_KWARGS` say what the reply may be; `engine`: the model's, whose
    tool-call format and grammars split calls out of the text): text and tool-call chunks as
    they are decoded, then a last chunk with the usage and response metadata.

    Raises:
        whatever the turn raised, when the chunks reach it.
    """
    events: queue.Queue = queue.Queue()
    threading.Thread(target=_run_into, args=(run, kwargs, engine, events.put)).start()
    while True:
        chunk = _event_chunk(events.get(), model_name)
        yield chunk
        if chunk.message.chunk_position == "last":
            return


async def alocal_stream(
    run: TurnRunner, kwargs: dict, model_name: str, engine
) -> AsyncIterator[ChatGenerationChunk]:
    """`local_stream` without blocking the event loop (the turn runs in the loop's
    executor). Raises as `local_stream`."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def put(event: tuple) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    worker = loop.run_in_executor(None, _run_into, run, kwargs, engine, put)
    while True:
        chunk = _event_chunk(await events.get(), model_name)
        yield chunk
        if chunk.message.chunk_position == "last":
            break
    await worker


def _run_into(run: TurnRunner, kwargs: dict, engine, put: Callable[[tuple], None]) -> None:
    """One in-process turn reported to `put` as ("text", piece) and ("call", index,
    `ToolCall`) events (`ToolCallStream`), then ("done", turn) or ("error", exception)."""
    try:
        spec = reply_spec(kwargs)
        calls = spec.call_format(engine.tokenizer)
        check = call_check(spec, calls, engine.grammars)
        splitter = ToolCallStream(spec, calls, check)

        def on_text(text: str) -> None:
            for event in splitter.feed(text):
                put(event)

        turn = run(on_text, spec)
        for event in splitter.finish():
            put(event)
        put(("done", turn))
    except BaseException as err:  # re-raised where the events are read
        put(("error", err))


def _event_chunk(event: tuple, model_name: str) -> ChatGenerationChunk:
    """The chunk of an in-process streaming event (`_run_into`); raises an "error" one."""
    kind, *rest = event
    if kind == "error":
        raise rest[0]
    if kind == "text":
        return ChatGenerationChunk(message=AIMessageChunk(content=rest[0]))
    if kind == "call":
        return call_chunk(*rest)
    fields = _turn_fields(rest[0], model_name)
    return ChatGenerationChunk(message=AIMessageChunk(content="", chunk_position="last", **fields))
