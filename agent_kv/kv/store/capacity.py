"""How much a store allocates: the rule its segments' capacities follow, and the footprint of a
store (live or saved) with the most its buffers can grow to.

A segment holds its longest row's live slots (and the next call's new ones) rounded up to whole
blocks with a little headroom (`GROWTH_SHARE`), and keeps its buffers while they are within
`KEEP_SHARE` plus one block of what it needs: its allocated bytes follow its live bytes at every
forward call, not a bound allocated up front (docs/architecture.md, "Capacity follows the live
tokens").
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_TOKENS = 32
"""Tokens: the grain of the token segments' capacities. A segment's allocated bytes follow its
live bytes within a tenth plus one block per layer and row (`KEEP_SHARE`)."""
SCALE_BLOCK = 4
"""Scale groups: the grain of the scale table's capacity (one group is `Int8Config.group`
tokens)."""
GROWTH_SHARE = 0.05
"""A segment that must grow (or shrink) is refitted to what it needs plus this share, in whole
blocks: the headroom that spares a decode step a reallocation every block."""
KEEP_SHARE = 0.1
"""A segment keeps its buffers while they hold what it needs with at most this share plus one
block to spare, so a length that moves a little between calls (evictions cut a few dozen
tokens, pins are released and taken) reallocates nothing, and a compiled decode step keeps its
shapes."""


def round_up(n: int, step: int) -> int:
    """`n` rounded up to a whole number of `step`s, at least one."""
    return max(step, -(-n // step) * step)


def fitted_capacity(current: int, needed: int, grain: int, bound: int | None = None) -> int:
    """The capacity a segment should have for `needed` slots per row: `current` while it holds
    them with at most `KEEP_SHARE` of them plus one `grain` to spare; otherwise `needed` plus
    `GROWTH_SHARE`, in whole grains, and never past a `bound` (the most the segment must hold
    before the next eviction, when the policy knows it) rounded up to a grain. 0 for a segment
    that needs nothing (past one grain held)."""
    if needed <= current <= needed + int(needed * KEEP_SHARE) + grain:
        return current
    want = -(-(needed + int(needed * GROWTH_SHARE)) // grain) * grain
    if bound is not None:
        want = min(want, -(-max(needed, bound) // grain) * grain)
    return want


def capacity_bound(current: int, most: int, grain: int) -> int:
    """The largest capacity a segment can reach from `current` while it never needs more than
    `most` slots: `fitted_capacity` keeps `current` or fits to what is needed, and what it fits
    to grows with the need."""
    return max(current, fitted_capacity(0, most, grain))


def live_bytes(
    channels: int, fp_elem: int, scale_elem: int, fp_tokens: int, q_tokens: int, groups: int
) -> int:
    """Bytes of live keys, values and scales: `channels` is `2 * kv_heads * head_dim` (keys
    and values), quantized tokens take one byte per channel."""
    return channels * (fp_tokens * fp_elem + q_tokens + groups * scale_elem)


@dataclass(frozen=True)
class StoreFootprint:
    """How much a store holds and has allocated: enough to bound what it can grow to without
    the store itself (a session saved to disk is described by one).

    Attributes:
        lengths: live tokens per layer (the longest row).
        fp_capacity, q_capacity, scale_capacity: FP slots, quantized slots and scale groups
            allocated per layer and row.
        batch: rows.
        fp_token_bytes: key + value bytes of one FP token in one layer.
        q_token_bytes: key + value bytes of one quantized token in one layer.
        scale_group_bytes: key + value scale bytes of one quantized group in one layer.
        live_bytes: bytes of live tokens (`KVStore.nbytes`).
        allocated_bytes: bytes of the buffers (`KVStore.allocated_nbytes`).
    """

    lengths: tuple[int, ...]
    fp_capacity: int
    q_capacity: int
    scale_capacity: int
    batch: int
    fp_token_bytes: int
    q_token_bytes: int
    scale_group_bytes: int
    live_bytes: int
    allocated_bytes: int

    @classmethod
    def of_state(cls, state: dict) -> StoreFootprint:
        """The footprint of a `KVStore.state()` (reads only tensor shapes and lengths, so a
        state loaded with `torch.load(mmap=True)` is not read into memory)."""
        layers, heads, dim = state["shape"]
        batch = state["batch"]
        fp_keys, q_keys = state["fp"]["keys"], state["q"]["keys"]
        scales = state["scales"]["keys"]
        channels = 2 * heads * dim
        fp_elem, scale_elem = fp_keys.element_size(), scales.element_size()
        lengths = state["lengths"]
        live = live_bytes(
            channels, fp_elem, scale_elem,
            sum(map(sum, lengths["fp"])), sum(map(sum, lengths["q"])),
            sum(map(sum, lengths["scales"])),
        )  # fmt: skip
        capacity = state["capacity"]
        q_bytes = channels * q_keys.element_size()
        per_slot = capacity["fp"] * channels * fp_elem + capacity["q"] * q_bytes
        allocated = layers * batch * (per_slot + capacity["scales"] * channels * scale_elem)
        return cls(
            lengths=tuple(
                max(q + f for q, f in zip(q_row, f_row, strict=True))
                for q_row, f_row in zip(lengths["q"], lengths["fp"], strict=True)
            ),
            fp_capacity=capacity["fp"],
            q_capacity=capacity["q"],
            scale_capacity=capacity["scales"],
            batch=batch,
            fp_token_bytes=channels * fp_elem,
            q_token_bytes=q_bytes,
            scale_group_bytes=channels * scale_elem,
            live_bytes=live,
            allocated_bytes=allocated,
        )

    def allocation_bound(self, max_tokens: list[int], quantizes: bool) -> int:
        """The most bytes the store's buffers can be allocated while no layer `i` holds more
        than `max_tokens[i]` tokens in a row (FP and quantized together), whatever is appended,
        evicted or quantized in between. `quantizes`: whether tokens may move to the quantized
        segment (mixed precision or a policy's quantized tier); its buffers stay as they are
        otherwise. Every layer has the capacity of the largest.

        Raises:
            ValueError: `max_tokens` does not have one entry per layer.
        """
        if len(max_tokens) != len(self.lengths):
            raise ValueError(
                f"need {len(self.lengths)} per-layer token bounds, got {len(max_tokens)}"
            )
        most = max(max_tokens)
        fp = capacity_bound(self.fp_capacity, most, BLOCK_TOKENS)
        q, groups = self.q_capacity, self.scale_capacity
        if quantizes:
            q = capacity_bound(q, most, BLOCK_TOKENS)
            groups = capacity_bound(groups, most, SCALE_BLOCK)
        per_row = fp * self.fp_token_bytes + q * self.q_token_bytes
        return len(max_tokens) * self.batch * (per_row + groups * self.scale_group_bytes)
