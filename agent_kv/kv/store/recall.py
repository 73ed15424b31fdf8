"""The hot store's link to its cold tier (`agent_kv.kv.cold_tier`): evicted tokens go there
instead of being lost, and a forward call's queries bring the best pages back before its
attention reads the layer."""

from __future__ import annotations

import time

import torch

from agent_kv.kv.cold_tier import ColdConfig, ColdTier
from agent_kv.kv.rope import Rotary
from agent_kv.kv.store.figures import StoreFigures
from agent_kv.kv.store.segments import Segments
from kernels.torch_attention import apply_rotation


class RecallTier:
    """A store's cold tier and recalls.

    Args:
        segments, figures: the store's parts.
        rotary: the model's rotary embedding in rerotate mode, else None.

    Attributes:
        tier: the cold tier (`attach`), or None.
        recalling: whether the current forward call and policy eviction use the cold tier:
            evictions go there and recalls come from it. Each call's plan says so
            (`agent_kv.kv.call_plan.CallPlan.recall`); a tier whose policy changed keeps its
            pages, unused.
    """

    def __init__(self, segments: Segments, figures: StoreFigures, rotary: Rotary | None):
        self.segments = segments
        self.figures = figures
        self.rotary = rotary
        self.tier: ColdTier | None = None
        self.recalling = False

    def attach(self, config: ColdConfig) -> ColdTier:
        """Keep evicted tokens in a cold tier with these settings from now on, `recalling` (a
        tier already attached keeps its pages and takes the new settings); returns it.

        Raises:
            ConfigError: invalid settings.
        """
        config.validate()
        seg = self.segments
        if self.tier is None:
            self.tier = ColdTier(seg.num_layers, seg.batch, config, self.rotary)
        else:
            self.tier.config = config
        self.recalling = True
        return self.tier

    def due(self, query_len: int, row: int) -> bool:
        """Whether a forward call of `query_len` queries per row, `row` its first, recalls cold
        pages: the store is `recalling` and `ColdConfig.due` says so."""
        return self.recalling and self.tier.config.due(query_len, self.segments.seen(row))

    def evict(self, evicted: torch.Tensor, layers: slice, rows: slice) -> None:
        """Move the live slots `evicted` `[L', R, Cq + C]` marks into the cold tier."""
        seg = self.segments
        valid = seg.valid(layers, rows)
        for i, layer in enumerate(range(*layers.indices(seg.num_layers))):
            for j, row in enumerate(range(*rows.indices(seg.batch))):
                slots = evicted[i, j][valid[i, j]].nonzero().squeeze(1)  # logical order
                if slots.numel():
                    keys, values = seg.read_slots(layer, row, slots)
                    positions = seg.live_positions(layer, row)[slots]
                    self.tier.add(layer, row, keys, values, positions)

    def recall(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        rows: range,
        positions: torch.Tensor,
        origins: torch.Tensor,
    ) -> int:
        """Bring the best cold pages of a layer back into the hot store for `rows`, before the
        call's attention reads it; returns the tokens recalled.

        The call's last `ColdConfig.queries` queries score the pages (`_scores`), or, after a
        vote pass, the pass's scores and votes choose them (`ColdTier.picked`); the recalled
        tokens leave the `evicted_tokens` count (an eviction that was undone) and go back at
        their original positions (`Segments.insert`) with fresh statistics, and the policy
        keeps them first until the layer's next recall (`held_joint`), within its budget, and
        the hot tokens near them right after (`near_joint`, `ColdConfig.neighbours`).

        Args:
            query: `[rows, Hq, q, D]`, the call's queries as attention receives them.
            scale: the attention's softmax scale.
            rows: the call's rows.
            positions: `[rows, q]` int64, the call's rotary positions.
            origins: `[rows]` int64, the original position of each row's first query.
        """
        started = time.perf_counter()
        seg = self.segments
        recalled = 0
        for i, row in enumerate(rows):
            if not self.tier.pages[layer][row]:
                self.tier.held[layer][row] = self.tier.near[layer][row] = None
                continue
            scores = self.tier.ballots[layer][row]
            if scores is None:
                scores = self._scores(layer, row, query[i], scale, positions[i], int(origins[i]))
            kept_positions, keys, values = self.tier.recall(layer, row, scores)
            self.tier.near[layer][row] = neighbours(
                seg.live_positions(layer, row), kept_positions, self.tier.config.neighbours
            )
            seg.insert(layer, row, keys, values, kept_positions, room=query.shape[2])
            seg.mark_changed(row)
            self.figures.evicted_tokens -= kept_positions.numel()  # back: no longer evicted
            recalled += kept_positions.numel()
        if recalled:
            seg.note_peak(rows)
        self.tier.recall_s += time.perf_counter() - started
        return recalled

    def vote(
        self,
        layer: int,
        query: torch.Tensor,
        scale: float,
        rows: range,
        positions: torch.Tensor,
        origins: torch.Tensor,
    ) -> None:
        """A vote pass's part in a layer (`agent_kv.kv.cold_tier`, "Choosing pages across
        layers"): each row's cold pages scored by the pass's queries (`_scores`) and the
        layer's one vote spread over their positions (`ColdTier.vote`). Arguments as
        `recall`'s."""
        started = time.perf_counter()
        for i, row in enumerate(rows):
            if self.tier.pages[layer][row]:
                scores = self._scores(layer, row, query[i], scale, positions[i], int(origins[i]))
                self.tier.vote(layer, row, scores, self.segments.seen(row))
        self.tier.recall_s += time.perf_counter() - started

    def forget_votes(self) -> None:
        """Drop a vote pass's votes once the call that used them is over (nothing without a
        tier)."""
        if self.tier is not None:
            self.tier.forget_votes()

    def _scores(
        self, layer: int, row: int, query: torch.Tensor, scale: float, positions: torch.Tensor,
        origin: int,
    ) -> torch.Tensor:  # fmt: skip
        """`[P]`: the row's cold pages of a layer scored by the last `ColdConfig.queries` of
        `query` `[Hq, q, D]` (rotary `positions` `[q]`, the first at original position
        `origin`; `ColdTier.page_scores`). In rerotate mode at original positions, or with
        `distances="in_cache"` at in-cache ones: each cold key at the position it would take
        among the layer's live tokens, as `ForwardCall` places them before the queries."""
        config = self.tier.config
        n = query.shape[1]
        window = min(n, config.queries)
        scoring = query[:, n - window :]
        placed = None
        if self.rotary is not None and config.distances == "original":
            scoring = self._at_original(scoring, positions[None, -window:], origin + n - window)
        elif self.rotary is not None:
            live = torch.sort(self.segments.live_positions(layer, row)).values
            before = int(positions[0]) - live.numel()  # where the first live token sits

            def placed(original: torch.Tensor) -> torch.Tensor:
                return torch.searchsorted(live, original) + before

        return self.tier.page_scores(layer, row, scoring, scale, placed)

    def _at_original(self, query: torch.Tensor, in_cache: torch.Tensor, start: int) -> torch.Tensor:
        """Queries `[Hq, S, D]` rotated at their in-cache positions `in_cache` `[1, S]`,
        rotated instead at original positions `start, start + 1, ...`."""
        window = query.shape[1]
        original = start + torch.arange(window, device=query.device)[None]
        cos, sin = self.rotary.cos_sin(in_cache)
        unrotated = Rotary.unrotate(query[None].float(), cos, sin)
        cos, sin = self.rotary.cos_sin(original)
        return apply_rotation(unrotated, cos, sin)[0]

    def held_joint(self, layers: slice, rows: slice) -> torch.Tensor | None:
        """`[L', R, Cq + C]` bool: the slots of the tokens each layer's last recall brought
        back, or None when not recalling or before any recall."""
        return self._joint(self.tier.held if self.recalling else None, layers, rows)

    def near_joint(self, layers: slice, rows: slice) -> torch.Tensor | None:
        """`[L', R, Cq + C]` bool: the slots of the hot tokens that were near a recalled one
        at each layer's last recall (`ColdConfig.neighbours`), or None when there are none."""
        return self._joint(self.tier.near if self.recalling else None, layers, rows)

    def _joint(
        self, chosen: list[list[torch.Tensor | None]] | None, layers: slice, rows: slice
    ) -> torch.Tensor | None:
        """The slots whose positions are in `chosen[layer][row]`, None when no layer's row
        has any (or `chosen` is None)."""
        if chosen is None:
            return None
        seg = self.segments
        found = False
        positions = seg.joint("positions", layers, rows)
        marked = torch.zeros_like(positions, dtype=torch.bool)
        for i, layer in enumerate(range(*layers.indices(seg.num_layers))):
            for j, row in enumerate(range(*rows.indices(seg.batch))):
                taken = chosen[layer][row]
                if taken is not None:
                    marked[i, j] = torch.isin(positions[i, j], taken)
                    found = True
        return (marked & seg.valid(layers, rows)) if found else None

    def held_mask(self, layer: int, row: int = 0) -> torch.Tensor | None:
        """`[length]` bool over one layer's row's live slots (logical order): the tokens its
        last recall brought back, or None when not recalling or before any recall."""
        layers, rows = slice(layer, layer + 1), slice(row, row + 1)
        held = self.held_joint(layers, rows)
        return None if held is None else held[0, 0][self.segments.valid(layers, rows)[0, 0]]

    @property
    def peak_bytes(self) -> int:
        """The most bytes the cold tier has held (0 without one)."""
        return 0 if self.tier is None else self.tier.peak_bytes

    def nbytes(self, row: int | None = None) -> int:
        """Exact bytes of the cold tier (codes, scales, digests), for one row or all; 0 without
        one. Never part of the hot store's bytes."""
        return 0 if self.tier is None else self.tier.nbytes(row)


def neighbours(live: torch.Tensor, recalled: torch.Tensor, reach: int) -> torch.Tensor | None:
    """The positions of `live` (int64 `[n]`, hot tokens) within `reach` positions of one of
    `recalled` (int64 `[m]`, ascending) and not among them; None when there are none (or
    `reach` is 0)."""
    if reach == 0 or recalled.numel() == 0 or live.numel() == 0:
        return None
    at = torch.searchsorted(recalled, live)
    left = recalled[(at - 1).clamp(min=0)]
    right = recalled[at.clamp(max=recalled.numel() - 1)]
    distance = torch.minimum((live - left).abs(), (right - live).abs())
    near = live[(distance > 0) & (distance <= reach)]
    return torch.sort(near).values if near.numel() else None
