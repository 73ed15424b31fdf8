"""One model call over the KV store: what each layer's attention reads, what it leaves, and the
commit that writes it all back for every layer at once.

The ritual of a call is `ForwardCall.open` (host: positions, the store's segments fitted to the
call, lengths uploaded) -> the model, whose registered attention function
(`agent_kv.kv.attention`) reads `segments(layer)` and the call's own new tokens
(`new_segment`), stages the new keys and values (`stage`) and the attention mass
(`record_attention`) -> `close`: every layer's new tokens written after its rows' FP slots and
the mass folded into the per-token statistics, with a handful of operations over
`[layers, rows, ...]` tensors, then the store's host lengths moved on
(`KVStore.note_appended`). What the call measures besides attention is its `CallPlan` (the
policy's, `Policy.prepare`): the per-token statistics it folds (each policy's own
`TokenStatistic`, handed what the call measured: `agent_kv.kv.token_statistics`), a prefill
profile, an observation window, recall from the cold tier, or a maxima pass.

In a sliding-window layer (`KVStore.attention_windows`) every segment also carries its window mask
(`Segment.window`): query `i` of a row, at original position `origin + i`, sees the stored and
new tokens at positions `> origin + i - window`, from the positions the store keeps per slot,
so a chunk is masked per query and a decode step reads the mask from tensors like the rest.

A static call (`static=True`) reads a fixed width of every segment (`KVStore.decode_widths`:
its capacity, or the policy's bound), masked by length tensors, so nothing it does depends on
a host value that changes between decode steps and it synchronises nothing: a decode step
made of the model call and the commit traces into one graph
(`agent_kv.runtime.engine.decode_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.rope import Rotary
from agent_kv.kv.token_statistics import Measured, TokenStatistic
from kernels.torch_attention import Segment

if TYPE_CHECKING:
    from agent_kv.kv.store import KVStore

SEGMENTS = ("q", "fp")
"""The stored segments, in reading order: quantized, then FP (`KVStore.q`, `KVStore.fp`)."""
NO_PLAN = CallPlan()
"""The plan of a call no policy prepared: no statistic folded, nothing else measured."""
SHARED = "shared"
"""What a shared view's segment is called among a layer's reads: read before the stored ones
(its tokens come first), it keeps no statistics (its tokens are pinned, never ranked)."""


@dataclass
class CallTensors:
    """What a forward call reads besides the store's buffers (the inputs of a static decode
    step's graph, besides the token ids).

    Attributes:
        position_ids: `[R, n]` int64, the new tokens' rotary positions.
        q_lengths, fp_lengths: `[L, R]` int64, each layer's rows' live quantized and FP slots
            before the call.
        origin: `[R]` int64, each row's tokens seen before the call: the original position of
            its first new token.
        q_slots, fp_slots: int64 `[W]`, `arange(W)`: the slots of each segment the call reads
            (its width as a tensor shape, so a traced step follows a width that changes
            without compiling again).
    """

    position_ids: torch.Tensor
    q_lengths: torch.Tensor
    fp_lengths: torch.Tensor
    origin: torch.Tensor
    q_slots: torch.Tensor
    fp_slots: torch.Tensor


class ForwardCall:
    """One model call's view of the store (module docstring).

    Args:
        store: the store.
        rows: its rows in the call, contiguous.
        n: new tokens per row.
        tensors: the call's positions and lengths.
        plan: what the call measures besides attention (`CallPlan`).
        static: read each segment at its fixed decode width (`KVStore.decode_widths`), masked by
            the lengths: a traced decode step.
    """

    def __init__(
        self,
        store: KVStore,
        rows: range,
        n: int,
        tensors: CallTensors,
        plan: CallPlan = NO_PLAN,
        static: bool = False,
    ):
        self.store = store
        self.rows = rows
        self.n = n
        self.tensors = tensors
        self.plan = plan
        self.static = static
        self._rows = slice(rows.start, rows.stop)
        slots = {"q": tensors.q_slots, "fp": tensors.fp_slots}
        self.widths = {name: slot.shape[0] for name, slot in slots.items()}
        layers = store.num_layers
        lengths = {"q": tensors.q_lengths, "fp": tensors.fp_lengths}
        self._lengths = {name: per_layer.unbind(0) for name, per_layer in lengths.items()}
        self._bias = {  # per layer, [R, 1, 1, W]
            name: _bias(slots[name] < lengths[name][..., None]).unbind(0)
            for name in SEGMENTS
            if self.widths[name]
        }
        self._new_lengths = torch.full((len(rows),), n, device=store.device)
        steps = torch.arange(n, device=store.device)
        self._query_positions = tensors.origin[:, None] + steps  # [R, n], original positions
        self._new_positions = steps  # [n], the new tokens' offsets from origin
        self._read: list[tuple[str, ...]] = [()] * layers
        self._new: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * layers
        self._masses: list[dict[str, torch.Tensor] | None] = [None] * layers
        self._observations: list[dict[str, torch.Tensor] | None] = [None] * layers
        self._maxes: list[dict[str, torch.Tensor] | None] = [None] * layers
        self._scored: torch.Tensor | None = None
        self._group = 1
        self._observed = 0
        self._closed = False

    @classmethod
    def open(
        cls,
        store: KVStore,
        rows: range,
        n: int,
        plan: CallPlan = NO_PLAN,
        start: int | None = None,
        static: bool = False,
        ahead: int = 0,
    ) -> ForwardCall:
        """Begin the next model call over `store`: `n` new tokens for each of the contiguous
        `rows`, measuring what `plan` says.

        Args:
            start: the first rotary position of the call for every row, instead of the
                default (a maxima pass that must stay inside the trained context).
            static: read each segment at its fixed decode width (`KVStore.decode_widths`,
                masked by the lengths), so the call's shapes depend on the capacities and
                bounds alone (a compiled or captured decode step); otherwise each segment is
                read up to its longest row.
            ahead: the call's tokens stand this many tokens past each row's next position,
                rotary and original positions alike (a vote pass over the last tokens of a
                chunk not yet fed).

        Returns:
            The call: its `tensors.position_ids` `[len(rows), n]` are the tokens seen onward
            (original positions), or the most live tokens of any layer onward (rerotate).

        Raises:
            ValueError: rows out of range or not contiguous ascending, `n < 1`, or a static
                call over a row past its bound.
            ContextOverflowError: positions past the model's trained context.
        """
        if not rows or rows.step != 1 or rows.start < 0 or rows.stop > store.batch or n < 1:
            raise ValueError(f"rows must be a non-empty ascending range within {store.batch}")
        if start is not None:
            starts = [start] * len(rows)
        else:
            starts = [store.next_position(r) for r in rows]
        starts = [s + ahead for s in starts]
        store.check_context(max(starts) + n)
        segments = store.segments
        store.recall.recalling = plan.recall
        store.figures.begin_call()
        segments.ensure_columns(plan.statistics)
        if plan.keeps_tokens:
            segments.fit(n)
        store.figures.note_allocated(store.allocated_nbytes())
        device = store.device
        span = slice(rows.start, rows.stop)
        if static:
            widths = store.decode_widths()
            for name, width in widths.items():
                if getattr(segments, name).most() > width:
                    raise ValueError(
                        f"a row holds {getattr(segments, name).most()} {name} slots, past the "
                        f"static read of {width}: the store's bound was not kept"
                    )
        else:  # each segment up to its longest row among the call's rows
            widths = {
                name: max(max(row[span]) for row in getattr(segments, name).lengths)
                for name in SEGMENTS
            }
        tensors = CallTensors(
            position_ids=torch.tensor(starts, device=device)[:, None]
            + torch.arange(n, device=device),
            q_lengths=segments.q.length_tensor(slice(None), span),
            fp_lengths=segments.fp.length_tensor(slice(None), span),
            origin=torch.tensor([segments.seen(r) + ahead for r in rows], device=device),
            q_slots=torch.arange(widths["q"], device=device),
            fp_slots=torch.arange(widths["fp"], device=device),
        )
        return cls(store, rows, n, tensors, plan, static)

    def position_ids(self) -> torch.Tensor:
        """`[R, n]` int64: the new tokens' rotary positions (the model's `position_ids`)."""
        return self.tensors.position_ids

    def close(self, folded: dict[str, torch.Tensor] | None = None) -> None:
        """End the call after the model ran: write its new tokens and statistics (`folded`,
        when a compiled step computed them, else `fold()`), then move the store's host
        lengths on (`KVStore.note_appended`; a maxima or vote pass keeps nothing), and
        forget the votes of the call's vote pass (`RecallTier.forget_votes`).

        Raises:
            ValueError: the call was closed already (its tokens are in the store).
        """
        if self._closed:
            raise ValueError("this forward call was closed already: open a new one")
        self._closed = True
        self.write(self.fold() if folded is None else folded)
        if self.plan.keeps_tokens:
            self.store.note_appended(self.rows, self.n)
        if self.plan.recall and not self.plan.vote:  # votes live for one recalling call
            self.store.recall.forget_votes()

    def recall(self, layer: int, query: torch.Tensor, scale: float) -> None:
        """Bring cold pages of `layer` back before its attention reads it, when the plan
        recalls and the cold tier says a call of this length is due (`RecallTier.recall`;
        never in a static call)."""
        store = self.store
        if self.static or not self.plan.recall:
            return
        if store.recall.due(query.shape[2], self.rows[0]):
            positions, origins = self.tensors.position_ids, self.tensors.origin
            store.recall.recall(layer, query, scale, self.rows, positions, origins)

    def vote(self, layer: int, query: torch.Tensor, scale: float) -> None:
        """A vote pass's part in `layer`: its cold pages scored by the pass's queries and the
        best pages' positions voted for (`RecallTier.vote`)."""
        positions, origins = self.tensors.position_ids, self.tensors.origin
        self.store.recall.vote(layer, query, scale, self.rows, positions, origins)

    # -- what attention reads ----------------------------------------------------------------

    def segments(self, layer: int) -> list[Segment]:
        """The stored segments of `layer` for the call's rows, in reading order (the shared
        views, then quantized, if it has width, then FP, if it has), each masked by its lengths
        (and in a sliding-window layer by each query's window); in rerotate mode with every
        token rotated to its rank among the row's live tokens."""
        store = self.store
        rows = self._rows
        widths = dict(self.widths)
        lengths = {name: per_layer[layer] for name, per_layer in self._lengths.items()}
        bias = {name: per_layer[layer] for name, per_layer in self._bias.items()}
        if self.plan.recall and not self.static:  # a recall may have grown this layer
            for name in SEGMENTS:
                table = getattr(store, name)
                widths[name] = max(widths[name], max(table.lengths[layer][rows]))
                lengths[name].copy_(table.length_tensor(slice(layer, layer + 1), rows)[0])
                slots = torch.arange(widths[name], device=store.device)
                bias[name] = _bias(slots < lengths[name][..., None])
        rotation = {"q": (None, None), "fp": (None, None)}
        if store.rotary is not None:
            cos_q, sin_q, cos_fp, sin_fp = self._rotation(layer, widths["q"], widths["fp"])
            rotation = {"q": (cos_q, sin_q), "fp": (cos_fp, sin_fp)}
        read = tuple(name for name in SEGMENTS if widths[name])
        shared = store.prefix.views()
        self._read[layer] = (*(SHARED,) * len(shared), *read)
        out = [self._shared_segment(view, layer) for view in shared]
        for name in read:
            table, width = getattr(store, name), widths[name]
            cos, sin = rotation[name]
            quantized = {}
            if name == "q":
                quantized = {
                    "key_scales": self._view(store.scales, "keys", layer, None),
                    "value_scales": self._view(store.scales, "values", layer, None),
                    "scale_index": self._view(table, "group", layer, width),
                }
            window = store.attention_windows[layer]
            mask = None
            if window is not None:
                positions = self._view(table, "positions", layer, width)
                mask = self._window(positions, self._query_positions, window)
            out.append(
                Segment(
                    keys=self._view(table, "keys", layer, width),
                    values=self._view(table, "values", layer, width),
                    lengths=lengths[name],
                    cos=cos,
                    sin=sin,
                    bias=bias[name],
                    window=mask,
                    **quantized,
                )
            )
        return out

    def _shared_segment(self, view, layer: int) -> Segment:
        """A shared view's tokens of `layer` (`KVStore.prefix`), the same for every row of the
        call: positions before every token of a row's own, all visible."""
        rows = len(self.rows)
        keys = view.keys[layer][None].expand(rows, -1, -1, -1)  # [R, H, n, D], no copy
        values = view.values[layer][None].expand(rows, -1, -1, -1)
        lengths = torch.full((rows,), keys.shape[2], device=keys.device)
        return Segment(keys=keys, values=values, lengths=lengths)

    def _rotation(self, layer: int, q_width: int, fp_width: int):
        """Rerotate tables `(cos_q, sin_q, cos_fp, sin_fp)`, `[R, width, D]` each: every live
        token at its rank among the row's live tokens, shifted so the new tokens sit at the
        query positions of this call."""
        store = self.store
        rows = self._rows
        positions = torch.cat(
            [
                store.q["positions"][layer, rows, :q_width],
                store.fp["positions"][layer, rows, :fp_width],
            ],
            dim=-1,
        )  # [R, q_width + fp_width]
        shifted = torch.zeros_like(positions)
        for i, row in enumerate(self.rows):
            q_len, fp_len = store.q.lengths[layer][row], store.fp.lengths[layer][row]
            live = torch.cat([positions[i, :q_len], positions[i, q_width : q_width + fp_len]])
            rank = torch.argsort(torch.argsort(live))
            rank = rank + (self.tensors.position_ids[i, 0] - live.numel())
            shifted[i, :q_len] = rank[:q_len]
            shifted[i, q_width : q_width + fp_len] = rank[q_len:]
        cos, sin = store.rotary.cos_sin(shifted)
        return cos[:, :q_width], sin[:, :q_width], cos[:, q_width:], sin[:, q_width:]

    @staticmethod
    def _window(positions: torch.Tensor, queries: torch.Tensor, window: int) -> torch.Tensor:
        """`[R, 1, n, W]` bool: which of the slots at `positions` (`[R, W]`, or `[W]` for every
        row) each query at `queries` (`[R, n]`, or `[n]`) sees in a window of `window` tokens:
        `position > query - window` (transformers' `sliding_window_overlay`)."""
        if positions.dim() == 1:
            positions, queries = positions[None], queries[None]
        return positions[:, None, None, :] > (queries - window)[:, None, :, None]

    def _view(self, table, name: str, layer: int, width: int | None) -> torch.Tensor:
        """Field `name` of `table` for `layer` and the call's rows, up to slot `width`: the
        table's cached views in an eager call, a plain slice in a traced one (slicing costs a
        graph nothing, and a cache filled while tracing would change its guards)."""
        if not self.static:
            return table.layer_views(name, self._rows, width)[layer]
        field = table[name][layer, self._rows]
        return field if width is None else field.narrow(table.specs[name].slot_dim - 1, 0, width)

    def new_segment(
        self, keys: torch.Tensor, values: torch.Tensor, layer: int | None = None
    ) -> Segment:
        """The call's own tokens `[R, H, n, D]` as the last, causal segment: query `i` of a row
        sees new token `j <= i`, and in a sliding-window `layer` (when given) only
        `j > i - window` (a mask only when the call is longer than the window)."""
        window = None if layer is None else self.store.attention_windows[layer]
        mask = None
        if window is not None and self.n > window:
            offsets = self._new_positions
            mask = self._window(offsets, offsets, window)
        return Segment(
            keys=keys, values=values, lengths=self._new_lengths, causal=True, window=mask
        )

    # -- what attention leaves ---------------------------------------------------------------

    def stage(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold a layer's new keys and values `[R, H, n, D]` (rotated at the call's
        positions) until `close` writes them."""
        self._new[layer] = (keys, values)

    def _by_segment(self, layer: int, per_segment: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Name the entries of a list aligned with `segments(layer)` and then the new tokens."""
        return dict(zip((*self._read[layer], "new"), per_segment, strict=True))

    def record_attention(
        self,
        layer: int,
        masses: list[torch.Tensor],
        group: int,
        scored: torch.Tensor | None = None,
    ) -> None:
        """Hold a layer's attention mass for `close`.

        Args:
            masses: per segment of `segments(layer)` and then the new tokens, `[R, H, width]`:
                the probability each slot received, summed over the scored queries and the
                `group` query heads of its KV head.
            group: query heads per KV head.
            scored: int64 `[S]`, ascending: which of the call's queries (0-based) the masses
                sum over (`agent_kv.kv.attention.scored_offsets`); default all `n`.
        """
        self._masses[layer] = self._by_segment(layer, masses)
        self._group = group
        self._scored = scored

    def record_observation_window(
        self, layer: int, masses: list[torch.Tensor], observed: int
    ) -> None:
        """Hold a layer's observation-window attention (SnapKV, Li et al. 2024, §4.1): per
        segment and then the new tokens, `[R, H, width]`, the attention from the call's last
        `observed` queries, summed over them and the query heads of each KV head."""
        self._observations[layer] = self._by_segment(layer, masses)
        self._observed = observed

    def record_maxima(self, layer: int, maxes: list[torch.Tensor]) -> None:
        """Hold a maxima pass's attention maxima (the largest probability any of the pass's
        queries and query heads gave each token), per segment and then the new tokens,
        `[R, H, width]`."""
        self._maxes[layer] = self._by_segment(layer, maxes)

    # -- commit ------------------------------------------------------------------------------

    def fold(self) -> dict[str, torch.Tensor]:
        """What `close` writes (every layer's new tokens after its rows' FP slots, the call's
        measurements folded into the plan's statistics; a maxima pass: only its maxima, none
        of its tokens), computed without writing anything (so a compiled step can
        return it: inductor copies a whole buffer it both reads and writes in place).

        Returns:
            `"new.<field>"`: each field's values for the new tokens (`[L, R, H, n, D]` keys
            and values, `[L, R, H, n]` statistics' columns, `[L, R, n]` positions and the
            columns of one value per token);
            `"<segment>.<field>"`: the updated columns of the stored slots the call read,
            `[L, R, H, W]` (`[L, R, W]` for one value per token), to replace the first `W`
            slots of `rows`.
        """
        store = self.store
        if self.plan.maxima_pass:
            return self._maxima()
        if self.plan.vote:
            return {}
        keys = torch.stack([k for k, _ in self._new])  # [L, R, H, n, D]
        values = torch.stack([v for _, v in self._new])
        if store.rotary is not None:  # stored unrotated, rotated at every read
            cos, sin = store.rotary.cos_sin(self.tensors.position_ids)  # [R, n, D]
            layers = store.num_layers
            flat = keys.flatten(0, 1).float()  # [L * R, H, n, D]
            unrotated = Rotary.unrotate(flat, cos.repeat(layers, 1, 1), sin.repeat(layers, 1, 1))
            keys = unrotated.view(keys.shape)
        positions = self.tensors.origin[:, None] + torch.arange(self.n, device=keys.device)
        folded = {
            "new.keys": keys.to(store.dtype),
            "new.values": values.to(store.dtype),
            "new.positions": positions.expand(store.num_layers, -1, -1),
        }
        folded.update(self._statistics(keys))
        return folded

    def write(self, folded: dict[str, torch.Tensor]) -> None:
        """Write what `fold` computed into the store's buffers (in place)."""
        store = self.store
        index = self._new_slots()
        rows = self._rows
        for key, value in folded.items():
            where, field = key.split(".")
            if where == "new":
                per_head = store.fp.specs[field].lead
                store.fp[field].index_put_(index.per_head if per_head else index.per_row, value)
            else:
                region = getattr(store, where)[field][:, rows]
                region.narrow(-1, 0, value.shape[-1]).copy_(value)
        if self._observations[0] is not None and self.plan.keeps_tokens:
            for row in self.rows:
                store.observed_from[row] = store.seen(row) + self.n - self._observed

    def _new_slots(self) -> _Slots:
        """Where the new tokens go: FP slot `fp_length + i` of each layer's row."""
        store = self.store
        device = self.tensors.fp_lengths.device
        layers = torch.arange(store.num_layers, device=device)[:, None, None]  # [L, 1, 1]
        rows = torch.arange(self.rows.start, self.rows.stop, device=device)[None, :, None]
        slot = self.tensors.fp_lengths[:, :, None] + torch.arange(self.n, device=device)
        heads = torch.arange(store.kv_heads, device=device)[None, None, :, None]
        return _Slots(
            per_row=(layers, rows, slot),  # [L, R, n]
            per_head=(layers[..., None], rows[..., None], heads, slot[:, :, None, :]),
        )

    def _stacked(self, per_layer: list[dict[str, torch.Tensor]], name: str) -> torch.Tensor | None:
        """`[L, R, H, width]`: each layer's entry `name` zero-padded to the widest (zeros for a
        layer without one), or None when no layer has one."""
        parts = [layer.get(name) for layer in per_layer]
        present = [part for part in parts if part is not None]
        if not present:
            return None
        width = max(part.shape[-1] for part in present)
        like = present[0]
        padded = [
            like.new_zeros(*like.shape[:-1], width)
            if part is None
            else F.pad(part, (0, width - part.shape[-1]))
            if part.shape[-1] < width
            else part
            for part in parts
        ]
        return torch.stack(padded)

    def _statistics(self, keys: torch.Tensor) -> dict[str, torch.Tensor]:
        """The plan's statistics after the call, as `fold` returns them: each
        `TokenStatistic` whose measurement the call took folds it, for each stored segment
        the call read and for the new tokens (`keys`, `[L, R, H, n, D]`); every other column
        of the new tokens starts at 0. The mean attention of the `"mass"` measurement divides
        by the scored queries that could see each token (`Measured.mean_mass`), and a call
        that scored `S` of its `n` queries weighs each by `n / S`."""
        n = self.n
        device = self.tensors.fp_lengths.device
        if self._scored is None:
            count = n
            seen_by = torch.arange(n, 0, -1, device=device)
        else:
            count = self._scored.numel()
            seen_by = count - torch.searchsorted(self._scored, torch.arange(n, device=device))
        live = (self.tensors.q_lengths + self.tensors.fp_lengths + n).float()[:, :, None, None]
        lengths = {"q": self.tensors.q_lengths, "fp": self.tensors.fp_lengths}
        observing = self._observations[0] is not None
        attended = self._masses[0] is not None  # False: tokens appended without a model call
        taken = {"mass": attended, "observation": observing, "keys": True}
        folding = [stat for stat in self.plan.statistics if taken.get(stat.measurement)]
        common = {"count": count, "weight": n / count, "group": self._group, "live": live}
        common["observed"] = self._observed
        out = {}
        for name in SEGMENTS:
            observation = self._stacked(self._observations, name) if observing else None
            mass = self._stacked(self._masses, name) if attended else None
            if mass is None and observation is None:  # the segment was not read
                continue
            width = (mass if mass is not None else observation).shape[-1]
            slots = torch.arange(width, device=device)
            valid = (slots < lengths[name][..., None])[:, :, None]  # [L, R, 1, W]
            for stat in folding:
                if stat.measurement == "keys":
                    continue  # the stored tokens' keys did not change
                measured = Measured(
                    mass=mass, observation=observation, maxima=None, keys=None,
                    stored=self._stored(name, stat, width), valid=valid, seen_by=None,
                    **common,
                )  # fmt: skip
                out.update({f"{name}.{c}": v for c, v in stat.fold(measured, False).items()})
        new = {
            "mass": torch.stack([layer["new"] for layer in self._masses]) if attended else None,
            "observation": (
                torch.stack([layer["new"] for layer in self._observations]) if observing else None
            ),
        }
        valid = torch.ones(*keys.shape[:2], 1, n, dtype=torch.bool, device=device)
        measured = Measured(
            mass=new["mass"], observation=new["observation"], maxima=None, keys=keys, stored={},
            valid=valid, seen_by=seen_by, **common,
        )  # fmt: skip
        for stat in folding:
            out.update({f"new.{c}": v for c, v in stat.fold(measured, True).items()})
        store = self.store
        for column, spec in store.segments.columns.items():
            if f"new.{column}" not in out:
                shape = (store.num_layers, *keys.shape[1:2], *spec.lead, n)
                out[f"new.{column}"] = keys.new_zeros(shape, dtype=torch.float32)
        return out

    def _stored(self, name: str, stat: TokenStatistic, width: int) -> dict[str, torch.Tensor]:
        """The columns of `stat` in segment `name` for the call's rows, first `width` slots."""
        table = getattr(self.store, name)
        return {
            column.name: table[column.name][:, self._rows].narrow(-1, 0, width)
            for column in stat.columns
        }

    def _maxima(self) -> dict[str, torch.Tensor]:
        """A maxima pass's `fold`: each stored segment's slots handed the pass's maxima, for
        the plan's statistics that fold them."""
        out = {}
        folding = [stat for stat in self.plan.statistics if stat.measurement == "maxima"]
        lengths = {"q": self.tensors.q_lengths, "fp": self.tensors.fp_lengths}
        for name in SEGMENTS:
            best = self._stacked(self._maxes, name)
            if best is None:
                continue
            width = best.shape[-1]
            slots = torch.arange(width, device=best.device)
            valid = (slots < lengths[name][..., None])[:, :, None]
            for stat in folding:
                measured = Measured(
                    mass=None, observation=None, maxima=best, keys=None,
                    stored=self._stored(name, stat, width), valid=valid, count=0, weight=0.0,
                    group=self._group, seen_by=None, live=best.new_zeros(()), observed=0,
                )  # fmt: skip
                out.update({f"{name}.{c}": v for c, v in stat.fold(measured, False).items()})
        return out


