"""Per-token statistics a policy keeps in the store: what a policy declares, and what a forward
call hands each one to fold.

A policy that ranks tokens by something the store does not hold declares it as a
`TokenStatistic` in its own module: the columns it keeps per token (`Column`: one float32
value per KV head, or one per token) and how a call's measurements change them
(`TokenStatistic.fold`). Its `Policy.prepare` names the statistics in the call's plan
(`CallPlan.statistics`); the store adds their columns when a plan first names them
(`Segments.ensure_columns`), and the forward call hands every statistic of the plan the same
`Measured` record and writes back what it returns (`ForwardCall.fold`). Nothing else in the
store, the attention function or the engine knows a statistic by name.

What a call measures (`Measured`, the `measurement` a statistic folds):
- `"mass"`: the attention every ordinary call's scored queries gave each token (`mass`, with
  `count`, `weight`, `group` and `seen_by` to make it a mean), and the live tokens after the
  call (`live`);
- `"observation"`: the attention from the call's last queries, when the plan asks for an
  observation window (`CallPlan.observation_window`);
- `"maxima"`: the largest attention any query and query head gave each token, in a maxima
  pass (`CallPlan.maxima_pass`), whose own tokens are never kept;
- `"keys"`: the new tokens' keys alone, in every call that keeps its tokens (no attention
  needed: tokens appended outside a model call too).
A statistic whose measurement a call did not take is left as it is, and the call's new tokens
start at 0 in its columns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

MEASUREMENTS = ("mass", "observation", "maxima", "keys")
"""What a forward call can measure for its statistics (module docstring)."""


@dataclass(frozen=True)
class Column:
    """One per-token column of the store's segments, float32.

    Attributes:
        name: the field's name in both segments (`KVStore.joint(name)` reads it).
        per_head: one value per KV head (`[L, B, H, S]`), or one per token (`[L, B, S]`).
    """

    name: str
    per_head: bool = True


@dataclass(frozen=True)
class Measured:
    """What one forward call measured, for the new tokens or for one stored segment's slots.

    Shapes: `L` layers, `R` the call's rows, `H` KV heads, `W` the segment's slots read (for
    the new tokens, `n`), `D` the head dimension.

    Attributes:
        mass: `[L, R, H, W]` float32, the attention each token received, summed over the
            scored queries and the `group` query heads of its KV head; None when the call read
            no attention (tokens appended outside a model call, a maxima pass).
        observation: `[L, R, H, W]`, the same from the call's last `observed` queries only, or
            None.
        maxima: `[L, R, H, W]`, each token's largest attention probability over the call's
            queries and query heads (a maxima pass), or None.
        keys: `[L, R, H, n, D]`, the new tokens' keys in the store's convention (None for a
            stored segment).
        stored: each column of the statistic as it stands for these slots (`[L, R, H, W]` or
            `[L, R, W]`); empty for the new tokens.
        valid: `[L, R, 1, W]` bool, which slots are live (all of the new tokens).
        count: the scored queries; `weight` is `n / count`.
        weight: how much one scored query stands for.
        group: query heads per KV head.
        seen_by: `[W]` (new tokens only, else None): how many scored queries could see each
            new token under the causal mask.
        live: `[L, R, 1, 1]` float32, each layer's live tokens of the row after the call.
        observed: the queries of the observation window (0: none).
    """

    mass: torch.Tensor | None
    observation: torch.Tensor | None
    maxima: torch.Tensor | None
    keys: torch.Tensor | None
    stored: dict[str, torch.Tensor]
    valid: torch.Tensor
    count: int
    weight: float
    group: int
    seen_by: torch.Tensor | None
    live: torch.Tensor
    observed: int

    def mean_mass(self) -> torch.Tensor:
        """`[L, R, H, W]`: the call's mean attention per query and query head,
        `a_j = mass_j / (group * n_j)` (docs/methods.md, "Attention-mass statistics"): `n_j`
        is `count` for stored tokens, `seen_by` for new ones.

        Raises:
            ValueError: the call read no attention.
        """
        if self.mass is None:
            raise ValueError("the call read no attention: nothing to average")
        queries = self.count if self.seen_by is None else self.seen_by
        return self.mass / (queries * self.group)


class TokenStatistic(ABC):
    """A per-token statistic: its columns and how one call's measurements change them.

    Subclasses set `columns` and `measurement` and write `fold`; instances are frozen
    dataclasses (a plan holds them, a compiled decode step traces their `fold`)."""

    columns: ClassVar[tuple[Column, ...]]
    """The columns the statistic keeps, in both segments."""
    measurement: ClassVar[str] = "mass"
    """Which of `MEASUREMENTS` it folds; calls without it leave it as it is."""

    @abstractmethod
    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        """The statistic's columns after the call, by column name.

        Args:
            measured: what the call measured for these slots (`Measured`).
            new: the slots are the call's new tokens (their columns start here; `stored` is
                empty) rather than stored ones.

        Returns:
            A tensor per column it changes, shaped as `Measured.stored`'s (`[L, R, H, W]` or
            `[L, R, W]`); a stored column it leaves out keeps its values, a new token's column
            it leaves out starts at 0.
        """
