"""Grammar-constrained decoding: the engine's one structured-generation mechanism.

A `Grammar` says what a reply must match (a Lark grammar, a JSON schema or a regular
expression); `GrammarCompiler` builds it against the model's tokenizer into a
`GrammarMatcher`, which, at each decode step, masks the logits to the tokens that keep the
reply inside the grammar and then advances by the sampled token. Once the grammar admits no
continuation the reply is complete; where it may end, the tokenizer's EOS is allowed.

The library is llguidance (PyPI `llguidance`, Microsoft's Low-level Guidance): on this
project's CPU with SmolLM2's 49,152-token vocabulary it builds an observation's action
grammar in ~2 ms and costs ~0.14 ms per decode step (`benchmarks/grammar_cost.py`, where
xgrammar and outlines-core are measured beside it: their per-grammar builds take hundreds of
milliseconds, which an agent pays at every step because each page has other element ids).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from agent_kv.errors import GrammarError, GrammarStateError

GRAMMAR_KINDS = ("lark", "json_schema", "regex")


@dataclass(frozen=True)
class Grammar:
    """What a constrained reply must match.

    Attributes:
        kind: "lark" (a Lark grammar in llguidance's dialect, rule `start`), "json_schema"
            (a JSON Schema as JSON text) or "regex" (the whole reply matches it).
        source: the grammar, schema or pattern text.
    """

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: dict[str, Any]) -> Grammar:
        """A grammar for JSON documents that validate against `schema`."""
        return cls("json_schema", json.dumps(schema))

    def validate(self) -> None:
        """Raise `GrammarError` for an unknown kind or an empty source."""
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(
                f"unknown grammar kind {self.kind!r}: choose one of {', '.join(GRAMMAR_KINDS)}"
            )
        if not self.source.strip():
            raise GrammarError(f"empty {self.kind} grammar")


class GrammarCompiler:
    """Builds `Grammar`s against one tokenizer (adapting the tokenizer takes ~0.3-1 s; do it
    once per engine).

    Args:
        tokenizer: a fast Hugging Face tokenizer.
        vocab_size: width of the model's logits (may exceed the tokenizer's vocabulary).
        eos_id: the token that ends a reply (the chat template's end-of-turn token).
        end_ids: other tokens that end a reply (`end_of_generation_ids`): allowed wherever
            `eos_id` is.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_id: int, end_ids=()):
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.end_ids = sorted({int(e) for e in end_ids if 0 <= e < vocab_size} - {eos_id})
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=eos_id
        )

    def matcher(self, grammar: Grammar) -> GrammarMatcher:
        """A fresh matcher for one reply under `grammar`.

        Raises:
            GrammarError: unknown kind, or a grammar, schema or pattern llguidance cannot
                build (the message carries its reason).
        """
        grammar.validate()
        try:
            match grammar.kind:
                case "lark":
                    text = llguidance.LLMatcher.grammar_from_lark(grammar.source)
                case "json_schema":
                    text = llguidance.LLMatcher.grammar_from_json_schema(grammar.source)
                case _:
                    text = llguidance.LLMatcher.grammar_from_regex(grammar.source)
        except (ValueError, TypeError) as err:
            reason = _first_line(str(err))
            raise GrammarError(f"cannot build the {grammar.kind} grammar: {reason}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0)
        if matcher.is_error():
            reason = _first_line(matcher.get_error())
            raise GrammarError(f"cannot build the {grammar.kind} grammar: {reason}")
        return GrammarMatcher(matcher, self.vocab_size, self.eos_id, self.end_ids)

    def accepts(self, grammar: Grammar, text: str) -> bool:
        """Whether `text`, tokenized as the tokenizer writes it, is a complete sentence of
        `grammar` (each token allowed in turn, the grammar accepting at the end).

        Raises:
            GrammarError: as `matcher`.
        """
        matcher = self.matcher(grammar)
        for token in self.hf_tokenizer(text, add_special_tokens=False)["input_ids"]:
            if not matcher.allowed()[token]:
                return False
            matcher.advance(token)
        return matcher.accepting


class GrammarMatcher:
    """The state of one reply under a grammar (made by `GrammarCompiler.matcher`)."""

    def __init__(
        self, matcher: llguidance.LLMatcher, vocab_size: int, eos_id: int, end_ids: list[int]
    ):
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos_id = eos_id
        self._end_ids = end_ids
        self._bitmask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """`[vocab]` bool: the tokens that keep the reply inside the grammar now (every
        end-of-generation token where the reply may end)."""
        self._matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = bits[: self._vocab_size].astype(bool)
        if self._end_ids and allowed[self._eos_id]:
            allowed[self._end_ids] = True
        return torch.from_numpy(allowed)

    def constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` `[vocab]` with every token outside the grammar set to -inf (a copy)."""
        return logits.masked_fill(~self.allowed(), float("-inf"))

    def advance(self, token: int) -> None:
        """Take `token` as the reply's next token.

        Raises:
            GrammarStateError: the grammar does not allow `token` here (only when it was not
                chosen from `constrain`'s logits, or the mask and the matcher disagree: the
                server's fault, not the request's).
        """
        if not self._matcher.consume_token(token):
            reason = _first_line(self._matcher.get_error())
            raise GrammarStateError(f"token {token} is outside the grammar: {reason}")

    @property
    def done(self) -> bool:
        """The reply is complete: the grammar allows no further token (EOS consumed, or no
        continuation exists)."""
        return self._matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """The reply may end here (it is a complete sentence of the grammar)."""
        return self._matcher.is_accepting()


END_OF_GENERATION_TEXTS = (
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
    "<|return|>", "</s>",
)  # fmt: skip
"""Added tokens that end a generation by their text, as llama.cpp's vocabulary loader marks
its end-of-generation tokens (`llama_vocab::impl::load`, src/llama-vocab.cpp): Qwen2.5-Coder,
for one, ends a reply of tool calls with `<|endoftext|>`, which neither its tokenizer's EOS
nor its config names."""


def end_of_generation_ids(tokenizer) -> list[int]:
    """The ids of the tokenizer's added tokens whose text is in `END_OF_GENERATION_TEXTS`
    (none for a tokenizer without added tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return sorted(
        token_id for token_id, token in added.items() if token.content in END_OF_GENERATION_TEXTS
    )


REASON_CHARS = 300
"""The most characters of llguidance's message an error keeps (its first line)."""


def _first_line(message: str) -> str:
    """The first line of a library message, cut to `REASON_CHARS` (its state dumps and
    backtraces follow on later lines), with the `error:` line that gives the reason when the
    first ends in a colon (a regex error: "regex parse error:", the pattern, a caret, then
    "error: unclosed character class")."""
    lines = [line.strip() for line in message.strip().splitlines()] or [""]
    line = " ".join(lines[0].split())
    if line.endswith(":"):
        reason = next((rest for rest in lines[1:] if rest.startswith("error:")), "")
        line = f"{line} {reason.removeprefix('error:').strip()}".strip()
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3] + "..."
