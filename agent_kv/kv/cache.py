"""transformers `Cache` adapter over `agent_kv.kv.store.KVStore`.

The model's attention modules call `cache.update(key_states, value_states, layer_idx)`; the
adapter hands the new keys and values straight back, and the registered attention function
(`agent_kv.kv.attention`) reads the store's segments and stages the new tokens in the call
(`ForwardCall.open`), whose commit writes every layer's at once. Nothing here reads a
length that changes between decode steps, so a traced decode step keeps one graph.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from agent_kv.kv.store import KVStore


class PassThroughLayer(CacheLayerMixin):
    """A cache layer that stores nothing: `update` hands the new keys and values back (the
    attention function reads and writes the store through its call)."""

    is_sliding = False

    def __init__(self):
        super().__init__()
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
        """0: positions come with every call (`position_ids`)."""
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(query_length, 0)`: the registered mask function builds no mask (causality and
        row lengths are the attention function's), so mask builders need no cache length."""
        return query_length, 0

    def get_max_length(self) -> int:
        """-1: the store sizes itself; budgets are the policy's business."""
        return -1


class StoreCacheLayer(PassThroughLayer):
    """One layer's view of the store, in transformers' cache-layer protocol; `is_sliding`
    says whether the layer attends through a sliding window (`KVStore.attention_windows`). No
    model's forward depends on it here: the registered mask function builds no mask, whatever
    layer transformers sizes it by."""

    def __init__(self, store: KVStore, layer_idx: int):
        super().__init__()
        self.store = store
        self.layer_idx = layer_idx
        self.is_sliding = store.attention_windows[layer_idx] is not None

    def get_seq_length(self) -> int:
        """Most live tokens of any row in this layer (after eviction: fewer than seen)."""
        return max(self.store.length(self.layer_idx, row) for row in range(self.store.batch))


class PassThroughCache(Cache):
    """A `Cache` of pass-through layers: what the model sees of a forward call whose
    attention reads and writes the store itself."""

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """0: the queries' positions come with every call (`position_ids`), and the mask
        function needs no offset."""
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """`(query_length, 0)` (`PassThroughLayer.get_mask_sizes`)."""
        return query_length, 0


class PackedCache(PassThroughCache):
    """The cache of a packed call over several stores (`agent_kv.kv.packed_call`): layers
    that hold nothing, since each sequence's attention goes through its own store's call.

    Args:
        num_layers: the model's decoder layers.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[PassThroughLayer() for _ in range(num_layers)])


class StoreCache(PassThroughCache):
    """A `Cache` whose layers are the layers of one `KVStore`."""

    def __init__(self, store: KVStore):
        super().__init__(layers=[StoreCacheLayer(store, i) for i in range(store.num_layers)])
        self.store = store
