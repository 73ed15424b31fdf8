"""What one forward call must measure and do besides attention, as its policy asks
(`Policy.prepare` returns one before every call): which per-token statistics to fold (each a
policy's own `TokenStatistic`), whether to profile the prefill's attention, an observation
window, recall from the cold tier, a maxima pass, or a vote pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent_kv.kv.token_statistics import TokenStatistic


@dataclass(frozen=True)
class CallPlan:
    """One forward call's measurements (`agent_kv.kv.forward_call.ForwardCall.open`).

    Attributes:
        statistics: the per-token statistics the call folds what it measured into
            (`agent_kv.kv.token_statistics`); their columns are added to the store if it lacks
            them.
        profile: whether a multi-token call measures the shape of its attention
            (`KVStore.record_profile`; ARKV plans from it).
        observation_window: how many of a multi-token call's last queries measure the
            `"observation"` attention (SnapKV's observation window, Li et al. 2024, §4.1; 0:
            none).
        recall: whether the call and the policy eviction after it use the store's cold tier
            (evictions go there, recalls come from it).
        maxima_pass: a maxima pass: its attention only measures each stored token's largest
            attention probability (the `"maxima"` measurement, KVzip's reconstruction pass),
            and its own tokens are not kept.
        vote: a vote pass (`agent_kv.kv.cold_tier`, "Choosing pages across layers"): each
            layer's attention scores its cold pages and votes for the best pages' positions
            (`RecallTier.vote`); nothing else is recorded and its own tokens are not kept.
    """

    statistics: tuple[TokenStatistic, ...] = ()
    profile: bool = False
    observation_window: int = 0
    recall: bool = False
    maxima_pass: bool = False
    vote: bool = False

    @property
    def keeps_tokens(self) -> bool:
        """Whether the call's own tokens join the store (all but maxima and vote passes)."""
        return not (self.maxima_pass or self.vote)