def append_kv(
    store: KVStore, keys: torch.Tensor, values: torch.Tensor, rows: range | None = None
) -> None:
    """Append `n` tokens to every layer of `rows` (default: all) of `store` outside a model
    call: a call opened, the tokens staged, the call closed. Their statistics start at 0 (no
    attention was read).

    Args:
        keys, values: `[L, R, H, n, D]`, or `[R, H, n, D]` for the same tokens in every layer;
            keys rotated as a model call would give them.

    Raises:
        ValueError: keys for another number of layers than the store's.
    """
    rows = range(store.batch) if rows is None else rows
    if keys.dim() == 5 and keys.shape[0] != store.num_layers:
        raise ValueError(f"keys for {keys.shape[0]} layers, the store has {store.num_layers}")
    if keys.dim() == 4:
        keys = keys.expand(store.num_layers, *keys.shape)
        values = values.expand(store.num_layers, *values.shape)
    plan = CallPlan(recall=store.recall.recalling)  # recall stays as the last plan left it
    call = ForwardCall.open(store, rows, keys.shape[-2], plan)
    for layer in range(store.num_layers):
        call.stage(layer, keys[layer], values[layer])
    call.close()


def _bias(visible: torch.Tensor) -> torch.Tensor:
    """`visible` `[L, R, W]` (or `[R, W]`) as an additive logit mask `[..., 1, 1, W]`: 0 where
    visible, -inf elsewhere."""
    zero = torch.zeros((), device=visible.device)
    return torch.where(visible, zero, -torch.inf)[..., None, None, :]


@dataclass(frozen=True)
class _Slots:
    """Advanced indices of the new tokens' FP slots: `per_row` for `[L, B, C]` fields
    (broadcasting to `[L, R, n]`), `per_head` for `[L, B, H, C, ...]` ones (`[L, R, H, n]`)."""

    per_row: tuple[torch.Tensor, ...]
    per_head: tuple[torch.Tensor, ...]
