"""LangChain messages as agent_kv's chat dicts and OpenAI's message shapes, and replies back as
LangChain messages: the conversions `ChatAgentKV` makes both in-process and against a server.

Going out, `chat_dicts` turns LangChain messages into the `{"role", "content", "pin",
"tool_calls", "tool_call_id"}` dicts of `agent_kv.runtime.chat.rendering` (what
`ChatService.run` takes) and `wire_messages` turns those into `/v1/chat/completions`
messages. Coming back, `usage_metadata`, `call_fields` and `call_chunk` give a reply's token
counts and tool calls in LangChain's terms.
"""

from __future__ import annotations

import json

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call, tool_call_chunk
from langchain_core.outputs import ChatGenerationChunk

from agent_kv.runtime.replies.tool_calls import ToolCall

TOOL_CALL_BLOCKS = ("tool_call", "tool_use")
"""Content blocks of an `AIMessage` that repeat its `tool_calls` (LangChain's and Anthropic's)."""
ROLES = (
    (SystemMessage, "system"),
    (HumanMessage, "user"),
    (AIMessage, "assistant"),
    (ToolMessage, "tool"),
)
"""LangChain message classes (their chunks included) and the chat roles they become."""


def chat_dicts(messages: list[BaseMessage]) -> list[dict]:
    """`{"role", "content", "pin", "tool_calls", "tool_call_id"}` dicts of LangChain messages
    (`agent_kv.runtime.chat.rendering`): an `AIMessage`'s `tool_calls` as `ToolCall`s (their
    arguments as generated when `additional_kwargs["tool_calls"]` holds them, else as JSON);
    a `ToolMessage`'s `tool_call_id` when it answers an earlier call (otherwise the message
    is a plain observation of role tool). Content is text blocks; an `AIMessage` may also
    carry blocks that repeat its `tool_calls` (`TOOL_CALL_BLOCKS`). A message with
    `additional_kwargs["pin"]` true is pinned.

    Raises:
        ValueError: a role other than system, user, assistant and tool, or other content.
    """
    dicts, called = [], set()
    for message in messages:
        if isinstance(message, ChatMessage):
            role = message.role
        else:
            role = next((role for cls, role in ROLES if isinstance(message, cls)), None)
        if role not in {"system", "user", "assistant", "tool"}:
            raise ValueError(
                f"cannot send a {type(message).__name__} with role {role!r}: the roles are "
                "system, user, assistant and tool"
            )
        if any(not _is_text(block, message) for block in _blocks(message)):
            raise ValueError(f"a {role} message has non-text content: only text is supported")
        pin = bool(message.additional_kwargs.get("pin", False))
        entry = {"role": role, "content": message.text, "pin": pin}
        calls = _calls(message) if isinstance(message, AIMessage) else []
        if calls:
            entry["tool_calls"] = calls
            called.update(call.id for call in calls)
        if isinstance(message, ToolMessage) and message.tool_call_id in called:
            entry["tool_call_id"] = message.tool_call_id
        dicts.append(entry)
    return dicts


def _blocks(message: BaseMessage) -> list[str | dict]:
    """The message's content blocks (none for string content)."""
    return [] if isinstance(message.content, str) else message.content


def _is_text(block: str | dict, message: BaseMessage) -> bool:
    """Whether a content block is text, or (on an `AIMessage`) a tool-call block, such as
    Anthropic's `tool_use`, that repeats one of the message's `tool_calls`."""
    if isinstance(block, str) or block.get("type") == "text":
        return True
    calls = message.tool_calls if isinstance(message, AIMessage) else []
    return block.get("type") in TOOL_CALL_BLOCKS and block.get("id") in {c["id"] for c in calls}


def _calls(message: AIMessage) -> list[ToolCall]:
    """The message's tool calls, arguments as the model generated them where known."""
    raw = {
        call.get("id"): (call.get("function") or {}).get("arguments")
        for call in message.additional_kwargs.get("tool_calls") or []
    }
    return [
        ToolCall(
            call["id"] or ToolCall.new_id(),
            call["name"],
            raw.get(call["id"]) or json.dumps(call["args"], ensure_ascii=False),
        )
        for call in message.tool_calls
    ]


def wire_messages(dicts: list[dict]) -> list[dict]:
    """`chat_dicts` as `/v1/chat/completions` messages (calls in OpenAI's shape)."""
    out = []
    for entry in dicts:
        wired = {key: value for key, value in entry.items() if key != "tool_calls"}
        if entry.get("tool_calls"):
            wired["tool_calls"] = [openai_call(call) for call in entry["tool_calls"]]
        out.append(wired)
    return out


def openai_call(call: ToolCall) -> dict:
    """A call in OpenAI's shape (`tool_calls` item)."""
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": call.id, "type": "function", "function": function}


def usage_metadata(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageMetadata:
    """A reply's token counts as LangChain's usage: the prompt's tokens (`cached_tokens` of
    them read from the session's cache, as `input_token_details["cache_read"]`) and the
    reply's."""
    return UsageMetadata(
        input_tokens=prompt_tokens,
        output_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        input_token_details={"cache_read": cached_tokens},
    )


def call_fields(calls: list[ToolCall]) -> dict:
    """`tool_calls` (arguments parsed) and the raw OpenAI-shaped calls in
    `additional_kwargs`, which keep the arguments as generated: an `AIMessage`'s keyword
    arguments (none without calls).

    Raises:
        json.JSONDecodeError: a call whose arguments are not JSON.
    """
    if not calls:
        return {}
    parsed = [tool_call(name=c.name, args=json.loads(c.arguments), id=c.id) for c in calls]
    raw = {"tool_calls": [openai_call(call) for call in calls]}
    return {"tool_calls": parsed, "additional_kwargs": raw}


def call_chunk(index: int, call: ToolCall) -> ChatGenerationChunk:
    """A streamed call: one `tool_call_chunks` entry with the whole arguments."""
    piece = tool_call_chunk(name=call.name, args=call.arguments, id=call.id, index=index)
    return ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[piece]))
