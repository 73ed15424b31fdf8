"""Next-token sampling, in vLLM's order: OpenAI's logit bias, then the repetition penalty
(vLLM's and llama.cpp's) and OpenAI's frequency and presence penalties on the logits
(`penalized`); then greedy, or temperature followed by the top-k, top-p (nucleus) and min-p
filters, seeded (`sample_next`). A `Grammar` in the parameters constrains the reply (see
`agent_kv.runtime.replies.grammar`).

The parameters are those of vLLM's `SamplingParams` (vllm/sampling_params.py; the filters
applied in vLLM's sampler, vllm/model_executor/layers/sampler.py) and of llama.cpp's sampler
chain (common/sampling.cpp: `top_k`, `top_p`, `min_p`, `repeat_penalty`), which define them
alike.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.runtime.replies.grammar import Grammar


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
            reply ends when the grammar is complete (`agent_kv.runtime.replies.grammar`).
        call_open: the text a tool call opens with, when the reply may be one
            (`ReplySpec.scope_stop`): a reply that begins with it, or may still, is a call,
            which no stop string cuts; no stop string cuts what follows it either.
        json_calls: the reply may be one call written as JSON text
            (`tool_calls.read_json_call`, under `auto`): a reply that is or may still become
            one is not cut by a stop string.
        frequency_penalty: subtracted from a token's logit once per time the reply has
            generated it, in [-2, 2] (`penalized`).
        presence_penalty: subtracted from the logit of every token the reply has generated,
            in [-2, 2].
        logit_bias: token id -> value in [-100, 100] added to its logit.
        top_k: keep only the `top_k` most likely tokens (ties with the last one kept); 0 or -1
            keeps every token (vLLM takes -1 and 0, llama.cpp 0, for "off").
        min_p: keep only tokens whose probability is at least `min_p` times the most likely
            token's, in [0, 1]; 0 keeps every token.
        repetition_penalty: > 0; the logit of every token that occurs in the prompt or the
            reply so far is divided by it when positive and multiplied by it otherwise (the
            CTRL paper's penalty, arXiv:1909.05858 section 4.1, as vLLM and llama.cpp apply
            it); 1 changes nothing, above 1 discourages repeating.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    grammar: Grammar | None = None
    call_open: str | None = None
    json_calls: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

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
        if self.top_k < -1:
            raise ConfigError(f"top_k must be -1 or 0 (every token) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must lie in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ConfigError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise ConfigError(f"logit_bias values must lie in [-100, 100], got {bias}")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise ConfigError(
                    f"logit_bias token {token} is not in the model's vocabulary of {vocab_size}"
                )
        if self.grammar is not None:
            self.grammar.validate()


def penalized(
    logits: torch.Tensor,
    params: SamplingParams,
    generated: list[int],
    prompt: torch.Tensor | Sequence[int] = (),
) -> torch.Tensor:
    """`logits` `[vocab]` after the logit bias and the penalties, in vLLM's order (logit bias
    first, then `apply_penalties`: repetition, frequency, presence):

    - the repetition penalty `r` (`SamplingParams.repetition_penalty`, the CTRL paper's,
      arXiv:1909.05858 section 4.1, as vLLM and llama.cpp apply it): the logit `x` of every
      token that occurs in `prompt` or `generated` becomes `x / r` when `x > 0`, else `x * r`;
    - OpenAI's (chat completions, `frequency_penalty`, `presence_penalty`, `logit_bias`):
      `x[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty + logit_bias[j]`,
      where `c[j]` counts token `j` among the reply's `generated` tokens only (the prompt's
      are not counted, as in vLLM).

    Args:
        logits: the model's next-token logits `[vocab]`.
        params: the sampling parameters.
        generated: the reply's tokens so far.
        prompt: the token ids the reply follows (the whole prompt, history included), in any
            order and with repeats; read by the repetition penalty only.

    Returns:
        a new float32 tensor when anything applies (the repetition penalty makes no logit
        infinite: it clamps to float32's range); `logits` itself otherwise.
    """
    frequency, presence = params.frequency_penalty, params.presence_penalty
    repetition = params.repetition_penalty != 1.0 and (len(prompt) or generated)
    if not (params.logit_bias or repetition or (generated and (frequency or presence))):
        return logits
    out = logits.float().clone()
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=out.device)
        out[ids] += torch.tensor(list(params.logit_bias.values()), device=out.device)
    if repetition:
        ids = [torch.as_tensor(prompt, dtype=torch.long), torch.tensor(generated, dtype=torch.long)]
        seen = torch.cat(ids)
        seen = seen[seen < out.shape[-1]].to(out.device)
        values, penalty = out[seen], params.repetition_penalty
        values = torch.where(values > 0, values / penalty, values * penalty)
        # a tiny or huge penalty must not make a logit infinite (inf - inf is NaN later)
        finite = torch.finfo(out.dtype).max
        out[seen] = values.clamp(-finite, finite)
    if generated and (frequency or presence):
        counts = torch.bincount(torch.tensor(generated), minlength=out.shape[-1])
        counts = counts[: out.shape[-1]].to(out.device, out.dtype)
        out -= counts * frequency + (counts > 0).to(out.dtype) * presence
    return out


GREEDY_BELOW = 1e-5
"""Temperatures below this decode greedily (dividing by them would overflow)."""


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> int:
    """Pick the next token id from `logits` `[vocab]` (after `penalized`; masked tokens at
    `-inf`).

    Greedy when `temperature < GREEDY_BELOW` (top-k, top-p and min-p then change nothing, as
    in vLLM). Otherwise a draw from `softmax(logits / temperature)` after three filters, in
    the order of vLLM's sampler (`_apply_top_k_top_p`, then `_apply_min_p`), each always
    keeping the most likely token:

    - top-k: the `top_k` most likely tokens, with any tied with the k-th;
    - top-p: of those, renormalized, the smallest set of most likely tokens whose mass reaches
      `top_p` (a token is kept while the mass of the tokens before it is below `top_p`);
    - min-p: of those, the tokens whose probability is at least `min_p` times the most
      likely one's (a ratio renormalizing does not change).
    """
    if params.temperature < GREEDY_BELOW:
        return int(torch.argmax(logits))
    scaled = (logits.float() - logits.max()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    if 0 < params.top_k < probs.shape[-1]:
        kth = torch.topk(probs, params.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, 0.0)
        probs /= probs.sum()
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of better tokens
        outside = before >= params.top_p
        outside[0] = False
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if params.min_p > 0.0:
        probs = torch.where(probs >= params.min_p * probs.max(), probs, 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))
