"""How a model writes a tool call, learnt from its chat template: the markers around a call,
the whitespace the template puts between them, and which markers are single added tokens.

Tool calls are read and written in the Hermes layout: each call is a JSON body
`{"name": NAME, "arguments": ARGS}` between an opening and a closing marker. Templates differ
in the markers' whitespace, in how calls are joined and in whether the markers are added
tokens of the vocabulary: Qwen2.5's template writes

    <tool_call>\\n{"name": "get_weather", "arguments": {"city": "Paris"}}\\n</tool_call>

with `<tool_call>` and `</tool_call>` single added tokens (151657 and 151658), calls joined by
a newline, and a reply's text put before its calls with a newline. A grammar must name those
tokens (llguidance's `<[id]>`), not spell their bytes: the model's own call-opening token is
one token, and its bytes tokenize otherwise.

`tool_call_format(tokenizer)` learns the layout once per tokenizer:

- a template that takes tools (its source reads a `tools` variable) is probed: a conversation
  ending in an assistant turn of one call, of two calls, and of text then a call, rendered
  through the template, gives the markers and separators, and a fourth render (nested and
  non-ASCII arguments) must equal this module's own render of the same call, or the format is
  refused (`ToolFormatError`): the template writes calls some other way (Llama 3.1's bare
  `{"name", "parameters"}`, Mistral's `[TOOL_CALLS][...]`), which agent_kv does not read;
- a template without tools gets the generic format of `agent_kv.runtime.chat.rendering`:
  `<tool_call>BODY</tool_call>` (as added tokens when the vocabulary has them), joined with
  nothing.
"""

from __future__ import annotations

import json
import re
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

from agent_kv.errors import ToolFormatError

GENERIC_OPEN = "<tool_call>"
GENERIC_CLOSE = "</tool_call>"
CALL_BODY_HEAD = '{{"name": {name}, "arguments": '
"""The start of a call's JSON body, before the arguments (`json.dumps` separators)."""


@dataclass(frozen=True)
class ToolCallFormat:
    """The layout of a model's tool calls (the Hermes body between markers).

    A reply of calls is `open BODY close`, repeated with `separator` between calls; a reply
    of text then calls is `TEXT text_separator CALLS`.

    Attributes:
        open: the text before a call's body, its marker and whitespace ("<tool_call>\\n").
        close: the text after a call's body ("\\n</tool_call>").
        marker: the opening marker alone ("<tool_call>"): text without it is not a call.
        separator: the text between two calls ("\\n"; "" in the generic format).
        text_separator: the text between a reply's text and its first call; None when the
            template writes no text beside calls (Hermes 3's drops it).
        added_tokens: the vocabulary's added tokens that occur in `open`, `close` or
            `separator`: their text -> token id (a grammar names them as tokens).
        parallel: the template writes several calls in one reply.
    """

    open: str
    close: str
    marker: str
    separator: str
    text_separator: str | None
    added_tokens: tuple[tuple[str, int], ...] = ()
    parallel: bool = True

    @property
    def text_before_calls(self) -> bool:
        """Whether a reply may put text before its calls: only where the template writes text
        beside calls and the opening marker is an added token, so a call's start is one
        token no text can spell."""
        marker_token = any(self.marker == text for text, _ in self.added_tokens)
        return self.text_separator is not None and marker_token

    def render_call(self, name: str, arguments: str) -> str:
        """One call as the model writes it; `arguments` is the arguments' JSON text, kept as
        given so a generated call renders as generated."""
        head = CALL_BODY_HEAD.format(name=json.dumps(name, ensure_ascii=False))
        return f"{self.open}{head}{arguments}}}{self.close}"

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """`(name, arguments)` calls joined by `separator`."""
        return self.separator.join(self.render_call(name, arguments) for name, arguments in calls)

    def render_reply(self, text: str, calls: Sequence[tuple[str, str]]) -> str:
        """A reply of `text` and then `calls` (either may be empty)."""
        if not calls:
            return text
        joined = self.render_calls(calls)
        return f"{text}{self.text_separator or ''}{joined}" if text else joined

    def lark(self, text: str) -> str:
        """`text` as a sequence of Lark items: each added token of `added_tokens` as the token
        (`<[id]>`), the rest as string literals; "" for empty text."""
        tokens = dict(self.added_tokens)
        if not tokens:
            return json.dumps(text) if text else ""
        pattern = "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True))
        items = []
        for piece in re.split(f"({pattern})", text):
            if piece in tokens:
                items.append(f"<[{tokens[piece]}]>")
            elif piece:
                items.append(json.dumps(piece))
        return " ".join(items)


