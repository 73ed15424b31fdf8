"""An append-only chat over one sequence: messages in, replies out, one KV cache throughout.

The conversation is rendered with the tokenizer's chat template (with the tools it offers,
`agent_kv.runtime.chat_rendering`) once per turn; what the cache already holds is a text
prefix of the new rendering, so each turn tokenizes and prefills only the new suffix. The pin
rules (`agent_kv.runtime.pin_rules`, the server's rules) pin tokens in the store (exempt from
eviction). A reply is kept as the text generated, calls included, so it renders as the cache
holds it.
"""

from __future__ import annotations

import bisect
import copy
from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.chat_engine import ChatEngine
from agent_kv.runtime.chat_layout import overlapping_tokens, place_messages, preamble_chars
from agent_kv.runtime.chat_rendering import render_chat
from agent_kv.runtime.pin_rules import PinRules
from agent_kv.runtime.reply_decoding import Generation
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.sequence import SequenceState
from agent_kv.runtime.tool_calls import Tool


@dataclass
class ForcedReply:
    """A teacher-forced reply (`Conversation.force_reply`), per token.

    Attributes:
        hits: whether each token was the most likely next token.
        logprobs: each token's log probability under the model and the policy's cache (nats).
        distributions: with `keep_distributions`, the next-token log-probabilities before
            each token, `[tokens, vocab]` float32 (nats); else None.
    """

    hits: list[bool]
    logprobs: list[float]
    distributions: torch.Tensor | None = field(default=None, repr=False)

    @property
    def greedy(self) -> bool:
        """Whether greedy decoding emits the whole reply."""
        return all(self.hits)


MESSAGE_FLAGS_ONLY = PinRules(roles=frozenset(), latest_observations=0)
"""`Conversation`'s default rules: pin the messages added with `pin` and nothing else."""


