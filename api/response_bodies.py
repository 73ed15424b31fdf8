"""The reply of a finished turn: the `/v1/chat/completions` body (`completion_body`), the
`/chat` body (`native_reply`), their parts, which the stream shares (the usage, the
assistant message, the cache's figures as `kv`), and the `X-Session-Id` header."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict

from agent_kv.serving.chat_service import ChatTurn
from api.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    KVStats,
    NativeChatResponse,
    PromptTokensDetails,
    Timing,
    Usage,
)
from api.schemas import ToolCallBody


def reply_usage(turn: ChatTurn) -> Usage:
    """The reply's token counts: the prompt's (`cached_tokens` of them read from the
    session's cache) and the reply's."""
    completion = len(turn.reply.token_ids)
    return Usage(
        prompt_tokens=turn.prompt_tokens,
        completion_tokens=completion,
        total_tokens=turn.prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=turn.sync.reused_tokens),
    )


def assistant_message(turn: ChatTurn) -> AssistantMessage:
    """The reply: its text, or its tool calls with content null."""
    if turn.tool_calls:
        calls = [ToolCallBody.of(call) for call in turn.tool_calls]
        return AssistantMessage(content=None, tool_calls=calls)
    return AssistantMessage(content=turn.content)


def kv_stats(turn: ChatTurn, images: int) -> KVStats:
    """The reply's `kv`: the turn's cache figures and the image parts dropped."""
    return KVStats.model_validate({**asdict(turn.kv), "image_parts_dropped": images})


def completion_body(model_name: str, turn: ChatTurn, images: int) -> ChatCompletion:
    """The response body of a finished `/v1/chat/completions` request (`images`: the image
    parts dropped)."""
    return ChatCompletion(
        id=f"chatcmpl-{uuid.uuid4().hex[:24]}",
        created=int(time.time()),
        model=model_name,
        choices=[
            ChatChoice(
                index=0,
                message=assistant_message(turn),
                finish_reason=turn.finish_reason,
            )
        ],
        usage=reply_usage(turn),
        kv=kv_stats(turn, images),
    )


def native_reply(turn: ChatTurn, images: int) -> NativeChatResponse:
    """The response body of a finished `/chat` request (`images`: the image parts dropped):
    the session, the reply, its usage, the cache's figures and the turn's timing."""
    return NativeChatResponse(
        session_id=turn.kv.session_id,
        message=assistant_message(turn),
        finish_reason=turn.finish_reason,
        usage=reply_usage(turn),
        kv=kv_stats(turn, images),
        timing=Timing(
            wait_s=turn.wait_s,
            ttft_s=turn.ttft_s,
            decode_tokens_per_s=turn.reply.decode_tokens_per_s,
        ),
    )


def set_session_header(headers, session_id: str) -> None:
    """`X-Session-Id: session_id` (also in the body's `kv`), when a header can carry it."""
    if session_id.isascii() and session_id.isprintable():
        headers["X-Session-Id"] = session_id
