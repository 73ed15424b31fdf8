"""CONF-KV: confidence-gated budgets with attention-and-recency ranking (docs/methods.md,
CONF-KV).

At each eviction the confidence `c` of the last next-token distribution
(`agent_kv.kv.confidence`, §1) picks the budget (§2): `n_high` tokens when `c >= tau`
(confident: tight budget), `n_low` otherwise (uncertain: keep more); a call with no signal (a
prompt chunk before the last) gets `n_low`. Tokens are ranked (§3) by

    rank_j = (1 - recency_weight) * pct(s)_j + recency_weight * pct(position)_j

where `s_j` is the EMA of the normalised attention mass token j received (kept by the store,
averaged over KV heads) and `pct` is the token's percentile among the candidates (tokens
neither pinned nor protected), in [0, 1]. Percentiles rather than `s / max(s)`: attention
sinks take a large share of the mass (0.4 at position 0 against a median of 0.001 in
SmolLM2-135M), and dividing by that maximum would leave recency alone deciding. The
`protect_recent` (`P`) newest unpinned tokens are never evicted. Evicted tokens never come
back, so the cache traces a sawtooth: it grows through uncertain stretches and is cut back in
confident ones.

The paper gives the weights and the gate; the form of the composite, `recency_weight` and the
default budgets are this project's choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.base import Policy, SlotView, check_budget
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic


@dataclass(frozen=True)
class AttentionEma(TokenStatistic):
    """CONF-KV's per-token score `s`: the EMA of the mean attention the token receives per
    forward call (docs/methods.md, "Attention-mass statistics"): a stored token
    `s <- d * s + (1 - d) * a`, a new one starts at `a` (`Measured.mean_mass`).

    Attributes:
        decay: `d`, the old score's weight per forward call, in [0, 1).

    Raises:
        ValueError: `decay` outside [0, 1).
    """

    columns = (Column("scores"),)
    decay: float = 0.9

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"the EMA's decay must lie in [0, 1), got {self.decay}")

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        step = measured.mean_mass()
        if new:
            return {"scores": step}
        scores = measured.stored["scores"]
        moved = self.decay * scores + (1 - self.decay) * step
        return {"scores": torch.where(measured.valid, moved, scores)}


@dataclass
class ConfidenceGate(Policy):
    """CONF-KV's budget (§2): `n_high` tokens per layer when confident, `n_low` otherwise.

    Parameters:
        n_high (int, default 512): budget in tokens per layer when confident (`c >= tau`).
        n_low (int, default 1024): budget when uncertain (`c < tau`); must be >= n_high.
        tau (float, default 0.6): confidence threshold in [0, 1].
        protect_recent (int, default 64): `P`, newest tokens never evicted.
    """

    n_high: int = 512
    n_low: int = 1024
    tau: float = 0.6
    protect_recent: int = 64

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """`n_low = budget`, `n_high = budget // 2` (each unless given).

        Raises:
            ConfigError: the derived `n_high` cannot hold `protect_recent`.
        """
        chosen = {"n_low": params.get("n_low", budget), "n_high": params.get("n_high", budget // 2)}
        protect = params.get("protect_recent", cls.protect_recent)
        if budget > 0 and "n_high" not in params and chosen["n_high"] <= protect:
            raise ConfigError(
                f"{cls.name}: budget {budget} is too small: its confident half "
                f"({chosen['n_high']}) must exceed protect_recent={protect}"
            )
        return chosen

    def validate(self) -> None:
        super().validate()
        check_budget(self.name, "n_high", self.n_high, self.protect_recent + self.sinks)
        check_budget(self.name, "n_low", self.n_low, self.protect_recent + self.sinks)
        if self.n_low < self.n_high:
            raise ConfigError(
                f"{self.name}: n_low ({self.n_low}, the uncertain budget) must be >= n_high "
                f"({self.n_high}, the confident budget)"
            )
        if not 0.0 <= self.tau <= 1.0:
            raise ConfigError(f"{self.name}: tau must lie in [0, 1], got {self.tau}")

    def budget(self, confidence: float | None) -> int:
        """`n_high` when `confidence >= tau`, else (or with no signal) `n_low`."""
        if confidence is not None and confidence >= self.tau:
            return self.n_high
        return self.n_low


@dataclass
class ConfKV(ConfidenceGate):
    """CONF-KV eviction: the confidence gate's budget, tokens ranked by mass and recency.

    Parameters (besides the gate's `n_high`, `n_low`, `tau`, `protect_recent`):
        sinks (int, default 0): the first positions, never evicted (attention sinks).
        recency_weight (float, default 0.3): weight of recency in the rank, in [0, 1].
    """

    name = "conf-kv"
    order = 50
    summary = (
        "per forward call, `N_high` tokens when the confidence `c >= tau`, else `N_low`; ranked "
        "by the percentiles of EMA attention mass and of recency; the newest `P` unpinned tokens "
        "always kept"
    )
    paper = "CONF-KV §1-3"
    statistics = (AttentionEma(),)
    recency_weight: float = 0.3

    def validate(self) -> None:
        super().validate()
        if not 0.0 <= self.recency_weight <= 1.0:
            raise ConfigError(
                f"{self.name}: recency_weight must lie in [0, 1], got {self.recency_weight}"
            )

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Composite of mass and recency percentiles among `candidates`; `[L, R, S]`."""
        mass = store.joint("scores", rows=view.rows).mean(dim=2)  # [L, R, S]
        positions = view.positions.float()
        return (1.0 - self.recency_weight) * _percentile(
            mass, candidates
        ) + self.recency_weight * _percentile(positions, candidates)


def _percentile(values: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Each value's rank among the candidates' values of its layer and row (`[..., S]`, the
    candidates marked by `candidates`), scaled to [0, 1]; equal values share a rank."""
    ranked = torch.where(candidates, values, torch.inf)
    below = torch.searchsorted(torch.sort(ranked, dim=-1).values, values.contiguous())
    count = candidates.sum(dim=-1, keepdim=True)
    return below.float() / (count - 1).clamp_min(1)
