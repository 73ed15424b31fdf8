"""Next-token sampling: OpenAI's logit bias and frequency and presence penalties, then greedy,
or temperature with nucleus (top-p) filtering, seeded; a `Grammar` in the parameters
constrains the reply (see `agent_kv.runtime.grammar`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.grammar import Grammar


@dataclass
class SamplingParams:
    """How a reply is decoded.

    Attributes:
        max_new_tokens: cap on generated tokens (>= 1).
        temperature: 0 for greedy decoding; otherwise logits are divided by it.
        top_p: nucleus mass in (0, 1]; the smallest set of tokens whose probability reaches it.
        seed: seeds the sampler's generator, for reproducible sampling.
        stop: strings that end the reply; the returned text stops before the first one.
        grammar: when set, every token is drawn from those the grammar allows next, and the
            reply ends when the grammar is complete (`agent_kv.runtime.grammar`).
        call_open: the text a tool call opens with, when the reply may be one
            (`ReplySpec.scope_stop`): a reply that begins with it, or may still, is a call,
            which no stop string cuts.
        frequency_penalty: subtracted from a token's logit once per time the reply has
            generated it, in [-2, 2] (`penalized`).
        presence_penalty: subtracted from the logit of every token the reply has generated,
            in [-2, 2].
        logit_bias: token id -> value in [-100, 100] added to its logit.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None
    call_open: str | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise `ConfigError` for out-of-range values, a `logit_bias` token id outside
        `[0, vocab_size)` when the vocabulary size is given (`GrammarError`, a `ConfigError`,
        for a grammar of unknown kind or empty source)."""
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise ConfigError("stop strings must be non-empty")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ConfigError(f"seed must lie in [-2**63, 2**64), got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(f"{name} must lie in [-2, 2], got {getattr(self, name)}")
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise ConfigError(f"logit_bias values must lie in [-100, 100], got {bias}")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ConfigError(
                    f"logit_bias token {token} is not in the model's vocabulary of {vocab_size}"
                )
        if self.grammar is not None:
            self.grammar.validate()


def penalized(logits: torch.Tensor, params: SamplingParams, generated: list[int]) -> torch.Tensor:
    """`logits` `[vocab]` after OpenAI's logit bias and penalties, as OpenAI's API reference
    defines them (chat completions, `frequency_penalty`, `presence_penalty`, `logit_bias`):
    `mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + logit_bias[j]`, where
    `c[j]` counts token `j` among the reply's `generated` tokens (the prompt's are not
    counted, as in vLLM). A new tensor when any is set; `logits` itself otherwise."""
    frequency, presence = params.frequency_penalty, params.presence_penalty
    if not (params.logit_bias or (generated and (frequency or presence))):
        return logits
    out = logits.float().clone()
    if generated and (frequency or presence):
        counts = torch.bincount(torch.tensor(generated), minlength=out.shape[-1])
        counts = counts[: out.shape[-1]].to(out.device, out.dtype)
        out -= counts * frequency + (counts > 0).to(out.dtype) * presence
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=out.device)
        out[ids] += torch.tensor(list(params.logit_bias.values()), device=out.device)
    return out


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (dividing by them would overflow)."""


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """Pick the next token id from `logits` `[vocab]`.

    Greedy when `temperature < GREEDY_BELOW`; otherwise a draw from
    `softmax(logits / temperature)` restricted to the top-p nucleus, which always holds at
    least the most likely token.
    """
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    scaled = (logits.float() - logits.max()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better tokens
        outside = before >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))
