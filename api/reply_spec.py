"""A chat request's tool and format fields as the turn's `ReplySpec`, checked before the turn
is admitted: each error is an `APIError` 400 naming the field."""

from __future__ import annotations

from agent_kv.errors import GrammarError
from agent_kv.runtime.grammar import GrammarCompiler
from agent_kv.runtime.tool_calls import ReplySpec
from api.errors import APIError
from api.schemas import ChatMessage, ReplyFields


def reply_spec(request: ReplyFields, grammars: GrammarCompiler) -> ReplySpec:
    """The request's `ReplySpec`, its grammar built once against the model's tokenizer so
    that a schema llguidance cannot compile is refused before anything runs.

    Raises:
        APIError: 400 for a `tool_choice` naming no offered tool (or `required` without
            tools), tools offered twice, or a tool's `parameters` or the `response_format`
            schema that cannot be compiled (the message carries the library's reason).
    """
    fields = request.model_dump(
        include={"tools", "tool_choice", "parallel_tool_calls", "response_format"},
        by_alias=True,
    )
    try:
        spec = ReplySpec.from_openai(**fields)
        grammar = spec.grammar()
        if grammar is not None:
            grammars.matcher(grammar)
    except GrammarError as err:
        raise APIError(400, str(err), _param_of(str(err), fields), "invalid_value") from None
    return spec


def _param_of(message: str, fields: dict) -> str:
    """The field a reply-spec error is about: named in its message, else the schemas'."""
    for field in ("tool_choice", "response_format"):
        if field in message:
            return field
    return "tools" if fields.get("tools") else "response_format"


def check_tool_results(messages: list[ChatMessage]) -> None:
    """Every `tool_call_id` must name a call of an earlier assistant message.

    Raises:
        APIError: 400 naming the first tool message that answers no earlier call.
    """
    called: set[str] = set()
    for i, message in enumerate(messages):
        called.update(call.id for call in getattr(message, "tool_calls", None) or [])
        answers = getattr(message, "tool_call_id", None)
        if answers is not None and answers not in called:
            raise APIError(
                400,
                f"messages[{i}].tool_call_id {answers!r} answers no tool call of "
                "an earlier assistant message",
                f"messages.{i}.tool_call_id",
                "invalid_value",
            )
