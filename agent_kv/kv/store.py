"""The KV store: static-shape buffers in two precisions, per-token statistics, pins, exact
accounting.

Layout (docs/architecture.md, Decisions, "Layout"): two segments, each a `SlotTable` stacked
over layers and rows (`[L, B, ...]`), every per-token field aligned with its segment's slots:
- the FP segment, capacity `C`: keys and values `[L, B, kv_heads, C, head_dim]` in the model's
  dtype (pinned tokens, the newest tokens, and without INT8 everything), their original
  positions and statistics;
- the quantized segment, capacity `Cq`: codes in int8 or float8_e4m3fn (`kernels.formats`),
  each slot's scale row (`q_group`), positions and statistics; and its scales `[L, B,
  kv_heads, G, head_dim]` float16, one row per group of tokens quantized together
  (`kernels.int8`). Tokens reach it by age (`Int8Config`, CONF-KV's mixed precision) or chosen
  by a policy (ARKV's tri-state cache); one store holds one format.
A row's live tokens are its first `q_len` quantized slots followed by its first `fp_len` FP
slots: its *logical order*. The *joint slot space* of a layer's row is the quantized slots
followed by the FP slots, `[Cq + C]`: the logical order is its live slots in order, and
policies rank and choose over it for every layer and row at once.

Capacities follow what the store holds: before every forward call each segment is fitted to
its longest row's live slots plus the call's new tokens, in whole `BLOCK_TOKENS` blocks with a
little headroom (`_fitted_capacity`), and kept while within a tenth plus a block of that; so the
bytes allocated follow the live bytes at every call, for a budgeted policy and full KV alike.
A policy's bound (`bound_capacity`: the pinned tokens plus its budget plus one prefill chunk)
only caps that headroom and fixes how much of a segment a static decode step reads. Between
capacity changes every tensor keeps its shape, so a decode step is static-shape: its lengths
and positions are tensors (`ForwardCall`), and it can run as one captured or compiled graph
with no host synchronisation (a capacity change traces its sizes as symbolic ones).

A forward call goes `begin_forward` (host: positions, lengths uploaded, room made) -> the
model, whose attention reads the stored segments and the call's own new tokens through the
`ForwardCall` and stages them there -> `ForwardCall.commit` (every layer's new tokens written
and its attention folded into the statistics, for all layers at once) -> `end_forward` (host
lengths and peaks). Eviction gathers the kept slots to the front of each segment (contiguous
compaction, CONF-KV §4), so attention reads dense prefixes, never an indirection table.

Sliding-window layers (`windows`, from the model's config: `agent_kv.kv.layer_windows`): the
attention function masks each query to its window (`ForwardCall.segments`), and after every
forward call `end_forward` drops from those layers the tokens no later query can see
(`trim_windows`), so such a layer holds its window and no more: the window is its policy, and
eviction policies step the full-attention layers only (`Policy.step`). Pinned tokens are
dropped with the rest once out of the window (the model cannot see them there either).

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
from agent_kv.kv.forward_call import CallTensors, ForwardCall
from agent_kv.kv.layer_windows import layer_windows
from agent_kv.kv.prefix_cache import PrefixCache, PrefixRun, SharedPrefix, SharedView
from agent_kv.kv.rope import Rotary
from agent_kv.kv.slot_table import FieldSpec, SlotTable, bytes_view
from kernels import dispatch
from kernels.formats import QUANT_FORMATS, QuantFormat, format_name
from kernels.int8 import SCALE_DTYPE, dequantize
from kernels.reference import apply_rotation

KV_DTYPE_ATTRIBUTE = "agent_kv_kv_dtype"
"""A model whose KV cache is stored in another dtype than its weights' (bfloat16 weights, a
float32 cache: `agent_kv.runtime.weight_formats`) carries that dtype as this attribute;
`KVStore.for_model` stores in it, and the attention function computes in it."""
BLOCK_TOKENS = 32
"""Tokens: the grain of the token segments' capacities. A segment holds its longest row's live
slots (and the next call's new ones) rounded up to whole blocks with a little headroom
(`GROWTH_SHARE`), so its allocated bytes follow its live bytes, within a tenth plus one block
per layer and row (`KEEP_SHARE`), at every forward call: not a bound allocated up front."""
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
STATISTICS = ("scores", "accumulated", "welford")
"""What a forward call can fold into the per-token statistics (`KVStore.statistics`):
CONF-KV's EMA of normalised mass, H2O's accumulated mass, ARKV's Welford mean and variance."""
META_FIELDS = (
    "scores", "accumulated", "hit_mean", "hit_m2", "window_mass", "reconstruction",
)  # fmt: skip
"""Per-token float32 statistics of both segments, one value per KV head (`[L, B, H, S]`)."""
WINDOW_SLACK = 32
"""Tokens a sliding-window layer may hold past its window before `trim_windows` drops them
(they are masked out meanwhile): the compaction then runs once per `WINDOW_SLACK + 1` decode
steps instead of after each, as `Policy.evict_slack` does for evictions."""
ALLOCATED_FIELDS = {"fp": ("keys", "values"), "q": ("keys", "values"), "scales": ("keys", "values")}
"""The fields of each segment that hold keys, values and scales: what `allocated_nbytes`
counts (positions, statistics and scale indices are bookkeeping, not KV)."""


def _round_up(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def _fitted_capacity(current: int, needed: int, grain: int, bound: int | None = None) -> int:
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


def _capacity_bound(current: int, most: int, grain: int) -> int:
    """The largest capacity a segment can reach from `current` while it never needs more than
    `most` slots: `_fitted_capacity` keeps `current` or fits to what is needed, and what it fits
    to grows with the need."""
    return max(current, _fitted_capacity(0, most, grain))


def _live_bytes(
    channels: int, fp_elem: int, scale_elem: int, fp_tokens: int, q_tokens: int, groups: int
) -> int:
    """Bytes of live keys, values and scales: `channels` is `2 * kv_heads * head_dim` (keys
    and values), quantized tokens take one byte per channel."""
    return channels * (fp_tokens * fp_elem + q_tokens + groups * scale_elem)


def _segment_specs(heads: int, dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
    """A token segment's fields: keys and values in `dtype`, positions, statistics."""
    return {
        "keys": FieldSpec((heads,), (dim,), dtype),
        "values": FieldSpec((heads,), (dim,), dtype),
        "positions": FieldSpec((), (), torch.long),
        "hits": FieldSpec((), (), torch.float32),
        **{name: FieldSpec((heads,), (), torch.float32) for name in META_FIELDS},
    }


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
        live = _live_bytes(
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
        fp = _capacity_bound(self.fp_capacity, most, BLOCK_TOKENS)
        q, groups = self.q_capacity, self.scale_capacity
        if quantizes:
            q = _capacity_bound(q, most, BLOCK_TOKENS)
            groups = _capacity_bound(groups, most, SCALE_BLOCK)
        per_row = fp * self.fp_token_bytes + q * self.q_token_bytes
        return len(max_tokens) * self.batch * (per_row + groups * self.scale_group_bytes)


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
        windows: per layer, its sliding window in tokens (a query at position `p` sees keys
            at `p - window < k <= p`), or None for a full-attention layer; default all None.

    Attributes:
        fp, q: the FP and quantized segments (`SlotTable`: fields `keys`, `values`,
            `positions`, `hits` and `META_FIELDS`; the quantized one also `group`, each slot's
            scale row); `fp.lengths` / `q.lengths` are the live slots `[L][B]`.
        scales: the quantized segment's scales (`keys`, `values`: `[L, B, H, G, D]` float16);
            `scales.lengths` the rows in use.
        appended: tokens ever appended per row (the next original position).
        statistics: which of `STATISTICS` forward calls fold into the per-token statistics
            (the policy says, `Policy.prepare`).
        window_slack: tokens a sliding-window layer may hold past its window before they are
            dropped (`WINDOW_SLACK`; 0: after every call).

    Raises:
        ValueError: non-positive sizes, an `ema_decay` outside [0, 1), or `windows` without
            one positive window or None per layer.
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
        windows: tuple[int | None, ...] | None = None,
    ):
        if min(num_layers, kv_heads, head_dim, batch) <= 0:
            raise ValueError("num_layers, kv_heads, head_dim and batch must be positive")
        windows = (None,) * num_layers if windows is None else tuple(windows)
        if len(windows) != num_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"windows must give {num_layers} positive windows or None")
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must lie in [0, 1), got {ema_decay}")
        if int8 is not None:
            int8.validate()
        device = torch.device(device)
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.batch = batch
        self.fp = SlotTable(_segment_specs(kv_heads, head_dim, dtype), num_layers, batch, device)
        q_specs = _segment_specs(kv_heads, head_dim, torch.int8)
        self.q = SlotTable(
            {**q_specs, "group": FieldSpec((), (), torch.long)}, num_layers, batch, device
        )
        scale = FieldSpec((kv_heads,), (head_dim,), SCALE_DTYPE)
        self.scales = SlotTable({"keys": scale, "values": scale}, num_layers, batch, device)
        self.fp.resize(BLOCK_TOKENS)
        self.appended = [0] * batch
        self.ema_decay = ema_decay
        self.int8 = int8
        self.rotary = rotary
        self.max_positions = max_positions
        self.windows = windows
        self.window_slack = WINDOW_SLACK
        self.window_dropped = 0
        """Tokens dropped from sliding-window layers as they left the window (`trim_windows`;
        not evictions, which `evicted_tokens` counts)."""
        self._global = torch.tensor([w is None for w in windows], device=device)
        self.statistics = frozenset(STATISTICS)
        self._pinned = torch.zeros(batch, 0, dtype=torch.bool)  # host: positions pinned
        self._pinned_device: torch.Tensor | None = None
        self._pinned_live: list[list[int]] | None = [[0] * batch for _ in range(num_layers)]
        self._bounds: tuple[int | None, int | None] = (None, None)
        self._decode_bounds: tuple[int | None, int | None] = (None, None)
        self._rows = range(batch)
        self._query_positions = torch.zeros(batch, 0, dtype=torch.long, device=device)
        self.peak_bytes = 0
        """The most live bytes (`nbytes`) the store has held, after any forward call's append."""
        self.row_peak_bytes = [0] * batch
        self.peak_allocated_bytes = self.allocated_nbytes()
        """The most bytes its buffers have held (`allocated_nbytes`): taken after every change
        of capacity."""
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
        """How many of a multi-token forward call's last queries measure `window_mass`
        (SnapKV's observation window; 0: none); a policy that ranks by it sets it
        (`Policy.prepare`)."""
        self.observed_from = [0] * batch
        """Per row, the position of the first query of the last observation window: tokens
        from there on (the window and what came after it) have no `window_mass` of their own."""
        self.cold: ColdTier | None = None
        """Where evicted tokens go instead of being lost (`attach_cold`), or None."""
        self.shared: SharedPrefix | None = None
        """The row's first positions read from shared runs (`share`), held once for every
        store that reads them (`agent_kv.kv.prefix_cache`), or None."""
        self.reconstructing = False
        """Whether the current forward call is a reconstruction pass (KVzip): its attention
        only records `reconstruction` maxima, and its own tokens are not kept."""
        self.recalling = False
        """Whether the current forward call and policy step use the cold tier: evictions go
        there and recalls come from it. The policy says so before every call
        (`Policy.prepare`); a tier whose policy changed keeps its pages, unused."""

    @classmethod
    def for_model(cls, model: torch.nn.Module, rerotate: bool = False, **kwargs) -> KVStore:
        """A store shaped for a transformers causal LM (reads `model.config`, its sliding-window
        layers included: `agent_kv.kv.layer_windows`); `rerotate` selects in-cache positions.
        Its dtype is the model's `KV_DTYPE_ATTRIBUTE` when set, else its weights' dtype.

        Raises:
            ConfigError: `rerotate` for a model without one RoPE for all layers, or a model
                whose layers agent_kv cannot run (`layer_windows`).
        """
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        param = next(model.parameters())
        kwargs.setdefault("dtype", getattr(model, KV_DTYPE_ATTRIBUTE, param.dtype))
        kwargs.setdefault("device", param.device)
        if rerotate:
            kwargs["rotary"] = Rotary.from_model(model)
        kwargs.setdefault("max_positions", int(getattr(cfg, "max_position_embeddings", 0) or 0))
        kwargs.setdefault("windows", layer_windows(cfg))
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, **kwargs)

    # -- shape and lengths -------------------------------------------------------------------

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
        return self.appended[row]

    def length(self, layer: int, row: int = 0) -> int:
        """Live tokens of a row in one layer (quantized + FP)."""
        return self.q.lengths[layer][row] + self.fp.lengths[layer][row]

    def lengths(self, row: int = 0) -> list[int]:
        """Live tokens per layer for a row."""
        return [self.length(layer, row) for layer in range(self.num_layers)]

    def quantized_lengths(self, row: int = 0) -> list[int]:
        """Live quantized tokens per layer for a row."""
        return [self.q.lengths[layer][row] for layer in range(self.num_layers)]

    def bytes_per_token(self) -> int:
        """Key + value bytes one token costs across all layers at full precision."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * element

    def int8_bytes_per_token(self, group: int) -> float:
        """Bytes one INT8 token costs across all layers, with its `1/group` share of the
        float16 scales of its group."""
        per_channel = 1 + torch.empty(0, dtype=SCALE_DTYPE).element_size() / group
        return 2 * self.num_layers * self.kv_heads * self.head_dim * per_channel

    def valid(self, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, Cq + C]` bool over the joint slot space: which slots of `layers` x `rows`
        are live."""
        return torch.cat([self.q.valid(layers, rows), self.fp.valid(layers, rows)], dim=-1)

    def joint(self, name: str, layers: slice = slice(None), rows: slice = slice(None)):
        """Field `name` of both segments over the joint slot space, `[L', R, ..., Cq + C]` (a
        copy; the statistics and `positions`)."""
        return torch.cat([self.q[name][layers, rows], self.fp[name][layers, rows]], dim=-1)

    def live_positions(self, layer: int, row: int = 0) -> torch.Tensor:
        """`[length]` original positions of the row's live tokens in one layer, logical
        order."""
        q_len, fp_len = self.q.lengths[layer][row], self.fp.lengths[layer][row]
        return torch.cat(
            [self.q["positions"][layer, row, :q_len], self.fp["positions"][layer, row, :fp_len]]
        )

    def live_meta(self, name: str, layer: int, row: int = 0) -> torch.Tensor:
        """A statistic over the row's live tokens in one layer, logical order: `[H, length]`
        (`[length]` for `hits`)."""
        q_len, fp_len = self.q.lengths[layer][row], self.fp.lengths[layer][row]
        return torch.cat(
            [self.q[name][layer, row, ..., :q_len], self.fp[name][layer, row, ..., :fp_len]],
            dim=-1,
        )

    # -- capacity ----------------------------------------------------------------------------

    def bound_capacity(self, fp_tokens: int | None, q_tokens: int | None, chunk: int) -> None:
        """Bound the segments from now on by what they can need before an eviction: per row,
        the pinned tokens plus `fp_tokens` unpinned FP tokens plus one forward call's `chunk`
        (the FP segment), and `q_tokens` (the quantized one), neither more than the model's
        context (`max_positions`, when known). A bound caps a segment's headroom
        (`_fitted_capacity`), it is never allocated ahead; None leaves a segment unbounded.
        Applied at the next `begin_forward`.

        Also sets what a static decode step reads (`decode_widths`): a row that has been
        stepped holds at most the pinned tokens plus `fp_tokens` FP tokens before a decode
        call appends one, so the step reads that much of the FP segment, not the chunk's room.

        The policy bounds the full-attention layers; a sliding-window layer holds up to
        `window_hold()` tokens between calls whatever the policy, so a bounded segment holds
        at least that (FP: up to the INT8 FP window, with mixed precision).
        """
        pinned = max(max(row) for row in self.pinned_live())
        hold = self.window_hold()
        fp_hold = hold if self.int8 is None else min(hold, self.int8.max_fp_tokens)
        fp = None if fp_tokens is None else max(pinned + fp_tokens, fp_hold) + chunk
        if q_tokens:  # a quantized segment that sliding-window layers may fill too
            q_tokens = max(q_tokens, hold)
        if self.max_positions:  # no row ever holds more live tokens than the model's context
            fp = None if fp is None else min(fp, self.max_positions)
            q_tokens = None if q_tokens is None else min(q_tokens, self.max_positions)
            fp_tokens = None if fp_tokens is None else min(fp_tokens, self.max_positions)
        self._bounds = (fp, q_tokens)
        held = None if fp_tokens is None else max(pinned + fp_tokens, fp_hold)
        self._decode_bounds = (
            q_tokens,
            None if held is None else _round_up(held, BLOCK_TOKENS),
        )

    @property
    def fp_bounded(self) -> bool:
        """Whether a policy's bound fixes the FP segment's capacity (`bound_capacity`); an
        unbounded store (full KV) grows by doubling."""
        return self._decode_bounds[1] is not None

    def decode_widths(self) -> dict[str, int]:
        """The slots of each segment a static decode step reads (`ForwardCall(static=True)`):
        its capacity, or less under a bound (`bound_capacity`) that keeps every row's length
        within it (`begin_forward` checks)."""
        widths = {}
        for name, bound in zip(("q", "fp"), self._decode_bounds, strict=True):
            capacity = getattr(self, name).capacity
            widths[name] = capacity if bound is None else min(capacity, bound)
        return widths

    def _fit(self, n: int) -> None:
        """Give the segments the capacities the next call of `n` new tokens per row needs
        (`_fitted_capacity`): the FP segment room for them, the quantized segment and the
        scale table what they hold (a quantization makes its own room: `_room`)."""
        fp_bound, q_bound = self._bounds
        self._resize(
            self.fp, _fitted_capacity(self.fp.capacity, self.fp.most() + n, BLOCK_TOKENS, fp_bound)
        )
        self._resize(
            self.q, _fitted_capacity(self.q.capacity, self.q.most(), BLOCK_TOKENS, q_bound)
        )
        self._resize(
            self.scales, _fitted_capacity(self.scales.capacity, self.scales.most(), SCALE_BLOCK)
        )

    def _resize(self, table: SlotTable, capacity: int) -> None:
        if capacity != table.capacity:
            table.resize(capacity)
            self._note_allocated()

    def _room(self, q_slots: int, groups: int) -> None:
        """Make room in the quantized segment and its scale table for `q_slots` slots and
        `groups` scale rows in the rows quantizing (`_fitted_capacity`; the other rows keep
        what they hold)."""
        q_slots, groups = max(q_slots, self.q.most()), max(groups, self.scales.most())
        self._resize(
            self.q, _fitted_capacity(self.q.capacity, q_slots, BLOCK_TOKENS, self._bounds[1])
        )
        self._resize(self.scales, _fitted_capacity(self.scales.capacity, groups, SCALE_BLOCK))

    # -- forward calls -----------------------------------------------------------------------

    def begin_forward(
        self, rows: range, n: int, start: int | None = None, static: bool = False
    ) -> ForwardCall:
        """Declare the next model call: `n` new tokens for each of the contiguous `rows`.

        Args:
            start: the first rotary position of the call for every row, instead of the
                default (a reconstruction pass that must stay inside the trained context).
            static: read each segment at its fixed decode width (`decode_widths`, masked by
                the lengths), so the call's shapes depend on the capacities and bounds alone
                (a compiled or captured decode step); otherwise each segment is read up to
                its longest row.

        Returns:
            The call (`ForwardCall`): its `position_ids` `[len(rows), n]` are the tokens seen
            onward (original positions), or the most live tokens of any layer onward
            (rerotate).

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
            starts = [max(self.lengths(r)) for r in rows]
        self.check_context(max(starts) + n)
        self._rows = rows
        self.call_allocated_bytes = 0
        if not self.reconstructing:
            self._fit(n)
        self._note_allocated()
        self._query_positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(
            n, device=self.device
        )
        layers, span = slice(None), slice(rows.start, rows.stop)
        if static:
            widths = self.decode_widths()
            for name, width in widths.items():
                if getattr(self, name).most() > width:
                    raise ValueError(
                        f"a row holds {getattr(self, name).most()} {name} slots, past the "
                        f"static read of {width}: the store's bound was not kept"
                    )
        else:  # each segment up to its longest row among the call's rows
            widths = {
                name: max(max(row[span]) for row in getattr(self, name).lengths)
                for name in ("q", "fp")
            }
        tensors = CallTensors(
            position_ids=self._query_positions,
            q_lengths=self.q.length_tensor(layers, span),
            fp_lengths=self.fp.length_tensor(layers, span),
            origin=torch.tensor([self.appended[r] for r in rows], device=self.device),
            q_slots=torch.arange(widths["q"], device=self.device),
            fp_slots=torch.arange(widths["fp"], device=self.device),
        )
        return ForwardCall(self, rows, n, tensors, static)

    def append(self, keys: torch.Tensor, values: torch.Tensor, rows: range | None = None) -> None:
        """Append `n` tokens to every layer of `rows` (default: all) outside a model call:
        one `begin_forward`, the tokens staged and committed, `end_forward`. Their statistics
        start at 0 (no attention was read).

        Args:
            keys, values: `[L, R, H, n, D]`, or `[R, H, n, D]` for the same tokens in every
                layer; keys rotated as a model call would give them.
        """
        rows = range(self.batch) if rows is None else rows
        if keys.dim() == 4:
            keys = keys.expand(self.num_layers, *keys.shape)
            values = values.expand(self.num_layers, *values.shape)
        call = self.begin_forward(rows, keys.shape[-2])
        for layer in range(self.num_layers):
            call.stage(layer, keys[layer], values[layer])
        call.commit()
        self.end_forward(call)

    def end_forward(self, call: ForwardCall) -> None:
        """Account for a committed call on the host: lengths, positions seen, pins, peaks."""
        if self.reconstructing:
            return
        n = call.n
        pinned = self._pinned_counts(call.rows, n)
        for lengths in self.fp.lengths:
            for row in call.rows:
                lengths[row] += n
        if self._pinned_live is not None:
            for layer in self._pinned_live:
                for i, row in enumerate(call.rows):
                    layer[row] += pinned[i]
        for row in call.rows:
            self.appended[row] += n
        self._note_peak()
        self.trim_windows(call.rows)

    # -- sliding-window layers ---------------------------------------------------------------

    def window_hold(self) -> int:
        """The most tokens a sliding-window layer's row holds between forward calls: its
        window less the new query's own slot, plus `window_slack` (0 without such layers)."""
        return max((w - 1 + self.window_slack for w in self.windows if w), default=0)

    def global_layers(self) -> torch.Tensor:
        """`[L]` bool on the store's device: which layers attend to every token (the ones an
        eviction policy steps)."""
        return self._global

    def trim_windows(self, rows: range) -> int:
        """Drop from every sliding-window layer of `rows` the tokens no later query can see
        (positions `<= seen - window`: the next query sits at `seen`), once a layer holds
        more than `window - 1 + window_slack`; pinned ones too (the window wins: the model
        cannot see them). Decided on host counts first: nothing due, no tensor operation.
        Returns the tokens dropped (`window_dropped`; not evictions: no cold tier, no
        `evicted_tokens`).
        """
        due = [
            layer
            for layer, window in enumerate(self.windows)
            if window and any(self.length(layer, r) > window - 1 + self.window_slack for r in rows)
        ]
        if not due:
            return 0
        layers, span = slice(due[0], due[-1] + 1), slice(rows.start, rows.stop)
        windows = torch.tensor([w or 0 for w in self.windows[layers]], device=self.device)
        horizon = torch.tensor([self.seen(r) for r in rows], device=self.device)
        positions = self.joint("positions", layers, span)  # [L', R, S]
        seen = positions > horizon[None, :, None] - windows[:, None, None]
        keep = self.valid(layers, span) & (seen | (windows == 0)[:, None, None])
        dropped = self._compact_counted(keep, layers, span)
        self.window_dropped += dropped
        return dropped

    def _pinned_counts(self, rows: range, n: int) -> list[int]:
        """Per row of `rows`, how many of its next `n` positions are pinned already."""
        counts = []
        for row in rows:
            start = self.appended[row]
            counts.append(int(self._pinned[row, start : start + n].sum()))
        return counts

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

    def read_rotation(self, layer: int, rows: slice, widths: tuple[int, int]):
        """Rerotate tables `(cos_q, sin_q, cos_fp, sin_fp)`, `[R, width, D]` each: every live
        token at its rank among the row's live tokens, shifted so the new tokens sit at the
        query positions of this call."""
        q_width, fp_width = widths
        positions = torch.cat(
            [
                self.q["positions"][layer, rows, :q_width],
                self.fp["positions"][layer, rows, :fp_width],
            ],
            dim=-1,
        )  # [R, q_width + fp_width]
        shifted = torch.zeros_like(positions)
        for i, row in enumerate(range(*rows.indices(self.batch))):
            q_len, fp_len = self.q.lengths[layer][row], self.fp.lengths[layer][row]
            live = torch.cat([positions[i, :q_len], positions[i, q_width : q_width + fp_len]])
            rank = torch.argsort(torch.argsort(live))
            rank = rank + (self._query_positions[i, 0] - live.numel())
            shifted[i, :q_len] = rank[:q_len]
            shifted[i, q_width : q_width + fp_len] = rank[q_len:]
        cos, sin = self.rotary.cos_sin(shifted)
        return cos[:, :q_width], sin[:, :q_width], cos[:, q_width:], sin[:, q_width:]

    # -- per-token statistics ----------------------------------------------------------------

    def record_profile(self, layer_idx: int, stats: torch.Tensor) -> None:
        """Add one prefill call's attention shape statistics to the layer's running means.

        Args:
            stats: `[rows, kv_heads, 3]` from `kernels.reference.attention_profile`:
                normalised entropy, log concentration and log kurtosis, each a mean over the
                scored queries.
        """
        if self.profile is None:
            self.profile = torch.zeros(self.num_layers, 4)
        self.profile[layer_idx, :3] += stats.float().mean(dim=(0, 1)).cpu()
        self.profile[layer_idx, 3] += 1

    def profile_means(self) -> torch.Tensor | None:
        """`[num_layers, 3]` mean prefill attention statistics per layer (normalised entropy,
        log concentration, log kurtosis), or None before every layer has one."""
        if self.profile is None or bool((self.profile[:, 3] == 0).any()):
            return None
        return self.profile[:, :3] / self.profile[:, 3:]

    # -- pins --------------------------------------------------------------------------------

    def pin(self, start: int, end: int, row: int = 0) -> None:
        """Pin positions `[start, end)` of a row: exempt from eviction and quantization until
        `unpin`.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._set_pins(start, end, row, True)

    def unpin(self, start: int, end: int, row: int = 0) -> None:
        """Release the pin on positions `[start, end)` of a row.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._set_pins(start, end, row, False)

    def _set_pins(self, start: int, end: int, row: int, value: bool) -> None:
        if start < 0 or end < start:
            raise ValueError(f"invalid position span [{start}, {end})")
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is not in this store's {self.batch} rows")
        self._grow_pins(end)
        self._pinned[row, start:end] = value
        self._pins_changed()

    def _pins_changed(self) -> None:
        self._pinned_device = None
        self._pinned_live = None

    def _grow_pins(self, size: int) -> None:
        if size > self._pinned.shape[1]:
            grown = torch.zeros(self.batch, size, dtype=torch.bool)
            grown[:, : self._pinned.shape[1]] = self._pinned
            self._pinned = grown
            self._pinned_device = None

    def pinned_tokens(self, row: int = 0) -> int:
        """Positions of the row pinned now (pinned tokens are never evicted, so all live)."""
        return int(self._pinned[row, : self.seen(row)].sum())

    def pinned_positions(self, row: int = 0) -> torch.Tensor:
        """`[seen]` bool: which positions the row has seen are pinned now."""
        self._grow_pins(self.seen(row))
        return self._pinned[row, : self.seen(row)]

    def pinned_flags(self) -> torch.Tensor:
        """`[B, P]` bool on the store's device: which positions of each row are pinned (`P`
        at least every position seen)."""
        self._grow_pins(max(self.appended) + 1)
        if self._pinned_device is None:
            self._pinned_device = self._pinned.to(self.device)
        return self._pinned_device

    def pinned_joint(self, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, Cq + C]` bool: which live slots of `layers` x `rows` hold a pinned token
        (False for free slots)."""
        flags = self.pinned_flags()[rows]  # [R, P]
        positions = self.joint("positions", layers, rows).clamp(0, flags.shape[1] - 1)
        pinned = torch.gather(flags[None].expand(positions.shape[0], -1, -1), 2, positions)
        return pinned & self.valid(layers, rows)

    def pinned_mask(self, layer: int, row: int = 0) -> torch.Tensor:
        """`[length]` bool: which live slots of the row's layer (logical order) are pinned."""
        return self.pinned_flags()[row, self.live_positions(layer, row)]

    def pinned_live(self) -> list[list[int]]:
        """`[L][B]` host counts of the pinned tokens each layer's row holds (all of them are
        in the FP segment: pinned tokens are never quantized)."""
        if self._pinned_live is None:
            counts = self.pinned_joint(slice(None), slice(None)).sum(dim=-1)
            self._pinned_live = counts.tolist()
        return self._pinned_live

    # -- eviction and quantization -----------------------------------------------------------

    def compact_joint(self, keep: torch.Tensor, layers: slice, rows: slice) -> int:
        """Keep the live slots `keep` marks in each layer's row of `layers` x `rows`, evict the
        rest (to the cold tier when recalling); returns the tokens evicted.

        Args:
            keep: `[L', R, Cq + C]` bool over the joint slot space; free slots are ignored.

        Quantized tokens move with their scale rows; scale rows no kept token uses are dropped.
        """
        keep = keep & self.valid(layers, rows)
        if self.recalling:
            self._to_cold(~keep, layers, rows)
        evicted = self._compact_counted(keep, layers, rows)
        self.evicted_tokens += evicted
        return evicted

    def _compact_counted(self, keep: torch.Tensor, layers: slice, rows: slice) -> int:
        """`_compact` to the `keep` mask `[L', R', S]`, noting each row whose cache changed
        (`changed_at`); returns the tokens removed, summed over layers and rows."""
        before = self._host_lengths(layers, rows)
        self._compact(keep, layers, rows)
        removed = 0
        for (layer, row), old in before.items():
            gone = old - self.length(layer, row)
            if gone:
                self.changed_at[row] = self.seen(row)
            removed += gone
        self._pinned_live = None
        return removed

    def _host_lengths(self, layers: slice, rows: slice) -> dict[tuple[int, int], int]:
        return {
            (layer, row): self.length(layer, row)
            for layer in range(*layers.indices(self.num_layers))
            for row in range(*rows.indices(self.batch))
        }

    def _compact(self, keep: torch.Tensor, layers: slice, rows: slice) -> None:
        """Gather the live slots `keep` `[L', R, Cq + C]` marks to the front of each segment
        and set the host lengths."""
        cq = self.q.capacity
        keep_q, keep_fp = keep[..., :cq], keep[..., cq:]
        tables = [(self.fp, keep_fp)]
        if any(max(row[rows]) for row in self.q.lengths[layers]):  # quantized tokens to move
            tables.append((self.q, keep_q))
        counts = torch.stack([mask.sum(dim=-1) for _, mask in tables]).tolist()
        # only the kept slots move: past the widest row's count nothing is live afterwards
        widest = max(count for per_layer in counts[0] for count in per_layer)
        self.fp.gather(kept_first(keep_fp)[..., :widest], layers, rows)
        if len(tables) > 1:
            self._compact_quantized(keep_q, layers, rows)
        for (table, _), per_layer in zip(tables, counts, strict=True):
            _set_lengths(table, layers, rows, per_layer)

    def _compact_quantized(self, keep: torch.Tensor, layers: slice, rows: slice) -> None:
        """Compact the quantized segment to the slots `keep` `[L', R, Cq]` marks, and its
        scale table to the rows those slots use (renumbered in order)."""
        groups = self.scales.capacity
        widest = int(keep.sum(dim=-1).max())  # past it nothing is live afterwards
        self.q.gather(kept_first(keep)[..., :widest], layers, rows)
        kept = torch.sort(keep.to(torch.uint8), dim=-1, descending=True, stable=True).values.bool()
        index = self.q["group"][layers, rows]  # [L', R, Cq], after the gather
        used = torch.zeros(*index.shape[:2], groups + 1, dtype=torch.bool, device=self.device)
        used.scatter_(2, torch.where(kept, index, groups), True)
        used = used[..., :groups]
        renumber = torch.cumsum(used.long(), dim=-1) - 1
        index.copy_(torch.where(kept, torch.gather(renumber, 2, index.clamp(0, groups - 1)), 0))
        self.scales.gather(kept_first(used), layers, rows)
        _set_lengths(self.scales, layers, rows, used.sum(dim=-1).tolist())

    def _to_cold(self, evicted: torch.Tensor, layers: slice, rows: slice) -> None:
        """Move the live slots `evicted` `[L', R, Cq + C]` marks into the cold tier."""
        valid = self.valid(layers, rows)
        for i, layer in enumerate(range(*layers.indices(self.num_layers))):
            for j, row in enumerate(range(*rows.indices(self.batch))):
                slots = evicted[i, j][valid[i, j]].nonzero().squeeze(1)  # logical order
                if slots.numel():
                    keys, values = self.read_slots(layer, row, slots)
                    positions = self.live_positions(layer, row)[slots]
                    self.cold.add(layer, row, keys, values, positions)

    def compact(self, layer: int, keep: torch.Tensor, row: int = 0) -> int:
        """Evict every live slot of one layer's row not in `keep` (int64 `[k]`, increasing,
        logical order); returns the tokens evicted."""
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        return self.compact_joint(self._joint_mask(keep, layers, rows), layers, rows)

    def _joint_mask(self, slots: torch.Tensor, layers: slice, rows: slice) -> torch.Tensor:
        """`[1, 1, Cq + C]` bool marking one layer's row's logical slots `slots` (int64)."""
        valid = self.valid(layers, rows)
        logical = torch.zeros(int(valid.sum()), dtype=torch.bool, device=self.device)
        logical[slots] = True
        joint = torch.zeros_like(valid)
        joint[valid] = logical
        return joint

    def quantize_joint(
        self, move: torch.Tensor, group: int, fmt: str, layers: slice, rows: slice
    ) -> int:
        """Move the FP slots `move` marks into the quantized segment, `group` consecutive ones
        (in slot order) sharing one scale per KV head and channel; they go to the end of the
        quantized segment, so each row's logical order becomes (quantized before, these, the
        remaining FP tokens). Returns the tokens moved.

        Args:
            move: `[L', R, C]` bool over the FP slots of `layers` x `rows`: a multiple of
                `group` live, unpinned slots in each layer's row.
            fmt: a `kernels.formats.QUANT_FORMATS` name, `"int8"` or `"fp8"`.

        Raises:
            ValueError: a count that is not a multiple of `group`; an unknown format.
            ConfigError: a format other than the one the store already holds.
        """
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"unknown quantized format {fmt!r}: use {', '.join(QUANT_FORMATS)}")
        valid = self.fp.valid(layers, rows)
        move = move & valid
        counts = move.sum(dim=-1)  # [L', R]
        host = counts.tolist()
        flat = [c for per_layer in host for c in per_layer]
        if not any(flat):
            return 0
        if any(c % group for c in flat):
            raise ValueError(f"tokens to quantize do not split into groups of {group}")
        quant = QUANT_FORMATS[fmt]
        self._retype(quant)
        q_lens = self.q.length_tensor(layers, rows)
        n_groups = self.scales.length_tensor(layers, rows)
        self._room(int((q_lens + counts).max()), int((n_groups + counts // group).max()))
        width = _round_up(max(flat), group)
        order = kept_first(move)[..., :width]  # the moved slots first, in slot order
        li, ri, si = (torch.arange(width, device=self.device) < counts[..., None]).nonzero(
            as_tuple=True
        )
        layer_at, row_at = li + (layers.start or 0), ri + (rows.start or 0)
        dest = q_lens[li, ri] + si
        scale_row = n_groups[li, ri] + si // group
        first = si % group == 0  # one scale row per group
        for part in ("keys", "values"):
            tokens = self.fp.take(part, order, layers, rows)  # [L', R, H, width, D]
            flat_tokens = tokens.reshape(-1, width, self.head_dim)
            codes, scales = dispatch.quantize_groups(flat_tokens, group, quant)
            codes = codes.view(tokens.shape)
            scales = scales.view(*tokens.shape[:3], width // group, self.head_dim)
            bytes_view(self.q[part])[layer_at, row_at, :, dest] = bytes_view(codes)[li, ri, :, si]
            self.scales[part][layer_at[first], row_at[first], :, scale_row[first]] = scales[
                li[first], ri[first], :, si[first] // group
            ]
        self.q["group"][layer_at, row_at, dest] = scale_row
        for name, spec in self.fp.specs.items():
            if name in ("keys", "values"):
                continue
            moved = self.fp.take(name, order, layers, rows)
            if spec.lead:
                self.q[name][layer_at, row_at, :, dest] = moved[li, ri, :, si]
            else:
                self.q[name][layer_at, row_at, dest] = moved[li, ri, si]
        keep = valid & ~move
        self.fp.gather(kept_first(keep), layers, rows)
        _set_lengths(self.fp, layers, rows, keep.sum(dim=-1).tolist())
        for i, layer in enumerate(range(*layers.indices(self.num_layers))):
            for j, row in enumerate(range(*rows.indices(self.batch))):
                self.q.lengths[layer][row] += host[i][j]
                self.scales.lengths[layer][row] += host[i][j] // group
                if host[i][j]:
                    self.changed_at[row] = self.seen(row)
        moved_total = sum(flat)
        self.quantized_tokens += moved_total
        self._note_allocated()
        return moved_total

    def quantize_slots(
        self, layer: int, row: int, slots: torch.Tensor, group: int, fmt: str
    ) -> int:
        """Quantize chosen live slots of one layer's row (`quantize_joint` for one layer and
        row); returns the tokens moved.

        Args:
            slots: int64 `[m]`, increasing logical slots of FP, unpinned tokens; `m` a
                multiple of `group`.

        Raises:
            ValueError: a slot already quantized, pinned or out of range; `m` not a multiple
                of `group`; an unknown format.
            ConfigError: a format other than the one the store already holds.
        """
        q_len, n = self.q.lengths[layer][row], self.length(layer, row)
        if slots.numel() and (int(slots.min()) < q_len or int(slots.max()) >= n):
            raise ValueError(f"slots must be FP slots in [{q_len}, {n}) of row {row}")
        if bool(self.pinned_mask(layer, row)[slots].any()):
            raise ValueError("pinned tokens are never quantized")
        move = torch.zeros(1, 1, self.fp.capacity, dtype=torch.bool, device=self.device)
        move[0, 0, slots - q_len] = True
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        return self.quantize_joint(move, group, fmt, layers, rows)

    def _retype(self, quant: QuantFormat) -> None:
        """Hold quantized codes as `quant.dtype` (refused while tokens of another format are
        held: one format per session)."""
        current = self.q["keys"].dtype
        if current == quant.dtype:
            return
        if self.q.most():
            raise ConfigError(
                f"this cache holds {format_name(current)} tokens; cannot add {quant.name} ones "
                "(one format per session)"
            )
        for part in ("keys", "values"):
            self.q.retype(part, quant.dtype)

    def oldest_mask(self, window: int, group: int, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, C]` bool over FP slots: the unpinned tokens older than the newest `window`
        unpinned ones of each layer's row, in whole groups of `group`, oldest first."""
        valid = self.fp.valid(layers, rows)
        unpinned = valid & ~self.pinned_joint(layers, rows)[..., self.q.capacity :]
        age = torch.cumsum(unpinned.long(), dim=-1)  # 1 for the oldest unpinned token
        whole = (age[..., -1:] - window).clamp_min(0) // group * group
        return unpinned & (age <= whole)

    def quantize_oldest(
        self, window: int, group: int, fmt: str, layers: slice = slice(None),
        rows: slice = slice(None),
    ) -> int:  # fmt: skip
        """Move every whole group of unpinned FP tokens older than the newest `window` ones
        into the quantized segment in format `fmt` (`quantize_joint`), in `layers` x `rows`;
        returns the tokens moved. Decided on host counts first: nothing to move, no tensor
        operation."""
        pinned = self.pinned_live()
        due = any(
            self.fp.lengths[layer][row] - pinned[layer][row] >= window + group
            for layer in range(*layers.indices(self.num_layers))
            for row in range(*rows.indices(self.batch))
        )
        if not due:
            return 0
        move = self.oldest_mask(window, group, layers, rows)
        return self.quantize_joint(move, group, fmt, layers, rows)

    def quantize_stale(self, layers: slice = slice(None), rows: slice = slice(None)) -> int:
        """Move the tokens that left the FP window into INT8 (CONF-KV's mixed precision,
        `int8`; no-op without it), in `layers` x `rows`; returns the tokens moved."""
        if self.int8 is None:
            return 0
        return self.quantize_oldest(self.int8.fp_window, self.int8.group, "int8", layers, rows)

    def quantized_format(self) -> str | None:
        """The format of the quantized tokens held (`"int8"` or `"fp8"`), None while none."""
        return format_name(self.q["keys"].dtype) if self.q.most() else None

    # -- per-row access (cold tier, reconstruction, evaluations) -----------------------------

    def read_slots(
        self, layer: int, row: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 keys and values `[H, m, D]` of a layer's row at its logical slots `slots`
        (int64 `[m]`), quantized ones dequantized with their group's scales."""
        q_len = self.q.lengths[layer][row]
        quantized, fp = slots[slots < q_len], slots[slots >= q_len] - q_len
        keys = [self.fp["keys"][layer, row][:, fp].float()]
        values = [self.fp["values"][layer, row][:, fp].float()]
        if quantized.numel():
            groups = self.q["group"][layer, row, quantized]
            for out, part in ((keys, "keys"), (values, "values")):
                codes = self.q[part][layer, row][:, quantized]
                out.insert(0, dequantize(codes, self.scales[part][layer, row][:, groups]))
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)

    def insert(
        self,
        layer: int,
        row: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        room: int = 0,
    ) -> None:
        """Put tokens back into a layer's FP segment at their original positions (a recall):
        the segment stays in position order, so the newest tokens stay last.

        Args:
            keys, values: `[H, m, D]`, in the store's key convention.
            positions: `[m]` int64 original positions, all older than the newest token.
            room: slots to keep free after them (the new tokens of the call recalling).
        """
        m = positions.numel()
        fp = self.fp.lengths[layer][row]
        if fp + m + room > self.fp.capacity:
            fitted = _fitted_capacity(self.fp.capacity, self.fp.most() + m + room, BLOCK_TOKENS)
            self._resize(self.fp, fitted)
        table = self.fp
        table["keys"][layer, row, :, fp : fp + m] = keys.to(self.dtype)
        table["values"][layer, row, :, fp : fp + m] = values.to(self.dtype)
        table["positions"][layer, row, fp : fp + m] = positions
        table["hits"][layer, row, fp : fp + m] = 0.0
        for name in META_FIELDS:
            table[name][layer, row, :, fp : fp + m] = 0.0
        order = torch.argsort(table["positions"][layer, row, : fp + m])
        table.lengths[layer][row] = fp + m
        table.gather(order.view(1, 1, -1), slice(layer, layer + 1), slice(row, row + 1))

    def truncate(self, end: int, row: int = 0) -> None:
        """Forget every token of the row at position `end` or later, so the next token takes
        position `end` again (a client rewrote history from there). Pins past `end` go too;
        shared blocks past it are no longer read, and the one it cuts is copied into the
        row's own FP segment (copy on write).

        Raises:
            ValueError: `end` is negative, past the tokens seen, or before `changed_at[row]`
                (eviction or quantization since then depended on the forgotten tokens).
        """
        if not self.changed_at[row] <= end <= self.seen(row):
            raise ValueError(
                f"cannot truncate row {row} to {end} tokens: the cache is exact only back to "
                f"{self.changed_at[row]} of its {self.seen(row)} tokens"
            )
        rows = slice(row, row + 1)
        keep = self.joint("positions", slice(None), rows) < end
        self._compact(keep & self.valid(slice(None), rows), slice(None), rows)
        if end < self.shared_tokens:
            self._truncate_shared(end)
        self.appended[row] = end
        self.observed_from[row] = min(self.observed_from[row], end)
        self._grow_pins(end)
        self._pinned[row, end:] = False
        self._pins_changed()

    def precision_counts(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position the row has seen (`[seen]` int64 each): in how many layers it is live
        at full precision, and in how many quantized; the other layers evicted it."""
        seen = self.seen(row)
        fp = torch.zeros(seen, dtype=torch.long, device=self.device)
        quantized = torch.zeros_like(fp)
        for layer in range(self.num_layers):
            q_len, fp_len = self.q.lengths[layer][row], self.fp.lengths[layer][row]
            quantized[self.q["positions"][layer, row, :q_len]] += 1
            fp[self.fp["positions"][layer, row, :fp_len]] += 1
        return fp, quantized

    # -- shared prefix -----------------------------------------------------------------------

    @property
    def shared_tokens(self) -> int:
        """Positions `[0, shared_tokens)` of the row are read from shared runs, not held in
        its own segments (0 without any)."""
        return 0 if self.shared is None else self.shared.tokens

    def shared_nbytes(self) -> int:
        """Bytes of the shared keys and values the store reads (held once for every store
        that reads them: never part of `nbytes` or `allocated_nbytes`)."""
        return 0 if self.shared is None else self.shared.nbytes()

    def shared_views(self) -> list[SharedView]:
        """The shared views read, in position order (empty without any)."""
        return [] if self.shared is None else list(self.shared.views)

    def pinned_run(self, start: int, limit: int, row: int = 0) -> int:
        """How many consecutive positions from `start` are pinned, at most `limit`."""
        self._grow_pins(start + limit)
        flags = self._pinned[row, start : start + limit]
        unpinned = (~flags).nonzero()
        return int(unpinned[0, 0]) if unpinned.numel() else flags.numel()

    def share(self, cache: PrefixCache, views: list[SharedView]) -> int:
        """Read `views` (references taken, `PrefixCache.match`) as the next positions of a
        one-row store that holds no token of its own yet: the tokens they add are seen, as if
        fed. Returns the tokens added.

        Raises:
            ValueError: a store of several rows, or one holding tokens of its own.
        """
        self._check_shareable()
        if self.shared is None:
            self.shared = SharedPrefix(cache)
        before = self.shared.tokens
        self.shared.extend(views)
        added = self.shared.tokens - before
        self.appended[0] += added
        return added

    def _check_shareable(self) -> None:
        if self.batch != 1:
            raise ValueError("only a one-row store reads shared prefix blocks")
        if self.seen(0) != self.shared_tokens:
            raise ValueError("shared blocks go before the store's own tokens, and it holds some")

    def front_tokens(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values `[L, H, count, D]` (views) of the row's first `count` own tokens,
        positions `shared_tokens` onward, which every layer must hold at full precision (a
        pinned run just prefilled).

        Raises:
            ValueError: a layer does not hold exactly those positions first.
        """
        start = self.shared_tokens
        if self.fp.capacity < count or self.q.most():
            raise ValueError(f"the store does not hold positions {start}..{start + count} first")
        expected = torch.arange(start, start + count, device=self.device)
        held = self.fp["positions"][:, 0, :count]
        lengths = self.fp.length_tensor(slice(None), slice(0, 1))
        if bool((lengths < count).any()) or not bool((held == expected).all()):
            raise ValueError(f"the store does not hold positions {start}..{start + count} first")
        return self.fp["keys"][:, 0, :, :count], self.fp["values"][:, 0, :, :count]

    def share_front(self, cache: PrefixCache, views: list[SharedView], count: int) -> None:
        """Read the row's first `count` own tokens from `views` instead (the runs
        `PrefixCache.publish` made of them, or found): they leave its own segments (not an
        eviction) and are read shared from now on."""
        if self.batch != 1:
            raise ValueError("only a one-row store reads shared prefix blocks")
        self.front_tokens(count)
        if self.shared is None:
            self.shared = SharedPrefix(cache)
        keep = self.valid(slice(None), slice(0, 1))
        keep[..., self.q.capacity : self.q.capacity + count] = False
        self._compact(keep, slice(None), slice(0, 1))
        self._pins_changed()
        self.shared.extend(views)

    def _truncate_shared(self, end: int) -> None:
        """Read shared blocks only before position `end` (the store holds no token of its
        own: they all came after the shared ones): the whole blocks before it stay shared, the
        tokens of the block it cuts are copied into the FP segment (copy on write)."""
        views = self.shared.views
        keys = torch.cat([view.keys for view in views], dim=2)
        values = torch.cat([view.values for view in views], dim=2)
        block = views[0].block_tokens
        kept = end - end % block
        dropped, remaining = [], kept
        for i, view in enumerate(views):
            if remaining >= view.tokens:
                remaining -= view.tokens
                continue
            if remaining:
                views[i] = SharedView(view.run, remaining // block, block)
                dropped.extend(views[i + 1 :])
                del views[i + 1 :]
            else:
                dropped.extend(views[i:])
                del views[i:]
            break
        if self.shared.cache is not None:
            self.shared.cache.release(dropped)
        positions = torch.arange(kept, end, device=self.device)
        for layer in range(self.num_layers):
            if positions.numel():
                self.insert(
                    layer, 0, keys[layer, :, kept:end], values[layer, :, kept:end], positions
                )
        self._pins_changed()

    def adopt_shared(self, cache: PrefixCache) -> None:
        """Read the shared views restored from disk (`from_state`) from `cache`'s runs: the
        blocks it holds replace the restored copies, the others become its runs."""
        if self.shared is None or self.shared.cache is cache:
            return
        adopted = cache.adopt(self.shared.views)
        self.shared.release()
        self.shared = SharedPrefix(cache)
        self.shared.extend(adopted)

    # -- cold tier ---------------------------------------------------------------------------

    def attach_cold(self, config: ColdConfig) -> ColdTier:
        """Keep evicted tokens in a cold tier with these settings from now on (a tier already
        attached keeps its pages and takes the new settings); returns it.

        Raises:
            ConfigError: invalid settings.
        """
        config.validate()
        if self.cold is None:
            self.cold = ColdTier(self.num_layers, self.batch, config, self.rotary)
        else:
            self.cold.config = config
        self.recalling = True
        return self.cold

    def recall_due(self, query_len: int) -> bool:
        """Whether the current forward call (of `query_len` queries per row) recalls cold
        pages: the store is `recalling` and `ColdConfig.due` says so for the call's first
        row."""
        return self.recalling and self.cold.config.due(query_len, self.seen(self._rows[0]))

    def recall(self, layer: int, query: torch.Tensor, scale: float) -> int:
        """Bring the best cold pages of a layer back into the hot store for the current rows,
        before the call's attention reads it; returns the tokens recalled.

        The call's last `ColdConfig.queries` queries score the pages (`ColdTier.recall`); the
        recalled tokens leave the `evicted_tokens` count (an eviction that was undone) and go
        back at their original positions (`insert`) with fresh statistics, and the policy
        keeps them first until the layer's next recall (`held_joint`), within its budget.

        Args:
            query: `[rows, Hq, q, D]`, the call's queries as attention receives them (rotated
                at the call's positions; in rerotate mode they are scored at their original
                positions instead, like the digests).
            scale: the attention's softmax scale.
        """
        started = time.perf_counter()
        n = query.shape[2]
        window = min(n, self.cold.config.queries)
        recalled = 0
        for i, row in enumerate(self._rows):
            scoring = query[i, :, n - window :]  # [Hq, S, D]
            if self.rotary is not None:
                scoring = self._at_original_positions(scoring, i, self.appended[row] - window)
            got = self.cold.recall(layer, row, scoring, scale)
            if got is None:
                continue
            positions, keys, values = got
            self.insert(layer, row, keys, values, positions, room=n)
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

    def held_joint(self, layers: slice, rows: slice) -> torch.Tensor | None:
        """`[L', R, Cq + C]` bool: the slots of the tokens each layer's last recall brought
        back, or None when not recalling or before any recall."""
        if not self.recalling:
            return None
        held_any = False
        positions = self.joint("positions", layers, rows)
        held = torch.zeros_like(positions, dtype=torch.bool)
        for i, layer in enumerate(range(*layers.indices(self.num_layers))):
            for j, row in enumerate(range(*rows.indices(self.batch))):
                taken = self.cold.held[layer][row]
                if taken is not None:
                    held[i, j] = torch.isin(positions[i, j], taken)
                    held_any = True
        return (held & self.valid(layers, rows)) if held_any else None

    def held_mask(self, layer: int, row: int = 0) -> torch.Tensor | None:
        """`[length]` bool over one layer's row's live slots (logical order): the tokens its
        last recall brought back, or None when not recalling or before any recall."""
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        held = self.held_joint(layers, rows)
        return None if held is None else held[0, 0][self.valid(layers, rows)[0, 0]]

    @property
    def peak_cold_bytes(self) -> int:
        """The most bytes the cold tier has held (0 without one)."""
        return 0 if self.cold is None else self.cold.peak_bytes

    def cold_nbytes(self, row: int | None = None) -> int:
        """Exact bytes of the cold tier (codes, scales, digests), for one row or all; 0 without
        one. Never part of `nbytes` or `allocated_nbytes`, which count the hot store."""
        return 0 if self.cold is None else self.cold.nbytes(row)

    # -- accounting --------------------------------------------------------------------------

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of live keys, values and scales over all layers, for one row or all."""
        rows = range(self.batch) if row is None else [row]
        element = torch.empty(0, dtype=self.dtype).element_size()
        scale = torch.empty(0, dtype=SCALE_DTYPE).element_size()
        return _live_bytes(
            2 * self.kv_heads * self.head_dim,
            element,
            scale,
            sum(lengths[r] for lengths in self.fp.lengths for r in rows),
            sum(lengths[r] for lengths in self.q.lengths for r in rows),
            sum(lengths[r] for lengths in self.scales.lengths for r in rows),
        )

    def allocated_nbytes(self, row: int | None = None) -> int:
        """Bytes of all key/value/scale buffers including spare capacity, for all rows or
        (`row`) one row's share: the buffers are `[L, B, ...]`, every row the same slots."""
        total = sum(
            getattr(self, segment).nbytes(names) for segment, names in ALLOCATED_FIELDS.items()
        )
        return total if row is None else total // self.batch

    def footprint(self) -> StoreFootprint:
        """What the store holds and has allocated (`StoreFootprint`)."""
        return StoreFootprint.of_state(self._outline())

    def full_kv_nbytes(self, row: int = 0) -> int:
        """Live bytes a full KV cache would hold for a row's tokens seen so far, at the FP
        dtype: the tokens alone, no spare capacity."""
        return self.seen(row) * self.bytes_per_token()

    def full_kv_allocated_nbytes(self, row: int = 0) -> int:
        """Bytes a full KV cache's buffers would be allocated for a row's tokens seen so far,
        at the FP dtype, under this store's capacity rule: the tokens plus `GROWTH_SHARE`, in
        whole `BLOCK_TOKENS` blocks (what a store that never evicts fits to them when they
        arrive in one call; arriving in many, it holds between the tokens and `KEEP_SHARE`
        more, plus a block)."""
        return _fitted_capacity(0, self.seen(row), BLOCK_TOKENS) * self.bytes_per_token()

    def _note_peak(self) -> None:
        for row in self._rows:
            self.row_peak_bytes[row] = max(self.row_peak_bytes[row], self.nbytes(row))
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        self._note_allocated()

    def _note_allocated(self) -> None:
        allocated = self.allocated_nbytes()
        self.call_allocated_bytes = max(self.call_allocated_bytes, allocated)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, allocated)

    # -- saving ------------------------------------------------------------------------------

    def _outline(self) -> dict:
        """The parts of `state()` a footprint reads, without copying a tensor."""
        return {
            "shape": [self.num_layers, self.kv_heads, self.head_dim],
            "batch": self.batch,
            "fp": {"keys": self.fp["keys"]},
            "q": {"keys": self.q["keys"]},
            "scales": {"keys": self.scales["keys"]},
            "lengths": self._lengths(),
            "capacity": self._capacities(),
        }

    def _lengths(self) -> dict:
        return {
            name: [list(row) for row in getattr(self, name).lengths]
            for name in ("fp", "q", "scales")
        }

    def _capacities(self) -> dict:
        return {name: getattr(self, name).capacity for name in ("fp", "q", "scales")}

    def state(self, trim: bool = False) -> dict:
        """Everything the store holds, as tensors and plain values (for `torch.save`). With
        `trim`, each field is a copy of its live slots only (a saved file then holds live
        bytes, not spare capacity); `capacity` says what `from_state` allocates again."""
        tables = {}
        for name in ("fp", "q", "scales"):
            table = getattr(self, name)
            live = table.most() if trim else table.capacity
            tables[name] = {
                field: (
                    tensor.narrow(table.specs[field].slot_dim, 0, live).clone() if trim else tensor
                )
                for field, tensor in table.fields.items()
            }
        return {
            **tables,
            "lengths": self._lengths(),
            "capacity": self._capacities(),
            "appended": list(self.appended),
            "shape": [self.num_layers, self.kv_heads, self.head_dim],
            "batch": self.batch,
            "ema_decay": self.ema_decay,
            "int8": None if self.int8 is None else [self.int8.fp_window, self.int8.group],
            "max_positions": self.max_positions,
            "windows": list(self.windows),
            "rerotate": self.rotary is not None,
            "pinned": self._pinned,
            "counters": [
                self.peak_bytes,
                self.evicted_tokens,
                self.quantized_tokens,
                self.peak_allocated_bytes,
                self.window_dropped,
            ],
            "row_counters": [self.row_peak_bytes, self.changed_at],
            "profile": self.profile,
            "observed_from": self.observed_from,
            "cold": None if self.cold is None else self.cold.state(),
            "shared": self._shared_state(),
        }

    def _shared_state(self) -> dict | None:
        """The shared keys and values the store reads, copied, with their blocks' digests."""
        views = self.shared_views()
        if not views:
            return None
        return {
            "keys": torch.cat([view.keys for view in views], dim=2),
            "values": torch.cat([view.values for view in views], dim=2),
            "digests": [d for view in views for d in view.run.digests[: view.blocks]],
            "block_tokens": views[0].block_tokens,
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
        keys = state["fp"]["keys"]
        int8 = None if state["int8"] is None else Int8Config(*state["int8"])
        store = cls(
            layers, heads, dim, keys.dtype, keys.device, state["ema_decay"], state["batch"],
            int8, rotary, state["max_positions"], state.get("windows"),
        )  # fmt: skip
        for name in ("fp", "q", "scales"):
            table = getattr(store, name)
            saved = state[name]
            for field, tensor in saved.items():
                spec = table.specs[field]
                table.specs[field] = type(spec)(spec.lead, spec.tail, tensor.dtype)
            table.fields = {field: tensor.clone() for field, tensor in saved.items()}
            table.capacity = next(iter(saved.values())).shape[table.specs["keys"].slot_dim]
            table.lengths = [list(row) for row in state["lengths"][name]]
            table.resize(state["capacity"][name])
        store.appended = list(state["appended"])
        store.profile = state.get("profile")
        if state.get("cold") is not None:
            store.cold = ColdTier.from_state(state["cold"], rotary)
        shared = state.get("shared")
        if shared is not None:  # read from a run of its own until a cache adopts it
            width = len(shared["digests"]) * shared["block_tokens"]
            if shared["keys"].shape[2] != width or shared["values"].shape != shared["keys"].shape:
                raise ValueError("the saved shared prefix does not match its block digests")
            run = PrefixRun(
                shared["keys"], shared["values"], list(shared["digests"]), start=0, refs=1
            )
            store.shared = SharedPrefix(None)
            store.shared.extend([SharedView(run, len(run.digests), shared["block_tokens"])])
        store.observed_from = list(state.get("observed_from", store.observed_from))
        store._pinned = state["pinned"].cpu()
        store._pins_changed()
        store.peak_bytes, store.evicted_tokens, store.quantized_tokens = state["counters"][:3]
        store.peak_allocated_bytes = max(state["counters"][3], store.allocated_nbytes())
        store.window_dropped = state["counters"][4] if len(state["counters"]) > 4 else 0
        store.row_peak_bytes, store.changed_at = (list(v) for v in state["row_counters"])
        return store


def kept_first(keep: torch.Tensor) -> torch.Tensor:
    """int64 `[..., W]`: for a bool mask `[..., W]`, the marked slots in order, then the
    others in order (a stable partition: what compaction gathers)."""
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices


def _set_lengths(table: SlotTable, layers: slice, rows: slice, counts: list[list[int]]) -> None:
    """Set a table's host lengths of `layers` x `rows` to `counts` `[L'][R]`."""
    row_ids = range(*rows.indices(table.batch))
    for layer, per_row in zip(range(*layers.indices(table.layers)), counts, strict=True):
        for row, count in zip(row_ids, per_row, strict=True):
            table.lengths[layer][row] = count
