"""What some model families add to the attention softmax: logit soft-capping and learned
attention sinks. The PyTorch read paths (`kernels.torch_attention`) apply both; the Triton decode
kernel applies neither and refuses calls that ask for them (`kernels.triton_attention.unsupported`),
so `kernels.dispatch` runs those through the PyTorch path.

- Soft-capping (Gemma-2, Gemma Team 2024, "Gemma 2", §2 "Logit soft-capping"): each scaled
  score `s` becomes `cap * tanh(s / cap)` before masking and softmax, as transformers' Gemma-2
  eager attention does.
- Attention sinks (gpt-oss, OpenAI 2025, "gpt-oss-120b & gpt-oss-20b model card", §2.1
  "Attention"; transformers' `s_aux`): one learned logit per query head joins the softmax
  denominator and carries no value, so the probabilities over the real tokens sum to less than
  one. The attention mass the store records is those probabilities: the sink's share is
  given to no token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SoftmaxExtras:
    """Soft-capping and sinks of one attention call.

    Attributes:
        softcap: the cap `c` (> 0) of `c * tanh(s / c)` on the scaled scores, or None.
        sinks: `[Hq]` float, one sink logit per query head, or None.
    """

    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        """Whether the call asks for either."""
        return self.softcap is not None or self.sinks is not None

    def cap(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (scaled scores, any shape) soft-capped; themselves without a cap. Apply it
        before any mask: the cap would turn a masked `-inf` into `-c`."""
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def sink_logits(self, kv_heads: int, queries: int) -> torch.Tensor | None:
        """float32 `[1, Hkv, G * queries, 1]`: each grouped query row's sink logit, rows
        ordered as the reference kernels group them (row `g * queries + i` is query `i` of
        query head `kv_head * G + g`); None without sinks."""
        if self.sinks is None:
            return None
        per_head = self.sinks.float().view(kv_heads, -1, 1)  # [Hkv, G, 1]
        return per_head.expand(-1, -1, queries).reshape(1, kv_heads, -1, 1)

    def probabilities(self, logits: torch.Tensor, queries: int) -> torch.Tensor:
        """The softmax of capped, masked `logits` `[B, Hkv, G * queries, L]` (float32) over
        the last dimension, with each row's sink in the denominator: `[B, Hkv, G*queries, L]`,
        the probabilities of the real tokens."""
        sink = self.sink_logits(logits.shape[1], queries)
        if sink is None:
            return torch.softmax(logits, dim=-1)
        sink = sink.expand(logits.shape[0], -1, -1, -1)
        return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]


NO_EXTRAS = SoftmaxExtras()
"""A call with neither soft-capping nor sinks."""
