"""An append-only chat over one session: messages in, replies out, one KV cache throughout.

The conversation is rendered with the tokenizer's chat template; what the cache already holds
is a text prefix of the new rendering, so each turn prefills only the new suffix. Messages
flagged `pin` have their tokens pinned in the store (exempt from eviction).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.engine import Engine, Generation
from agent_kv.sampling import SamplingParams
from agent_kv.session import Session


@dataclass
class _Pending:
    ids: list[int]
    pin: bool


class ChatSession:
    """One conversation whose whole history stays in one managed KV cache.

    Args:
        engine: the engine (model, tokenizer, policy).
        session: an existing session to continue; a new empty one by default.
    """

    def __init__(self, engine: Engine, session: Session | None = None):
        self.engine = engine
        self.session = session or engine.new_session()
        self.messages: list[dict[str, str]] = []
        self._rendered = ""  # template text of everything queued or cached
        self._pending: list[_Pending] = []

    def _render(self, generation_prompt: bool) -> str:
        return self.engine.tokenizer.apply_chat_template(
            self.messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def _queue_delta(self, rendered: str, pin: bool) -> None:
        if not rendered.startswith(self._rendered):
            raise RuntimeError(
                "the chat template re-rendered earlier turns differently; "
                "this template cannot be extended append-only"
            )
        delta = rendered[len(self._rendered) :]
        if delta:
            ids = self.engine.tokenizer(delta, add_special_tokens=False)["input_ids"]
            self._pending.append(_Pending(ids, pin))
        self._rendered = rendered

    def add(self, role: str, content: str, pin: bool = False) -> None:
        """Append a message; its tokens are prefilled with the next `reply`.

        Args:
            role: "system", "user", "assistant" or "tool".
            content: the message text.
            pin: pin the message's tokens (never evicted).
        """
        self.messages.append({"role": role, "content": content})
        self._queue_delta(self._render(generation_prompt=False), pin)

    def reply(self, params: SamplingParams) -> Generation:
        """Prefill the queued messages and the assistant header, then generate the reply.

        The reply is appended to the conversation as an assistant message (its full generated
        text, stop strings included, which is what the cache holds).
        """
        self._queue_delta(self._render(generation_prompt=True), pin=False)
        store = self.session.store
        start = store.seen_tokens
        prompt: list[int] = []
        for item in self._pending:
            if item.pin:
                store.pin(start + len(prompt), start + len(prompt) + len(item.ids))
            prompt.extend(item.ids)
        self._pending.clear()
        self.session.text = self._rendered
        generation = self.engine.generate(self.session, prompt, params)
        self.messages.append({"role": "assistant", "content": generation.raw_text})
        self._rendered = self.session.text
        return generation
