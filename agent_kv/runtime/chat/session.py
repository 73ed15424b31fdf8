"""One chat over one sequence: its messages, where each lies in the cache (token spans), and
the pins its rules choose, kept turn by turn. The session object behind every front end: the
agent's `Conversation` and the server's and LangChain's turns (`ChatService`).

A turn renders the whole chat once, with the generation prompt. When the rendering extends
the text the cache holds (messages were appended, as an agent does), only the new text is
tokenized, only the new messages are placed (`agent_kv.runtime.chat.layout`), and the pin
rules (`agent_kv.runtime.chat.pin_rules`) are applied turn by turn: a message the rules stop
choosing (an observation superseded by a newer one) is released, and pattern matches in the
new text are pinned. When it does not (a stateless client resent a chat it changed, or a
template re-rendered earlier turns), the chat is tokenized whole and matched token by token
against the cache's history (`agent_kv.runtime.chat.history_sync`: reused, cut back or rebuilt),
and every message is placed and every pin chosen again. Either way the chat is rendered once
and tokenized once per turn.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent_kv.kv.kv_figures import KVFigures
from agent_kv.runtime.chat.history_sync import HistorySync, prepare_history
from agent_kv.runtime.chat.layout import (
    RenderedChat,
    clean_split_tokens,
    overlapping_tokens,
    place_messages,
    placed_chat,
    preamble_chars,
    starting_tokens,
)
from agent_kv.runtime.chat.pin_rules import ChatPins, PinRules, apply_pins
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.tool_calls import Tool

MESSAGE_FLAGS_ONLY = PinRules(roles=frozenset(), latest_observations=0)
"""The default rules of a `ChatSession`: pin the messages flagged `"pin": True` and nothing
else."""


@dataclass(frozen=True)
class TurnPrompt:
    """What one turn feeds the model.

    Attributes:
        token_ids: the prompt's tokens the cache does not hold yet (to prefill).
        sync: how the chat met the cache's history (`HistorySync`; "none" when the chat
            extended it).
        prompt_tokens: tokens of the whole chat as rendered for this turn.
    """

    token_ids: list[int]
    sync: HistorySync
    prompt_tokens: int


@dataclass(frozen=True)
class _NewText:
    """The tokens of `text[new_from:]`, the part of a turn's rendering the cache does not hold:
    ids, and character spans `[starts[i], ends[i])` in `text`, from token position `base`."""

    text: str
    new_from: int
    ids: list[int]
    starts: list[int]
    ends: list[int]
    base: int
    preamble_chars: int


class ChatSession:
    """A chat whose whole history stays in one managed KV cache (module docstring).

    Args:
        sequence: the sequence holding the cache (a new one's, or one continued).
        tools: the tools offered, rendered into the prompt.
        rules: what to pin (`PinRules`); by default the messages flagged `"pin": True`.

    Attributes:
        messages: the chat, `{"role", "content"}` dicts (optionally `"pin": True`), those
            added since the last turn included.
        spans: per message placed, its token positions `[start, end)` in the cache (a
            message's footer, rendered with the next turn, extends its span then).
        rendered: the template text the cache holds.

    Raises:
        ConfigError: invalid `rules`.
    """

    def __init__(
        self,
        sequence: SequenceState,
        tools: Sequence[Tool] = (),
        rules: PinRules = MESSAGE_FLAGS_ONLY,
    ):
        rules.validate()
        self.sequence = sequence
        self.tools = tuple(tools)
        self.rules = rules
        self.messages: list[dict] = []
        self.spans: list[tuple[int, int]] = []
        self.rendered = ""
        self._pinned: set[int] = set()  # messages the rules pin now
        self._text_pins: list[tuple[int, int]] = []  # token spans of pattern matches
        self._observation_pins: dict[int, list[tuple[int, int]]] = {}  # latest pages' parts
        self._reply_pins: list[tuple[int, int]] = []  # token spans of replies pinned
        self._pinned_replies: dict[int, int] = {}  # reply message -> its characters pinned

    def add(self, message: dict) -> None:
        """Append `message` (`{"role", "content"}`, optionally `"pin": True`); it is placed
        and pinned with the next turn (`take_prompt`)."""
        self.messages.append(message)

    def take_prompt(self, tokenizer, fresh: Callable[[], SequenceState]) -> TurnPrompt:
        """The next turn's prompt: the chat rendered once with the generation prompt; when it
        extends `rendered` (the first turn's always does) at a clean split (`_splits_cleanly`:
        a reply's footer starts the new text), only the new text is tokenized and follows what
        the sequence holds, else the chat is tokenized whole and met with the history
        (`take_chat`; a sequence rebuilt from scratch is made by `fresh`). The new messages are
        placed and the pins applied before anything is fed.

        Raises:
            ConfigError: the chat template re-renders earlier messages when one is added (no
                message has a fixed place).
        """
        text = render_chat(tokenizer, self.messages, self.tools, generation_prompt=True)
        if not text.startswith(self.rendered):
            return self.take_chat(placed_chat(tokenizer, self.messages, self.tools, text), fresh)
        new_from = len(self.rendered)
        encoded = tokenizer(text[new_from:], add_special_tokens=False, return_offsets_mapping=True)
        offsets = encoded["offset_mapping"]
        ids = list(encoded["input_ids"])
        if new_from and ids and not self._splits_cleanly(tokenizer, ids[0], offsets[0][0]):
            return self.take_chat(placed_chat(tokenizer, self.messages, self.tools, text), fresh)
        base = self.sequence.store.seen_tokens
        new = _NewText(
            text=text,
            new_from=new_from,
            ids=ids,
            starts=[new_from + start for start, _ in offsets],
            ends=[new_from + end for _, end in offsets],
            base=base,
            preamble_chars=preamble_chars(tokenizer, self.tools, text) if new_from == 0 else 0,
        )
        self._place(new, place_messages(tokenizer, self.messages, self.tools, text))
        return TurnPrompt(new.ids, HistorySync(base, len(new.ids), "none"), base + len(new.ids))

    def _splits_cleanly(self, tokenizer, first_new: int, first_offset: int) -> bool:
        """Whether the new text, whose first token is `first_new` at character `first_offset`
        of it, tokenizes after what the cache holds as the whole rendering does: the split
        lies at a token no merge crosses (`clean_split_tokens`), the new text's first or the
        cache's last (a reply's `<|im_end|>` follows it; content added after the generation
        prompt, which ends in a newline, does not)."""
        clean = clean_split_tokens(tokenizer)
        held = self.sequence.token_ids
        return (first_new in clean and first_offset == 0) or bool(held and held[-1] in clean)

    def take_chat(
        self,
        chat: RenderedChat,
        fresh: Callable[[], SequenceState],
        messages: list[dict] | None = None,
        pins: ChatPins | None = None,
    ) -> TurnPrompt:
        """The next turn's prompt from a chat already rendered and tokenized whole
        (`placed_chat`; a stateless client's whole conversation, `messages`, which replace
        the session's when given): its tokens are met with the history (`prepare_history`: the
        cache is cut back where they diverge, or rebuilt on `fresh()`), every message is
        placed and every pin chosen again (a pinned reply the chat still has is pinned again,
        its same characters: `add_reply`).

        Args:
            pins: the rules' choice over `chat`, when the caller already made it
                (`ChatPins.choose`; a server turn sizes its KV reservation by it); None: chosen
                here.
        """
        if messages is not None:
            self.messages = list(messages)
        pins = pins or ChatPins.choose(chat, self.messages, self.rules)
        sync = prepare_history(self.sequence, chat.token_ids, fresh)
        self.spans = list(pins.message_spans)
        self._pinned = set(pins.messages)
        self._text_pins = list(pins.text)
        self._observation_pins = {i: list(spans) for i, spans in pins.observations.items()}
        self._reply_pins = self._replies_pinned_in(chat)
        self.rendered = chat.text
        apply_pins(self.sequence.store, [*pins.spans(), *self._reply_pins])
        return TurnPrompt(chat.token_ids[sync.reused_tokens :], sync, len(chat.token_ids))

    def _replies_pinned_in(self, chat: RenderedChat) -> list[tuple[int, int]]:
        """The token spans of `chat` holding the characters each pinned reply keeps pinned
        (`add_reply`), from the start of its content, for the replies `chat` still has."""
        spans = []
        for index, chars in sorted(self._pinned_replies.items()):
            if index >= len(self.messages):
                continue
            content = self.messages[index]["content"]
            at = chat.text.find(content, chat.message_chars[index][0])
            if at >= 0:
                spans.append(chat.token_span(at, at + chars))
        return spans

    def _place(self, new: _NewText, placed: list[tuple[int, int]]) -> None:
        """Record the token span of each message not placed yet (and the footer the last
        placed one gained) from `placed`, every message's character span in `new.text`; then
        apply the rules."""
        if self.spans:  # the last message's footer, rendered only now, extends its span
            start, end = self.spans[-1]
            footer_end = new.base + bisect.bisect_left(new.starts, placed[len(self.spans) - 1][1])
            self.spans[-1] = (start, max(end, footer_end))
        for start, end in placed[len(self.spans) :]:
            first, last = starting_tokens(new.starts, max(start, new.new_from), end)
            self.spans.append((new.base + first, new.base + last))
        self._apply_rules(new, placed)
        self.rendered = new.text

    def _apply_rules(self, new: _NewText, placed: list[tuple[int, int]]) -> None:
        """Pin what the rules choose now and release the messages they no longer choose, as
        `ChatPins.choose` over the whole chat would; pattern matches (and the tools'
        description) in the new text are pinned for good; with `observation_patterns`, their
        matches in a latest observation (`placed`: each message's characters in `new.text`)
        are pinned while it is one of the latest."""
        pins = self.sequence.store.pins
        if self.rules.observation_patterns:
            self._place_observation_pins(new, placed)
        chosen = set(self.rules.pinned_messages(self.messages))
        for i in sorted(self._pinned - chosen):
            pins.unpin(*self.spans[i])
        for i in sorted(chosen):
            pins.pin(*self.spans[i])
        self._pinned = chosen
        for start, end in self.rules.text_spans(new.text, new.preamble_chars, new.new_from):
            first, last = overlapping_tokens(new.starts, new.ends, start, end)
            if last > first:
                self._text_pins.append((new.base + first, new.base + last))
        for span in [*self._text_pins, *self._reply_pins]:
            pins.pin(*span)
        for spans in self._observation_pins.values():
            for span in spans:
                pins.pin(*span)

    def _place_observation_pins(self, new: _NewText, placed: list[tuple[int, int]]) -> None:
        """Release the parts pinned of observations no longer among the latest, and find the
        token spans of `observation_patterns`' matches in each new latest one (placed in the
        new text)."""
        latest = set(self.rules.latest_observations_of(self.messages))
        for index in sorted(set(self._observation_pins) - latest):
            for span in self._observation_pins.pop(index):
                self.sequence.store.pins.unpin(*span)
        for index in sorted(latest - set(self._observation_pins)):
            start, end = placed[index]
            spans = []
            for first_char, end_char in self.rules.observation_spans(
                new.text, (max(start, new.new_from), end)
            ):
                first, last = overlapping_tokens(new.starts, new.ends, first_char, end_char)
                if last > first:
                    spans.append((new.base + first, new.base + last))
            self._observation_pins[index] = spans

    def pin_reply(self, start: int, end: int) -> None:
        """Pin token positions `[start, end)` ahead of a reply being decoded (they may lie past
        the tokens seen); `add_reply` says which of them the reply keeps pinned."""
        self.sequence.store.pins.pin(start, end)

    def release_reply_tail(self, reply_end: int, pinned_end: int) -> None:
        """Release positions `[reply_end, pinned_end)` pinned ahead for a reply that ended
        before them (`pin_reply`)."""
        self.sequence.store.pins.unpin(reply_end, pinned_end)

    def add_reply(self, tokenizer, text: str, start: int, pinned_tokens: int = 0) -> None:
        """Append the reply the cache now holds from position `start` to its last token:
        `text` is what was fed (the generated text, stop strings included), as the template
        renders the assistant message. Its first `pinned_tokens` tokens stay pinned (also when
        a later turn rebuilds the chat: `take_chat` pins the same characters of the message
        again), and the rules' pattern matches in it are pinned, as in any new text."""
        seen = self.sequence.store.seen_tokens
        index = len(self.messages)
        self.messages.append({"role": "assistant", "content": text})
        self.spans.append((start, seen))
        self.rendered += text
        fed = self.sequence.token_ids[start:seen]
        if pinned_tokens:
            pinned_end = min(start + pinned_tokens, seen)
            self._reply_pins.append((start, pinned_end))
            self._pinned_replies[index] = len(tokenizer.decode(fed[: pinned_end - start]))
        matches = self.rules.text_spans(text)
        if matches:
            encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            starts = [first for first, _ in encoded["offset_mapping"]]
            ends = [last for _, last in encoded["offset_mapping"]]
            exact = list(encoded["input_ids"]) == fed  # else the whole reply, to be safe
            for match_start, match_end in matches:
                first, last = overlapping_tokens(starts, ends, match_start, match_end)
                span = (start + first, start + last) if exact else (start, seen)
                if span[1] > span[0]:
                    self._text_pins.append(span)
                    self.sequence.store.pins.pin(*span)

    def figures(self) -> KVFigures:
        """What the session's KV cache holds now (`KVFigures`)."""
        return KVFigures.of(self.sequence.store)

    def fork(self, sequence: SequenceState | None = None) -> ChatSession:
        """An independent copy of this chat over `sequence` (default: a deep copy of this
        one's), with the same messages, spans and pins."""
        twin = ChatSession(sequence or copy.deepcopy(self.sequence), self.tools, self.rules)
        twin.messages = copy.deepcopy(self.messages)
        twin.spans = list(self.spans)
        twin.rendered = self.rendered
        twin._pinned = set(self._pinned)
        twin._text_pins = list(self._text_pins)
        twin._observation_pins = {i: list(spans) for i, spans in self._observation_pins.items()}
        twin._reply_pins = list(self._reply_pins)
        twin._pinned_replies = dict(self._pinned_replies)
        return twin
