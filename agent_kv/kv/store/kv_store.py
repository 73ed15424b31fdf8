"""The KV store: a front over the parts that each own one concern (docs/architecture.md,
"The store's parts"):

- `segments` (`Segments`): the FP and quantized segments and the scale table, their
  capacities (fitted to what they hold: `capacity`), the tokens each row has seen, compaction;
- `pins` (`Pins`): positions exempt from eviction and quantization;
- `precision` (`PrecisionTiers`): tokens moved into the quantized segment (CONF-KV's mixed
  precision, a policy's quantized tier);
- `recall` (`RecallTier`): the cold tier, evictions into it and recalls out of it;
- `prefix` (`PrefixReads`): the shared prefix blocks a one-row store reads before its own;
- `figures` (`StoreFigures`): peaks and counters.
Each part saves and restores its own state (`state`, `from_state`).

The front says what a row holds and has seen, bounds the segments by a policy's budget, evicts
(compaction, to the cold tier when recalling), cuts a row's history (`truncate`), drops what
sliding-window layers no longer see, and accounts for what a forward call appended
(`note_appended`). A forward call itself is `agent_kv.kv.forward_call.ForwardCall`, made over a
store with `ForwardCall.open`: the store knows nothing of calls.

Sliding-window layers (`attention_windows`, from the model's config:
`agent_kv.kv.attention_windows`): the attention masks each query to its window, and after every
forward call the store drops from those layers the tokens no later query can see
(`trim_attention_windows`), so such a layer holds its window and no more: the window is its
policy, and eviction policies evict in the full-attention layers only (`Policy.evict`). Pinned
tokens are dropped with the rest once out of the window.

Positions: by default keys are stored rotated at their original positions and the next
token's position is the number of tokens the row has seen. In `rerotate` mode (StreamingLLM,
see `agent_kv.kv.rope`) keys are stored unrotated and rotated at every read to their rank among
the row's live tokens, and new tokens take positions inside the cache, so an episode can run
past the model's trained context.
"""

from __future__ import annotations

import torch

from agent_kv.errors import ContextOverflowError
from agent_kv.kv.attention_windows import attention_windows
from agent_kv.kv.cold_tier import ColdTier
from agent_kv.kv.rope import Rotary
from agent_kv.kv.store.capacity import BLOCK_TOKENS, StoreFootprint, fitted_capacity
from agent_kv.kv.store.figures import StoreFigures
from agent_kv.kv.store.pins import Pins
from agent_kv.kv.store.precision import Int8Config, PrecisionTiers
from agent_kv.kv.store.prefix_reads import PrefixReads
from agent_kv.kv.store.recall import RecallTier
from agent_kv.kv.store.segments import Segments
from agent_kv.kv.token_statistics import TokenStatistic
from kernels.int8 import SCALE_DTYPE

KV_DTYPE_ATTRIBUTE = "agent_kv_kv_dtype"
"""A model whose KV cache is stored in another dtype than its weights' (bfloat16 weights, a
float32 cache: `agent_kv.runtime.models.weight_formats`) carries that dtype as this attribute;
`KVStore.for_model` stores in it, and the attention function computes in it."""
ATTENTION_WINDOW_SLACK = 32
"""Tokens a sliding-window layer may hold past its window before `trim_attention_windows` drops
them (they are masked out meanwhile): the compaction then runs once per
`ATTENTION_WINDOW_SLACK + 1` decode steps instead of after each, as `Policy.evict_slack` does
for evictions."""


