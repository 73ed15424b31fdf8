"""SnapKV: keep the tokens the end of the prompt attends to.

Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation" (2024), §4: the
attention the last `W` queries of a prompt (the observation window) give the earlier tokens
predicts which tokens generation will attend to. Each cached token's score is the attention
the window gave it, max-pooled along positions (kernel 7) so that a selected token brings its
neighbours and the kept spans read as text (§4.2, "Efficient Clustering via Pooling"):

    w_i = sum over the window's queries q and the query heads of i's KV head of attn(q, i)
    score_j = max of w_i over the live tokens i within kernel // 2 of j, in position order

The top-scored tokens fill the budget, and the window itself is kept.

The paper compresses once, after the prompt, and keeps every generated token. Here every
prefill forward call is a compression point with its own observation window (its last `W`
queries): a long prompt fed in chunks is compressed after each chunk, so the store never holds
more than the budget plus one chunk, and the last chunk's window is the prompt's, as in the
paper; in a multi-turn session each turn's prompt compresses the whole cache again (the
earlier turns' replies included). Between compressions nothing is scored anew: the tokens fed
since the last window (a decode step's, a one-token chunk's) and the window itself rank above
every scored token, newest first, so decoding evicts the lowest-scored prompt tokens first
once the layer passes its budget and, should the budget fill with newer tokens, falls back to
a sliding window. The store keeps one set of tokens per layer: the pooled scores are averaged
over the layer's KV heads (the paper selects per head).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from agent_kv.errors import ConfigError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic


@dataclass(frozen=True)
class ObservationMass(TokenStatistic):
    """SnapKV's per-token score before pooling (§4.1): the attention the last observation
    window's queries gave the token, summed over them and the query heads of its KV head;
    each observing call replaces it (`w_i` in the module docstring)."""

    columns = (Column("observation_mass"),)
    measurement = "observation"

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        return {"observation_mass": measured.observation}


@dataclass
class SnapKV(FixedBudgetPolicy):
    """Keep the observation window and the tokens it attends to most, up to the budget.

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`), the
            observation window included.
        observation_window (int, default 32): `W`, the last queries of each prefill forward
            call whose attention scores the cache (the paper's window size); a shorter call
            observes with all its queries.
        kernel (int, default 7): width of the max-pooling along positions, odd.
    """

    name = "snapkv"
    order = 30
    summary = (
        "after each prefill call, the tokens its last `observation_window` queries attend to most"
        " (max-pooled along positions), plus that window; tokens generated since rank above them,"
        " newest first"
    )
    paper = "SnapKV §4"
    statistics = (ObservationMass(),)
    observation_window: int = 32
    kernel: int = 7

    def validate(self) -> None:
        """Raises `ConfigError` for a window under one query, an even or non-positive
        kernel, or a budget that, cut by the slack, keeps no token beyond the window, the
        sinks and `protect_recent`."""
        super().validate()
        if self.observation_window < 1:
            raise ConfigError(
                f"{self.name}: observation_window must be >= 1, got {self.observation_window}"
            )
        if self.kernel < 1 or self.kernel % 2 == 0:
            raise ConfigError(f"{self.name}: kernel must be an odd width >= 1, got {self.kernel}")
        kept = self.budget_tokens - min(self.evict_slack, self.budget_tokens // 2)
        floor = self.observation_window + self.sinks + self.protect_recent
        if kept <= floor:
            raise ConfigError(
                f"{self.name}: budget {self.budget_tokens} keeps {kept} tokens after an "
                f"eviction (evict_slack {self.evict_slack}), leaving none to select beyond the "
                f"observation window, sinks and protect_recent ({floor}); raise the budget or "
                "lower evict_slack or observation_window"
            )

    def prepare(self, store: KVStore) -> CallPlan:
        """Ask every prefill call for its observation window's attention."""
        return replace(super().prepare(store), observation_window=self.observation_window)

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """`[L, R, S]`: tokens before the last observation window by their pooled window
        attention (mean over KV heads); the window and the tokens after it above them all,
        newest highest."""
        rows = range(*view.rows.indices(store.batch))
        observed = torch.tensor([store.observed_from[r] for r in rows], device=store.device)
        far = torch.iinfo(torch.long).max
        order = torch.argsort(torch.where(view.valid, view.positions, far), dim=-1, stable=True)
        positions = torch.take_along_dim(view.positions, order, dim=-1)  # position order
        valid = torch.take_along_dim(view.valid, order, dim=-1)
        scored = valid & (positions < observed[None, :, None])  # a prefix in position order
        mass = store.joint("observation_mass", rows=view.rows)  # [L, R, H, S]
        mass = torch.take_along_dim(mass, order[:, :, None], dim=-1)
        mass = torch.where(scored[:, :, None], mass, -torch.inf)
        layers, batch, heads, width = mass.shape
        pooled = F.max_pool1d(
            mass.reshape(-1, heads, width), self.kernel, stride=1, padding=self.kernel // 2
        ).view(layers, batch, heads, width)
        pooled = torch.where(scored, pooled.mean(dim=2), -torch.inf)
        top = pooled.amax(dim=-1, keepdim=True).clamp_min(-1.0) + 1.0
        count = scored.sum(dim=-1, keepdim=True)
        newer = top + (torch.arange(width, device=store.device) - count).float()
        ranks = torch.where(scored, pooled, newer)
        return torch.empty_like(ranks).scatter_(-1, order, ranks)
