"""Precision tiers: moving FP tokens into the quantized segment, by age (CONF-KV's mixed
precision, `Int8Config`) or chosen by a policy (ARKV's tri-state cache); one format per
store."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.store.capacity import round_up
from agent_kv.kv.store.figures import StoreFigures
from agent_kv.kv.store.pins import Pins
from agent_kv.kv.store.segments import Segments, kept_first, set_lengths
from agent_kv.kv.store.slot_table import bytes_view
from kernels import dispatch
from kernels.formats import QUANT_FORMATS, QuantFormat, format_name


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


class PrecisionTiers:
    """Quantization of a store's FP tokens into its quantized segment.

    Args:
        segments, pins, figures: the store's parts.
        int8: mixed-precision settings, or None to quantize only when a policy chooses.
    """

    def __init__(
        self, segments: Segments, pins: Pins, figures: StoreFigures, int8: Int8Config | None
    ):
        self.segments = segments
        self.pins = pins
        self.figures = figures
        self.int8 = int8

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
        seg = self.segments
        valid = seg.fp.valid(layers, rows)
        move = move & valid
        counts = move.sum(dim=-1)  # [L', R]
        host = counts.tolist()
        flat = [c for per_layer in host for c in per_layer]
        if not any(flat):
            return 0
        if any(c % group for c in flat):
            raise ValueError(f"tokens to quantize do not split into groups of {group}")
        self._retype(QUANT_FORMATS[fmt])
        q_lens = seg.q.length_tensor(layers, rows)
        n_groups = seg.scales.length_tensor(layers, rows)
        seg.room(int((q_lens + counts).max()), int((n_groups + counts // group).max()))
        width = round_up(max(flat), group)
        order = kept_first(move)[..., :width]  # the moved slots first, in slot order
        li, ri, si = (torch.arange(width, device=seg.device) < counts[..., None]).nonzero(
            as_tuple=True
        )
        layer_at, row_at = li + (layers.start or 0), ri + (rows.start or 0)
        dest = q_lens[li, ri] + si
        scale_row = n_groups[li, ri] + si // group
        first = si % group == 0  # one scale row per group
        for part in ("keys", "values"):
            tokens = seg.fp.take(part, order, layers, rows)  # [L', R, H, width, D]
            codes, scales = dispatch.quantize_groups(
                tokens.reshape(-1, width, seg.head_dim), group, QUANT_FORMATS[fmt]
            )
            codes = codes.view(tokens.shape)
            scales = scales.view(*tokens.shape[:3], width // group, seg.head_dim)
            bytes_view(seg.q[part])[layer_at, row_at, :, dest] = bytes_view(codes)[li, ri, :, si]
            seg.scales[part][layer_at[first], row_at[first], :, scale_row[first]] = scales[
                li[first], ri[first], :, si[first] // group
            ]
        seg.q["group"][layer_at, row_at, dest] = scale_row
        for name, spec in seg.fp.specs.items():
            if name in ("keys", "values"):
                continue
            moved = seg.fp.take(name, order, layers, rows)
            if spec.lead:
                seg.q[name][layer_at, row_at, :, dest] = moved[li, ri, :, si]
            else:
                seg.q[name][layer_at, row_at, dest] = moved[li, ri, si]
        keep = valid & ~move
        seg.fp.gather(kept_first(keep), layers, rows)
        set_lengths(seg.fp, layers, rows, keep.sum(dim=-1).tolist())
        for i, layer in enumerate(range(*layers.indices(seg.num_layers))):
            for j, row in enumerate(range(*rows.indices(seg.batch))):
                seg.q.lengths[layer][row] += host[i][j]
                seg.scales.lengths[layer][row] += host[i][j] // group
                if host[i][j]:
                    seg.mark_changed(row)
        moved_total = sum(flat)
        self.figures.quantized_tokens += moved_total
        self.figures.note_allocated(seg.allocated_nbytes())
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
        seg = self.segments
        q_len, n = seg.q.lengths[layer][row], seg.length(layer, row)
        if slots.numel() and (int(slots.min()) < q_len or int(slots.max()) >= n):
            raise ValueError(f"slots must be FP slots in [{q_len}, {n}) of row {row}")
        if bool(self.pins.mask(layer, row)[slots].any()):
            raise ValueError("pinned tokens are never quantized")
        move = torch.zeros(1, 1, seg.fp.capacity, dtype=torch.bool, device=seg.device)
        move[0, 0, slots - q_len] = True
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        return self.quantize_joint(move, group, fmt, layers, rows)

    def _retype(self, quant: QuantFormat) -> None:
        """Hold quantized codes as `quant.dtype` (refused while tokens of another format are
        held: one format per store)."""
        q = self.segments.q
        current = q["keys"].dtype
        if current == quant.dtype:
            return
        if q.most():
            raise ConfigError(
                f"this cache holds {format_name(current)} tokens; cannot add {quant.name} ones "
                "(one format per session)"
            )
        for part in ("keys", "values"):
            q.retype(part, quant.dtype)

    def oldest_mask(self, window: int, group: int, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, C]` bool over FP slots: the unpinned tokens older than the newest `window`
        unpinned ones of each layer's row, in whole groups of `group`, oldest first."""
        seg = self.segments
        valid = seg.fp.valid(layers, rows)
        unpinned = valid & ~self.pins.joint(layers, rows)[..., seg.q.capacity :]
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
        seg = self.segments
        pinned = self.pins.live()
        due = any(
            seg.fp.lengths[layer][row] - pinned[layer][row] >= window + group
            for layer in range(*layers.indices(seg.num_layers))
            for row in range(*rows.indices(seg.batch))
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
        q = self.segments.q
        return format_name(q["keys"].dtype) if q.most() else None

    def counts(self, row: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Per position the row has seen (`[seen]` int64 each): in how many layers it is live
        at full precision, and in how many quantized; the other layers evicted it."""
        seg = self.segments
        fp = torch.zeros(seg.seen(row), dtype=torch.long, device=seg.device)
        quantized = torch.zeros_like(fp)
        for layer in range(seg.num_layers):
            q_len, fp_len = seg.q.lengths[layer][row], seg.fp.lengths[layer][row]
            quantized[seg.q["positions"][layer, row, :q_len]] += 1
            fp[seg.fp["positions"][layer, row, :fp_len]] += 1
        return fp, quantized
