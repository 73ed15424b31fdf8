"""What a `ChatAgentKV` reply may be: tools bound to the model (`bind_tools`), a structured
output (`with_structured_output`), and the call keyword arguments both set (`REPLY_KWARGS`),
read back as the turn's `ReplySpec`.

The fields are OpenAI's request fields: in-process they become the turn's `ReplySpec`
(`reply_spec`), against a server the request's fields.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from agent_kv.runtime.replies.tool_calls import ReplySpec

REPLY_KWARGS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
"""Call keyword arguments (set by `bind_tools`, `with_structured_output` or `bind`) that say
what the reply may be, as OpenAI's request fields."""


def reply_spec(kwargs: dict) -> ReplySpec:
    """The call's `ReplySpec` from its `REPLY_KWARGS`.

    Raises:
        GrammarError: fields a spec cannot take (`ReplySpec.from_openai`).
    """
    return ReplySpec.from_openai(**{key: kwargs.get(key) for key in REPLY_KWARGS})


def tool_fields(
    tools: Sequence[dict | type | Callable | Any],
    tool_choice: str | bool | dict | None,
    parallel_tool_calls: bool | None,
) -> dict[str, Any]:
    """The call keyword arguments that offer `tools` (`ChatAgentKV.bind_tools`): OpenAI's
    `tools` (each converted by `convert_to_openai_tool`), and `tool_choice` and
    `parallel_tool_calls` when given.

    Raises:
        ValueError: a `tool_choice` naming no offered tool, or True with several tools.
    """
    formatted = [convert_to_openai_tool(tool) for tool in tools]
    fields: dict[str, Any] = {"tools": formatted}
    choice = _tool_choice(tool_choice, [tool["function"]["name"] for tool in formatted])
    if choice is not None:
        fields["tool_choice"] = choice
    if parallel_tool_calls is not None:
        fields["parallel_tool_calls"] = parallel_tool_calls
    return fields


def structured_output(
    model: BaseChatModel, schema: dict | type, method: str, include_raw: bool
) -> Runnable:
    """`model` answering with `schema`, parsed (`ChatAgentKV.with_structured_output`, which
    describes the methods): the model bound to the method's fields, then its parser, or with
    `include_raw` `{"raw", "parsed", "parsing_error"}`.

    Raises:
        ValueError: an unknown method.
    """
    pydantic_schema = isinstance(schema, type) and is_basemodel_subclass(schema)
    traced = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        bound = model.bind_tools([schema], tool_choice=name, parallel_tool_calls=False, **traced)
        if pydantic_schema:
            parser = PydanticToolsParser(tools=[schema], first_tool_only=True)
        else:
            parser = JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
    elif method in ("json_schema", "json_mode"):
        if method == "json_schema":
            json_schema = convert_to_json_schema(schema)
            name = _tool_name(json_schema.get("title") or "response")
            body = {"name": name, "schema": json_schema}
            format_ = {"type": "json_schema", "json_schema": body}
        else:
            format_ = {"type": "json_object"}
        bound = model.bind(response_format=format_, **traced)
        if pydantic_schema:
            parser = PydanticOutputParser(pydantic_object=schema)
        else:
            parser = JsonOutputParser()
    else:
        raise ValueError(
            f"method must be function_calling, json_schema or json_mode, got {method!r}"
        )
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    )
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")


def _tool_choice(choice: str | bool | dict | None, names: list[str]) -> str | dict | None:
    """`bind_tools`' `tool_choice` as OpenAI's.

    Raises:
        ValueError: a name not offered, or True with other than one tool.
    """
    if choice is None or choice in ("auto", "none", "required") or isinstance(choice, dict):
        return choice
    if choice == "any":
        return "required"
    if choice is True:
        if len(names) != 1:
            raise ValueError(f"tool_choice=True needs exactly one tool, got {len(names)}")
        choice = names[0]
    if choice not in names:
        raise ValueError(f"tool_choice {choice!r} is not one of the tools: {', '.join(names)}")
    return {"type": "function", "function": {"name": choice}}


def _tool_name(title: str) -> str:
    """`title` as a schema name OpenAI takes (letters, digits, `_`, `-`; at most 64)."""
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in title)[:64] or "response"
