"""Where each message lies in a rendered chat, from one rendering and one tokenization.

A chat template renders message `i` as a header (`<|im_start|>user\\n`), the message's
content, and a footer; a message's span is the text from the start of its header to the start
of the next message's header (the first message's span starts at 0, so it holds whatever the
template puts before it, the tools' description included; the last one's ends where the
generation prompt begins). That is where rendering the messages one prefix at a time would
place them, without rendering the chat once per message.

The template's headers and generation prompt are learnt once per tokenizer and tools offered
(`template_frame`: a few renderings of probe messages, cached). Each message is then found in
order as its header followed by its content as the template receives it. A chat the frame
does not explain (a template that trims or rewrites content, a header that depends on the
messages around it, such as consecutive tool results merged into one turn) is placed by
rendering each prefix instead, which also refuses a
template that re-renders earlier messages when one is added.
"""

from __future__ import annotations

import bisect
import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2

from agent_kv.errors import ConfigError
from agent_kv.runtime.chat.rendering import content_as_rendered, render_chat
from agent_kv.runtime.replies.tool_calls import Tool

PROBE_ROLES = ("system", "user", "assistant", "tool")
"""The roles whose headers `TemplateFrame` learns."""
_PROBE = "\x1fagent-kv-probe\x1f"
_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, IndexError, KeyError)


@dataclass(frozen=True)
class TemplateFrame:
    """What a chat template puts around messages, learnt from probe renderings.

    Attributes:
        headers: per role, the text rendered between the previous message's end and the
            content of a message of that role following a user message (a role the
            template refuses there is missing).
        generation_prompt: the text the generation prompt appends (the assistant header).
        tools_preamble: the tools' description when the template renders it before the
            first message as a message of its own; "" otherwise.
    """

    headers: dict[str, str]
    generation_prompt: str
    tools_preamble: str

    @classmethod
    def learn(cls, tokenizer, tools: Sequence[Tool] = ()) -> TemplateFrame:
        """The frame of `tokenizer`'s template with `tools` offered (about six renderings).

        Raises:
            ConfigError: the template renders a plain user message differently with the
                generation prompt than without it followed by the prompt (nothing can be
                placed by the frame then; `render_placed` falls back for every chat).
        """
        opener = {"role": "user", "content": "hello"}
        plain = render_chat(tokenizer, [opener], tools)
        prompted = render_chat(tokenizer, [opener], tools, generation_prompt=True)
        if not prompted.startswith(plain):
            raise ConfigError("the chat template's generation prompt rewrites the chat")
        headers = {}
        for role in PROBE_ROLES:
            probe = {"role": role, "content": _PROBE}
            try:
                text = render_chat(tokenizer, [opener, probe], tools)
            except _TEMPLATE_ERRORS:  # e.g. a template that refuses this role here
                continue
            if text.startswith(plain) and _PROBE in text:
                headers[role] = text[len(plain) : text.index(_PROBE)]
        preamble = _tools_preamble(tokenizer, tools) or _preamble_before(
            plain, opener["content"], headers.get("user")
        )
        return cls(headers, prompted[len(plain) :], preamble if tools else "")


def _tools_preamble(tokenizer, tools: Sequence[Tool]) -> str:
    """The tools' description rendered alone, when the template can render no message at all
    (`render_chat`'s generic format puts it in a system message of its own); "" otherwise."""
    if not tools:
        return ""
    try:
        return render_chat(tokenizer, [], tools)
    except _TEMPLATE_ERRORS:  # the template needs a message
        return ""


def _preamble_before(plain: str, content: str, user_header: str | None) -> str:
    """What a template that needs a message renders before a lone user message of `content`
    (`plain`): a system message of its own holding the tools' description (Qwen's templates:
    their default system prompt and the tools); "" when nothing precedes the message. The
    message's own header is `user_header` (what follows a message before a user message's
    content) less the footer the template ends a message with."""
    end = plain.rfind(content)
    if user_header is None or end < 0:
        return ""
    footer = plain[end + len(content) :]
    opening = user_header[len(footer) :] if user_header.startswith(footer) else user_header
    at = plain.rfind(opening + content)
    return plain[:at] if at > 0 else ""


