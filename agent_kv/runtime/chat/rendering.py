"""A conversation as the model reads it: chat messages, tool calls and tool results rendered
through the tokenizer's chat template.

Messages are dicts: `role` ("system", "user", "assistant" or "tool"), `content` (a string),
and optionally `tool_calls` (an assistant message's `ToolCall`s) and `tool_call_id` (the call
a tool message answers). Tools offered (`Tool`s) are shown to the model in one of two ways:

- **the template's own tool support**, when the chat template reads a `tools` variable: the
  tools, the calls (arguments as objects) and the tool results go to the template as
  Hugging Face's chat format has them, and the template renders them;
- **a generic format** otherwise (SmolLM2's template, for one): the tools are listed, one
  JSON object per line between `<tools>` and `</tools>` with how to call them, at the end
  of the first system message (a system message holding only that is put first when there
  is none); an assistant message's calls follow its text as the model writes them
  (`ToolCallFormat.render_reply`); a tool result is a message of role `tool`.

In both, calls are generated in the model's format (`agent_kv.runtime.replies.tool_call_format`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import jinja2

from agent_kv.runtime.replies.tool_call_format import (
    GENERIC_CLOSE,
    GENERIC_OPEN,
    template_source,
    template_takes_tools,
    tool_call_format,
)
from agent_kv.runtime.replies.tool_calls import Tool

TOOLS_PREAMBLE = (
    "You can call functions. Their signatures are listed, one JSON object per line, "
    "between <tools> and </tools>:"
)
CALL_INSTRUCTION = (
    f'To call one, reply with {GENERIC_OPEN}{{"name": <function name>, "arguments": '
    f"<arguments as a JSON object>}}{GENERIC_CLOSE}, once per call. A function's result comes "
    "back in a message of role tool."
)


NAME_PROBE = "agent_kv_name_probe"
"""The name `template_takes_names` looks for in a probe conversation's rendering."""


def template_takes_names(tokenizer, role: str) -> bool:
    """Whether the tokenizer's chat template renders the `name` of a message of `role`
    ("system", "user", "assistant" or "tool"). A message dict's optional `name` (OpenAI's
    name of its author) goes to the template as it is, which renders it or not: this renders
    a probe conversation (system, user, assistant, then a user or tool message) with
    `NAME_PROBE` as the name of its message of that role, and looks for the probe. A template
    that never mentions `name`, or fails on the probe, renders none."""
    if "name" not in template_source(tokenizer):
        return False
    chat = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "tool" if role == "tool" else "user", "content": "t"},
    ]
    chat[{"system": 0, "user": 1, "assistant": 2, "tool": 3}[role]]["name"] = NAME_PROBE
    try:
        return NAME_PROBE in tokenizer.apply_chat_template(chat, tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError):
        return False


def tools_block(tools: Sequence[Tool]) -> str:
    """The generic format's description of `tools` (appended to the system message)."""
    lines = [json.dumps(tool.openai()["function"], ensure_ascii=False) for tool in tools]
    return "\n".join([TOOLS_PREAMBLE, "<tools>", *lines, "</tools>", CALL_INSTRUCTION])


def render_chat(
    tokenizer,
    messages: list[dict],
    tools: Sequence[Tool] = (),
    generation_prompt: bool = False,
) -> str:
    """The conversation's template text (with the assistant header when
    `generation_prompt`).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: the conversation (see the module docstring).
        tools: the tools offered this turn (none: messages render as plain chat).

    Raises:
        jinja2 errors and ValueError from the template, as `apply_chat_template` raises them.
    """
    if template_takes_tools(tokenizer):
        return tokenizer.apply_chat_template(
            [_hf_message(message) for message in messages],
            tools=[tool.openai() for tool in tools] or None,
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
    rendered = _generic_messages(tokenizer, messages, tools)
    if tools and not (messages and messages[0]["role"] == "system"):
        rendered.insert(0, {"role": "system", "content": tools_block(tools)})
    return tokenizer.apply_chat_template(
        rendered, tokenize=False, add_generation_prompt=generation_prompt
    )


def content_as_rendered(tokenizer, messages: list[dict], tools: Sequence[Tool] = ()) -> list[str]:
    """Each message's content as `render_chat` hands it to the template: as given with the
    template's own tool support; in the generic format with an assistant's calls written
    after its text, and the tools' description after the first system message's text."""
    if template_takes_tools(tokenizer):
        return [message["content"] for message in messages]
    return [message["content"] for message in _generic_messages(tokenizer, messages, tools)]


def _generic_messages(tokenizer, messages: list[dict], tools: Sequence[Tool]) -> list[dict]:
    """The messages in the generic format, one per message: calls after an assistant's text,
    the tools' description at the end of a first system message."""
    calls = tool_call_format(tokenizer)
    rendered = [
        {
            "role": message["role"],
            "content": calls.render_reply(
                message["content"],
                [(call.name, call.arguments) for call in message.get("tool_calls") or []],
            ),
            **_name_of(message),
        }
        for message in messages
    ]
    if tools and rendered and rendered[0]["role"] == "system":
        block = tools_block(tools)
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{block}"}
    return rendered


def _hf_message(message: dict) -> dict:
    """The message in Hugging Face's chat format (calls' arguments as objects)."""
    out = {"role": message["role"], "content": message["content"], **_name_of(message)}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": json.loads(call.arguments)},
            }
            for call in message["tool_calls"]
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _name_of(message: dict) -> dict:
    """`{"name": ...}` of a message that has a name, else `{}`."""
    return {"name": message["name"]} if message.get("name") is not None else {}
