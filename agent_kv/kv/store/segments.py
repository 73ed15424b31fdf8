"""The store's token segments: the FP and quantized `SlotTable`s and the quantized segment's
scale table, their capacities (fitted to what they hold: `agent_kv.kv.store.capacity`), what
each row has seen, and the moves that keep them dense (compaction, a recall's insert).

Layout (docs/architecture.md, Decisions, "Layout"): two segments, each stacked over layers and
rows (`[L, B, ...]`), every per-token field aligned with its segment's slots:
- the FP segment, capacity `C`: keys and values `[L, B, kv_heads, C, head_dim]` in the model's
  dtype (pinned tokens, the newest tokens, and without INT8 everything), their original
  positions and the columns of the policies' per-token statistics;
- the quantized segment, capacity `Cq`: codes in int8 or float8_e4m3fn (`kernels.formats`),
  each slot's scale row (`group`), positions and the same statistics' columns; and its scales
  `[L, B, kv_heads, G, head_dim]` float16, one row per group of tokens quantized together
  (`kernels.int8`).
A statistic's columns (`agent_kv.kv.token_statistics.Column`) are added to both segments when a
call's plan first names the statistic (`ensure_columns`), zeros for the tokens already held.
A row's live tokens are its first `q_len` quantized slots followed by its first `fp_len` FP
slots: its *logical order*. The *joint slot space* of a layer's row is the quantized slots
followed by the FP slots, `[Cq + C]`: the logical order is its live slots in order, and
policies rank and choose over it for every layer and row at once. Eviction gathers the kept
slots to the front of each segment (contiguous compaction, CONF-KV §4), so attention reads
dense prefixes, never an indirection table.
"""

from __future__ import annotations

import torch

from agent_kv.kv.store.capacity import (
    BLOCK_TOKENS,
    SCALE_BLOCK,
    fitted_capacity,
    live_bytes,
    round_up,
)
from agent_kv.kv.store.figures import StoreFigures
from agent_kv.kv.store.slot_table import FieldSpec, SlotTable
from agent_kv.kv.token_statistics import Column, TokenStatistic
from agent_kv.renamed_fields import RENAMED_STORE_FIELDS, current_names
from kernels.int8 import SCALE_DTYPE, dequantize

ALLOCATED_FIELDS = {"fp": ("keys", "values"), "q": ("keys", "values"), "scales": ("keys", "values")}
"""The fields of each segment that hold keys, values and scales: what `allocated_nbytes`
counts (positions, statistics and scale indices are bookkeeping, not KV)."""
TABLES = ("fp", "q", "scales")
"""The segments' tables by attribute name."""


def segment_specs(heads: int, dim: int, dtype: torch.dtype) -> dict[str, FieldSpec]:
    """A token segment's own fields: keys and values in `dtype`, and positions (statistics'
    columns come with the statistics: `Segments.ensure_columns`)."""
    return {
        "keys": FieldSpec((heads,), (dim,), dtype),
        "values": FieldSpec((heads,), (dim,), dtype),
        "positions": FieldSpec((), (), torch.long),
    }


def column_spec(column: Column, heads: int) -> FieldSpec:
    """The field of a statistic's column: float32, one value per KV head or per token."""
    return FieldSpec((heads,) if column.per_head else (), (), torch.float32)


def kept_first(keep: torch.Tensor) -> torch.Tensor:
    """int64 `[..., W]`: for a bool mask `[..., W]`, the marked slots in order, then the
    others in order (a stable partition: what compaction gathers)."""
    return torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices


def set_lengths(table: SlotTable, layers: slice, rows: slice, counts: list[list[int]]) -> None:
    """Set a table's host lengths of `layers` x `rows` to `counts` `[L'][R]`."""
    row_ids = range(*rows.indices(table.batch))
    for layer, per_row in zip(range(*layers.indices(table.layers)), counts, strict=True):
        for row, count in zip(row_ids, per_row, strict=True):
            table.lengths[layer][row] = count


