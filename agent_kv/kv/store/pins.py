"""Pins: positions of each row exempt from eviction and quantization (the goal, tool calls,
observations an agent must not lose), kept on the host by position and counted per layer
among the live tokens."""

from __future__ import annotations

import torch

from agent_kv.kv.store.segments import Segments


def flag_runs(flags: list[bool]) -> list[tuple[int, int]]:
    """`[start, end)` runs of True in `flags` (positions: pinned, kept):
    `[True, True, False, True]` -> `[(0, 2), (3, 4)]`."""
    runs, start = [], None
    for i, flag in enumerate([*flags, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    return runs


class Pins:
    """Which positions of each row are pinned.

    Args:
        segments: the store's segments (positions of the live slots, tokens seen).
    """

    def __init__(self, segments: Segments):
        self.segments = segments
        self.flags = torch.zeros(segments.batch, 0, dtype=torch.bool)
        """`[B, P]` bool on the host: which positions are pinned (`P` grows as needed)."""
        self._device: torch.Tensor | None = None
        self._live: list[list[int]] | None = [
            [0] * segments.batch for _ in range(segments.num_layers)
        ]

    def pin(self, start: int, end: int, row: int = 0) -> None:
        """Pin positions `[start, end)` of a row: exempt from eviction and quantization until
        `unpin`.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._set(start, end, row, True)

    def unpin(self, start: int, end: int, row: int = 0) -> None:
        """Release the pin on positions `[start, end)` of a row.

        Raises:
            ValueError: `start < 0`, `end < start`, or a row outside the batch.
        """
        self._set(start, end, row, False)

    def _set(self, start: int, end: int, row: int, value: bool) -> None:
        if start < 0 or end < start:
            raise ValueError(f"invalid position span [{start}, {end})")
        if not 0 <= row < self.segments.batch:
            raise ValueError(f"row {row} is not in this store's {self.segments.batch} rows")
        self._grow(end)
        self.flags[row, start:end] = value
        self.changed()

    def cut(self, row: int, end: int) -> None:
        """Forget the row's pins from position `end` on (its history was cut there)."""
        self._grow(end)
        self.flags[row, end:] = False
        self.changed()

    def load(self, flags: torch.Tensor) -> None:
        """Take saved flags `[B, P]` back."""
        self.flags = flags.cpu()
        self.changed()

    def changed(self) -> None:
        """The pins or the live slots changed: counts and the device copy are made again."""
        self._device = None
        self._live = None

    def _grow(self, size: int) -> None:
        if size > self.flags.shape[1]:
            grown = torch.zeros(self.segments.batch, size, dtype=torch.bool)
            grown[:, : self.flags.shape[1]] = self.flags
            self.flags = grown
            self._device = None

    def tokens(self, row: int = 0) -> int:
        """Positions of the row pinned now (pinned tokens are never evicted, so all live)."""
        return int(self.flags[row, : self.segments.seen(row)].sum())

    def positions(self, row: int = 0) -> torch.Tensor:
        """`[seen]` bool: which positions the row has seen are pinned now."""
        seen = self.segments.seen(row)
        self._grow(seen)
        return self.flags[row, :seen]

    def counts(self, rows: range, n: int) -> list[int]:
        """Per row of `rows`, how many of its next `n` positions are pinned already."""
        counts = []
        for row in rows:
            start = self.segments.seen(row)
            counts.append(int(self.flags[row, start : start + n].sum()))
        return counts

    def run(self, start: int, limit: int, row: int = 0) -> int:
        """How many consecutive positions from `start` are pinned, at most `limit`."""
        self._grow(start + limit)
        flags = self.flags[row, start : start + limit]
        unpinned = (~flags).nonzero()
        return int(unpinned[0, 0]) if unpinned.numel() else flags.numel()

    def device_flags(self) -> torch.Tensor:
        """`[B, P]` bool on the store's device (`P` at least every position seen)."""
        self._grow(max(self.segments.appended) + 1)
        if self._device is None:
            self._device = self.flags.to(self.segments.device)
        return self._device

    def joint(self, layers: slice, rows: slice) -> torch.Tensor:
        """`[L', R, Cq + C]` bool: which live slots of `layers` x `rows` hold a pinned token
        (False for free slots)."""
        flags = self.device_flags()[rows]  # [R, P]
        positions = self.segments.joint("positions", layers, rows).clamp(0, flags.shape[1] - 1)
        pinned = torch.gather(flags[None].expand(positions.shape[0], -1, -1), 2, positions)
        return pinned & self.segments.valid(layers, rows)

    def mask(self, layer: int, row: int = 0) -> torch.Tensor:
        """`[length]` bool: which live slots of the row's layer (logical order) are pinned."""
        return self.device_flags()[row, self.segments.live_positions(layer, row)]

    def live(self) -> list[list[int]]:
        """`[L][B]` host counts of the pinned tokens each layer's row holds (all of them are
        in the FP segment: pinned tokens are never quantized)."""
        if self._live is None:
            self._live = self.joint(slice(None), slice(None)).sum(dim=-1).tolist()
        return self._live

    def appended(self, rows: range, n: int) -> None:
        """`n` tokens were appended to `rows`: count those already pinned among the live."""
        if self._live is None:
            return
        pinned = self.counts(rows, n)
        for layer in self._live:
            for i, row in enumerate(rows):
                layer[row] += pinned[i]