def template_source(tokenizer) -> str:
    """The tokenizer's chat template text (the default one of named templates; "" for none)."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default", "")
    return template or ""


def template_takes_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template reads a `tools` variable (its own tool format)."""
    return "tools" in template_source(tokenizer)


_FORMATS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> format | error
_FORMATS_LOCK = threading.Lock()


def tool_call_format(tokenizer) -> ToolCallFormat:
    """`tokenizer`'s tool-call format (see the module docstring), learnt on first use and kept
    while the tokenizer lives.

    Raises:
        ToolFormatError: the template takes tools but writes calls in a layout this module
            does not read (the message says what the probe found).
    """
    with _FORMATS_LOCK:
        found = _FORMATS.get(tokenizer)
    if found is None:
        try:
            found = _learn(tokenizer) if template_takes_tools(tokenizer) else _generic(tokenizer)
        except ToolFormatError as err:
            found = err
        with _FORMATS_LOCK:
            _FORMATS[tokenizer] = found
    if isinstance(found, ToolFormatError):
        raise ToolFormatError(str(found))
    return found


def _added_tokens(tokenizer, *texts: str) -> tuple[tuple[str, int], ...]:
    """The tokenizer's added tokens whose text occurs in any of `texts`: `(text, id)` pairs."""
    added = {token.content: token_id for token_id, token in tokenizer.added_tokens_decoder.items()}
    return tuple(
        sorted((t, i) for t, i in added.items() if len(t) > 1 and any(t in s for s in texts))
    )


def _generic(tokenizer) -> ToolCallFormat:
    """The generic format (templates without tools), once the template renders the roles it
    needs: a system message (the tools' list), an assistant turn (the calls) and a `tool`
    message (a result).

    Raises:
        ToolFormatError: the template refuses one of those roles (Gemma's has no system role).
    """
    chat = [
        {"role": "system", "content": "Probe tools."},
        {"role": "user", "content": "Probe question."},
        {"role": "assistant", "content": f"{GENERIC_OPEN}{{}}{GENERIC_CLOSE}"},
        {"role": "tool", "content": "Probe result."},
    ]
    try:
        tokenizer.apply_chat_template(chat, tokenize=False)
    except Exception as err:  # the template's own refusal (jinja2 or ValueError)
        raise ToolFormatError(
            f"has no tool format and cannot render the generic one's roles: {err}"
        ) from None
    tokens = _added_tokens(tokenizer, GENERIC_OPEN, GENERIC_CLOSE)
    return ToolCallFormat(GENERIC_OPEN, GENERIC_CLOSE, GENERIC_OPEN, "", "", tokens)


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool",
        "description": "Probe.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
    },
}
_PROBE_ARGUMENTS = ({"q": "one"}, {"q": "two"})
_CHECK_ARGUMENTS = {"q": 'é "x" 中', "n": [1, 2.5, {"k": None}], "b": True}
_PROBE_TEXT = "Probe text."


