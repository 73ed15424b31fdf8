"""The KV store: dense per-layer buffers in two precisions, scores, pins, exact accounting.

Layout (docs/architecture.md, Decisions, "Layout"): each layer holds, for a batch of `B` rows,
- an FP segment `[B, kv_heads, capacity, head_dim]` in the model's dtype: pinned tokens, the
  newest tokens, and (without INT8) everything;
- a quantized segment of the same shape, in int8 or float8_e4m3fn (`kernels.formats`), with
  float16 scales per KV head and channel for each group of tokens quantized together, and
  each slot's group index (`kernels.int8`). Tokens reach it by age (`Int8Config`, CONF-KV's
  mixed precision: `quantize_stale`) or chosen by a policy (`quantize_slots`, ARKV's
  tri-state cache); one store holds one format.
A row's live tokens are its first `q_len[row]` quantized slots followed by its first
`fp_len[row]` FP slots; that concatenation is the row's *logical order*, the order of the
per-token metadata (original positions, scores). Rows have their own lengths: slots past a
row's length are masked by the attention read, never zero-padded into the softmax.

Eviction gathers the kept slots into the front of the same buffers (contiguous compaction,
CONF-KV §4), so attention reads dense prefixes and never an indirection table. Tokens that
leave the FP window move to the INT8 segment in groups (`quantize_stale`); pinned tokens
never do.

Positions: by default keys are stored rotated at their original positions and the next
token's position is the number of tokens the row has seen. In `rerotate` mode (StreamingLLM,
see `agent_kv.kv.rope`) keys are stored unrotated and rotated at every read to their rank among
the row's live tokens, and new tokens take positions inside the cache, so an episode can run
past the model's trained context.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from agent_kv.errors import ConfigError, ContextOverflowError
from agent_kv.kv.cold_tier import ColdConfig, ColdTier
from agent_kv.kv.rope import Rotary
from kernels import dispatch
from kernels.formats import QUANT_FORMATS, QuantFormat, format_name
from kernels.int8 import SCALE_DTYPE, dequantize
from kernels.reference import Segment, apply_rotation

CAPACITY_STEP = 256  # tokens; buffers grow to multiples of this, by doubling
SCALE_CAPACITY_STEP = 16  # scale groups; the quantized segment's scales grow in these
SHRINK_GRAIN = 8
"""A buffer shrinks to whole grains of `step // SHRINK_GRAIN` slots (32 tokens, 2 scale
groups), keeping at least one grain free: finer than growth, so a shrunk buffer holds close to
its live bytes, and a free grain is one default INT8 group, so the decode sawtooth of mixed
precision (up to a group waiting in FP, then moving to INT8) fits without growing again."""
ALLOCATED_BUFFERS = ("keys", "values", "q_keys", "q_values", "key_scales", "value_scales")
"""The buffers of `LayerStore` that hold keys, values and scales (what `allocated_nbytes`
counts)."""
SEGMENT_OF_BUFFER = {
    "keys": ("fp", 2), "values": ("fp", 2), "q_keys": ("q", 2), "q_values": ("q", 2),
    "q_group": ("q", 1), "key_scales": ("scales", 2), "value_scales": ("scales", 2),
}  # fmt: skip
"""Each buffer of `LayerStore` (besides the metadata): the segment whose slots it holds and
the dimension of those slots."""
META_FIELDS = (
    "positions", "scores", "accumulated", "hits", "hit_mean", "hit_m2", "window_mass",
    "reconstruction",
)  # fmt: skip
"""Per-token metadata of `LayerStore`, each with the token (logical order) as last dimension."""


def _round_up(n: int, step: int = CAPACITY_STEP) -> int:
    return max(step, -(-n // step) * step)


def _resized(tensor: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A copy of `tensor` with `size` entries along `dim`, the first ones carried over."""
    shape = list(tensor.shape)
    shape[dim] = size
    out = torch.zeros(shape, dtype=tensor.dtype, device=tensor.device)
    keep = min(size, tensor.shape[dim])
    out.narrow(dim, 0, keep).copy_(tensor.narrow(dim, 0, keep))
    return out


def _grown_capacity(current: int, needed: int, step: int = CAPACITY_STEP) -> int | None:
    """The capacity to grow to when `needed` slots exceed `current` (None otherwise): twice
    `current`'s whole steps, at least `needed`, rounded up to a multiple of `step`."""
    if needed <= current:
        return None
    return _round_up(max(needed, 2 * (current - current % step)), step)


def _new_capacity(current: int, needed: int, step: int = CAPACITY_STEP) -> int | None:
    """The capacity to reallocate to, or None to keep `current`: grow as `_grown_capacity`
    when `needed` exceeds it; shrink to `needed` plus one grain of `step // SHRINK_GRAIN`,
    rounded up to whole grains, when `current` is larger than what one growth from that
    shrunk capacity would give.

    So growth's own slack is never shrunk: a length that swings across a capacity (a decode
    sawtooth of quantized groups or of evictions) grows once and then keeps that capacity
    instead of reallocating back and forth, whatever the swing; a buffer of one `step` or less
    never shrinks. The price: a buffer may keep up to about twice its live slots, as growth
    leaves them (512 slots stay for 193 to 512 live: their fitted 256 or more grows to 512).
    """
    grown = _grown_capacity(current, needed, step)
    if grown is not None:
        return grown
    grain = step // SHRINK_GRAIN
    fitted = _round_up(needed + grain, grain)
    return fitted if current > _grown_capacity(fitted, fitted + 1, step) else None


def _live_bytes(
    channels: int, fp_elem: int, scale_elem: int, fp_tokens: int, q_tokens: int, groups: int
) -> int:
    """Bytes of live keys, values and scales: `channels` is `2 * kv_heads * head_dim` (keys
    and values), quantized tokens take one byte per channel."""
    return channels * (fp_tokens * fp_elem + q_tokens + groups * scale_elem)


def _capacity_bound(current: int, most: int, step: int) -> int:
    """The largest capacity `_new_capacity` can reach from `current` while never more than
    `most` slots are needed. A growth from a capacity `c < n <= most` goes to
    `max(round_up(n), 2f)`, `f` the whole steps of `c`: a multiple of `step` below `most`, so
    at most `round_up(most) - step`; a shrink only lowers the capacity (and a later growth
    starts from lower)."""
    top = _round_up(most, step)
    return max(current, top, 2 * (top - step))