class Segments:
    """The token segments of a batch of rows across all layers (module docstring).

    Args:
        num_layers, kv_heads, head_dim: the model's KV shape.
        dtype: the FP segment's dtype.
        device: where the buffers live.
        batch: rows.
        figures: where allocation peaks are noted.

    Attributes:
        fp, q: the FP and quantized segments (`SlotTable`: fields `keys`, `values`,
            `positions` and the statistics' `columns`; the quantized one also `group`, each
            slot's scale row); `fp.lengths` / `q.lengths` are the live slots `[L][B]`.
        columns: the statistics' columns both segments hold, by name (their fields' specs).
        scales: the quantized segment's scales (`keys`, `values`: `[L, B, H, G, D]` float16);
            `scales.lengths` the rows in use.
        appended: tokens ever appended per row (the next original position).
        changed_at: per row, the tokens seen when eviction, quantization or a recall last
            changed its cache: the cache holds exactly what feeding its first `changed_at`
            tokens would give, plus everything fed since, unaltered.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        batch: int,
        figures: StoreFigures,
    ):
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.batch = batch
        self.figures = figures
        self.fp = SlotTable(segment_specs(kv_heads, head_dim, dtype), num_layers, batch, device)
        q_specs = segment_specs(kv_heads, head_dim, torch.int8)
        self.q = SlotTable(
            {**q_specs, "group": FieldSpec((), (), torch.long)}, num_layers, batch, device
        )
        scale = FieldSpec((kv_heads,), (head_dim,), SCALE_DTYPE)
        self.scales = SlotTable({"keys": scale, "values": scale}, num_layers, batch, device)
        self.fp.resize(BLOCK_TOKENS)
        self.columns: dict[str, FieldSpec] = {}
        self.appended = [0] * batch
        self.changed_at = [0] * batch
        self.bounds: tuple[int | None, int | None] = (None, None)
        """Per segment (FP, quantized), the most slots a row can need before the next
        eviction (`bound`), or None."""
        self.decode_bounds: tuple[int | None, int | None] = (None, None)
        """Per segment (quantized, FP), the slots a static decode step reads at most, or
        None (its capacity)."""

    def ensure_columns(self, statistics: tuple[TokenStatistic, ...]) -> None:
        """Add to both segments the columns of `statistics` they lack (zeros for the tokens
        already held: a statistic starts counting when a plan first names it).

        Raises:
            ValueError: a column of that name is held with another shape.
        """
        for stat in statistics:
            for column in stat.columns:
                spec = column_spec(column, self.kv_heads)
                held = self.columns.get(column.name)
                if held == spec:
                    continue
                if held is not None:
                    raise ValueError(f"column {column.name!r} is held with another shape")
                self.fp.add_field(column.name, spec)
                self.q.add_field(column.name, spec)
                self.columns[column.name] = spec

    # -- lengths and reads -------------------------------------------------------------------

    def seen(self, row: int) -> int:
        """Tokens appended to a row so far (its next original position)."""
        return self.appended[row]

    def mark_changed(self, row: int) -> None:
        """Eviction, quantization or a recall changed the row's cache now (`changed_at`)."""
        self.changed_at[row] = self.seen(row)

    def length(self, layer: int, row: int = 0) -> int:
        """Live tokens of a row in one layer (quantized + FP)."""
        return self.q.lengths[layer][row] + self.fp.lengths[layer][row]

    def lengths(self, row: int = 0) -> list[int]:
        """Live tokens per layer for a row."""
        return [self.length(layer, row) for layer in range(self.num_layers)]

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
        """A statistic's column over the row's live tokens in one layer, logical order:
        `[H, length]` (`[length]` for a column of one value per token)."""
        q_len, fp_len = self.q.lengths[layer][row], self.fp.lengths[layer][row]
        return torch.cat(
            [self.q[name][layer, row, ..., :q_len], self.fp[name][layer, row, ..., :fp_len]],
            dim=-1,
        )

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

    # -- capacity ----------------------------------------------------------------------------

    def bound(self, fp: int | None, q: int | None, decode_fp: int | None) -> None:
        """Cap the FP and quantized segments' capacities at `fp` and `q` slots (None: no cap)
        from the next `fit`, and have a static decode step read at most `decode_fp` FP slots
        (rounded up to a block) and `q` quantized ones."""
        self.bounds = (fp, q)
        self.decode_bounds = (q, None if decode_fp is None else round_up(decode_fp, BLOCK_TOKENS))

    @property
    def fp_bounded(self) -> bool:
        """Whether a policy's bound fixes what a static decode step reads of the FP segment."""
        return self.decode_bounds[1] is not None

    def decode_widths(self) -> dict[str, int]:
        """The slots of each segment a static decode step reads: its capacity, or less under a
        bound (`bound`) that keeps every row's length within it."""
        widths = {}
        for name, bound in zip(("q", "fp"), self.decode_bounds, strict=True):
            capacity = getattr(self, name).capacity
            widths[name] = capacity if bound is None else min(capacity, bound)
        return widths

    def fit(self, n: int) -> None:
        """Give the segments the capacities the next call of `n` new tokens per row needs
        (`fitted_capacity`): the FP segment room for them, the quantized segment and the scale
        table what they hold (a quantization makes its own room: `room`)."""
        fp_bound, q_bound = self.bounds
        self.resize(
            self.fp, fitted_capacity(self.fp.capacity, self.fp.most() + n, BLOCK_TOKENS, fp_bound)
        )
        self.resize(self.q, fitted_capacity(self.q.capacity, self.q.most(), BLOCK_TOKENS, q_bound))
        self.resize(
            self.scales, fitted_capacity(self.scales.capacity, self.scales.most(), SCALE_BLOCK)
        )

    def resize(self, table: SlotTable, capacity: int) -> None:
        """Reallocate `table` to `capacity` slots (nothing when it has them), noting the
        allocation."""
        if capacity != table.capacity:
            table.resize(capacity)
            self.figures.note_allocated(self.allocated_nbytes())

    def room(self, q_slots: int, groups: int) -> None:
        """Make room in the quantized segment and its scale table for `q_slots` slots and
        `groups` scale rows in the rows quantizing (`fitted_capacity`; the other rows keep
        what they hold)."""
        q_slots, groups = max(q_slots, self.q.most()), max(groups, self.scales.most())
        self.resize(self.q, fitted_capacity(self.q.capacity, q_slots, BLOCK_TOKENS, self.bounds[1]))
        self.resize(self.scales, fitted_capacity(self.scales.capacity, groups, SCALE_BLOCK))

    # -- moves -------------------------------------------------------------------------------

    def compact(self, keep: torch.Tensor, layers: slice, rows: slice) -> None:
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
            set_lengths(table, layers, rows, per_layer)

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
        set_lengths(self.scales, layers, rows, used.sum(dim=-1).tolist())

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
            fitted = fitted_capacity(self.fp.capacity, self.fp.most() + m + room, BLOCK_TOKENS)
            self.resize(self.fp, fitted)
        table = self.fp
        table["keys"][layer, row, :, fp : fp + m] = keys.to(self.dtype)
        table["values"][layer, row, :, fp : fp + m] = values.to(self.dtype)
        table["positions"][layer, row, fp : fp + m] = positions
        for name in self.columns:
            table[name][layer, row, ..., fp : fp + m] = 0.0
        order = torch.argsort(table["positions"][layer, row, : fp + m])
        table.lengths[layer][row] = fp + m
        table.gather(order.view(1, 1, -1), slice(layer, layer + 1), slice(row, row + 1))

    # -- bytes -------------------------------------------------------------------------------

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of live keys, values and scales over all layers, for one row or all."""
        rows = range(self.batch) if row is None else [row]
        element = torch.empty(0, dtype=self.dtype).element_size()
        scale = torch.empty(0, dtype=SCALE_DTYPE).element_size()
        return live_bytes(
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

    def note_peak(self, rows: range) -> None:
        """Take the live bytes of `rows` and of all rows, and the allocated bytes, now into
        the peaks (`figures`)."""
        self.figures.note_live({row: self.nbytes(row) for row in rows}, self.nbytes())
        self.figures.note_allocated(self.allocated_nbytes())

    def host_lengths(self) -> dict[str, list[list[int]]]:
        """Each table's host lengths `[L][B]`, copied."""
        return {name: [list(row) for row in getattr(self, name).lengths] for name in TABLES}

    def capacities(self) -> dict[str, int]:
        """Each table's capacity."""
        return {name: getattr(self, name).capacity for name in TABLES}

    # -- saving ------------------------------------------------------------------------------

    def state(self, trim: bool = False) -> dict:
        """Each table's fields (with `trim`, copies of the live slots only), lengths and
        capacities, and the tokens each row has seen."""
        tables = {}
        for name in TABLES:
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
            "lengths": self.host_lengths(),
            "capacity": self.capacities(),
            "appended": list(self.appended),
        }

    def load(self, state: dict) -> None:
        """Take the tables and positions of `state()` back (copies), each table reallocated to
        its saved capacity. Columns saved under an old name are read under their current one
        (`agent_kv.renamed_fields.RENAMED_STORE_FIELDS`: a session saved before
        `observation_mass` was named so holds `window_mass`)."""
        for name in TABLES:
            table = getattr(self, name)
            saved = current_names(state[name], RENAMED_STORE_FIELDS)
            for field, tensor in saved.items():
                if field not in table.specs:  # a statistic's column: `[L, B, (H,) S]`
                    per_head = tensor.dim() == 4
                    table.specs[field] = column_spec(Column(field, per_head), self.kv_heads)
                    self.columns[field] = table.specs[field]
                spec = table.specs[field]
                table.specs[field] = FieldSpec(spec.lead, spec.tail, tensor.dtype)
            table.fields = {field: tensor.clone() for field, tensor in saved.items()}
            table.capacity = next(iter(saved.values())).shape[table.specs["keys"].slot_dim]
            table.lengths = [list(row) for row in state["lengths"][name]]
            table.resize(state["capacity"][name])
        self.appended = list(state["appended"])
