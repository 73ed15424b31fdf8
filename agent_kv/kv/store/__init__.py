"""The KV store and its parts: `KVStore` (`kv_store`) over segments, pins, precision
tiers, the cold tier's link, shared prefix reads and figures."""

from agent_kv.kv.store.capacity import BLOCK_TOKENS, KEEP_SHARE, StoreFootprint
from agent_kv.kv.store.kv_store import ATTENTION_WINDOW_SLACK, KV_DTYPE_ATTRIBUTE, KVStore
from agent_kv.kv.store.precision import Int8Config
from agent_kv.kv.store.segments import kept_first

__all__ = [
    "ATTENTION_WINDOW_SLACK",
    "BLOCK_TOKENS",
    "KEEP_SHARE",
    "KV_DTYPE_ATTRIBUTE",
    "Int8Config",
    "KVStore",
    "StoreFootprint",
    "kept_first",
]
