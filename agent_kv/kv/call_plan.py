"""What one forward call must measure and do besides attention, as its policy asks
(`Policy.prepare` returns one before every call): which per-token statistics to fold, whether
to profile the prefill's attention, SnapKV's observation window, recall from the cold tier, a
reconstruction pass, or a vote pass."""

from __future__ import annotations

from dataclasses import dataclass

STATISTICS = ("scores", "accumulated", "welford")
"""What a forward call can fold into the per-token statistics: CONF-KV's EMA of normalised
mass, H2O's accumulated mass, ARKV's Welford mean and variance."""


@dataclass(frozen=True)
class CallPlan:
    """One forward call's measurements (`agent_kv.kv.forward_call.ForwardCall.open`).

    Attributes:
        statistics: which of `STATISTICS` the call folds into the per-token statistics.
        profile: whether a multi-token call measures the shape of its attention
            (`KVStore.record_profile`; ARKV plans from it).
        observation_window: how many of a multi-token call's last queries measure
            `observation_mass` (SnapKV's observation window, Li et al. 2024, §4.1; 0: none).
        recall: whether the call and the policy eviction after it use the store's cold tier
            (evictions go there, recalls come from it).
        reconstruct: a reconstruction pass (KVzip, Kim et al. 2025, §3.2): its attention only
            records each stored token's `reconstruction` maximum, and its own tokens are not
            kept.
        vote: a vote pass (`agent_kv.kv.cold_tier`, "Choosing pages across layers"): each
            layer's attention scores its cold pages and votes for the best pages' positions
            (`RecallTier.vote`); nothing else is recorded and its own tokens are not kept.
    """

    statistics: frozenset[str] = frozenset(STATISTICS)
    profile: bool = False
    observation_window: int = 0
    recall: bool = False
    reconstruct: bool = False
    vote: bool = False

    @property
    def keeps_tokens(self) -> bool:
        """Whether the call's own tokens join the store (all but reconstruction and vote
        passes)."""
        return not (self.reconstruct or self.vote)