class Conversation:
    """One conversation whose whole history stays in one managed KV cache.

    Messages added wait for the next reply; then the chat is rendered once (with the
    generation prompt), only the text past what the cache holds is tokenized, each new
    message is placed in it (`agent_kv.runtime.chat_layout`), and the pin rules are applied
    turn by turn: a message the rules stop choosing (an observation superseded by a newer
    one) is released, and pattern matches in the new text are pinned.

    Args:
        engine: the engine (model, tokenizer, policy).
        sequence: an existing sequence to continue; a new empty one by default.
        tools: the tools offered throughout, rendered into the prompt (none by default).
        rules: what to pin (`PinRules`); by default only the messages added with `pin`.

    Raises:
        ConfigError: invalid `rules`.
    """

    def __init__(
        self,
        engine: ChatEngine,
        sequence: SequenceState | None = None,
        tools: tuple[Tool, ...] = (),
        rules: PinRules = MESSAGE_FLAGS_ONLY,
    ):
        rules.validate()
        self.engine = engine
        self.sequence = sequence or engine.new_sequence()
        self.tools = tools
        self.rules = rules
        self.messages: list[dict] = []
        self.spans: dict[int, tuple[int, int]] = {}  # message index -> token positions [start, end)
        self._rendered = ""  # template text the cache holds
        self._pinned: set[int] = set()  # messages the rules pin now
        self._text_pins: list[tuple[int, int]] = []  # token spans of pattern matches

    def add(self, role: str, content: str, pin: bool = False) -> None:
        """Append a message; it is placed and prefilled with the next reply.

        Args:
            role: "system", "user", "assistant" or "tool".
            content: the message text.
            pin: pin the message's tokens for good (what `PinRules` does with `"pin": True`).
        """
        self.messages.append({"role": role, "content": content} | ({"pin": True} if pin else {}))

    def _take_prompt(self) -> list[int]:
        """The new messages and the assistant header as the prompt to prefill: the chat
        rendered once, the text past what the cache holds tokenized once, each new message's
        token span recorded and the pin rules applied.

        Raises:
            ConfigError: the chat template re-rendered earlier turns differently (it cannot
                be extended append-only).
        """
        tokenizer = self.engine.tokenizer
        text = render_chat(tokenizer, self.messages, self.tools, generation_prompt=True)
        if not text.startswith(self._rendered):
            raise ConfigError(
                "the chat template re-rendered earlier turns differently; "
                "this template cannot be extended append-only"
            )
        new_from = len(self._rendered)
        encoded = tokenizer(text[new_from:], add_special_tokens=False, return_offsets_mapping=True)
        starts = [new_from + start for start, _ in encoded["offset_mapping"]]
        ends = [new_from + end for _, end in encoded["offset_mapping"]]
        base = self.sequence.store.seen_tokens
        placed = place_messages(tokenizer, self.messages, self.tools, text)
        first_new = len(self.spans)
        if first_new:  # the last message's footer, rendered only now, extends its span
            start, end = self.spans[first_new - 1]
            self.spans[first_new - 1] = (
                start,
                max(end, base + bisect.bisect_left(starts, placed[first_new - 1][1])),
            )
        for i in range(first_new, len(self.messages)):
            start, end = placed[i]
            self.spans[i] = (
                base + bisect.bisect_left(starts, max(start, new_from)),
                base + bisect.bisect_left(starts, end),
            )
        preamble = preamble_chars(tokenizer, self.tools, text) if new_from == 0 else 0
        self._apply_rules(text, preamble, new_from, starts, ends, base)
        self._rendered = text
        return list(encoded["input_ids"])

    def _apply_rules(self, text, preamble, new_from, starts, ends, base) -> None:
        """Pin what the rules choose now and release the messages they no longer choose, as
        `protected_spans` over the whole chat would: pattern matches (and the tools'
        description) in the new text `text[new_from:]`, whose tokens start at characters
        `starts` and end at `ends` from position `base`, are pinned for good."""
        pins = self.sequence.store.pins
        chosen = set(self.rules.pinned_messages(self.messages))
        for i in sorted(self._pinned - chosen):
            pins.unpin(*self.spans[i])
        for i in sorted(chosen):
            pins.pin(*self.spans[i])
        self._pinned = chosen
        for start, end in self.rules.text_spans(text, preamble, new_from):
            first, last = overlapping_tokens(starts, ends, start, end)
            if last > first:
                self._text_pins.append((base + first, base + last))
        for span in self._text_pins:
            pins.pin(*span)

    def prefill(self) -> torch.Tensor:
        """Prefill the queued messages and the assistant header now, as `reply` would first;
        returns the logits for the reply's first token, `[vocab]` float32. A `reply`,
        `force_reply` or `fork` after it starts from there."""
        prompt = self._take_prompt()
        return self.engine.feed(self.sequence, prompt) if prompt else self.sequence.last_logits

    def fork(self) -> Conversation:
        """An independent copy of this conversation: the sequence (store, pins, logits) is
        deep-copied, the engine shared. What one copy replies does not reach the other."""
        twin = Conversation(self.engine, copy.deepcopy(self.sequence), self.tools, self.rules)
        twin.messages = copy.deepcopy(self.messages)
        twin.spans = dict(self.spans)
        twin._rendered = self._rendered
        twin._pinned = set(self._pinned)
        twin._text_pins = list(self._text_pins)
        return twin

    def reply(self, params: SamplingParams, pin: bool = False) -> Generation:
        """Prefill the queued messages and the assistant header, then generate the reply.

        The reply is appended to the conversation as an assistant message (its full generated
        text, stop strings included, which is what the cache holds). With `pin`, its tokens
        are pinned from the first one decoded (the next `params.max_new_tokens` positions
        are pinned ahead, and those the reply did not reach are released after it).

        Raises:
            ConfigError: invalid sampling parameters (checked before anything is prefilled,
                so the queued messages stay queued).
        """
        params.validate()
        prompt = self._take_prompt()
        store = self.sequence.store
        reply_start = store.seen_tokens + len(prompt)
        if pin:
            store.pins.pin(reply_start, reply_start + params.max_new_tokens)
        generation = self.engine.generate(self.sequence, prompt, params)
        store = self.sequence.store  # a re-encoding engine replaced it (`Engine.reencode`)
        if pin:
            store.pins.unpin(store.seen_tokens, reply_start + params.max_new_tokens)
        self.messages.append({"role": "assistant", "content": generation.raw_text})
        self.spans[len(self.messages) - 1] = (reply_start, store.seen_tokens)
        self._rendered += generation.raw_text
        return generation

    def force_reply(
        self, text: str, keep_distributions: bool = False, pin: bool | int = False
    ) -> ForcedReply:
        """Teacher-force `text` as the next assistant reply: whether greedy decoding would
        have produced it, and how likely the model found it.

        The queued messages and the assistant header are prefilled as `reply` does; then the
        reply's tokens are fed one at a time, exactly as decoding feeds them (one forward
        call and one policy eviction per token, gated by that call's confidence), and each is
        compared with the logits before it. The cache ends holding the prompt followed by
        `text`, as if the model had replied `text`.

        Args:
            text: the reply (e.g. a reference action, "click [12]").
            keep_distributions: also return each step's next-token log-probabilities.
            pin: pin the reply's tokens (True), or its first `pin` tokens (a count; e.g. a
                note before the action), from before the first is fed.

        Returns:
            Per token of `text`: whether it was the most likely next token, and its log
            probability (nats).

        Raises:
            ValueError: `text` is empty.
            ContextOverflowError: the prompt or reply outgrows the model's context.
        """
        if not text:
            raise ValueError("force_reply needs a non-empty reply")
        prompt = self._take_prompt()
        store = self.sequence.store
        reply_start = store.seen_tokens + len(prompt)
        tokens = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        pinned = len(tokens) if pin is True else min(int(pin), len(tokens))
        if pinned:
            store.pins.pin(reply_start, reply_start + pinned)
        logits = self.engine.feed(self.sequence, prompt) if prompt else self.sequence.last_logits
        forced = ForcedReply([], [])
        distributions = []
        for token in tokens:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            forced.hits.append(int(logits.argmax()) == token)
            forced.logprobs.append(float(log_probs[token]))
            if keep_distributions:
                distributions.append(log_probs)
            logits = self.engine.feed(self.sequence, [token])
        if keep_distributions:
            forced.distributions = torch.stack(distributions)
        self.messages.append({"role": "assistant", "content": text})
        self.spans[len(self.messages) - 1] = (reply_start, self.sequence.store.seen_tokens)
        self._rendered += text
        return forced

    @property
    def text(self) -> str:
        """The template text the cache holds (plus messages queued for the next reply)."""
        return self._rendered
