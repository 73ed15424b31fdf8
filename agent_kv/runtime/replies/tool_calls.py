"""Tool calls and structured replies: what a reply may be, as one grammar, and what it was.

A turn may offer function tools (OpenAI's `tools`) and say whether the reply must call one
(`ToolChoice`: `none`, `auto`, `required`, or one named function), and may ask for a JSON
reply (`ReplyFormat`: any JSON object, or one that validates against a JSON Schema). A
`ReplySpec` turns these into one `Grammar` for the engine's constrained decoder
(`agent_kv.runtime.replies.grammar`, llguidance), so a forced call or a schema'd reply always
parses and validates:

- a call is the model's own layout of `{"name": NAME, "arguments": ARGS}` between markers
  (`agent_kv.runtime.replies.tool_call_format`: Qwen2.5's `<tool_call>\\n...\\n</tool_call>`, its
  markers named as the added tokens they are), where `ARGS` is a JSON object valid against
  the tool's `parameters` schema; with `parallel` several calls follow each other;
- schemas are checked for size and depth, and object schemas that list their properties
  are closed unless they say otherwise, as in OpenAI's strict mode
  (`agent_kv.runtime.replies.json_schemas`); a tool's `$defs` and `$ref`s keep working inside the
  call's document;
- `required` and a named function allow only calls (of any tool, or of that one);
- `auto` allows calls, a text reply that contains no opening marker (or, with a
  `ReplyFormat`, a JSON reply), or, where the opening marker is an added token, text and
  then calls (`ToolCallFormat.text_before_calls`);
- `none` allows text that contains no opening marker (or the `ReplyFormat`'s JSON); with
  no tools, only a `ReplyFormat` constrains the reply.

JSON is generated compact except for `", "` and `": "` separators (`JSON_LAYOUT`), the layout
`json.dumps` writes, so a call rendered back into the history from its parsed fields
(`render_calls`) is the text the model generated and the session's cache is reused.

`parse_reply` splits a finished reply into text and calls; `ToolCallStream` does it
incrementally for streamed replies. Under `auto`, a reply that is wholly one call written as
JSON text (`{"name": ..., "arguments": {...}}`, bare or in a Markdown code fence: what a small
model that does not use its call marker writes) is read as that call when its arguments pass
the tool's grammar (`call_check`), as llama.cpp's Hermes 2 Pro parser reads such openings
(common/chat.cpp).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from agent_kv.errors import GrammarError
from agent_kv.runtime.replies.grammar import Grammar, GrammarCompiler
from agent_kv.runtime.replies.json_schemas import check_schema, closed, embedded
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_call_format import (
    CALL_BODY_HEAD,
    ToolCallFormat,
    tool_call_format,
)

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON layout for constrained JSON (`x-guidance`): no free whitespace, the
separators of `json.dumps`."""
CHOICE_MODES = ("none", "auto", "required", "function")
JSON_CALL_STARTS = ('{"name":', '```json{"name":', '```{"name":')
"""How a reply that writes a call as JSON text starts, whitespace removed: a bare body, or one
in a Markdown code fence."""
CallCheck = Callable[[str, str], bool]
"""`(name, arguments JSON text) -> whether the call passes the tool's grammar`."""
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""A function's name: 1-64 letters, digits, underscores or hyphens (OpenAI's rule)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call.

    Attributes:
        name: the function's name (what a call names).
        description: what it does, shown to the model.
        parameters: the JSON Schema of its arguments (an object schema; `{}` for any object).
    """

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's `{"type": "function", "function": {...}}`."""
        function = {"name": self.name, "description": self.description}
        return {"type": "function", "function": {**function, "parameters": self.arguments_schema}}

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """`parameters`, or an object schema when it is empty."""
        return self.parameters or {"type": "object"}


