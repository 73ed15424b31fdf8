"""transformers `Cache` adapter over `agent_kv.kv.store.KVStore`.

The model's attention modules call `cache.update(key_states, value_states, layer_idx)`; the
adapter hands the new keys and values straight back, and the registered attention function
(`agent_kv.kv.attention`) reads the store's segments and stages the new tokens in the call
(`KVStore.begin_forward`), whose commit writes every layer's at once. Nothing here reads a
length that changes between decode steps, so a traced decode step keeps one graph.
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
        """Nothing to do: the store allocates its buffers itself."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new `[R, Hkv, n, D]` keys and values, unchanged: the attention function reads
        the store and stages them."""
        return key_states, value_states

    def get_seq_length(self) -> int:
        """Most live tokens of any row in this layer (after eviction: fewer than seen)."""
        return max(self.store.length(self.layer_idx, row) for row in range(self.store.batch))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(query_length, 0)`: the registered mask function builds no mask (causality and
        row lengths are the attention function's), so mask builders need no cache length."""
        return query_length, 0

    def get_max_length(self) -> int:
        """-1: the store sizes itself; budgets are the policy's business."""
        return -1


class StoreCache(Cache):
    """A `Cache` whose layers are the layers of one `KVStore`."""

    def __init__(self, store: KVStore):
        super().__init__(layers=[StoreCacheLayer(store, i) for i in range(store.num_layers)])
        self.store = store

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: the queries' positions come with every call (`position_ids`), and the mask
        function needs no offset."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """`(query_length, 0)` (`StoreCacheLayer.get_mask_sizes`)."""
        return query_length, 0
