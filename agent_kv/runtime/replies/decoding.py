"""One reply's decoding state, token by token: sampling (under a grammar when one is set), the
end of the reply (an end-of-turn token, a stop string, a complete grammar, the token cap),
the text streamed so far, and the finished `Generation`. The same state serves a reply
decoded alone (`Engine.generate`) and one decoded as a row of a continuous batch
(`agent_kv.runtime.engine.batch_scheduler`), so the two give the same reply.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from agent_kv.runtime.replies.grammar import GrammarMatcher
from agent_kv.runtime.replies.sampling import SamplingParams, penalized, sample_next
from agent_kv.runtime.replies.tool_calls import may_be_json_call


@dataclass
class Generation:
    """A finished reply.

    Attributes:
        text: generated text up to (not including) the first stop string or end-of-turn token.
        raw_text: everything generated and fed to the cache (stop strings included, EOS not).
        token_ids: generated token ids (EOS included when it ended the reply).
        finish_reason: "stop" (EOS, stop string or a complete grammar) or "length"
            (max_new_tokens reached).
        prompt_tokens: tokens of the prompt this reply follows (those read from shared prefix
            blocks included).
        ttft_s: seconds from the start of the prefill to the first sampled token.
        decode_s: seconds spent after the first token.
    """

    text: str
    raw_text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int
    ttft_s: float
    decode_s: float

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated after the first one, per second of decode."""
        return (len(self.token_ids) - 1) / self.decode_s if self.decode_s > 0 else 0.0


class ReplyDecoder:
    """The state of one reply being decoded.

    Use: `choose(logits)` gives the next token to feed (None once the reply has ended); after
    the caller fed it to the cache, `fed()` checks the stop strings and the grammar and
    streams the text; `generation()` gives the finished reply. Every chosen token is fed, so
    the cache ends with the prompt followed by `raw_text`; an EOS ends the reply unfed.

    Args:
        params: sampling parameters (validated by the caller).
        matcher: the grammar's matcher, or None.
        tokenizer: decodes the reply's tokens.
        eos_ids: end-of-turn token ids.
        on_text: receives the reply's text as it grows, in pieces that concatenate to `text`:
            a piece is held back while it could still be the start of a stop string or ends
            in an incomplete character.
        started: `time.perf_counter()` when the turn's prefill began (for `ttft_s`).
        prompt_ids: every token the reply follows (the sequence's history and the new
            prompt), which the repetition penalty counts as vLLM does (`penalized`).
    """

    def __init__(
        self,
        params: SamplingParams,
        matcher: GrammarMatcher | None,
        tokenizer,
        eos_ids: set[int],
        on_text: Callable[[str], None] | None = None,
        started: float | None = None,
        prompt_ids: Sequence[int] = (),
    ):
        self.params = params
        self.matcher = matcher
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.on_text = on_text
        self.started = time.perf_counter() if started is None else started
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device="cpu").manual_seed(params.seed)
        self.generated: list[int] = []
        counted = prompt_ids if params.repetition_penalty != 1.0 else ()
        self.prompt = torch.unique(torch.tensor(counted, dtype=torch.long))
        """The prompt's distinct token ids `[n]` (none without a repetition penalty)."""
        self.finish_reason: str | None = None  # set once the reply has ended
        self._first_token_at: float | None = None
        self._ended_at: float | None = None
        self._sent = 0  # characters of the reply handed to on_text
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        """Whether the reply has ended."""
        return self.finish_reason is not None

    def choose(self, logits: torch.Tensor) -> int | None:
        """The next token from `logits` `[vocab]` (the grammar's tokens only, with one), to be
        fed; None when the reply has ended (before: now at `max_new_tokens` tokens; or the
        token drawn is an end-of-turn token, which is not fed).

        Raises:
            GrammarStateError: the matcher refused the token (not possible for a token drawn
                from its own mask).
        """
        if self.finished:
            return None
        if len(self.generated) >= self.params.max_new_tokens:
            return self._end("length")
        logits = penalized(logits, self.params, self.generated, self.prompt)
        constrained = logits if self.matcher is None else self.matcher.constrain(logits)
        token = sample_next(constrained, self.params, self.generator)
        if self._first_token_at is None:
            self._first_token_at = time.perf_counter()
        self.generated.append(token)
        if token in self.eos_ids:
            return self._end("stop")
        if self.matcher is not None:
            self.matcher.advance(token)
        return token

    def fed(self) -> None:
        """The last chosen token is in the cache: end the reply on a stop string or a
        complete grammar, else stream what text is safe to send."""
        text = self.tokenizer.decode(self.generated, skip_special_tokens=False)
        if self._stops(text) or (self.matcher is not None and self.matcher.done):
            self._end("stop")
            return
        if self.on_text is not None:
            safe = len(text.rstrip("\ufffd")) - self._hold
            if safe > self._sent:
                self.on_text(text[self._sent : safe])
                self._sent = safe

    def generation(self, prompt_tokens: int) -> Generation:
        """The finished reply (its last text piece streamed), after a prompt of
        `prompt_tokens` tokens. Call once `choose` returned None."""
        raw_ids = [t for t in self.generated if t not in self.eos_ids]
        raw_text = self.tokenizer.decode(raw_ids, skip_special_tokens=False)
        reply = cut_at_stop(raw_text, self.params.stop) if self._stops(raw_text) else raw_text
        if self.on_text is not None and len(reply) > self._sent:
            self.on_text(reply[self._sent :])
            self._sent = len(reply)
        first = self._first_token_at or self._ended_at or time.perf_counter()
        return Generation(
            text=reply,
            raw_text=raw_text,
            token_ids=list(self.generated),
            finish_reason=self.finish_reason or "length",
            prompt_tokens=prompt_tokens,
            ttft_s=first - self.started,
            decode_s=(self._ended_at or time.perf_counter()) - first,
        )

    def _stops(self, text: str) -> bool:
        """Whether a stop string ends the reply `text`: one occurs in its text before any tool
        call (`SamplingParams.call_open`, the opening marker; a reply that may still become
        one has no text yet)."""
        if self.params.json_calls and may_be_json_call(text):
            return False
        opener = self.params.call_open
        if opener is not None:
            if opener.startswith(text):
                return False
            at = text.find(opener)
            text = text if at < 0 else text[:at]
        return any(s in text for s in self.params.stop)

    def _end(self, reason: str) -> None:
        """End the reply for `reason`; None (`choose`'s "nothing to feed")."""
        self.finish_reason = reason
        self._ended_at = time.perf_counter()
        return None


def cut_at_stop(text: str, stop: list[str]) -> str:
    """`text` up to the first occurrence of any stop string."""
    return text[: min((text.find(s) for s in stop if s in text), default=len(text))]