@dataclass(frozen=True)
class ToolCall:
    """One call the model made.

    Attributes:
        id: the call's id (`call_` and 24 hex digits), which a tool result names.
        name: the function called.
        arguments: its arguments, as the JSON object text the model generated.
    """

    id: str
    name: str
    arguments: str

    @staticmethod
    def new_id() -> str:
        """A fresh call id."""
        return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolChoice:
    """Whether a reply must call a tool.

    Attributes:
        mode: "none" (no call), "auto" (text or calls), "required" (calls only) or
            "function" (calls of `name` only).
        name: the function for mode "function".
    """

    mode: str = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ReplyFormat:
    """A JSON reply (OpenAI's `response_format`).

    Attributes:
        schema: the JSON Schema the reply validates against (`{"type": "object"}` for
            `json_object`).
        name: the schema's name, for error messages.
    """

    schema: dict[str, Any]
    name: str = "json_object"


@dataclass(frozen=True)
class ReplySpec:
    """What one reply may be: the tools offered, the choice among them, and its format.

    Attributes:
        tools: the functions offered (names unique).
        choice: whether the reply must call one.
        parallel: several calls may follow each other in one reply.
        format: a JSON reply format, or None for free text.
    """

    tools: tuple[Tool, ...] = ()
    choice: ToolChoice = ToolChoice()
    parallel: bool = True
    format: ReplyFormat | None = None

    def validate(self) -> None:
        """Raise `GrammarError` for duplicate tool names, an unknown choice mode, a named
        function that is not offered, a choice that needs tools when none are offered, a
        tool whose parameters are not an object schema, or a schema `check_schema`
        refuses."""
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise GrammarError(f"tool {duplicate!r} is offered twice")
        if self.choice.mode not in CHOICE_MODES:
            raise GrammarError(
                f"tool_choice must be one of {', '.join(CHOICE_MODES)}, got {self.choice.mode!r}"
            )
        if self.choice.mode == "function" and self.choice.name not in names:
            raise GrammarError(f"tool_choice names {self.choice.name!r}, which is not in tools")
        if self.choice.mode == "required" and not self.tools:
            raise GrammarError("tool_choice required needs at least one tool")
        for tool in self.tools:
            what = f"tool {tool.name!r} parameters"
            check_schema(tool.parameters, what)
            if (
                not isinstance(tool.parameters, dict)
                or tool.arguments_schema.get("type", "object") != "object"
            ):
                raise GrammarError(f"{what} must be an object schema (arguments are an object)")
        if self.format is not None:
            check_schema(self.format.schema, "response_format schema")

    @classmethod
    def from_openai(
        cls,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool | None = None,
        response_format: dict | None = None,
    ) -> ReplySpec:
        """The spec of OpenAI's request fields, as JSON values (`tools` entries
        `{"type": "function", "function": {"name", "description", "parameters"}}`;
        `tool_choice` "none", "auto", "required" or `{"type": "function", "function":
        {"name"}}`, default "auto" with tools, else "none"; `response_format` `{"type":
        "text" | "json_object" | "json_schema", "json_schema": {"name", "schema"}}`).

        Raises:
            GrammarError: a field of the wrong shape, or a spec `validate` refuses.
        """
        offered = []
        for tool in tools or []:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or tool.get("type") != "function":
                raise GrammarError(
                    f"a tool must be {{'type': 'function', 'function': ...}}: {tool!r}"
                )
            offered.append(
                Tool(
                    function["name"],
                    function.get("description") or "",
                    function.get("parameters") or {},
                )
            )
        if tool_choice is None:
            choice = ToolChoice("auto" if offered else "none")
        elif isinstance(tool_choice, str):
            choice = ToolChoice(tool_choice)
        else:
            choice = ToolChoice("function", (tool_choice.get("function") or {}).get("name"))
        fmt = None
        kind = (response_format or {}).get("type", "text")
        if kind == "json_object":
            fmt = ReplyFormat({"type": "object"})
        elif kind == "json_schema":
            body = response_format.get("json_schema") or {}
            fmt = ReplyFormat(body.get("schema") or {}, body.get("name") or "json_schema")
        elif kind != "text":
            raise GrammarError(
                f"response_format type must be text, json_object or json_schema, got {kind!r}"
            )
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        spec = cls(tuple(offered), choice, parallel, fmt)
        spec.validate()
        return spec

    def call_format(self, tokenizer) -> ToolCallFormat | None:
        """The model's tool-call format when tools are offered (`tool_call_format`), else
        None (the reply's grammar and parse need it only with tools).

        Raises:
            ToolFormatError: tools are offered and the model's template writes calls in a
                layout agent_kv does not read.
        """
        return tool_call_format(tokenizer) if self.tools else None

    def scope_stop(self, params: SamplingParams, calls: ToolCallFormat | None) -> SamplingParams:
        """`params` with its stop strings scoped to the free text this reply may be, as OpenAI
        accepts `stop` beside tools and a `response_format`: a reply that may be text keeps
        them for its text before any call (`SamplingParams.call_open`, the format's opening
        marker; `SamplingParams.json_calls`: a reply that is a call written as JSON text is
        not cut either); a reply that may only be calls or JSON drops them (a stop string would cut
        it mid-call or mid-JSON, leaving text that neither parses nor validates).

        Raises:
            GrammarError: `validate` fails.
        """
        self.validate()
        callable_ = bool(self.callable_tools())
        text = self.format is None and (not callable_ or self.choice.mode == "auto")
        return replace(
            params,
            stop=list(params.stop) if text else [],
            call_open=calls.marker if callable_ and calls is not None else None,
            json_calls=callable_ and text,
        )

    @property
    def calls_allowed(self) -> bool:
        """Whether the reply may hold tool calls."""
        return bool(self.tools) and self.choice.mode != "none"

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a call may name under the choice."""
        if not self.calls_allowed:
            return ()
        if self.choice.mode == "function":
            return tuple(tool for tool in self.tools if tool.name == self.choice.name)
        return self.tools

    def grammar(self, calls: ToolCallFormat | None) -> Grammar | None:
        """The reply's grammar (a Lark grammar in llguidance's dialect, JSON parts as
        `%json`, the format's added tokens as `<[id]>`), or None when the reply is free text.
        Text is never free when tools are offered: under `tool_choice` none it may not open a
        call (`ToolCallFormat.marker`), which the model, shown the tools, would otherwise
        write.

        Args:
            calls: the model's tool-call format (`call_format`; None without tools).

        Raises:
            GrammarError: `validate` fails, or tools are offered without a format.
        """
        self.validate()
        if self.tools and calls is None:
            raise GrammarError("tools are offered but no tool-call format was given")
        tools = self.callable_tools()
        if not tools:
            if self.format is not None:
                return Grammar("lark", f"start: {_json_rule(self.format.schema)}\n")
            if not self.tools:
                return None
            return Grammar("lark", f"start: TEXT\n{_text_rule(calls.marker)}\n")
        defs, refs = embedded({tool.name: tool.arguments_schema for tool in tools})
        bodies = [_call_schema(tool.name, refs[tool.name]) for tool in tools]
        call_schema = bodies[0] if len(bodies) == 1 else {"oneOf": bodies}
        call_schema = {**call_schema, "$defs": defs}
        item = " ".join(
            part
            for part in (calls.lark(calls.open), _json_rule(call_schema), calls.lark(calls.close))
            if part
        )
        separator = calls.lark(calls.separator)
        more = f"({separator} call)*" if separator else "call*"
        rules = [f"calls: call {more}" if self.parallel and calls.parallel else "calls: call"]
        if separator and not calls.separator.strip():  # the model may end on the separator
            rules[0] += f" {separator}?"
        rules.append(f"call: {item}")
        if self.choice.mode in ("required", "function"):
            start = "start: calls"
        elif self.format is not None:
            start = f"start: calls | {_json_rule(self.format.schema)}"
        elif calls.text_before_calls:
            start = "start: TEXT | calls | PREFACE calls"
            rules += [_text_rule(calls.marker), _preface_rule(calls)]
        else:
            start = "start: calls | TEXT"
            rules.append(_text_rule(calls.marker))
        return Grammar("lark", "\n".join([start, *rules]) + "\n")


def _call_schema(name: str, arguments_ref: str) -> dict[str, Any]:
    """The JSON Schema of one call's body: `{"name": name, "arguments": {...}}`, the
    arguments' schema at `arguments_ref` (`json_schemas.embedded`)."""
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": arguments_ref}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json_rule(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema` (`closed`), in `JSON_LAYOUT`."""
    return "%json " + json.dumps({**closed(schema), "x-guidance": JSON_LAYOUT})


