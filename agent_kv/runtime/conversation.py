"""An append-only chat over one sequence: messages in, replies out, one KV cache throughout.

The conversation is rendered with the tokenizer's chat template (with the tools it offers,
`agent_kv.runtime.chat_rendering`); what the cache already holds is a text prefix of the new
rendering, so each turn prefills only the new suffix. Messages flagged `pin` have their
tokens pinned in the store (exempt from eviction). A reply is kept as the text generated,
calls included, so it renders as the cache holds it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.chat_rendering import render_chat
from agent_kv.runtime.engine import Engine, Generation
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.sequence import Sequence
from agent_kv.runtime.tool_calls import Tool


@dataclass
class _Pending:
    ids: list[int]
    pin: bool
    message: int | None  # index in `messages`; None for the assistant header


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


class Conversation:
    """One conversation whose whole history stays in one managed KV cache.

    Args:
        engine: the engine (model, tokenizer, policy).
        sequence: an existing sequence to continue; a new empty one by default.
        tools: the tools offered throughout, rendered into the prompt (none by default).
    """

    def __init__(
        self, engine: Engine, sequence: Sequence | None = None, tools: tuple[Tool, ...] = ()
    ):
        self.engine = engine
        self.sequence = sequence or engine.new_sequence()
        self.tools = tools
        self.messages: list[dict[str, str]] = []
        self.spans: dict[int, tuple[int, int]] = {}  # message index -> token positions [start, end)
        self._rendered = ""  # template text of everything queued or cached
        self._pending: list[_Pending] = []

    def _render(self, generation_prompt: bool) -> str:
        return render_chat(self.engine.tokenizer, self.messages, self.tools, generation_prompt)

    def _queue_delta(self, rendered: str, pin: bool, message: int | None) -> None:
        if not rendered.startswith(self._rendered):
            raise ConfigError(
                "the chat template re-rendered earlier turns differently; "
                "this template cannot be extended append-only"
            )
        delta = rendered[len(self._rendered) :]
        if delta:
            ids = self.engine.tokenizer(delta, add_special_tokens=False)["input_ids"]
            self._pending.append(_Pending(ids, pin, message))
        self._rendered = rendered

    def add(self, role: str, content: str, pin: bool = False) -> None:
        """Append a message; its tokens are prefilled with the next `reply`.

        Args:
            role: "system", "user", "assistant" or "tool".
            content: the message text.
            pin: pin the message's tokens (never evicted).
        """
        self.messages.append({"role": role, "content": content})
        self._queue_delta(self._render(generation_prompt=False), pin, len(self.messages) - 1)

    def unpin_message(self, index: int) -> None:
        """Release the pin on message `index` (already prefilled); its tokens become evictable.

        Raises:
            KeyError: the message has not been prefilled yet.
        """
        start, end = self.spans[index]
        self.sequence.store.pins.unpin(start, end)

    def _take_prompt(self) -> list[int]:
        """Queue the assistant header, pin and place the queued messages' tokens, and return
        them all as the prompt to prefill (the queue is emptied)."""
        self._queue_delta(self._render(generation_prompt=True), pin=False, message=None)
        store = self.sequence.store
        prompt: list[int] = []
        for item in self._pending:
            start = store.seen_tokens + len(prompt)
            span = (start, start + len(item.ids))
            if item.message is not None:
                self.spans[item.message] = span
            if item.pin:
                store.pins.pin(*span)
            prompt.extend(item.ids)
        self._pending.clear()
        return prompt

    def prefill(self) -> torch.Tensor:
        """Prefill the queued messages and the assistant header now, as `reply` would first;
        returns the logits for the reply's first token, `[vocab]` float32. A `reply`,
        `force_reply` or `fork` after it starts from there."""
        prompt = self._take_prompt()
        return self.engine.feed(self.sequence, prompt) if prompt else self.sequence.last_logits

    def fork(self) -> Conversation:
        """An independent copy of this conversation: the sequence (store, pins, logits) is
        deep-copied, the engine shared. What one copy replies does not reach the other."""
        twin = Conversation(self.engine, copy.deepcopy(self.sequence), self.tools)
        twin.messages = copy.deepcopy(self.messages)
        twin.spans = dict(self.spans)
        twin._rendered = self._rendered
        twin._pending = list(self._pending)
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
        call and one policy step per token, gated by that call's confidence), and each is
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
