"""KVzip: query-agnostic importance from a reconstruction pass over the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (2025),
§3: after the context is prefilled, the model is prompted to repeat it ("Repeat the previous
context:" followed by the context itself, teacher-forced); a KV pair matters as much as the
most any of those reconstruction queries attends to it (§3.2, the maximum over the queries
and the query heads of its KV head), and the least needed pairs are evicted. No question is
needed: the score says what the model needs to reproduce the context, whatever is asked.

Here the context arrives in prefill chunks, so the pass runs after each chunk over that
chunk's tokens (the engine's `_reconstruct`: the prompt and the chunk fed once more, their
attention recorded by `ForwardCall.record_reconstruction` and then truncated away), before the
eviction; every token already cached, not only the chunk's, keeps the largest probability
any pass gave it. Tokens no pass has seen (a decoded reply) score 0 and stay only while they
are among the `protect_recent` newest. Each pass costs about one more prefill of its chunk,
with every query's attention read against the whole cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore

REPEAT_PROMPT = "\n\nRepeat the previous context:\n"
"""What precedes a chunk fed again for its reconstruction pass (the paper's prompt)."""


@dataclass
class KVzip(FixedBudgetPolicy):
    """Keep the tokens a reconstruction of the context needs most.

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`).
        protect_recent (int, default 32): the newest unpinned tokens always kept.
        sinks (int, default 4): the first positions always kept (attention sinks).
    """

    name = "kvzip"
    order = 110
    summary = (
        "the tokens a reconstruction of the context needs most: after each prefill chunk the "
        "model is made to repeat that chunk, and each cached token scores the most attention any "
        "repeat query gave it; about twice the prefill time"
    )
    paper = "KVzip §3"
    reconstructs: ClassVar[bool] = True
    protect_recent: int = 32
    sinks: int = 4

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Each token's reconstruction score (`reconstruction`), the largest over the layer's
        KV heads; `[L, R, S]`."""
        return store.joint("reconstruction", rows=view.rows).amax(dim=2)
