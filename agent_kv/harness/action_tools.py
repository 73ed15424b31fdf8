"""The browser actions as function tools: one tool per action kind of `envs.actions`, its
arguments a JSON Schema, for an agent that acts through tool calls instead of action text.

`ACTION_TOOLS` are the tools an episode offers (the same on every page, so the prompt that
lists them stays a prefix of the cache); `page_tools` narrows them to one page, for the
grammar a call is decoded under: element ids those of the observation, tab indices those of
the open tabs, free text bounded as the text grammar bounds it (`envs.action_grammar`).
`call_action` turns a call into the action text the environment parses, `action_call` an
action into the call that makes it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from agent_kv.runtime.replies.tool_calls import Tool, ToolCall
from envs.action_grammar import TEXT_CHARS, URL_CHARS
from envs.actions import ACTION_GRAMMAR, Action

ELEMENT = {"type": "integer", "description": "the [id] of an element on the page"}
TEXT = {"type": "string", "pattern": f"^[^\\]\\n\\r]{{0,{TEXT_CHARS}}}$"}
ARGUMENTS: dict[str, dict[str, dict[str, Any]]] = {
    "click": {"element_id": ELEMENT},
    "hover": {"element_id": ELEMENT},
    "type": {
        "element_id": ELEMENT,
        "text": {**TEXT, "description": "the text to type"},
        "press_enter": {"type": "boolean", "description": "press Enter after typing"},
    },
    "press": {"key": {"type": "string", "pattern": "^[A-Za-z0-9+]{1,40}$"}},
    "scroll": {"direction": {"enum": ["up", "down"]}},
    "new_tab": {},
    "tab_focus": {"tab_index": {"type": "integer", "minimum": 0}},
    "close_tab": {},
    "goto": {"url": {"type": "string", "pattern": f"^[^\\]\\n\\r ]{{1,{URL_CHARS}}}$"}},
    "go_back": {},
    "go_forward": {},
    "stop": {"answer": {**TEXT, "description": "the answer, when the goal asks for one"}},
}
"""Per action kind (`ACTION_GRAMMAR`), its arguments' schemas, in the order a call writes
them; every argument is required."""
DESCRIPTIONS = {
    "click": "Click an element.",
    "hover": "Hover over an element.",
    "type": "Type text into an element.",
    "press": "Press a key combination, e.g. Control+a.",
    "scroll": "Scroll the page.",
    "new_tab": "Open a new tab.",
    "tab_focus": "Switch to a tab.",
    "close_tab": "Close the current tab.",
    "goto": "Open a URL.",
    "go_back": "Go back one page.",
    "go_forward": "Go forward one page.",
    "stop": "End the episode with the answer when the page shows it.",
}
JSON_TYPES = {"integer": int, "string": str, "boolean": bool}
"""The Python type of each JSON type the arguments use."""
ELEMENT_KINDS = ("click", "hover", "type")
"""The actions that name an element: left out of a page without element ids."""


def _tool(kind: str, arguments: dict[str, dict[str, Any]]) -> Tool:
    schema = {"type": "object", "properties": arguments, "required": list(arguments)}
    return Tool(kind, DESCRIPTIONS[kind], {**schema, "additionalProperties": False})


ACTION_TOOLS: tuple[Tool, ...] = tuple(_tool(kind, ARGUMENTS[kind]) for kind in ACTION_GRAMMAR)
"""The tools an episode offers, one per action kind."""


def page_tools(ids: Sequence[int], tabs: int) -> tuple[Tool, ...]:
    """`ACTION_TOOLS` narrowed to a page with element `ids` and `tabs` open tabs: the
    element actions take only those ids (and are left out without any), `tab_focus` only
    those tabs."""
    narrowed = {"element_id": {"enum": sorted(set(ids))}, "tab_index": {"enum": list(range(tabs))}}
    return tuple(
        _tool(kind, {name: narrowed.get(name, schema) for name, schema in arguments.items()})
        for kind, arguments in ARGUMENTS.items()
        if ids or kind not in ELEMENT_KINDS
    )


def call_action(call: ToolCall) -> str:
    """The action text of a call (`str(Action)`, e.g. "click [12]"), for the environment to
    parse and check.

    Raises:
        ValueError: the call names no action, or its arguments are not those of its action
            (other names, or a value of another type).
    """
    if call.name not in ARGUMENTS:
        raise ValueError(f"no browser action is called {call.name!r}")
    arguments = json.loads(call.arguments)
    if not isinstance(arguments, dict) or set(arguments) != set(ARGUMENTS[call.name]):
        raise ValueError(
            f"{call.name} takes the arguments {sorted(ARGUMENTS[call.name])}, got {call.arguments}"
        )
    for name, value in arguments.items():
        if not _fits(value, ARGUMENTS[call.name][name]):
            raise ValueError(f"{call.name}'s {name} cannot be {json.dumps(value)}")
    return str(Action(call.name, **arguments))


def _fits(value: Any, schema: dict[str, Any]) -> bool:
    """Whether an argument has its schema's type (or is one of its `enum`); the patterns and
    bounds are the grammar's to keep, and the environment checks the action itself."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = JSON_TYPES[schema["type"]]
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def action_call(action: Action) -> ToolCall:
    """The call that makes `action` (an element given by id), its arguments in the order
    and layout a decoded call has them.

    Raises:
        ValueError: the action names its element by role and name, not by id.
    """
    if action.element_ref is not None:
        raise ValueError(f"{action} names its element by reference: resolve it to an id first")
    arguments = {name: getattr(action, name) for name in ARGUMENTS[action.kind]}
    return ToolCall(ToolCall.new_id(), action.kind, json.dumps(arguments, ensure_ascii=False))
