"""A chat request's tool and format fields as the turn's `ReplySpec`, checked before the turn
is admitted: each error is an `APIError` 400 naming the field."""

from __future__ import annotations

from agent_kv.errors import GrammarError
from agent_kv.runtime.grammar import GrammarCompiler
from agent_kv.runtime.tool_calls import ReplyFormat, ReplySpec, Tool, ToolChoice
from api.errors import APIError
from api.schemas import ChatMessage, JSONObjectFormat, JSONSchemaFormat, ReplyFields


def reply_spec(request: ReplyFields, grammars: GrammarCompiler) -> ReplySpec:
    """The request's `ReplySpec`, its grammar built once against the model's tokenizer so
    that a schema llguidance cannot compile is refused before anything runs.

    Raises:
        APIError: 400 for a `tool_choice` naming no offered tool (or `required` without
            tools), tools offered twice, or a tool's `parameters` or the `response_format`
            schema that cannot be compiled (the message carries the library's reason).
    """
    tools = tuple(
        Tool(tool.function.name, tool.function.description, tool.function.parameters)
        for tool in request.tools or []
    )
    choice = request.tool_choice
    if choice is None:
        choice = ToolChoice("auto" if tools else "none")
    elif isinstance(choice, str):
        choice = ToolChoice(choice)
    else:
        choice = ToolChoice("function", choice.function.name)
    fmt = request.response_format
    reply_format = None
    if isinstance(fmt, JSONObjectFormat):
        reply_format = ReplyFormat({"type": "object"})
    elif isinstance(fmt, JSONSchemaFormat):
        reply_format = ReplyFormat(fmt.json_schema.schema_, fmt.json_schema.name)
    spec = ReplySpec(tools, choice, request.parallel_tool_calls, reply_format)
    try:
        grammar = spec.grammar()
        if grammar is not None:
            grammars.matcher(grammar)
    except GrammarError as err:
        param = "response_format" if spec.format is not None and not tools else "tools"
        if "tool_choice" in str(err):
            param = "tool_choice"
        raise APIError(400, str(err), param, "invalid_value") from None
    return spec


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