def _text_rule(marker: str) -> str:
    """The Lark terminal TEXT: any non-empty text without `marker` in it."""
    return f"TEXT: /(.|\\n)+/ & ~{_containing(marker)}"


def _preface_rule(calls: ToolCallFormat) -> str:
    """The Lark terminal PREFACE: text before calls, without the opening marker, ending in
    the format's `text_separator`."""
    text = f"(.|\\n)*{_regex_literal(calls.text_separator)}" if calls.text_separator else "(.|\\n)+"
    return f"PREFACE: /{text}/ & ~{_containing(calls.marker)}"


def _containing(text: str) -> str:
    """A Lark regex for any text that contains `text`."""
    return f"/(.|\\n)*{_regex_literal(text)}(.|\\n)*/"


def _regex_literal(text: str) -> str:
    """`text` escaped for a Lark regex between slashes."""
    escaped = "".join(f"\\{c}" if c in r"\/.^$*+?()[]{}|" else c for c in text)
    return escaped.replace("\n", "\\n")


def render_calls(calls: list[ToolCall], fmt: ToolCallFormat) -> str:
    """The calls as the model writes them in `fmt`; `arguments` is taken as its text, so a
    generated call renders as generated."""
    return fmt.render_calls([(call.name, call.arguments) for call in calls])


