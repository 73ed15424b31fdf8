"""What a store has held and done, counted as it happens: live and allocated peaks, evictions,
quantizations and sliding-window drops. The store's parts report here; nothing here reads a
tensor."""

from __future__ import annotations


class StoreFigures:
    """A store's counters and peaks (bytes are keys, values and scales of the hot store).

    Args:
        batch: rows.

    Attributes:
        peak_bytes: the most live bytes (`KVStore.nbytes`) held, after any forward call's
            append.
        row_peak_bytes: per row, the most live bytes that row held.
        peak_allocated_bytes: the most bytes the buffers have held (`KVStore.allocated_nbytes`),
            taken after every change of capacity.
        call_allocated_bytes: the most bytes the buffers have held since the last forward call
            began: over one call and the policy eviction after it.
        evicted_tokens: tokens evicted, summed over layers and rows (a recalled token leaves
            the count again).
        quantized_tokens: tokens moved to the quantized segment, summed over layers and rows.
        attention_window_dropped: tokens dropped from sliding-window layers as they left the
            window (not evictions).
        reencoded_tokens: tokens fed again by `Engine.reencode`, summed over its runs.
    """

    def __init__(self, batch: int):
        self.peak_bytes = 0
        self.row_peak_bytes = [0] * batch
        self.peak_allocated_bytes = 0
        self.call_allocated_bytes = 0
        self.evicted_tokens = 0
        self.quantized_tokens = 0
        self.attention_window_dropped = 0
        self.reencoded_tokens = 0

    def carry(self, earlier: StoreFigures) -> None:
        """Take over the figures of the store this one replaces (`Engine.reencode`): the
        peaks are the larger of the two, the counters the sum, so a sequence's figures span
        every store it had."""
        self.peak_bytes = max(self.peak_bytes, earlier.peak_bytes)
        self.row_peak_bytes = [
            max(mine, theirs)
            for mine, theirs in zip(self.row_peak_bytes, earlier.row_peak_bytes, strict=True)
        ]
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, earlier.peak_allocated_bytes)
        self.evicted_tokens += earlier.evicted_tokens
        self.quantized_tokens += earlier.quantized_tokens
        self.attention_window_dropped += earlier.attention_window_dropped
        self.reencoded_tokens += earlier.reencoded_tokens

    def note_allocated(self, allocated: int) -> None:
        """Take `allocated` (bytes the buffers hold now) into the peaks."""
        self.call_allocated_bytes = max(self.call_allocated_bytes, allocated)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, allocated)

    def note_live(self, per_row: dict[int, int], total: int) -> None:
        """Take the live bytes of some rows (`row -> bytes`) and of the whole store into the
        peaks."""
        for row, live in per_row.items():
            self.row_peak_bytes[row] = max(self.row_peak_bytes[row], live)
        self.peak_bytes = max(self.peak_bytes, total)

    def begin_call(self) -> None:
        """A forward call begins: the call's allocation peak starts again (from what the
        buffers hold once fitted to the call, noted next)."""
        self.call_allocated_bytes = 0