@dataclass(frozen=True)
class RenderedChat:
    """A chat rendered with the generation prompt and tokenized, with each message's place.

    Attributes:
        text: the rendering (`render_chat(..., generation_prompt=True)`).
        token_ids: `tokenizer(text, add_special_tokens=False)`'s tokens.
        token_starts, token_ends: each token's character span `[start, end)` in `text`.
        message_chars: each message's character span `[start, end)` in `text` (module
            docstring).
        preamble_chars: the length of the tools' description the rendering opens with, when
            the template puts it before the first message as a message of its own; else 0.
    """

    text: str
    token_ids: list[int]
    token_starts: list[int]
    token_ends: list[int]
    message_chars: list[tuple[int, int]]
    preamble_chars: int = 0

    def token_span(self, start: int, end: int) -> tuple[int, int]:
        """The tokens `[first, last)` that overlap characters `[start, end)` of `text`."""
        return overlapping_tokens(self.token_starts, self.token_ends, start, end)


def overlapping_tokens(starts: list[int], ends: list[int], start: int, end: int) -> tuple[int, int]:
    """The tokens `[first, last)` overlapping characters `[start, end)`, of tokens whose
    character spans are `[starts[i], ends[i])` in order (empty when `last <= first`)."""
    return bisect.bisect_right(ends, start), bisect.bisect_left(starts, end)


def starting_tokens(starts: list[int], start: int, end: int) -> tuple[int, int]:
    """The tokens `[first, last)` whose first character lies in characters `[start, end)`, of
    tokens starting at characters `starts` in order: how a message's tokens are counted."""
    return bisect.bisect_left(starts, start), bisect.bisect_left(starts, end)


_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {tools: frame}
_FRAMES_LOCK = threading.Lock()


def template_frame(tokenizer, tools: Sequence[Tool] = ()) -> TemplateFrame | None:
    """`tokenizer`'s template frame with `tools` offered, learnt on first use and kept while the
    tokenizer lives; None when the template has none (`TemplateFrame.learn` refused it)."""
    key = json.dumps([tool.openai() for tool in tools], sort_keys=True)
    with _FRAMES_LOCK:
        frames = _FRAMES.setdefault(tokenizer, {})
        if key not in frames:
            try:
                frames[key] = TemplateFrame.learn(tokenizer, tools)
            except ConfigError:
                frames[key] = None
        return frames[key]


def render_placed(
    tokenizer,
    messages: list[dict],
    tools: Sequence[Tool] = (),
    previous: RenderedChat | None = None,
) -> RenderedChat:
    """`messages` rendered once with the generation prompt, tokenized once (a fast tokenizer,
    for the offsets; past `previous` only, when given and its text starts the rendering:
    `placed_chat`), and each message placed (module docstring).

    Raises:
        ConfigError: the chat template re-renders earlier messages when one is added, so
            messages have no fixed place.
        jinja2 errors and ValueError from the template, as `render_chat` raises them.
    """
    text = render_chat(tokenizer, messages, tools, generation_prompt=True)
    return placed_chat(tokenizer, messages, tools, text, previous)


