"""A chat request's tool and format fields as the turn's `ReplySpec`, checked before the turn
is admitted: each error is an `APIError` 400 naming the field."""

from __future__ import annotations

from agent_kv.errors import GrammarError, ToolFormatError
from agent_kv.runtime.replies.tool_calls import ReplySpec, ToolChoice
from api.errors import APIError
from api.schemas import ChatMessage, ReplyFields


def reply_spec(request: ReplyFields, engine, model_name: str) -> ReplySpec:
    """The request's `ReplySpec`, each tool's schema and the reply format compiled on their
    own first (so an error names the part at fault), then the whole grammar, against the
    model's tokenizer (`engine.grammars`, calls in `engine.tokenizer`'s tool-call format): a
    schema llguidance cannot compile is refused before anything runs.

    Raises:
        APIError: 400 (param `tools`) for tools offered to a model whose chat template
            writes calls in a layout agent_kv does not read, naming `model_name`;
        APIError: 400 for a `tool_choice` naming no offered tool (or `required` without
            tools), tools offered twice, a tool's `parameters` that are not an object schema,
            too large or too deep (`json_schemas.check_schema`) or cannot be compiled (param
            `tools.N.function.parameters`), or the same of the `response_format` schema.
    """
    fields = request.model_dump(
        include={"tools", "tool_choice", "parallel_tool_calls", "response_format"},
        by_alias=True,
    )
    try:
        spec = ReplySpec.from_openai(**fields)
    except GrammarError as err:
        raise APIError(400, str(err), _param_of(str(err), fields), "invalid_value") from None
    try:
        calls = spec.call_format(engine.tokenizer)
    except ToolFormatError as err:
        message = f"model {model_name!r} cannot take tools: its chat template {err}"
        raise APIError(400, message, "tools", "unsupported") from None
    parts = [
        (ReplySpec((tool,), ToolChoice("required")), f"tools.{i}.function.parameters")
        for i, tool in enumerate(spec.tools)
    ]
    if spec.format is not None:
        parts.append((ReplySpec(format=spec.format), "response_format"))
    for part, param in [*parts, (spec, "tools")]:
        try:
            grammar = part.grammar(calls)
            if grammar is not None:
                engine.grammars.matcher(grammar)
        except GrammarError as err:
            raise APIError(400, str(err), param, "invalid_value") from None
    return spec


def _param_of(message: str, fields: dict) -> str:
    """The field a reply-spec error is about, named in its message (else `tools`)."""
    for field in ("tool_choice", "response_format"):
        if field in message:
            return field
    for i, tool in enumerate(fields.get("tools") or []):
        if message.startswith(f"tool {tool['function']['name']!r} parameters"):
            return f"tools.{i}.function.parameters"
    return "tools"


def check_tool_results(messages: list[ChatMessage]) -> None:
    """Every `tool_call_id` must name a call of an earlier assistant message, and no assistant
    message may give two calls one id.

    Raises:
        APIError: 400 naming the first message at fault.
    """
    called: set[str] = set()
    for i, message in enumerate(messages):
        ids = [call.id for call in getattr(message, "tool_calls", None) or []]
        if len(set(ids)) != len(ids):
            twice = next(call_id for call_id in ids if ids.count(call_id) > 1)
            raise APIError(
                400,
                f"messages[{i}].tool_calls gives two calls the id {twice!r}",
                f"messages.{i}.tool_calls",
                "invalid_value",
            )
        called.update(ids)
        answers = getattr(message, "tool_call_id", None)
        if answers is not None and answers not in called:
            raise APIError(
                400,
                f"messages[{i}].tool_call_id {answers!r} answers no tool call of "
                "an earlier assistant message",
                f"messages.{i}.tool_call_id",
                "invalid_value",
            )
