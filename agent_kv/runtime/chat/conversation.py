"""An append-only chat over one sequence: messages in, replies out, one KV cache throughout.

The chat is a `ChatSession` (`agent_kv.runtime.chat.session`, the session object the server
runs its turns on too): rendered with the tokenizer's chat template (with the tools it offers,
`agent_kv.runtime.chat.rendering`) once per turn; what the cache already holds is a text
prefix of the new rendering, so each turn tokenizes and prefills only the new suffix, and the
pin rules (`agent_kv.runtime.chat.pin_rules`, the server's rules) pin tokens in the store (exempt
from eviction). A reply is kept as the text generated, calls included, so it renders as the
cache holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_kv.kv.kv_figures import KVFigures
from agent_kv.runtime.chat.pin_rules import PinRules
from agent_kv.runtime.chat.session import MESSAGE_FLAGS_ONLY, ChatSession
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.decoding import Generation
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import Tool


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
    """One conversation whose whole history stays in one managed KV cache: a `ChatSession`
    (messages, their token spans, the pin rules applied turn by turn) that the engine prefills
    and replies in.

    Messages added wait for the next reply; then the chat is rendered once (with the
    generation prompt), only the text past what the cache holds is tokenized, and each new
    message is placed and pinned by the rules (`agent_kv.runtime.chat.session`).

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
        self.engine = engine
        self.chat = ChatSession(sequence or engine.new_sequence(), tools, rules)

    @property
    def sequence(self) -> SequenceState:
        """The sequence holding the cache."""
        return self.chat.sequence

    @property
    def messages(self) -> list[dict]:
        """The conversation's messages (`ChatSession.messages`)."""
        return self.chat.messages

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Each placed message's token positions `[start, end)` (`ChatSession.spans`)."""
        return self.chat.spans

    def figures(self) -> KVFigures:
        """What the conversation's KV cache holds now (`KVFigures`, the record the server's
        turns report too)."""
        return self.chat.figures()

    def add(self, role: str, content: str, pin: bool = False) -> None:
        """Append a message; it is placed and prefilled with the next reply.

        Args:
            role: "system", "user", "assistant" or "tool".
            content: the message text.
            pin: pin the message's tokens for good (what `PinRules` does with `"pin": True`).
        """
        self.chat.add({"role": role, "content": content} | ({"pin": True} if pin else {}))

    def _take_prompt(self) -> list[int]:
        """The new messages and the assistant header as the prompt to prefill
        (`ChatSession.take_prompt`)."""
        return self.chat.take_prompt(self.engine.tokenizer, self.engine.new_sequence).token_ids

    def prefill(self) -> torch.Tensor:
        """Prefill the queued messages and the assistant header now, as `reply` would first;
        returns the logits for the reply's first token, `[vocab]` float32. A `reply`,
        `force_reply` or `fork` after it starts from there."""
        prompt = self._take_prompt()
        return self.engine.prefill(self.sequence, prompt) if prompt else self.sequence.last_logits

    def fork(self) -> Conversation:
        """An independent copy of this conversation: the sequence (store, pins, logits) is
        deep-copied, the engine shared. What one copy replies does not reach the other."""
        chat = self.chat.fork()
        twin = Conversation(self.engine, chat.sequence, chat.tools, chat.rules)
        twin.chat = chat
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
        reply_start = self.sequence.store.seen_tokens + len(prompt)
        if pin:
            self.chat.pin_reply(reply_start, reply_start + params.max_new_tokens)
        generation = self.engine.generate(self.sequence, prompt, params)
        if pin:  # (a re-encoding engine may have replaced the store: `Engine.reencode`)
            self.chat.release_reply_tail(
                self.sequence.store.seen_tokens, reply_start + params.max_new_tokens
            )
        pinned = self.sequence.store.seen_tokens - reply_start if pin else 0
        self.chat.add_reply(self.engine.tokenizer, generation.raw_text, reply_start, pinned)
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
        reply_start = self.sequence.store.seen_tokens + len(prompt)
        tokens = self.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
        pinned = len(tokens) if pin is True else min(int(pin), len(tokens))
        if pinned:
            self.chat.pin_reply(reply_start, reply_start + pinned)
        logits = self.engine.prefill(self.sequence, prompt) if prompt else self.sequence.last_logits
        forced = ForcedReply([], [])
        distributions = []
        for token in tokens:
            log_probs = torch.log_softmax(logits.float(), dim=-1)
            forced.hits.append(int(logits.argmax()) == token)
            forced.logprobs.append(float(log_probs[token]))
            if keep_distributions:
                distributions.append(log_probs)
            logits = self.engine.prefill(self.sequence, [token])
        if keep_distributions:
            forced.distributions = torch.stack(distributions)
        self.chat.add_reply(self.engine.tokenizer, text, reply_start, pinned)
        return forced

    @property
    def text(self) -> str:
        """The template text the cache holds (plus messages queued for the next reply)."""
        return self.chat.rendered
