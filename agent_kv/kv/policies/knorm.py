"""Key norm: keep the tokens whose keys have the smallest L2 norm.

Devoto et al., "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"
(EMNLP 2024), §3-4: across layers and heads, a cached key's L2 norm is low where the
attention it draws is high, so keeping the lowest-norm keys approximates keeping the most
attended ones without reading any attention (kvpress's `KnormPress`). Each token's key norm is
recorded once, when it arrives, from its key alone (`KeyNorm`; the norm of a rotated key is
the norm of the unrotated one, so either positions mode gives the same score); a token ranks
by minus its norm, averaged over the layer's KV heads (the store keeps one set of tokens per
layer; the paper scores each head). The newest `protect_recent` tokens and the first `sinks`
positions are kept whatever their norm, as for every budgeted policy here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic


@dataclass(frozen=True)
class KeyNorm(TokenStatistic):
    """Each token's key L2 norm per KV head, `[L, R, H, n]`, set once from the new keys."""

    columns = (Column("key_norm"),)
    measurement = "keys"

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        return {"key_norm": measured.keys.float().norm(dim=-1)} if new else {}


@dataclass
class KeyNormPolicy(FixedBudgetPolicy):
    """Keep the `budget_tokens` unpinned tokens of smallest key norm per layer.

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`).
        protect_recent (int, default 32): the newest unpinned tokens always kept.
        sinks (int, default 4): the first positions always kept (attention sinks).
    """

    name = "knorm"
    order = 35
    summary = "the tokens whose keys have the smallest L2 norm, scored once from the keys alone"
    paper = "Devoto et al. 2024 §3"
    statistics = (KeyNorm(),)
    protect_recent: int = 32
    sinks: int = 4

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Minus each token's key norm, averaged over the layer's KV heads; `[L, R, S]`."""
        return -store.joint("key_norm", rows=view.rows).mean(dim=2)
