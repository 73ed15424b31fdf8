"""KVzip: query-agnostic importance from a reconstruction pass over the context.

Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction" (2025),
§3: after the context is prefilled, the model is prompted to repeat it ("Repeat the previous
context:" followed by the context itself, teacher-forced); a KV pair matters as much as the
most any of those reconstruction queries attends to it (§3.2, the maximum over the queries
and the query heads of its KV head), and the least needed pairs are evicted. No question is
needed: the score says what the model needs to reproduce the context, whatever is asked.

Here the context arrives in prefill chunks, so the pass runs after each chunk over that
chunk's tokens (`KVzip.maxima_pass_tokens`: the prompt and the chunk fed once more as a maxima
pass, whose attention maxima `ReconstructionMax` folds and whose tokens are never kept), before
the eviction; every token already cached, not only the chunk's, keeps the largest probability
any pass gave it. Tokens no pass has seen (a decoded reply) score 0 and stay only while they
are among the `protect_recent` newest. Each pass costs about one more prefill of its chunk,
with every query's attention read against the whole cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic

REPEAT_PROMPT = "\n\nRepeat the previous context:\n"
"""What precedes a chunk fed again for its reconstruction pass (the paper's prompt)."""


@dataclass(frozen=True)
class ReconstructionMax(TokenStatistic):
    """KVzip's per-token score (§3.2): the largest attention probability any reconstruction
    query and query head gave the token, over every pass so far."""

    columns = (Column("reconstruction"),)
    measurement = "maxima"

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        return {"reconstruction": torch.maximum(measured.stored["reconstruction"], measured.maxima)}


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
    statistics = (ReconstructionMax(),)
    protect_recent: int = 32
    sinks: int = 4

    def maxima_pass_tokens(
        self, chunk: list[int], encode: Callable[[str], list[int]]
    ) -> list[int] | None:
        """The reconstruction pass after a prefilled `chunk` (§3): the repeat prompt and the
        chunk once more; none after a decoded token."""
        return encode(REPEAT_PROMPT) + chunk if len(chunk) > 1 else None

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Each token's reconstruction score (`reconstruction`), the largest over the layer's
        KV heads; `[L, R, S]`."""
        return store.joint("reconstruction", rows=view.rows).amax(dim=2)