def placed_chat(
    tokenizer,
    messages: list[dict],
    tools: Sequence[Tool],
    text: str,
    previous: RenderedChat | None = None,
) -> RenderedChat:
    """`text`, the rendering of `messages` with the generation prompt, tokenized once (a fast
    tokenizer, for the offsets) and each message placed in it. When `previous` (an earlier
    turn's chat) is a text prefix of `text`, its tokens before its last clean split
    (`clean_split_tokens`: the `<|im_start|>` of its generation prompt) are kept and
    only the text from there is tokenized, which gives the tokens of tokenizing `text` whole.

    Raises:
        ConfigError: the chat template re-renders earlier messages when one is added.
    """
    kept = 0
    if previous is not None and text.startswith(previous.text):
        clean = clean_split_tokens(tokenizer)
        ids = previous.token_ids
        kept = next((i for i in range(len(ids) - 1, -1, -1) if ids[i] in clean), 0)
    new_from = previous.token_starts[kept] if kept else 0
    encoded = tokenizer(text[new_from:], add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    return RenderedChat(
        text=text,
        token_ids=(previous.token_ids[:kept] if kept else []) + list(encoded["input_ids"]),
        token_starts=(previous.token_starts[:kept] if kept else [])
        + [new_from + start for start, _ in offsets],
        token_ends=(previous.token_ends[:kept] if kept else [])
        + [new_from + end for _, end in offsets],
        message_chars=place_messages(tokenizer, messages, tools, text),
        preamble_chars=preamble_chars(tokenizer, tools, text),
    )


def clean_split_tokens(tokenizer) -> frozenset[int]:
    """The tokens where a text may be split and tokenized part by part as it tokenizes whole:
    the tokenizer's added tokens (the chat template's `<|im_start|>`, `<|im_end|>`), which are
    cut out of the text before its pre-tokenization, so no merge crosses them, that strip no
    whitespace beside them (`lstrip`, `rstrip` off)."""
    return frozenset(
        token_id
        for token_id, added in tokenizer.added_tokens_decoder.items()
        if not added.lstrip and not added.rstrip
    )


def place_messages(
    tokenizer, messages: list[dict], tools: Sequence[Tool], text: str
) -> list[tuple[int, int]]:
    """Each message's character span in `text`, the messages' rendering with the generation
    prompt (module docstring): through the template's frame, or by rendering each prefix
    where the frame does not explain `text`.

    Raises:
        ConfigError: the chat template re-renders earlier messages when one is added.
    """
    frame = template_frame(tokenizer, tools)
    spans = None if frame is None else _place(text, messages, tools, frame, tokenizer)
    return message_char_spans(tokenizer, messages, tools) if spans is None else spans


def preamble_chars(tokenizer, tools: Sequence[Tool], text: str) -> int:
    """The length of the tools' description `text` opens with when the template renders it
    before the first message as a message of its own (`TemplateFrame.tools_preamble`); else
    0."""
    frame = template_frame(tokenizer, tools)
    preamble = frame.tools_preamble if frame is not None else _tools_preamble(tokenizer, tools)
    return len(preamble) if preamble and text.startswith(preamble) else 0


def _place(
    text: str, messages: list[dict], tools: Sequence[Tool], frame: TemplateFrame, tokenizer
) -> list[tuple[int, int]] | None:
    """Each message's character span in `text` found through `frame`; None where the frame
    does not explain the rendering."""
    if not messages or not text.endswith(frame.generation_prompt):
        return None
    contents = content_as_rendered(tokenizer, messages, tools)
    starts, cursor = [], 0
    for i, (message, content) in enumerate(zip(messages, contents, strict=True)):
        header = "" if i == 0 else frame.headers.get(message["role"])
        if header is None:
            return None
        found = text.find(header + content, cursor)
        if found < 0:
            return None
        starts.append(0 if i == 0 else found)
        cursor = found + len(header) + len(content)
    ends = [*starts[1:], len(text) - len(frame.generation_prompt)]
    if ends[-1] < cursor:
        return None
    return list(zip(starts, ends, strict=True))


def message_char_spans(
    tokenizer, messages: list[dict], tools: Sequence[Tool] = ()
) -> list[tuple[int, int]]:
    """Each message's character span in the chat's rendering with the generation prompt,
    found by rendering each prefix of the chat (one rendering per message).

    Raises:
        ConfigError: the chat template does not render the conversation append-only (each
            message's rendering a prefix of the next), so messages have no fixed place.
    """
    spans, previous = [], ""
    for i in range(len(messages)):
        text = render_chat(tokenizer, messages[: i + 1], tools)
        if not text.startswith(previous):
            raise ConfigError(
                "the model's chat template re-renders earlier messages when one is added; "
                "message spans cannot be pinned"
            )
        spans.append((len(previous), len(text)))
        previous = text
    return spans