@dataclass(frozen=True)
class StoreFootprint:
    """How much a store holds and has allocated, per layer: enough to bound what it can grow
    to without the store itself (a session saved to disk is described by one).

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
    fp_capacity: tuple[int, ...]
    q_capacity: tuple[int, ...]
    scale_capacity: tuple[int, ...]
    batch: int
    fp_token_bytes: int
    q_token_bytes: int
    scale_group_bytes: int
    live_bytes: int
    allocated_bytes: int

    @classmethod
    def of_state(cls, state: dict) -> StoreFootprint:
        """The footprint of a `KVStore.state()` (reads only tensor shapes, so a state loaded
        with `torch.load(mmap=True)` is not read into memory)."""
        layers = state["layers"]
        first = layers[0]
        batch, heads, _, dim = first["keys"].shape
        channels = 2 * heads * dim
        fp_elem = first["keys"].element_size()
        scale_elem = first["key_scales"].element_size()
        live = sum(
            _live_bytes(
                channels, fp_elem, scale_elem, sum(lay["fp_len"]), sum(lay["q_len"]),
                sum(lay["n_groups"]),
            )
            for lay in layers
        )  # fmt: skip
        capacity = [_capacities(lay) for lay in layers]
        q_bytes = channels * first["q_keys"].element_size()
        allocated = batch * sum(
            c["fp"] * channels * fp_elem + c["q"] * q_bytes + c["scales"] * channels * scale_elem
            for c in capacity
        )
        return cls(
            lengths=tuple(
                max(q + f for q, f in zip(lay["q_len"], lay["fp_len"], strict=True))
                for lay in layers
            ),
            fp_capacity=tuple(c["fp"] for c in capacity),
            q_capacity=tuple(c["q"] for c in capacity),
            scale_capacity=tuple(c["scales"] for c in capacity),
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
        otherwise.

        Raises:
            ValueError: `max_tokens` does not have one entry per layer.
        """
        if len(max_tokens) != len(self.lengths):
            raise ValueError(
                f"need {len(self.lengths)} per-layer token bounds, got {len(max_tokens)}"
            )
        total = 0
        for i, most in enumerate(max_tokens):
            fp = _capacity_bound(self.fp_capacity[i], most, CAPACITY_STEP)
            q, groups = self.q_capacity[i], self.scale_capacity[i]
            if quantizes:
                q = _capacity_bound(q, most, CAPACITY_STEP)
                groups = _capacity_bound(groups, most, SCALE_CAPACITY_STEP)
            per_row = fp * self.fp_token_bytes + q * self.q_token_bytes
            total += self.batch * (per_row + groups * self.scale_group_bytes)
        return total


@dataclass(frozen=True)
class Int8Config:
    """Mixed precision (CONF-KV §4): the newest `fp_window` unpinned tokens stay in the model's
    dtype; older retained unpinned tokens are stored as INT8 per KV head and channel.

    Attributes:
        fp_window: `W`, newest unpinned tokens of every layer kept at full precision.
        group: tokens quantized together (sharing one scale per head and channel); tokens
            leave the FP window in whole groups, so up to `group - 1` extra stay FP.
    """

    fp_window: int = 128
    group: int = 32

    @property
    def max_fp_tokens(self) -> int:
        """The most unpinned tokens a layer holds at full precision: the FP window plus up to
        `group - 1` waiting for a whole group."""
        return self.fp_window + self.group - 1

    def validate(self) -> None:
        """Raises `ConfigError` for a window that is not a whole number >= 0 or a group that
        is not a whole number >= 1."""
        if not isinstance(self.fp_window, int) or self.fp_window < 0:
            raise ConfigError(f"int8 fp_window must be a whole number >= 0, got {self.fp_window!r}")
        if not isinstance(self.group, int) or self.group < 1:
            raise ConfigError(f"int8 group must be a whole number >= 1, got {self.group!r}")


