"""One record of what a KV cache holds, read from its store at one moment: the figures every
front end reports (the server's and the LangChain model's `kv`, an episode's summary and its
steps, a recall task's record), so each names and counts them alike.

Bytes come in pairs, allocated (what the buffers hold, spare capacity included: what the
process pays) and live (what the kept tokens need); token counts are summed over layers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent_kv.kv.store import KVStore


@dataclass
class KVFigures:
    """A KV cache's figures at one moment (module docstring).

    Attributes:
        kv_allocated_bytes: bytes the store's buffers hold now (`KVStore.allocated_nbytes`).
        kv_live_bytes: live KV bytes now (`KVStore.nbytes`).
        peak_kv_allocated_bytes: the most bytes its buffers have held
            (`StoreFigures.peak_allocated_bytes`).
        peak_kv_live_bytes: the most live KV bytes it has held (`StoreFigures.peak_bytes`).
        full_kv_allocated_bytes: what a full KV cache of the tokens seen would allocate at
            full precision under the same growth rule (`KVStore.full_kv_allocated_nbytes`).
        full_kv_live_bytes: the live bytes of those tokens alone at full precision
            (`KVStore.full_kv_nbytes`).
        kv_shared_bytes: bytes of the shared prefix blocks the store reads
            (`PrefixReads.nbytes`; held once for every store that reads them, so apart from
            the figures above; 0 without prefix sharing).
        cold_kv_bytes: bytes of the cold tier now (evicted tokens kept for recall, in host
            memory; `RecallTier.nbytes`), 0 without one; apart from the figures above.
        peak_cold_kv_bytes: the most bytes the cold tier has held (0 without one).
        tokens_seen: tokens the store has taken in (`KVStore.seen_tokens`).
        evicted_tokens: tokens evicted, summed over layers.
        quantized_tokens: tokens moved to INT8, summed over layers.
        reencoded_tokens: tokens the engine encoded again (0 without re-encoding).
        pinned_tokens: positions pinned now.
    """

    kv_allocated_bytes: int
    kv_live_bytes: int
    peak_kv_allocated_bytes: int
    peak_kv_live_bytes: int
    full_kv_allocated_bytes: int
    full_kv_live_bytes: int
    kv_shared_bytes: int
    cold_kv_bytes: int
    peak_cold_kv_bytes: int
    tokens_seen: int
    evicted_tokens: int
    quantized_tokens: int
    reencoded_tokens: int
    pinned_tokens: int

    @classmethod
    def of(cls, store: KVStore) -> KVFigures:
        """The figures of `store` now."""
        counters = store.figures
        return cls(
            kv_allocated_bytes=store.allocated_nbytes(),
            kv_live_bytes=store.nbytes(),
            peak_kv_allocated_bytes=counters.peak_allocated_bytes,
            peak_kv_live_bytes=counters.peak_bytes,
            full_kv_allocated_bytes=store.full_kv_allocated_nbytes(),
            full_kv_live_bytes=store.full_kv_nbytes(),
            kv_shared_bytes=store.prefix.nbytes(),
            cold_kv_bytes=store.recall.nbytes(),
            peak_cold_kv_bytes=store.recall.peak_bytes,
            tokens_seen=store.seen_tokens,
            evicted_tokens=counters.evicted_tokens,
            quantized_tokens=counters.quantized_tokens,
            reencoded_tokens=counters.reencoded_tokens,
            pinned_tokens=store.pins.tokens(),
        )

    def fields_of(self, record: type) -> dict[str, Any]:
        """The figures a report of dataclass `record` carries, by name: those of its fields
        that are figures here."""
        names = {field.name for field in dataclasses.fields(record)}
        return {key: value for key, value in dataclasses.asdict(self).items() if key in names}
