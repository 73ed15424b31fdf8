"""transformers `Cache` adapter over `agent_kv.kv.store.KVStore`.

The model's attention modules call `cache.update(key_states, value_states, layer_idx)`; the
adapter appends the new tokens to the store (for the rows of `KVStore.begin_forward`); the
registered attention function (`agent_kv.kv.attention`) then reads the store's segments.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from agent_kv.kv.store import KVStore


class StoreCacheLayer(CacheLayerMixin):
    """One layer's view of the store, in transformers' cache-layer protocol."""

    is_sliding = False

    def __init__(self, store: KVStore, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the store allocates its buffers up front."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[B, Hkv, n, D]` keys/values for the rows of the store's current forward;
        return their FP segment views (attention reads the full store itself)."""
        return self.store.append(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        """Most live tokens of any row in this layer (after eviction: fewer than seen)."""
        layer = self.store.layers[self.layer_idx]
        return max(layer.length(row) for row in range(layer.batch))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` for mask builders: live tokens plus the new queries."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        """-1: the store grows on demand; budgets are the policy's business."""
        return -1


class StoreCache(Cache):
    """A `Cache` whose layers are the layers of one `KVStore`."""

    def __init__(self, store: KVStore):
        super().__init__(layers=[StoreCacheLayer(store, i) for i in range(len(store.layers))])
        self.store = store