class KVStore:
    """The KV cache of a batch of sequences across all layers of a model.

    Args:
        num_layers: decoder layers.
        kv_heads: key/value heads per layer (GQA: fewer than query heads).
        head_dim: channels per head.
        dtype: storage dtype of the FP segment.
        device: where the buffers live.
        batch: rows (independent sequences).
        int8: mixed-precision settings, or None to keep every token in `dtype`.
        rotary: the model's rotary embedding for `rerotate` positions, or None for original
            positions.
        max_positions: the model's trained context in tokens (0: unchecked); no forward call
            may place a token past it.
        attention_windows: per layer, its sliding window in tokens (a query at position `p`
            sees keys at `p - window < k <= p`), or None for a full-attention layer; default
            all None.

    Attributes:
        segments, pins, precision, recall, prefix, figures: the parts (module docstring).
        attention_window_slack: tokens a sliding-window layer may hold past its window before
            they are dropped (`ATTENTION_WINDOW_SLACK`; 0: after every call).
        profile: `[num_layers, 4]`, sums of the three prefill attention statistics and the
            calls counted (`record_profile`), or None.
        observed_from: per row, the position of the first query of the last observation
            window: tokens from there on have no `observation_mass` of their own.

    Raises:
        ValueError: non-positive sizes, or `attention_windows` without one positive window or
            None per layer.
        ConfigError: invalid `int8` settings.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
        int8: Int8Config | None = None,
        rotary: Rotary | None = None,
        max_positions: int = 0,
        attention_windows: tuple[int | None, ...] | None = None,
    ):
        if min(num_layers, kv_heads, head_dim, batch) <= 0:
            raise ValueError("num_layers, kv_heads, head_dim and batch must be positive")
        windows = (None,) * num_layers if attention_windows is None else tuple(attention_windows)
        if len(windows) != num_layers or any(w is not None and w < 1 for w in windows):
            raise ValueError(f"attention_windows must give {num_layers} positive windows or None")
        if int8 is not None:
            int8.validate()
        device = torch.device(device)
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.batch = batch
        self.rotary = rotary
        self.max_positions = max_positions
        self.attention_windows = windows
        self.attention_window_slack = ATTENTION_WINDOW_SLACK
        self._global = torch.tensor([w is None for w in windows], device=device)
        self.figures = StoreFigures(batch)
        self.segments = Segments(num_layers, kv_heads, head_dim, dtype, device, batch, self.figures)
        self.pins = Pins(self.segments)
        self.precision = PrecisionTiers(self.segments, self.pins, self.figures, int8)
        self.recall = RecallTier(self.segments, self.figures, rotary)
        self.prefix = PrefixReads(self.segments, self.pins)
        self.figures.note_allocated(self.allocated_nbytes())
        self.profile: torch.Tensor | None = None
        self.observed_from = [0] * batch

    @classmethod
    def for_model(cls, model: torch.nn.Module, rerotate: bool = False, **kwargs) -> KVStore:
        """A store shaped for a transformers causal LM (reads `model.config`, its sliding-window
        layers included: `agent_kv.kv.attention_windows`); `rerotate` selects in-cache positions.
        Its dtype is the model's `KV_DTYPE_ATTRIBUTE` when set, else its weights' dtype.

        Raises:
            ConfigError: `rerotate` for a model without one RoPE for all layers, or a model
                whose layers agent_kv cannot run (`attention_windows`).
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
        kwargs.setdefault("attention_windows", attention_windows(cfg))
        return cls(cfg.num_hidden_layers, kv_heads, head_dim, **kwargs)

    # -- what a row holds --------------------------------------------------------------------

    @property
    def fp(self):
        """The FP segment (`Segments.fp`)."""
        return self.segments.fp

    @property
    def q(self):
        """The quantized segment (`Segments.q`)."""
        return self.segments.q

    @property
    def scales(self):
        """The quantized segment's scale table (`Segments.scales`)."""
        return self.segments.scales

    @property
    def int8(self) -> Int8Config | None:
        """The mixed-precision settings, or None."""
        return self.precision.int8

    @property
    def positions_mode(self) -> str:
        """ "original" or "rerotate"."""
        return "original" if self.rotary is None else "rerotate"

    @property
    def seen_tokens(self) -> int:
        """Tokens appended to row 0 so far (`seen(row)` for others)."""
        return self.segments.seen(0)

    def seen(self, row: int) -> int:
        """Tokens appended to a row so far (its next original position)."""
        return self.segments.seen(row)

    def next_position(self, row: int) -> int:
        """The rotary position a row's next token takes: its tokens seen (original
        positions), or its longest layer's live tokens (rerotate: kept tokens renumbered in
        order)."""
        return self.seen(row) if self.rotary is None else max(self.lengths(row))

    def length(self, layer: int, row: int = 0) -> int:
        """Live tokens of a row in one layer (quantized + FP)."""
        return self.segments.length(layer, row)

    def lengths(self, row: int = 0) -> list[int]:
        """Live tokens per layer for a row."""
        return self.segments.lengths(row)

    def quantized_lengths(self, row: int = 0) -> list[int]:
        """Live quantized tokens per layer for a row."""
        return [self.q.lengths[layer][row] for layer in range(self.num_layers)]

    def valid(self, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, Cq + C]` bool: the live slots of `layers` x `rows` (`Segments.valid`)."""
        return self.segments.valid(layers, rows)

    def joint(self, name: str, layers: slice = slice(None), rows: slice = slice(None)):
        """Field `name` over the joint slot space, `[L', R, ..., Cq + C]` (`Segments.joint`)."""
        return self.segments.joint(name, layers, rows)

    def live_positions(self, layer: int, row: int = 0) -> torch.Tensor:
        """`[length]` original positions of the row's live tokens in one layer, logical order."""
        return self.segments.live_positions(layer, row)

    def kept_share(self, start: int, end: int, row: int = 0) -> float:
        """The share of positions `[start, end)` of a row that are live, averaged over the
        layers (1.0: every layer holds every one; 0.0: all evicted; a span must be seen).

        Raises:
            ValueError: an empty span.
        """
        if end <= start:
            raise ValueError(f"empty position span [{start}, {end})")
        kept = 0
        for layer in range(self.num_layers):
            positions = self.live_positions(layer, row)
            kept += int(((positions >= start) & (positions < end)).sum())
        return kept / ((end - start) * self.num_layers)

    def ensure_columns(self, statistics: tuple[TokenStatistic, ...]) -> None:
        """Hold the columns of `statistics` (`Segments.ensure_columns`): a policy reading its
        statistic finds the column, zeros where nothing was folded yet."""
        self.segments.ensure_columns(statistics)

    def live_meta(self, name: str, layer: int, row: int = 0) -> torch.Tensor:
        """A statistic over the row's live tokens in one layer, logical order
        (`Segments.live_meta`)."""
        return self.segments.live_meta(name, layer, row)

    def bytes_per_token(self) -> int:
        """Key + value bytes one token costs across all layers at full precision."""
        element = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.kv_heads * self.head_dim * element

    def int8_bytes_per_token(self, group: int) -> float:
        """Bytes one INT8 token costs across all layers, with its `1/group` share of the
        float16 scales of its group."""
        per_channel = 1 + torch.empty(0, dtype=SCALE_DTYPE).element_size() / group
        return 2 * self.num_layers * self.kv_heads * self.head_dim * per_channel

    # -- capacity ----------------------------------------------------------------------------

    def bound_capacity(self, fp_tokens: int | None, q_tokens: int | None, chunk: int) -> None:
        """Bound the segments from now on by what they can need before an eviction: per row,
        the pinned tokens plus `fp_tokens` unpinned FP tokens plus one forward call's `chunk`
        (the FP segment), and `q_tokens` (the quantized one), neither more than the model's
        context (`max_positions`, when known). A bound caps a segment's headroom
        (`fitted_capacity`), it is never allocated ahead; None leaves a segment unbounded.
        Applied at the next forward call.

        Also sets what a static decode step reads (`decode_widths`): a row that has been
        stepped holds at most the pinned tokens plus `fp_tokens` FP tokens before a decode
        call appends one, so the step reads that much of the FP segment, not the chunk's room.

        The policy bounds the full-attention layers; a sliding-window layer holds up to
        `attention_window_hold()` tokens between calls whatever the policy, so a bounded segment
        holds at least that (FP: up to the INT8 FP window, with mixed precision).
        """
        pinned = max(max(row) for row in self.pins.live())
        hold = self.attention_window_hold()
        fp_hold = hold if self.int8 is None else min(hold, self.int8.max_fp_tokens)
        fp = None if fp_tokens is None else max(pinned + fp_tokens, fp_hold) + chunk
        if q_tokens:  # a quantized segment that sliding-window layers may fill too
            q_tokens = max(q_tokens, hold)
        if self.max_positions:  # no row ever holds more live tokens than the model's context
            fp = None if fp is None else min(fp, self.max_positions)
            q_tokens = None if q_tokens is None else min(q_tokens, self.max_positions)
            fp_tokens = None if fp_tokens is None else min(fp_tokens, self.max_positions)
        held = None if fp_tokens is None else max(pinned + fp_tokens, fp_hold)
        self.segments.bound(fp, q_tokens, held)

    @property
    def fp_bounded(self) -> bool:
        """Whether a policy's bound fixes the FP segment's capacity (`bound_capacity`); an
        unbounded store (full KV) grows with what it holds."""
        return self.segments.fp_bounded

    def decode_widths(self) -> dict[str, int]:
        """The slots of each segment a static decode step reads (`Segments.decode_widths`)."""
        return self.segments.decode_widths()

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

    def note_appended(self, rows: range, n: int) -> None:
        """A committed forward call wrote `n` new tokens after each of `rows`' FP slots:
        host lengths, positions seen, pins and peaks follow, and sliding-window layers drop
        what no later query sees (`trim_attention_windows`)."""
        seg = self.segments
        self.pins.appended(rows, n)
        for lengths in seg.fp.lengths:
            for row in rows:
                lengths[row] += n
        for row in rows:
            seg.appended[row] += n
        seg.note_peak(rows)
        self.trim_attention_windows(rows)

    def skip(self, n: int, row: int = 0) -> None:
        """Move a row's next original position on by `n` positions it will never hold (the
        gaps of a cache encoded again from the tokens it kept, `Engine.reencode`): the next
        token appended takes position `seen + n`. The cache is exact from here only
        (`Segments.changed_at`).

        Raises:
            ValueError: `n < 0`, or a row outside the store.
        """
        if n < 0 or not 0 <= row < self.batch:
            raise ValueError(f"cannot skip {n} positions of row {row} ({self.batch} rows)")
        self.segments.appended[row] += n
        self.segments.mark_changed(row)

    # -- sliding-window layers ---------------------------------------------------------------

    def attention_window_hold(self) -> int:
        """The most tokens a sliding-window layer's row holds between forward calls: its
        window less the new query's own slot, plus `attention_window_slack` (0 without such
        layers)."""
        return max(
            (w - 1 + self.attention_window_slack for w in self.attention_windows if w), default=0
        )

    def global_layers(self) -> torch.Tensor:
        """`[L]` bool on the store's device: which layers attend to every token (the ones an
        eviction policy evicts in)."""
        return self._global

    def trim_attention_windows(self, rows: range) -> int:
        """Drop from every sliding-window layer of `rows` the tokens no later query can see
        (positions `<= seen - window`: the next query sits at `seen`), once a layer holds
        more than `window - 1 + attention_window_slack`; pinned ones too (the window wins: the
        model cannot see them). Decided on host counts first: nothing due, no tensor operation.
        Returns the tokens dropped (`figures.attention_window_dropped`; not evictions: no cold
        tier).
        """
        due = [
            layer
            for layer, window in enumerate(self.attention_windows)
            if window
            and any(self.length(layer, r) > window - 1 + self.attention_window_slack for r in rows)
        ]
        if not due:
            return 0
        layers, span = slice(due[0], due[-1] + 1), slice(rows.start, rows.stop)
        windows = torch.tensor([w or 0 for w in self.attention_windows[layers]], device=self.device)
        horizon = torch.tensor([self.seen(r) for r in rows], device=self.device)
        positions = self.joint("positions", layers, span)  # [L', R, S]
        seen = positions > horizon[None, :, None] - windows[:, None, None]
        keep = self.valid(layers, span) & (seen | (windows == 0)[:, None, None])
        dropped = self._compact_counted(keep, layers, span)
        self.figures.attention_window_dropped += dropped
        return dropped

    # -- prefill attention profile -----------------------------------------------------------

    def record_profile(self, layer_idx: int, stats: torch.Tensor) -> None:
        """Add one prefill call's attention shape statistics to the layer's running means.

        Args:
            stats: `[rows, kv_heads, 3]` from `kernels.torch_attention.attention_profile`:
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

    # -- eviction ----------------------------------------------------------------------------

    def compact_joint(self, keep: torch.Tensor, layers: slice, rows: slice) -> int:
        """Keep the live slots `keep` marks in each layer's row of `layers` x `rows`, evict the
        rest (to the cold tier when recalling); returns the tokens evicted.

        Args:
            keep: `[L', R, Cq + C]` bool over the joint slot space; free slots are ignored.

        Quantized tokens move with their scale rows; scale rows no kept token uses are dropped.
        """
        keep = keep & self.valid(layers, rows)
        if self.recall.recalling:
            self.recall.evict(~keep, layers, rows)
        evicted = self._compact_counted(keep, layers, rows)
        self.figures.evicted_tokens += evicted
        return evicted

    def _compact_counted(self, keep: torch.Tensor, layers: slice, rows: slice) -> int:
        """`Segments.compact` to the `keep` mask `[L', R', S]`, noting each row whose cache
        changed; returns the tokens removed, summed over layers and rows."""
        layer_ids = range(*layers.indices(self.num_layers))
        row_ids = range(*rows.indices(self.batch))
        before = {(layer, row): self.length(layer, row) for layer in layer_ids for row in row_ids}
        self.segments.compact(keep, layers, rows)
        removed = 0
        for (layer, row), old in before.items():
            gone = old - self.length(layer, row)
            if gone:
                self.segments.mark_changed(row)
            removed += gone
        self.pins.changed()
        return removed

    def compact(self, layer: int, keep: torch.Tensor, row: int = 0) -> int:
        """Evict every live slot of one layer's row not in `keep` (int64 `[k]`, increasing,
        logical order); returns the tokens evicted."""
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        valid = self.valid(layers, rows)
        logical = torch.zeros(int(valid.sum()), dtype=torch.bool, device=self.device)
        logical[keep] = True
        joint = torch.zeros_like(valid)
        joint[valid] = logical
        return self.compact_joint(joint, layers, rows)

    def intact_tokens(self, row: int = 0) -> int:
        """The length `n` of the row's intact prefix: every layer holds each of positions
        `[0, n)` at full precision (read shared, or in its own FP segment in position order),
        none evicted, quantized or dropped from a sliding window. Each of them was therefore
        computed attending to every token before it, as a prefill of the first `n` tokens alone
        would: a cache cut back to `n` or fewer tokens is that prefill's (`truncate`), whatever
        eviction did later. 0 for a row with a cold tier (a recalled token is held again,
        but the tokens fed while it was cold did not attend to it).

        Raises:
            ValueError: a row outside the store.
        """
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is not in this store's {self.batch} rows")
        if self.recall.tier is not None:
            return 0
        seg, start = self.segments, self.prefix.tokens
        lengths = seg.fp.length_tensor(slice(None), slice(row, row + 1))[:, 0]  # [L]
        positions = seg.fp["positions"][:, row]  # [L, C]
        slots = torch.arange(positions.shape[-1], device=positions.device)
        in_order = (positions == slots + start) & (slots < lengths[:, None])
        held = in_order.to(torch.int32).cumprod(dim=-1).sum(dim=-1)  # [L] leading run
        return start + int(held.min()) if held.numel() else start

    def truncate(self, end: int, row: int = 0) -> None:
        """Forget every token of the row at position `end` or later, so the next token takes
        position `end` again (a client rewrote history from there). Pins past `end` go too;
        shared blocks past it are no longer read, and the one it cuts is copied into the
        row's own FP segment (copy on write). The cut is exact back to `changed_at[row]`
        (nothing changed the cache since: it holds what feeding the first `end` tokens gave,
        eviction and quantization included) and within the intact prefix (`intact_tokens`:
        what a prefill of the first `end` tokens alone gives, before any eviction).

        Raises:
            ValueError: a row outside the store; `end` not a whole number, negative, past the
                tokens seen, or both before `changed_at[row]` (eviction or quantization since
                then depended on the forgotten tokens) and past the intact prefix; or
                inside the shared prefix of a store of several rows.
        """
        seg = self.segments
        if not 0 <= row < self.batch:
            raise ValueError(f"row {row} is not in this store's {self.batch} rows")
        exact = isinstance(end, int) and seg.changed_at[row] <= end <= self.seen(row)
        intact = None if exact else self.intact_tokens(row)
        if not exact and not (isinstance(end, int) and 0 <= end <= intact):
            raise ValueError(
                f"cannot truncate row {row} to {end!r} tokens: it has seen {self.seen(row)}, "
                f"its cache is exact only back to {seg.changed_at[row]}, and intact only up "
                f"to {intact}"
            )
        seg.changed_at[row] = min(seg.changed_at[row], end)
        if end < self.prefix.tokens and self.batch != 1:
            raise ValueError("the rows of a store of several rows read one shared prefix")
        rows = slice(row, row + 1)
        keep = self.joint("positions", slice(None), rows) < end
        seg.compact(keep & self.valid(slice(None), rows), slice(None), rows)
        if end < self.prefix.tokens:
            self.prefix.truncate(end)
        seg.appended[row] = end
        self.observed_from[row] = min(self.observed_from[row], end)
        self.pins.cut(row, end)

    # -- bytes -------------------------------------------------------------------------------

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of live keys, values and scales over all layers, for one row or all."""
        return self.segments.nbytes(row)

    def allocated_nbytes(self, row: int | None = None) -> int:
        """Bytes of all key/value/scale buffers including spare capacity, for all rows or
        (`row`) one row's share."""
        return self.segments.allocated_nbytes(row)

    def footprint(self) -> StoreFootprint:
        """What the store holds and has allocated (`StoreFootprint`)."""
        seg = self.segments
        return StoreFootprint.of_state(
            {
                "shape": [self.num_layers, self.kv_heads, self.head_dim],
                "batch": self.batch,
                "fp": {"keys": seg.fp["keys"]},
                "q": {"keys": seg.q["keys"]},
                "scales": {"keys": seg.scales["keys"]},
                "lengths": seg.host_lengths(),
                "capacity": seg.capacities(),
            }
        )

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
        return fitted_capacity(0, self.seen(row), BLOCK_TOKENS) * self.bytes_per_token()

    # -- saving ------------------------------------------------------------------------------

    def state(self, trim: bool = False) -> dict:
        """Everything the store holds, as tensors and plain values (for `torch.save`), each part
        saving its own. With `trim`, each segment field is a copy of its live slots only (a
        saved file then holds live bytes, not spare capacity); `capacity` says what
        `from_state` allocates again."""
        seg, figures = self.segments, self.figures
        return {
            **seg.state(trim),
            "shape": [self.num_layers, self.kv_heads, self.head_dim],
            "batch": self.batch,
            "int8": None if self.int8 is None else [self.int8.fp_window, self.int8.group],
            "max_positions": self.max_positions,
            # the keys these had before `attention_windows` and `attention_window_slack` were
            # named so: saved sessions must load
            "windows": list(self.attention_windows),
            "window_slack": self.attention_window_slack,
            "rerotate": self.rotary is not None,
            "pinned": self.pins.flags,
            "counters": [
                figures.peak_bytes,
                figures.evicted_tokens,
                figures.quantized_tokens,
                figures.peak_allocated_bytes,
                figures.attention_window_dropped,
                figures.reencoded_tokens,
            ],
            "row_counters": [figures.row_peak_bytes, seg.changed_at],
            "intact_tokens": [self.intact_tokens(row) for row in range(self.batch)],
            "profile": self.profile,
            "observed_from": self.observed_from,
            "cold": None if self.recall.tier is None else self.recall.tier.state(),
            "shared": self.prefix.state(),
        }

    @classmethod
    def from_state(cls, state: dict, rotary: Rotary | None = None) -> KVStore:
        """The store `state()` described; `rotary`, the model's rotary tables, is required for
        a store saved in rerotate mode.

        Raises:
            ValueError: a rerotate state without `rotary`, or saved shared tokens that do not
                match their block digests.
        """
        if state["rerotate"] and rotary is None:
            raise ValueError("this store was saved in rerotate mode: pass the model's rotary")
        layers, heads, dim = state["shape"]
        keys = state["fp"]["keys"]
        int8 = None if state["int8"] is None else Int8Config(*state["int8"])
        store = cls(
            layers, heads, dim, keys.dtype, keys.device, state["batch"], int8, rotary,
            state["max_positions"], state.get("windows"),
        )  # fmt: skip
        store.segments.load(state)
        store.profile = state.get("profile")
        if state.get("cold") is not None:
            store.recall.tier = ColdTier.from_state(state["cold"], rotary)
        if state.get("shared") is not None:
            store.prefix.load(state["shared"])
        store.observed_from = list(state.get("observed_from", store.observed_from))
        store.attention_window_slack = state.get("window_slack", ATTENTION_WINDOW_SLACK)
        store.pins.load(state["pinned"])
        counters, figures = state["counters"], store.figures
        figures.peak_bytes, figures.evicted_tokens, figures.quantized_tokens = counters[:3]
        figures.peak_allocated_bytes = max(counters[3], store.allocated_nbytes())
        figures.attention_window_dropped = counters[4] if len(counters) > 4 else 0
        figures.reencoded_tokens = counters[5] if len(counters) > 5 else 0
        row_peaks, changed_at = state["row_counters"]
        figures.row_peak_bytes = list(row_peaks)
        store.segments.changed_at = list(changed_at)
        return store