def _assistant(content: str, arguments: Sequence[dict]) -> dict:
    """An assistant message of `content` calling the probe tool once per `arguments`."""
    calls = [
        {
            "id": f"call_probe{i}",
            "type": "function",
            "function": {"name": "probe_tool", "arguments": args},
        }
        for i, args in enumerate(arguments)
    ]
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _reply_text(tokenizer, assistant: dict) -> str:
    """What the template writes for `assistant` after the generation prompt, in a chat where
    a user message follows it (as a call's turn is followed by its result: a template that
    writes the last turn otherwise, Qwen3's empty thinking block, is read as in history),
    its end of turn and the next message (what follows the text of a plain reply) removed.

    Raises:
        ToolFormatError: the render does not start with the generation prompt, or does not
            end as a plain reply's turn does.
    """
    user = {"role": "user", "content": "Probe question."}
    after = {"role": "user", "content": "Probe follow-up."}

    def render(messages, prompt=False):
        return tokenizer.apply_chat_template(
            messages, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=prompt
        )

    prompt = render([user], prompt=True)
    plain = render([user, {"role": "assistant", "content": _PROBE_TEXT}, after])
    if not plain.startswith(prompt) or _PROBE_TEXT not in plain[len(prompt) :]:
        raise ToolFormatError("its assistant turn does not follow its generation prompt")
    end = plain[len(prompt) :].split(_PROBE_TEXT, 1)[1]
    full = render([user, assistant, after])
    if not full.startswith(prompt) or not full.endswith(end):
        raise ToolFormatError("a turn with tool calls does not follow its generation prompt")
    return full[len(prompt) : len(full) - len(end)]


def _learn(tokenizer) -> ToolCallFormat:
    """Probe the template (see the module docstring).

    Raises:
        ToolFormatError: the template's calls are not Hermes bodies between markers, or its
            renders do not follow one layout.
    """
    try:
        one = _reply_text(tokenizer, _assistant("", _PROBE_ARGUMENTS[:1]))
        body = CALL_BODY_HEAD.format(name='"probe_tool"') + json.dumps(_PROBE_ARGUMENTS[0]) + "}"
        if one.count(body) != 1:
            raise ToolFormatError(f"its call is not a Hermes body {{'name', 'arguments'}}: {one!r}")
        open_, close = one.split(body)
        marker = open_.strip()
        if not marker or not close.strip():
            raise ToolFormatError(f"its call has no opening or closing marker: {one!r}")
        texted = _reply_text(tokenizer, _assistant(_PROBE_TEXT, _PROBE_ARGUMENTS[:1]))
        text_separator = None  # the template drops text beside calls
        if texted.startswith(_PROBE_TEXT) and texted.endswith(one):
            text_separator = texted[len(_PROBE_TEXT) : len(texted) - len(one)]
        elif texted != one:
            raise ToolFormatError(
                f"its reply of text and a call is not text then the call: {texted!r}"
            )
        parallel, separator = _two_calls(tokenizer, one)
        tokens = _added_tokens(tokenizer, open_, close, separator)
        found = ToolCallFormat(open_, close, marker, separator, text_separator, tokens, parallel)
        check = _reply_text(tokenizer, _assistant("", [_CHECK_ARGUMENTS]))
    except ToolFormatError:
        raise
    except Exception as err:  # the template's own refusal (jinja2 or ValueError)
        raise ToolFormatError(f"its template cannot render a tool call: {err}") from None
    ours = found.render_call("probe_tool", json.dumps(_CHECK_ARGUMENTS, ensure_ascii=False))
    if check != ours:
        raise ToolFormatError(
            f"its call renders as {check!r}, where the Hermes layout gives {ours!r}"
        )
    return found


def _two_calls(tokenizer, one: str) -> tuple[bool, str]:
    """Whether the template writes two calls in one turn, and the text between them."""
    try:
        two = _reply_text(tokenizer, _assistant("", _PROBE_ARGUMENTS))
    except ToolFormatError:
        raise
    except Exception:  # a template that refuses a second call (Llama 3.1's raises)
        return False, ""
    second = one.replace(json.dumps(_PROBE_ARGUMENTS[0]), json.dumps(_PROBE_ARGUMENTS[1]))
    if not two.startswith(one) or not two.endswith(second):
        raise ToolFormatError(f"its two calls are not one call after the other: {two!r}")
    return True, two[len(one) : len(two) - len(second)]