def parse_reply(
    text: str, spec: ReplySpec, fmt: ToolCallFormat | None, check: CallCheck | None = None
) -> tuple[str, list[ToolCall]]:
    """Split a finished reply into its text and its tool calls.

    A reply counts as calls when it is wholly calls as the grammar generates them, or (where
    `fmt.text_before_calls`) text, the format's text separator and then wholly calls; each
    call names a tool the choice allows and carries a JSON object of arguments. Under `auto`,
    with `check`, a reply that is one call written as JSON text (`read_json_call`) whose
    arguments pass `check` is that call. Anything else (free text, a call cut short by
    `max_tokens`) is text.

    Returns:
        `(text, calls)`: the text before the calls ("" for a reply of calls only) and the
        calls; `(text, [])` when the reply holds no complete calls.
    """
    if not spec.calls_allowed or fmt is None:
        return text, []
    allowed = {tool.name for tool in spec.callable_tools()}
    preface, rest = _split_preface(text, fmt)
    calls = []
    rest = rest.strip()
    while rest:
        taken = _take_call(rest, allowed, fmt)
        if not isinstance(taken, tuple):
            calls = []
            break
        call, rest = taken
        calls.append(call)
        rest = rest.strip()
    if calls:
        return preface, calls
    written = read_json_call(text, spec) if check is not None else None
    if written is not None and check(*written):
        return "", [ToolCall(ToolCall.new_id(), *written)]
    return text, []


_FENCED = re.compile(r"```(?:json)?[ \t]*\n(.*)\n[ \t]*```", re.S)


def read_json_call(text: str, spec: ReplySpec) -> tuple[str, str] | None:
    """Under `auto` (no reply format), the call a reply writes as JSON text: the whole reply
    one body `{"name": NAME, "arguments": {...}}`, bare or in a Markdown code fence (```` ``` ````
    or ```` ```json ````), naming a tool the choice allows with an object of arguments.

    Returns:
        `(name, arguments as json.dumps text)`, or None for any other reply.
    """
    if spec.choice.mode != "auto" or spec.format is not None or not spec.calls_allowed:
        return None
    body = text.strip()
    if (fenced := _FENCED.fullmatch(body)) is not None:
        body = fenced.group(1)
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(parsed, dict) or set(parsed) != {"name", "arguments"}:
        return None
    tools = {tool.name: tool for tool in spec.callable_tools()}
    if parsed["name"] not in tools or not isinstance(parsed["arguments"], dict):
        return None
    arguments = _schema_order(parsed["arguments"], tools[parsed["name"]].arguments_schema)
    return parsed["name"], json.dumps(arguments, ensure_ascii=False)


