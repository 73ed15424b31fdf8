"""H2O: heavy hitters plus a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (NeurIPS 2023), §3-4: keep the tokens with the largest accumulated attention scores
(the heavy hitters) and the most recent tokens; evict the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic


@dataclass(frozen=True)
class AccumulatedMass(TokenStatistic):
    """H2O's per-token score (§3): the attention mass the token received, summed over every
    query since it arrived; a call that scored `S` of its `n` queries weighs each by `n / S`
    (`Measured.weight`)."""

    columns = (Column("accumulated"),)

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        added = measured.mass * measured.weight
        return {"accumulated": added if new else measured.stored["accumulated"] + added}


@dataclass
class H2O(FixedBudgetPolicy):
    """Keep `protect_recent` recent tokens and `budget - protect_recent` heavy hitters per layer.

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`).
        protect_recent (int, default 256): the recent window, part of the budget (H2O's
            default splits the budget half and half).

    Heavy hitters are ranked by the attention mass summed over every query since the token
    arrived (the store's `accumulated`), averaged over the layer's KV heads, as in the paper;
    unlike CONF-KV's score this favours old tokens, which have been seen by more queries.
    """

    name = "h2o"
    order = 20
    summary = (
        "heavy hitters by accumulated attention plus a recent window, half the budget unless "
        "`protect_recent` is given"
    )
    paper = "H2O §3-4"
    statistics = (AccumulatedMass(),)
    protect_recent: int = 256

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """The budget, half of it the recent window unless `protect_recent` is given."""
        return {
            **super().budget_params(budget, params),
            "protect_recent": params.get("protect_recent", budget // 2),
        }

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Accumulated attention mass, mean over KV heads; `[L, R, S]`."""
        return store.joint("accumulated", rows=view.rows).mean(dim=2)