class LayerStore:
    """One layer's live tokens for `batch` rows.

    Attributes:
        keys, values: FP segment `[B, kv_heads, capacity, head_dim]`, model dtype.
        fp_len: live FP slots per row.
        q_keys, q_values: quantized segment `[B, kv_heads, q_capacity, head_dim]`, int8 or
            float8_e4m3fn.
        q_len: live quantized slots per row.
        q_group: `[B, q_capacity]` int64, the scale index of each quantized slot.
        key_scales, value_scales: `[B, kv_heads, groups, head_dim]` float16.
        n_groups: scale rows in use per row.
        positions: `[B, meta_capacity]` int64, original position of each slot in logical order.
        scores: `[B, kv_heads, meta_capacity]` float32, EMA of normalised attention mass.
        accumulated: same shape, attention mass summed over every query since the token
            arrived (H2O's accumulated score; favours old tokens by design).
        hits: `[B, meta_capacity]` float32, forward calls that have scored each token.
        hit_mean, hit_m2: `[B, kv_heads, meta_capacity]` float32, Welford's running mean and
            sum of squared deviations of the relative attention each token received per call
            (ARKV's heavy-hitter statistics, see `KVStore.record_attention`).
        window_mass: `[B, kv_heads, meta_capacity]` float32, the attention each token received
            from the last observation window (SnapKV, see `KVStore.record_window`); 0 for
            tokens that arrived after it.
        reconstruction: same shape, the largest attention probability each token received
            from a reconstruction pass (KVzip, `KVStore.record_reconstruction`); 0 for
            tokens no pass has seen.
        appended: tokens ever appended per row (the next original position).
    """

    def __init__(
        self, batch: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ):
        self.batch = batch
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.fp_len = [0] * batch
        self.q_len = [0] * batch
        self.n_groups = [0] * batch
        self.appended = [0] * batch
        shape = (batch, kv_heads, 0, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.q_keys = torch.zeros(shape, dtype=torch.int8, device=device)
        self.q_values = torch.zeros_like(self.q_keys)
        self.q_group = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.key_scales = torch.zeros(shape, dtype=SCALE_DTYPE, device=device)
        self.value_scales = torch.zeros_like(self.key_scales)
        self.positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.scores = torch.zeros(batch, kv_heads, 0, device=device)
        self.accumulated = torch.zeros_like(self.scores)
        self.hits = torch.zeros(batch, 0, device=device)
        self.hit_mean = torch.zeros_like(self.scores)
        self.hit_m2 = torch.zeros_like(self.scores)
        self.window_mass = torch.zeros_like(self.scores)
        self.reconstruction = torch.zeros_like(self.scores)
        self._fit_fp(CAPACITY_STEP)
        self._fit_meta(CAPACITY_STEP)

    def length(self, row: int = 0) -> int:
        """Live tokens of a row (quantized + FP)."""
        return self.q_len[row] + self.fp_len[row]

    @property
    def capacity(self) -> int:
        """FP slots allocated per row."""
        return self.keys.shape[2]

    def _fit_fp(self, needed: int, shrink: bool = False) -> None:
        """Grow the FP segment to hold `needed` slots per row; with `shrink`, also shrink it
        (`_new_capacity`)."""
        size = (_new_capacity if shrink else _grown_capacity)(self.keys.shape[2], needed)
        if size is not None:
            self.keys, self.values = (_resized(t, 2, size) for t in (self.keys, self.values))

    def _fit_meta(self, needed: int, shrink: bool = False) -> None:
        """`_fit_fp` for the per-token metadata."""
        size = (_new_capacity if shrink else _grown_capacity)(self.positions.shape[1], needed)
        if size is not None:
            for name in META_FIELDS:
                tensor = getattr(self, name)
                setattr(self, name, _resized(tensor, tensor.dim() - 1, size))

    def _reorder_meta(self, row: int, order: torch.Tensor) -> None:
        """Put the row's per-token metadata in `order` (logical slots, int64 `[k]`) at its
        first `k` slots."""
        k = order.numel()
        for name in META_FIELDS:
            tensor = getattr(self, name)[row]
            tensor[..., :k] = tensor[..., order]

    def _fit_quantized(self, needed: int, groups: int, shrink: bool = False) -> None:
        """`_fit_fp` for the quantized segment (`needed` slots) and its scales (`groups`)."""
        rule = _new_capacity if shrink else _grown_capacity
        size = rule(self.q_keys.shape[2], needed)
        if size is not None:
            self.q_keys, self.q_values = (
                _resized(t, 2, size) for t in (self.q_keys, self.q_values)
            )
            self.q_group = _resized(self.q_group, 1, size)
        size = rule(self.key_scales.shape[2], groups, step=SCALE_CAPACITY_STEP)
        if size is not None:
            self.key_scales, self.value_scales = (
                _resized(t, 2, size) for t in (self.key_scales, self.value_scales)
            )

    def append(self, rows: range, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Append `n` new tokens to each of `rows`; `keys`, `values`: `[len(rows), H, n, D]`."""
        n = keys.shape[2]
        # buffers are shared by every row: size them for the longest row after this append
        grow = [n if r in rows else 0 for r in range(self.batch)]
        self._fit_fp(max(f + g for f, g in zip(self.fp_len, grow, strict=True)))
        self._fit_meta(max(self.length(r) + g for r, g in enumerate(grow)))
        for i, row in enumerate(rows):
            fp, logical = self.fp_len[row], self.length(row)
            self.keys[row, :, fp : fp + n] = keys[i]
            self.values[row, :, fp : fp + n] = values[i]
            self.positions[row, logical : logical + n] = torch.arange(
                self.appended[row], self.appended[row] + n, device=self.device
            )
            for name in META_FIELDS[1:]:
                getattr(self, name)[row, ..., logical : logical + n] = 0.0
            self.fp_len[row] += n
            self.appended[row] += n

    def live_positions(self, row: int = 0) -> torch.Tensor:
        """`[length]` original positions of the row's live tokens, in logical order."""
        return self.positions[row, : self.length(row)]

    def compact(self, row: int, keep: torch.Tensor) -> None:
        """Keep only the logical slots `keep` (int64 `[k]`, increasing) of `row`.

        Quantized tokens move with their group index; scale rows no kept token uses are
        dropped. Buffers then shrink to the longest row's live slots by `_new_capacity`'s
        rule.
        """
        q_len = self.q_len[row]
        kept_q, kept_fp = keep[keep < q_len], keep[keep >= q_len] - q_len
        self._reorder_meta(row, keep)
        nf = kept_fp.numel()
        for buffer in (self.keys, self.values):
            dispatch.compact(buffer, row, kept_fp)
        self.fp_len[row] = nf
        nq = kept_q.numel()
        for buffer in (self.q_keys, self.q_values):
            dispatch.compact(buffer, row, kept_q)
        groups = self.q_group[row, kept_q]
        used = torch.unique(groups)  # sorted
        self.q_group[row, :nq] = torch.searchsorted(used, groups)
        self.key_scales[row, :, : used.numel()] = self.key_scales[row, :, used]
        self.value_scales[row, :, : used.numel()] = self.value_scales[row, :, used]
        self.q_len[row] = nq
        self.n_groups[row] = used.numel()
        self._fit_fp(max(self.fp_len), shrink=True)
        self._fit_meta(max(self.length(r) for r in range(self.batch)), shrink=True)
        self._fit_quantized(max(self.q_len), max(self.n_groups), shrink=True)

    def read_slots(self, row: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 keys and values `[H, m, D]` of the row's logical slots `slots` (int64
        `[m]`), quantized ones dequantized with their group's scales."""
        q_len = self.q_len[row]
        quantized, fp = slots[slots < q_len], slots[slots >= q_len] - q_len
        keys = [self.keys[row, :, fp].float()]
        values = [self.values[row, :, fp].float()]
        if quantized.numel():
            groups = self.q_group[row, quantized]
            keys.insert(
                0, dequantize(self.q_keys[row, :, quantized], self.key_scales[row][:, groups])
            )
            values.insert(
                0, dequantize(self.q_values[row, :, quantized], self.value_scales[row][:, groups])
            )
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def insert(
        self, row: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor
    ) -> None:
        """Put tokens back into the row's FP segment at their original positions (a recall):
        the segment stays in position order, so the newest tokens stay last.

        Args:
            keys, values: `[H, m, D]`, in the store's key convention.
            positions: `[m]` int64 original positions, all older than the newest token.
        """
        m = positions.numel()
        fp, logical = self.fp_len[row], self.length(row)
        self._fit_fp(max(max(self.fp_len), fp + m))
        self._fit_meta(max(max(self.length(r) for r in range(self.batch)), logical + m))
        self.keys[row, :, fp : fp + m] = keys.to(self.dtype)
        self.values[row, :, fp : fp + m] = values.to(self.dtype)
        self.positions[row, logical : logical + m] = positions
        for name in META_FIELDS[1:]:
            getattr(self, name)[row, ..., logical : logical + m] = 0.0
        q_len = self.q_len[row]
        order = torch.argsort(self.positions[row, q_len : logical + m])
        for buffer in (self.keys, self.values):
            buffer[row, :, : fp + m] = buffer[row, :, order]
        self._reorder_meta(row, torch.cat([torch.arange(q_len, device=self.device), q_len + order]))
        self.fp_len[row] = fp + m

    def stale_slots(self, row: int, pinned: torch.Tensor, config: Int8Config) -> torch.Tensor:
        """FP slots (int64, indices into the FP segment, oldest first) that left the FP
        window: unpinned FP tokens older than the newest `config.fp_window`, in whole groups
        of `config.group`.

        Args:
            pinned: `[length]` bool over the row's logical slots.
        """
        # the FP segment stays in arrival order: appends go to its end, gathers keep order
        unpinned = (~pinned[self.q_len[row] :]).nonzero().squeeze(1)  # FP slots, oldest first
        stale = unpinned[: max(unpinned.numel() - config.fp_window, 0)]
        return stale[: stale.numel() // config.group * config.group]

    def quantize(self, row: int, moving: torch.Tensor, group: int, fmt: QuantFormat) -> None:
        """Move the FP slots `moving` (int64 `[m]`, increasing indices into the FP segment,
        `m` a multiple of `group`) of `row` into the quantized segment, `group` consecutive
        ones sharing a scale; they go to the end of the quantized segment, so logical order
        becomes (old quantized, moved, remaining FP). The FP segment shrinks by
        `_new_capacity`'s rule before the quantized one grows, so the two are never held at
        their larger sizes together.

        Raises:
            ValueError: `m` is not a multiple of `group`.
            ConfigError: the layer already holds tokens in another format (one store, one
                quantized format).
        """
        m = moving.numel()
        if m % group:
            raise ValueError(f"{m} tokens do not split into groups of {group}")
        if self.q_keys.dtype != fmt.dtype:
            if any(self.q_len):
                held = format_name(self.q_keys.dtype)
                raise ConfigError(
                    f"this cache holds {held} tokens; cannot add {fmt.name} ones (one format "
                    "per session)"
                )
            self.q_keys = self.q_keys.to(fmt.dtype)
            self.q_values = self.q_values.to(fmt.dtype)
        q_len, fp_len = self.q_len[row], self.fp_len[row]
        staying = torch.ones(fp_len, dtype=torch.bool, device=self.device)
        staying[moving] = False
        staying = staying.nonzero().squeeze(1)
        q_keys, k_scales = dispatch.quantize_groups(self.keys[row, :, moving], group, fmt)
        q_values, v_scales = dispatch.quantize_groups(self.values[row, :, moving], group, fmt)
        groups, new_groups = self.n_groups[row], m // group
        for buffer in (self.keys, self.values):
            dispatch.compact(buffer, row, staying)
        self.fp_len[row] = fp_len - m
        self._fit_fp(max(self.fp_len), shrink=True)
        others = [r for r in range(self.batch) if r != row]
        self._fit_quantized(
            max([q_len + m, *(self.q_len[r] for r in others)]),
            max([groups + new_groups, *(self.n_groups[r] for r in others)]),
        )
        self.q_keys[row, :, q_len : q_len + m] = q_keys
        self.q_values[row, :, q_len : q_len + m] = q_values
        self.q_group[row, q_len : q_len + m] = groups + torch.arange(m, device=self.device).div(
            group, rounding_mode="floor"
        )
        self.key_scales[row, :, groups : groups + new_groups] = k_scales
        self.value_scales[row, :, groups : groups + new_groups] = v_scales
        self.n_groups[row] = groups + new_groups
        self._reorder_meta(
            row,
            torch.cat([torch.arange(q_len, device=self.device), q_len + moving, q_len + staying]),
        )
        self.q_len[row] = q_len + m

    def nbytes(self, row: int | None = None) -> int:
        """Bytes of live tokens: FP keys and values, INT8 keys and values, and the scales
        in use, for one row or (None) all rows."""
        rows = range(self.batch) if row is None else [row]
        return _live_bytes(
            2 * self.kv_heads * self.head_dim,
            self.keys.element_size(),
            self.key_scales.element_size(),
            sum(self.fp_len[r] for r in rows),
            sum(self.q_len[r] for r in rows),
            sum(self.n_groups[r] for r in rows),
        )

    def allocated_nbytes(self) -> int:
        """Bytes of the key, value and scale buffers including unused capacity."""
        return sum(getattr(self, name).nbytes for name in ALLOCATED_BUFFERS)


class KVStore:
    """The KV cache of a batch of sequences across all layers of a model.

    Args:
        num_layers: decoder layers.
        kv_heads: key/value heads per layer (GQA: fewer than query heads).
        head_dim: channels per head.
        dtype: storage dtype of the FP segment.
        device: where the buffers live.
        ema_decay: weight of the old score in the attention-mass EMA, per forward call.
        batch: rows (independent sequences).
        int8: mixed-precision settings, or None to keep every token in `dtype`.
        rotary: the model's rotary embedding for `rerotate` positions, or None for original
            positions.
        max_positions: the model's trained context in tokens (0: unchecked); no forward call
            may place a token past it.

    Raises:
        ValueError: non-positive sizes or an `ema_decay` outside [0, 1).
        ConfigError: invalid `int8` settings.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ema_decay: float = 0.9,
        batch: int = 1,
        int8: Int8Config | None = None,
        rotary: Rotary | None = None,
        max_positions: int = 0,
    ):
        if min(num_layers, kv_heads, head_dim, batch) <= 0:
            raise ValueError("num_layers, kv_heads, head_dim and batch must be positive")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1), got {ema_decay}")
        if int8 is not None:
            int8.validate()
        device = torch.device(device)
        self.batch = batch
        self.layers = [
            LayerStore(batch, kv_heads, head_dim, dtype, device) for _ in range(num_layers)
        ]
        self.ema_decay = ema_decay
        self.int8 = int8
        self.rotary = rotary
        self._pinned = torch.zeros(batch, 0, dtype=torch.bool, device=device)
        self._rows = range(batch)
        self._query_positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.max_positions = max_positions
        self.peak_bytes = 0
        """The most live bytes (`nbytes`) the store has held, after any forward call's append."""
        self.row_peak_bytes = [0] * batch
        self.peak_allocated_bytes = self.allocated_nbytes()
        """The most bytes its buffers have held (`allocated_nbytes`): taken after every append
        and every quantization, the only operations that grow them."""
        self.call_allocated_bytes = self.peak_allocated_bytes
        """The most bytes its buffers have held since the last `begin_forward`: over one
        forward call and the policy step after it."""
        self.evicted_tokens = 0
        self.quantized_tokens = 0
        self.changed_at = [0] * batch
        """Per row, the tokens seen when eviction or quantization last changed its cache: the
        cache holds exactly what feeding its first `changed_at` tokens would give, plus
        everything fed since, unaltered."""
        self.profile_prefill = False
        """Whether multi-token forward calls measure the shape of their attention
        (`record_profile`); a policy that plans from it turns it on (`Policy.prepare`)."""
        self.profile: torch.Tensor | None = None
        """`[num_layers, 4]`: sums of the three prefill statistics and the calls counted."""
        self.observation_window = 0
        """How many of a multi-token forward call's last queries `record_window` measures
        (SnapKV's observation window; 0: none); a policy that ranks by it sets it
        (`Policy.prepare`)."""
        self.observed_from = [0] * batch
        """Per row, the position of the first query of the last observation window: tokens
        from there on (the window and what came after it) have no `window_mass` of their own."""
        self.cold: ColdTier | None = None
        """Where evicted tokens go instead of being lost (`attach_cold`), or None."""
        self.reconstructing = False
        """Whether the current forward call is a reconstruction pass (KVzip): its attention
        only records `reconstruction` maxima, and its tokens are truncated away after it."""
        self.recalling = False
        """Whether the current forward call and policy step use the cold tier: evictions go
        there and recalls come from it. The policy says so before every call
        (`Policy.prepare`); a tier whose policy changed keeps its pages, unused."""

    @classmethod
    def for_model(cls, model: torch.nn.Module, rerotate: bool = False, **kwargs) -> KVStore:
        """A store shaped for a transformers causal LM (reads `model.config`); `rerotate`
        selects in-cache positions (raises `ConfigError` for models without RoPE)."""
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        param = next(model.parameters())
        kwargs.setdefault("dtype", param.dtype)
        kwargs.setdefault("device", param.device)
        if rerotate:
            kwargs["rotary"] = Rotary.from_model(model)
        kwargs.setdefault("max_positions", int(getattr(cfg, "max_position_embeddings", 0) or 0))
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, **kwargs)

    @property
    def positions_mode(self) -> str:
        """ "original" or "rerotate"."""
        return "original" if self.rotary is None else "rerotate"

    @property
    def seen_tokens(self) -> int:
        """Tokens appended to row 0 so far (`seen(row)` for others)."""
        return self.seen(0)

    def seen(self, row: int) -> int:
        """Tokens appended to a row so far (its next original position)."""
        return self.layers[0].appended[row]

    def bytes_per_token(self) -> int:
        """Key + value bytes one token costs across all layers at full precision."""
        layer = self.layers[0]
        return 2 * len(self.layers) * layer.kv_heads * layer.head_dim * layer.keys.element_size()

    def int8_bytes_per_token(self, group: int) -> float:
        """Bytes one INT8 token costs across all layers, with its `1/group` share of the
        float16 scales of its group."""
        layer = self.layers[0]
        per_channel = 1 + layer.key_scales.element_size() / group
        return 2 * len(self.layers) * layer.kv_heads * layer.head_dim * per_channel

    def begin_forward(self, rows: range, n: int, start: int | None = None) -> torch.Tensor:
        """Declare the next model call: `n` new tokens for each of the contiguous `rows`.

        Args:
            start: the first rotary position of the call for every row, instead of the
                default (a reconstruction pass that must stay inside the trained context).

        Returns:
            `position_ids` `[len(rows), n]` for the call: tokens seen onward (original
            positions), or the most live tokens of any layer onward (rerotate).

        Raises:
            ValueError: rows out of range or not contiguous ascending, or `n < 1`.
            ContextOverflowError: positions past the model's trained context.
        """
        if not rows or rows.step != 1 or rows.start < 0 or rows.stop > self.batch or n < 1:
            raise ValueError(f"rows must be a non-empty ascending range within {self.batch}")
        if start is not None:
            starts = [start] * len(rows)
        elif self.rotary is None:
            starts = [self.seen(r) for r in rows]
        else:
            starts = [max(layer.length(r) for layer in self.layers) for r in rows]
        self.check_context(max(starts) + n)
        device = self.layers[0].device
        self._rows = rows
        self.call_allocated_bytes = 0  # appends only grow buffers: `_note_peak` takes the most
        self._query_positions = torch.tensor(starts, device=device)[:, None] + torch.arange(
            n, device=device
        )
        return self._query_positions

    def check_context(self, end: int) -> None:
        """Raise `ContextOverflowError` if position `end - 1` lies past the model's trained
        context (known when the store was made with `for_model`)."""
        if self.max_positions and end > self.max_positions:
            if self.rotary is None:
                hint = "use rerotate positions (--positions rerotate) with a budgeted policy"
            else:
                hint = "the policy keeps too many tokens: lower its budget or pin less"
            raise ContextOverflowError(
                f"position {end - 1} is past the model's {self.max_positions}-token context "
                f"({self.positions_mode} positions); {hint}"
            )

    def append(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append new tokens to one layer, for the rows of the current `begin_forward`.

        Args:
            keys, values: `[len(rows), kv_heads, n, head_dim]`, keys rotated at the positions
                `begin_forward` returned.

        Returns:
            The FP segment of those rows, `[len(rows), kv_heads, max fp length, head_dim]`
            views; attention reads the whole store through `segments`.

        Raises:
            ValueError: a shape that does not match the rows or the heads.
        """
        layer = self.layers[layer_idx]
        rows = self._rows
        expected = [len(rows), layer.kv_heads, self._query_positions.shape[1], layer.head_dim]
        if list(keys.shape) != expected:
            raise ValueError(f"expected keys {expected}, got {list(keys.shape)}")
        if self.rotary is not None:
            cos, sin = self.rotary.cos_sin(self._query_positions)
            keys = Rotary.unrotate(keys.float(), cos, sin).to(keys.dtype)
        layer.append(rows, keys, values)
        if layer_idx == len(self.layers) - 1:
            self._note_peak()
        fp = max(layer.fp_len[r] for r in rows)
        rows_slice = slice(rows.start, rows.stop)
        return layer.keys[rows_slice, :, :fp], layer.values[rows_slice, :, :fp]

    def segments(self, layer_idx: int) -> list[Segment]:
        """What attention reads for the current rows: the INT8 segment (when any row has one)
        and the FP segment ending with the new tokens, with rotation tables in rerotate mode."""
        layer = self.layers[layer_idx]
        rows = slice(self._rows.start, self._rows.stop)
        q_lens = layer.q_len[rows]
        fp_lens = layer.fp_len[rows]
        cos_q = sin_q = cos_fp = sin_fp = None
        if self.rotary is not None:
            cos_q, sin_q, cos_fp, sin_fp = self._read_rotation(layer_idx)
        fp = Segment(
            keys=layer.keys[rows, :, : max(fp_lens)],
            values=layer.values[rows, :, : max(fp_lens)],
            lengths=fp_lens,
            causal=True,
            cos=cos_fp,
            sin=sin_fp,
        )
        if max(q_lens) == 0:
            return [fp]
        width = max(q_lens)
        quantized = Segment(
            keys=layer.q_keys[rows, :, :width],
            values=layer.q_values[rows, :, :width],
            lengths=q_lens,
            key_scales=layer.key_scales[rows],
            value_scales=layer.value_scales[rows],
            scale_index=layer.q_group[rows, :width],
            cos=cos_q,
            sin=sin_q,
        )
        return [quantized, fp]

    def _read_rotation(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        """Rerotate tables `(cos_q, sin_q, cos_fp, sin_fp)`, `[rows, width, D]` each: every
        live token at its rank among the row's live tokens, shifted so the new tokens sit at
        the query positions of this call."""
        layer = self.layers[layer_idx]
        rows = list(self._rows)
        q_width = max(layer.q_len[r] for r in rows)
        fp_width = max(layer.fp_len[r] for r in rows)
        device = layer.device
        q_pos = torch.zeros(len(rows), q_width, dtype=torch.long, device=device)
        fp_pos = torch.zeros(len(rows), fp_width, dtype=torch.long, device=device)
        new = self._query_positions.shape[1]
        for i, row in enumerate(rows):
            original = layer.live_positions(row)
            rank = torch.argsort(torch.argsort(original))
            shifted = rank + (self._query_positions[i, 0] - (original.numel() - new))
            q_pos[i, : layer.q_len[row]] = shifted[: layer.q_len[row]]
            fp_pos[i, : layer.fp_len[row]] = shifted[layer.q_len[row] :]
        cos_q, sin_q = self.rotary.cos_sin(q_pos)
        cos_fp, sin_fp = self.rotary.cos_sin(fp_pos)
        return cos_q, sin_q, cos_fp, sin_fp

    def record_attention(
        self,
        layer_idx: int,
        masses: list[torch.Tensor],
        query_len: int,
        group: int,
        scored_offsets: torch.Tensor | None = None,
    ) -> None:
        """Fold one forward call's attention into the layer's scores, for the current rows.

        Args:
            masses: per segment of `segments(layer_idx)`, `[rows, kv_heads, width]`: the
                attention probability each slot received, summed over the scored queries
                and the `group` query heads of its KV head.
            query_len: queries per row in this call (1 in decode, the chunk size in prefill).
            group: query heads per KV head.
            scored_offsets: int64 `[S]`, ascending: which of the call's queries (0-based) the
                mass sums over (`agent_kv.kv.attention.scored_offsets`); default all
                `query_len`.

        The step's mean attention per query `a_j = mass_j / (group * n_j)`, where `n_j` counts
        the scored queries that could see token j under the causal mask, removes the bias
        toward old tokens (docs/methods.md, "Attention-mass statistics"). Tokens already
        scored update as `s <- d*s + (1-d)*a`; the `query_len` new tokens start at `a`. The
        mass is also added to `accumulated` (H2O's score), scaled by `query_len / S` so that a
        sample stands for the whole call's queries.

        ARKV's heavy-hitter statistics (`hits`, `hit_mean`, `hit_m2`) take one observation per
        call, the relative attention `x_j = a_j * L` (L the row's live tokens: 1.0 is a uniform
        share), folded in by Welford's update (`count += 1; d = x - mean; mean += d / count;
        m2 += d * (x - mean)`), so mean and variance do not drift as the context grows.
        """
        layer = self.layers[layer_idx]
        device = masses[0].device
        # n_j for the new tokens: the scored queries at or after token j's offset in the call
        if scored_offsets is None:
            scored = query_len
            seen_by = torch.arange(query_len, 0, -1, device=device)
        else:
            scored = len(scored_offsets)
            seen_by = scored - torch.searchsorted(
                scored_offsets.to(device), torch.arange(query_len, device=device)
            )
        weight = query_len / scored
        for i, row in enumerate(self._rows):
            mass = _logical_mass(layer, masses, i, row)  # [kv_heads, length]
            n = mass.shape[1]
            first_new = n - query_len
            visible = torch.full((n,), float(scored), device=mass.device)
            visible[first_new:] = seen_by
            step = mass / (visible * group)
            scores = layer.scores[row, :, :n]
            scores[:, :first_new].mul_(self.ema_decay).add_(
                step[:, :first_new], alpha=1 - self.ema_decay
            )
            scores[:, first_new:] = step[:, first_new:]
            layer.accumulated[row, :, :n].add_(mass, alpha=weight)
            _welford(layer, row, step * n, first_new)

    def record_reconstruction(
        self, layer_idx: int, maxes: list[torch.Tensor], query_len: int
    ) -> None:
        """Fold a reconstruction pass's attention into the layer's `reconstruction` scores,
        for the current rows: each token the pass did not add keeps the larger of its score
        and the pass's (KVzip, Kim et al. 2025, §3.2: a token matters as much as the most any
        reconstruction query attends to it).

        Args:
            maxes: per segment of `segments(layer_idx)`, `[rows, kv_heads, width]`: the
                largest attention probability each slot received from the pass's queries and
                the query heads of its KV head (`kernels.reference.sampled_mass`).
            query_len: the pass's tokens, the last `query_len` of each row (not scored).
        """
        layer = self.layers[layer_idx]
        for i, row in enumerate(self._rows):
            best = _logical_mass(layer, maxes, i, row)  # [kv_heads, length]
            old = best.shape[1] - query_len
            kept = layer.reconstruction[row, :, :old]
            torch.maximum(kept, best[:, :old], out=kept)

    def record_window(self, layer_idx: int, masses: list[torch.Tensor], observed: int) -> None:
        """Keep one forward call's observation-window attention as the layer's `window_mass`
        (SnapKV, Li et al. 2024, §4.1), for the current rows; the call's last `observed`
        tokens are the window (`observed_from`).

        Args:
            masses: per segment of `segments(layer_idx)`, `[rows, kv_heads, width]`: the
                attention probability each slot received from the call's last `observed`
                queries, summed over them and the query heads of its KV head.
            observed: the window's queries, at most the call's.
        """
        layer = self.layers[layer_idx]
        for i, row in enumerate(self._rows):
            mass = _logical_mass(layer, masses, i, row)
            layer.window_mass[row, :, : mass.shape[1]] = mass
            self.observed_from[row] = self.seen(row) - observed

    def pin(self, start: int, end: int, row: int = 0) -> None:
        """Pin positions `[start, end)` of a row: exempt from eviction and quantization until
        `unpin`.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._check_span(start, end, row)
        self._grow_pins(end)
        self._pinned[row, start:end] = True

    def unpin(self, start: int, end: int, row: int = 0) -> None:
        """Release the pin on positions `[start, end)` of a row.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._check_span(start, end, row)
        self._grow_pins(end)
        self._pinned[row, start:end] = False

    def pinned_tokens(self, row: int = 0) -> int:
        """Positions of the row pinned now (pinned tokens are never evicted, so all live)."""
        return int(self._pinned[row, : self.seen(row)].sum())

    def _check_span(self, start: int, end: int, row: int) -> None:
        if start < 0 or end < start:
            raise ValueError(f"invalid position span [{start}, {end})")
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is not in this store's {self.batch} rows")

    def pinned_mask(self, layer_idx: int, row: int = 0) -> torch.Tensor:
        """`[length]` bool: which live slots of the row's layer (logical order) are pinned."""
        layer = self.layers[layer_idx]
        self._grow_pins(layer.appended[row])
        return self._pinned[row, layer.live_positions(row)]

    def _grow_pins(self, size: int) -> None:
        if size > self._pinned.shape[1]:
            self._pinned = _resized(self._pinned, 1, size)

    def compact(self, layer_idx: int, keep: torch.Tensor, row: int = 0) -> None:
        """Evict every live slot of the row's layer not in `keep` (int64 `[k]`, increasing,
        logical order); with a cold tier the evicted tokens move there."""
        layer = self.layers[layer_idx]
        if keep.numel() < layer.length(row):
            self.changed_at[row] = self.seen(row)
            if self.recalling:
                evicted = torch.ones(layer.length(row), dtype=torch.bool, device=keep.device)
                evicted[keep] = False
                slots = evicted.nonzero().squeeze(1)
                keys, values = layer.read_slots(row, slots)
                self.cold.add(layer_idx, row, keys, values, layer.live_positions(row)[slots])
        self.evicted_tokens += layer.length(row) - keep.numel()
        layer.compact(row, keep)

    def attach_cold(self, config: ColdConfig) -> ColdTier:
        """Keep evicted tokens in a cold tier with these settings from now on (a tier already
        attached keeps its pages and takes the new settings); returns it.

        Raises:
            ConfigError: invalid settings.
        """
        config.validate()
        if self.cold is None:
            self.cold = ColdTier(len(self.layers), self.batch, config, self.rotary)
        else:
            self.cold.config = config
        self.recalling = True
        return self.cold

    def recall_due(self, query_len: int) -> bool:
        """Whether the current forward call (of `query_len` queries per row) recalls cold
        pages: the store is `recalling` and `ColdConfig.due` says so for the call's first
        row."""
        return self.recalling and self.cold.config.due(query_len, self.seen(self._rows[0]))

    def recall(self, layer_idx: int, query: torch.Tensor, scale: float) -> int:
        """Bring the best cold pages of a layer back into the hot store for the current rows,
        before the call's attention reads it; returns the tokens recalled.

        The call's last `ColdConfig.queries` queries score the pages (`ColdTier.recall`); the
        recalled tokens leave the `evicted_tokens` count (an eviction that was undone) and go
        back at their original positions (`LayerStore.insert`) with fresh
        statistics, and the policy keeps them first until the layer's next recall
        (`held_mask`), within its budget.

        Args:
            query: `[rows, Hq, q, D]`, the call's queries as attention receives them (rotated
                at the call's positions; in rerotate mode they are scored at their original
                positions instead, like the digests).
            scale: the attention's softmax scale.
        """
        started = time.perf_counter()
        layer = self.layers[layer_idx]
        n = query.shape[2]
        window = min(n, self.cold.config.queries)
        recalled = 0
        for i, row in enumerate(self._rows):
            scoring = query[i, :, n - window :]  # [Hq, S, D]
            if self.rotary is not None:
                scoring = self._at_original_positions(scoring, i, layer.appended[row] - window)
            got = self.cold.recall(layer_idx, row, scoring, scale)
            if got is None:
                continue
            positions, keys, values = got
            layer.insert(row, keys, values, positions)
            self.changed_at[row] = self.seen(row)
            self.evicted_tokens -= positions.numel()  # back in the cache: no longer evicted
            recalled += positions.numel()
        if recalled:
            self._note_peak()
        self.cold.recall_s += time.perf_counter() - started
        return recalled

    def _at_original_positions(self, query: torch.Tensor, i: int, start: int) -> torch.Tensor:
        """Queries `[Hq, S, D]` of the call's `i`-th row, rotated at their in-cache positions
        (the call's last `S`), rotated instead at original positions `start, start + 1, ...`."""
        window = query.shape[1]
        in_cache = self._query_positions[i : i + 1, -window:]
        original = start + torch.arange(window, device=query.device)[None]
        cos, sin = self.rotary.cos_sin(in_cache)
        unrotated = Rotary.unrotate(query[None].float(), cos, sin)
        cos, sin = self.rotary.cos_sin(original)
        return apply_rotation(unrotated, cos, sin)[0]

    def held_mask(self, layer_idx: int, row: int = 0) -> torch.Tensor | None:
        """`[length]` bool over the row's live slots (logical order): the tokens the layer's
        last recall brought back, or None when not recalling or before any recall."""
        if not self.recalling or self.cold.held[layer_idx][row] is None:
            return None
        return torch.isin(
            self.layers[layer_idx].live_positions(row), self.cold.held[layer_idx][row]
        )

    @property
    def peak_cold_bytes(self) -> int:
        """The most bytes the cold tier has held (0 without one)."""
        return 0 if self.cold is None else self.cold.peak_bytes

    def cold_nbytes(self, row: int | None = None) -> int:
        """Exact bytes of the cold tier (codes, scales, digests), for one row or all; 0 without
        one. Never part of `nbytes` or `allocated_nbytes`, which count the hot store."""
        return 0 if self.cold is None else self.cold.nbytes(row)

    def quantize_stale(self, layer_idx: int, row: int = 0) -> int:
        """Move tokens that left the FP window into INT8 (no-op without `int8`); returns the
        tokens moved."""
        layer = self.layers[layer_idx]
        if self.int8 is None or layer.fp_len[row] < self.int8.fp_window + self.int8.group:
            return 0  # fewer FP tokens than the window plus a group: nothing can be stale
        moving = layer.stale_slots(row, self.pinned_mask(layer_idx, row), self.int8)
        return self._quantize(layer_idx, row, moving, self.int8.group, QUANT_FORMATS["int8"])

    def quantize_slots(
        self, layer_idx: int, row: int, slots: torch.Tensor, group: int, fmt: str
    ) -> int:
        """Quantize the chosen live slots of a row's layer (a policy's choice, e.g. ARKV's
        middle tier); returns the tokens moved.

        Args:
            slots: int64 `[m]`, increasing logical slots of FP, unpinned tokens; `m` a
                multiple of `group`. Afterwards the logical order is (quantized before, these
                slots, the remaining FP tokens).
            group: tokens sharing one scale per KV head and channel.
            fmt: a `kernels.formats.QUANT_FORMATS` name, `"int8"` or `"fp8"`.

        Raises:
            ValueError: a slot already quantized, pinned or out of range; `m` not a multiple
                of `group`; an unknown format.
            ConfigError: a format other than the one the store already holds.
        """
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}: use {', '.join(QUANT_FORMATS)}")
        layer = self.layers[layer_idx]
        q_len, n = layer.q_len[row], layer.length(row)
        if slots.numel() and (int(slots.min()) < q_len or int(slots.max()) >= n):
            raise ValueError(f"slots must be FP slots in [{q_len}, {n}) of row {row}")
        if bool(self.pinned_mask(layer_idx, row)[slots].any()):
            raise ValueError("pinned tokens are never quantized")
        return self._quantize(layer_idx, row, slots - q_len, group, QUANT_FORMATS[fmt])

    def _quantize(
        self, layer_idx: int, row: int, fp_slots: torch.Tensor, group: int, fmt: QuantFormat
    ) -> int:
        if fp_slots.numel() == 0:
            return 0
        self.layers[layer_idx].quantize(row, fp_slots, group, fmt)
        self._note_allocated()
        self.quantized_tokens += fp_slots.numel()
        self.changed_at[row] = self.seen(row)
        return fp_slots.numel()

    def quantized_format(self) -> str | None:
        """The format of the quantized tokens held (`"int8"` or `"fp8"`), None while none."""
        for layer in self.layers:
            if any(layer.q_len):
                return format_name(layer.q_keys.dtype)
        return None

    def truncate(self, end: int, row: int = 0) -> None:
        """Forget every token of the row at position `end` or later, so the next token takes
        position `end` again (a client rewrote history from there). Pins past `end` go too.

        Raises:
            ValueError: `end` is negative, past the tokens seen, or before `changed_at[row]`
                (eviction or quantization since then depended on the forgotten tokens).
        """
        if not self.changed_at[row] <= end <= self.seen(row):
            raise ValueError(
                f"cannot truncate row {row} to {end} tokens: the cache is exact only back to "
                f"{self.changed_at[row]} of its {self.seen(row)} tokens"
            )
        for layer in self.layers:
            keep = (layer.live_positions(row) < end).nonzero().squeeze(1)
            layer.compact(row, keep)
            layer.appended[row] = end
        self.observed_from[row] = min(self.observed_from[row], end)
        self._grow_pins(end)
        self._pinned[row, end:] = False

    def state(self, trim: bool = False) -> dict:
        """Everything the store holds, as tensors and plain values (for `torch.save`). With
        `trim`, each buffer is a copy of its live slots only (a saved file then holds live
        bytes, not spare capacity), and each layer's `capacity` says what `from_state`
        allocates again: each segment's live slots rounded up to whole capacity steps."""
        counts = ("fp_len", "q_len", "n_groups", "appended")
        return {
            "layers": [
                {
                    **(_trimmed_buffers(layer) if trim else _buffers(layer)),
                    **{c: getattr(layer, c) for c in counts},
                }
                for layer in self.layers
            ],
            "shape": [len(self.layers), self.layers[0].kv_heads, self.layers[0].head_dim],
            "batch": self.batch,
            "ema_decay": self.ema_decay,
            "int8": None if self.int8 is None else [self.int8.fp_window, self.int8.group],
            "max_positions": self.max_positions,
            "rerotate": self.rotary is not None,
            "pinned": self._pinned,
            "counters": [
                self.peak_bytes,
                self.evicted_tokens,
                self.quantized_tokens,
                self.peak_allocated_bytes,
            ],
            "row_counters": [self.row_peak_bytes, self.changed_at],
            "profile": self.profile,
            "observed_from": self.observed_from,
            "cold": None if self.cold is None else self.cold.state(),
        }

    @classmethod
    def from_state(cls, state: dict, rotary: Rotary | None = None) -> KVStore:
        """The store `state()` described; `rotary`, the model's rotary tables, is required for
        a store saved in rerotate mode.

        Raises:
            ValueError: a rerotate state without `rotary`.
        """
        if state["rerotate"] and rotary is None:
            raise ValueError("this store was saved in rerotate mode: pass the model's rotary")
        layers, heads, dim = state["shape"]
        first = state["layers"][0]
        int8 = None if state["int8"] is None else Int8Config(*state["int8"])
        store = cls(
            layers, heads, dim, first["keys"].dtype, first["keys"].device, state["ema_decay"],
            state["batch"], int8, rotary, state["max_positions"],
        )  # fmt: skip
        for layer, saved in zip(store.layers, state["layers"], strict=True):
            for name, value in saved.items():
                if name != "capacity":
                    setattr(layer, name, list(value) if isinstance(value, list) else value)
            if "capacity" in saved:  # trimmed: allocate the segments' capacities again
                for name in (*SEGMENT_OF_BUFFER, *META_FIELDS):
                    segment, dim = SEGMENT_OF_BUFFER.get(name, ("meta", -1))
                    tensor = getattr(layer, name)
                    setattr(layer, name, _resized(tensor, dim, saved["capacity"][segment]))
            for name in META_FIELDS:  # states saved before a field existed
                if name not in saved:
                    like = layer.positions if name == "hits" else layer.scores
                    setattr(layer, name, torch.zeros_like(like, dtype=torch.float32))
        store.profile = state.get("profile")
        if state.get("cold") is not None:
            store.cold = ColdTier.from_state(state["cold"], rotary)
        store.observed_from = list(state.get("observed_from", store.observed_from))
        store._pinned = state["pinned"]
        store.peak_bytes, store.evicted_tokens, store.quantized_tokens = state["counters"][:3]
        saved_peak = state["counters"][3:]  # states saved before the allocated peak existed
        store.peak_allocated_bytes = max([*saved_peak, store.allocated_nbytes()])
        store.row_peak_bytes, store.changed_at = (list(v) for v in state["row_counters"])
        return store

    def lengths(self, row: int = 0) -> list[int]:
        """Live tokens per layer for a row."""
        return [layer.length(row) for layer in self.layers]

    def quantized_lengths(self, row: int = 0) -> list[int]:
        """Live INT8 tokens per layer for a row."""
        return [layer.q_len[row] for layer in self.layers]

    def precision_counts(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position the row has seen (`[seen]` int64 each): in how many layers it is live
        at full precision, and in how many quantized; the other layers evicted it."""
        seen = self.seen(row)
        fp = torch.zeros(seen, dtype=torch.long, device=self.layers[0].device)
        quantized = torch.zeros_like(fp)
        for layer in self.layers:
            live = layer.live_positions(row)  # quantized slots first, then FP (logical order)
            quantized[live[: layer.q_len[row]]] += 1
            fp[live[layer.q_len[row] :]] += 1
        return fp, quantized

    def pinned_positions(self, row: int = 0) -> torch.Tensor:
        """`[seen]` bool: which positions the row has seen are pinned now."""
        self._grow_pins(self.seen(row))
        return self._pinned[row, : self.seen(row)]

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of live keys, values and scales over all layers, for one row or all."""
        return sum(layer.nbytes(row) for layer in self.layers)

    def allocated_nbytes(self, row: int | None = None) -> int:
        """Bytes of all key/value/scale buffers including spare capacity, for all rows or
        (`row`) one row's share: the buffers are `[batch, ...]`, every row the same slots."""
        total = sum(layer.allocated_nbytes() for layer in self.layers)
        return total if row is None else total // self.batch

    def footprint(self) -> StoreFootprint:
        """What the store holds and has allocated (`StoreFootprint`)."""
        return StoreFootprint.of_state(self.state())

    def full_kv_nbytes(self, row: int = 0) -> int:
        """Live bytes a full KV cache would hold for a row's tokens seen so far, at the FP
        dtype: the tokens alone, no spare capacity."""
        return self.seen(row) * self.bytes_per_token()

    def full_kv_allocated_nbytes(self, row: int = 0) -> int:
        """Bytes a full KV cache's buffers would be allocated for a row's tokens seen so far,
        at the FP dtype, under this store's growth rule: the FP capacity doubled from one
        `CAPACITY_STEP` until it holds them (256, 512, 1,024, ... slots), which a store that
        never evicts follows while no forward call needs more than twice the slots it holds
        (512-token prefill chunks do not)."""
        capacity = CAPACITY_STEP
        while capacity < self.seen(row):
            capacity = _grown_capacity(capacity, capacity + 1)
        return capacity * self.bytes_per_token()

    def record_profile(self, layer_idx: int, stats: torch.Tensor) -> None:
        """Add one prefill call's attention shape statistics to the layer's running means.

        Args:
            stats: `[rows, kv_heads, 3]` from `kernels.reference.attention_profile`:
                normalised entropy, log concentration and log kurtosis, each a mean over the
                scored queries.
        """
        if self.profile is None:
            self.profile = torch.zeros(len(self.layers), 4)
        self.profile[layer_idx, :3] += stats.float().mean(dim=(0, 1)).cpu()
        self.profile[layer_idx, 3] += 1

    def profile_means(self) -> torch.Tensor | None:
        """`[num_layers, 3]` mean prefill attention statistics per layer (normalised entropy,
        log concentration, log kurtosis), or None before every layer has one."""
        if self.profile is None or bool((self.profile[:, 3] == 0).any()):
            return None
        return self.profile[:, :3] / self.profile[:, 3:]

    def _note_peak(self) -> None:
        for row in self._rows:
            self.row_peak_bytes[row] = max(self.row_peak_bytes[row], self.nbytes(row))
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        self._note_allocated()

    def _note_allocated(self) -> None:
        allocated = self.allocated_nbytes()
        self.call_allocated_bytes = max(self.call_allocated_bytes, allocated)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, allocated)


def _buffers(layer: LayerStore) -> dict:
    """The layer's buffers and metadata as they are, spare capacity included."""
    return {name: getattr(layer, name) for name in (*SEGMENT_OF_BUFFER, *META_FIELDS)}


def _trimmed_buffers(layer: LayerStore) -> dict:
    """Copies of the layer's live slots of each buffer and metadata field, with the
    `capacity` per segment that `KVStore.from_state` restores (a segment never allocated
    stays so)."""
    live = {
        "fp": max(layer.fp_len),
        "q": max(layer.q_len),
        "scales": max(layer.n_groups),
        "meta": max(layer.length(r) for r in range(layer.batch)),
    }
    capacity = {
        "fp": _round_up(live["fp"]),
        "q": _round_up(live["q"]) if layer.q_keys.shape[2] else 0,
        "scales": _round_up(live["scales"], SCALE_CAPACITY_STEP)
        if layer.key_scales.shape[2]
        else 0,
        "meta": _round_up(live["meta"]),
    }
    buffers = {}
    for name in (*SEGMENT_OF_BUFFER, *META_FIELDS):
        segment, dim = SEGMENT_OF_BUFFER.get(name, ("meta", -1))
        buffers[name] = getattr(layer, name).narrow(dim, 0, live[segment]).clone()
    return {**buffers, "capacity": capacity}


def _capacities(layer_state: dict) -> dict[str, int]:
    """Slots per segment a layer of a `KVStore.state()` holds once loaded: its `capacity`
    when trimmed, else its buffers' sizes."""
    if "capacity" in layer_state:
        return dict(layer_state["capacity"])
    return {
        "fp": layer_state["keys"].shape[2],
        "q": layer_state["q_keys"].shape[2],
        "scales": layer_state["key_scales"].shape[2],
    }


def _logical_mass(layer: LayerStore, masses: list[torch.Tensor], i: int, row: int) -> torch.Tensor:
    """`[kv_heads, length]`: the attention mass `masses` (per segment, `[rows, kv_heads,
    width]`) gives row `row` (the call's `i`-th) of `layer`, over its live slots in logical
    order (quantized, then FP)."""
    parts = [masses[-1][i, :, : layer.fp_len[row]]]
    if len(masses) == 2:
        parts.insert(0, masses[0][i, :, : layer.q_len[row]])
    return torch.cat(parts, dim=1)


def _welford(layer: LayerStore, row: int, observed: torch.Tensor, first_new: int) -> None:
    """Fold one observation `observed` `[kv_heads, n]` per live token into the row's running
    mean and squared-deviation sums (Welford, 1962); slots from `first_new` on are new tokens
    and start a fresh count."""
    n = observed.shape[1]
    hits = layer.hits[row, :n]
    mean = layer.hit_mean[row, :, :n]
    m2 = layer.hit_m2[row, :, :n]
    hits[first_new:] = 0.0
    mean[:, first_new:] = 0.0
    m2[:, first_new:] = 0.0
    hits += 1.0
    delta = observed - mean
    mean += delta / hits
    m2 += delta * (observed - mean)