def _schema_order(value: Any, schema: Any) -> Any:
    """`value` with each object's keys in the order its schema lists `properties` (others
    after, as written), through nested objects and array items: the order the grammar
    generates them in."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, list):
        return [_schema_order(item, schema.get("items")) for item in value]
    if not isinstance(value, dict):
        return value
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    keys = [key for key in properties if key in value]
    keys += [key for key in value if key not in properties]
    return {key: _schema_order(value[key], properties.get(key)) for key in keys}


def may_be_json_call(head: str) -> bool:
    """Whether a reply starting with `head` may be (or is) one call written as JSON text."""
    compact = "".join(head.split())
    return any(start.startswith(compact) or compact.startswith(start) for start in JSON_CALL_STARTS)


def call_check(
    spec: ReplySpec, fmt: ToolCallFormat | None, grammars: GrammarCompiler
) -> CallCheck | None:
    """A `CallCheck` for `spec`'s tools: the call, rendered in `fmt`, must be a sentence of the
    grammar of a forced call of that tool (its arguments valid against its schema, in the
    layout the grammar generates); None without a format (no tools offered)."""
    if fmt is None:
        return None

    def check(name: str, arguments: str) -> bool:
        tool = next(tool for tool in spec.tools if tool.name == name)
        grammar = ReplySpec((tool,), ToolChoice("required"), parallel=False).grammar(fmt)
        return grammars.accepts(grammar, fmt.render_call(name, arguments))

    return check


def _split_preface(text: str, fmt: ToolCallFormat) -> tuple[str, str]:
    """`(text before the calls, the rest)`: the rest starts at the first opening marker where
    text may precede calls (the separator before it dropped), else it is the whole reply."""
    if not fmt.text_before_calls:
        return "", text
    at = text.find(fmt.marker)
    if at <= 0:
        return "", text
    preface = text[:at]
    if fmt.text_separator and preface.endswith(fmt.text_separator):
        preface = preface[: -len(fmt.text_separator)]
    return preface, text[at:]


_DECODER = json.JSONDecoder()


def _take_call(text: str, allowed: set[str], fmt: ToolCallFormat) -> tuple[ToolCall, str] | str:
    """The call at the start of `text` and the text after it; or "incomplete" when `text`
    may still grow into a call, or "invalid" when it cannot.

    The body is read as one JSON value after the opening marker (so a closing marker inside
    an argument string does not end it), then the closing marker must follow, whitespace
    around the body aside; it must be `{"name", "arguments"}` naming an allowed tool with an
    object of arguments."""
    opener, closer = fmt.marker, fmt.close.strip()
    if not text.startswith(opener):
        return "incomplete" if opener.startswith(text) else "invalid"
    body = text[len(opener) :]
    start = len(body) - len(body.lstrip())
    try:
        parsed, end = _DECODER.raw_decode(body, start)
    except RecursionError:
        return "invalid"
    except json.JSONDecodeError as err:
        return "incomplete" if err.pos >= len(body.rstrip()) else "invalid"
    after = body[end:].lstrip()
    if not after.startswith(closer):
        return "incomplete" if closer.startswith(after) else "invalid"
    if not isinstance(parsed, dict) or set(parsed) != {"name", "arguments"}:
        return "invalid"
    if parsed["name"] not in allowed or not isinstance(parsed["arguments"], dict):
        return "invalid"
    raw = body[start:end]
    head = CALL_BODY_HEAD.format(name=json.dumps(parsed["name"], ensure_ascii=False))
    if raw.startswith(head):
        arguments = raw[len(head) : -1]  # as generated, so it renders back the same
    else:
        arguments = json.dumps(parsed["arguments"], ensure_ascii=False)
    return ToolCall(ToolCall.new_id(), parsed["name"], arguments), after[len(closer) :]


class ToolCallStream:
    """Splits a streamed reply into text deltas and finished calls, as it grows.

    Feed each new piece of the reply to `feed`; it returns the events that piece settles:
    `("text", delta)` for reply text, `("call", index, ToolCall)` for each call once its
    body and closing marker are complete. Text that might still become the start of a call
    (the opening marker, or where text may precede calls the text separator and the marker)
    is held back until it cannot. Once a call has started, everything after it is read as
    calls; `finish` returns what is left (a call cut short comes back as text).

    With `check`, a reply that may be one call written as JSON text (`read_json_call`) is held
    whole, and `finish` gives it as that call when its arguments pass `check`.

    Args:
        spec: the turn's reply spec (no calls allowed: every piece is text at once).
        fmt: the model's tool-call format (`ReplySpec.call_format`; None without tools).
        check: validates a call written as JSON text (`call_check`); None reads none.
    """

    def __init__(self, spec: ReplySpec, fmt: ToolCallFormat | None, check: CallCheck | None = None):
        self.spec = spec
        self.fmt = fmt
        auto = spec.choice.mode == "auto" and spec.format is None
        self.check = check if auto else None
        self._allowed = {tool.name for tool in spec.callable_tools()}
        self._buffer = ""
        self._mode = "text" if not spec.calls_allowed or fmt is None else "undecided"
        self._lead = (fmt.text_separator or "") + fmt.marker if fmt else ""  # calls after text
        self._held_separator = ""  # the separator taken off text before calls
        self.calls: list[ToolCall] = []

    def feed(self, piece: str) -> list[tuple]:
        """The events settled by `piece` (see the class)."""
        self._buffer += piece
        if self._mode == "undecided":
            head = self._buffer.lstrip()
            if head.startswith(self.fmt.marker):
                self._mode = "calls"
            elif not self.fmt.marker.startswith(head) and not (
                self.check is not None and may_be_json_call(head)
            ):
                self._mode = "preface" if self.fmt.text_before_calls else "text"
        if self._mode == "text":
            text, self._buffer = self._buffer, ""
            return [("text", text)] if text else []
        if self._mode == "preface":
            return self._take_preface()
        if self._mode == "undecided":
            return []
        return self._take_calls()

    def _take_preface(self) -> list[tuple]:
        """Text up to the calls' lead (the separator and marker), holding back a tail that may
        still become it; once the lead is complete, the calls after it."""
        at = self._buffer.find(self._lead)
        if at >= 0:
            text, self._buffer = (
                self._buffer[:at],
                self._buffer[at + len(self.fmt.text_separator or "") :],
            )
            self._held_separator = self.fmt.text_separator or ""
            self._mode = "calls"
            return ([("text", text)] if text else []) + self._take_calls()
        keep = next(
            (n for n in range(min(len(self._lead), len(self._buffer)), 0, -1)
             if self._lead.startswith(self._buffer[-n:])),
            0,
        )  # fmt: skip
        text = self._buffer[: len(self._buffer) - keep]
        self._buffer = self._buffer[len(text) :]
        return [("text", text)] if text else []

    def _take_calls(self) -> list[tuple]:
        events = []
        while True:
            taken = _take_call(self._buffer.lstrip(), self._allowed, self.fmt)
            if not isinstance(taken, tuple):
                return events
            call, self._buffer = taken
            events.append(("call", len(self.calls), call))
            self.calls.append(call)

    def finish(self) -> list[tuple]:
        """The events left at the end of the reply: held-back or unparsable text."""
        rest, self._buffer = self._buffer, ""
        if self._mode == "calls" and not rest.strip():
            return []
        if self._mode == "undecided" and self.check is not None:
            _, calls = parse_reply(rest, self.spec, self.fmt, self.check)
            if calls:
                self.calls.append(calls[0])
                return [("call", 0, calls[0])]
        if self._mode == "calls" and not self.calls:
            rest = self._held_separator + rest  # the calls never came: it was all text
        return [("text", rest)] if rest else []
