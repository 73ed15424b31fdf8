"""A session: one sequence's KV store, its token history, and what happened to its memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_kv.cache import StoreCache
from agent_kv.store import KVStore


@dataclass
class StepRecord:
    """One forward call (a prefill chunk or a decode token).

    Attributes:
        seen_tokens: tokens appended so far, after this call.
        appended_kv_bytes: live KV bytes after this call appended, before eviction (the
            sawtooth's peaks).
        kv_bytes: live KV bytes after this call's eviction (its troughs).
        confidence: `c` of the call's last next-token distribution.
        gated: whether `confidence` chose the budget (False for prompt chunks before the
            last, which get the policy's no-signal budget).
        budget: the policy's budget this step (unpinned tokens per layer), None for no limit.
        evicted: tokens evicted this step, summed over layers.
    """

    seen_tokens: int
    appended_kv_bytes: int
    kv_bytes: int
    confidence: float
    gated: bool
    budget: int | None
    evicted: int


@dataclass
class Session:
    """One sequence's state across every turn.

    Attributes:
        store: the managed KV cache.
        cache: its transformers `Cache` adapter, passed to the model.
        token_ids: every token fed to the model so far, in order.
        last_logits: `[vocab]` logits after the last fed token (None before the first call).
        steps: one record per forward call.
    """

    store: KVStore
    cache: StoreCache
    token_ids: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None
    steps: list[StepRecord] = field(default_factory=list)

    @classmethod
    def for_model(cls, model: torch.nn.Module, **store_kwargs) -> Session:
        """An empty session shaped for `model`."""
        store = KVStore.for_model(model, **store_kwargs)
        return cls(store=store, cache=StoreCache(store))
