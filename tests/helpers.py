"""Shared helpers for tests that drive a KVStore directly, without a model."""

from __future__ import annotations

import torch

from agent_kv.kv.store import KVStore


def append_tokens(
    store: KVStore, keys: torch.Tensor, values: torch.Tensor | None = None, rows: range = range(1)
) -> None:
    """Append `keys`/`values` `[len(rows), H, n, D]` to every layer, as one forward call."""
    store.append(keys, -keys if values is None else values, rows)


def random_tokens(store: KVStore, n: int, rows: range = range(1)) -> None:
    """Append `n` random tokens to every layer of `rows`."""
    shape = (len(rows), store.kv_heads, n, store.head_dim)
    append_tokens(store, torch.randn(shape), torch.randn(shape), rows)


def kept_positions(store: KVStore, layer_idx: int = 0, row: int = 0) -> list[int]:
    """Original positions of a layer's live tokens, in logical order."""
    return store.live_positions(layer_idx, row).tolist()
