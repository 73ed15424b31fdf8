"""Random eviction: the ablation baseline that keeps as many tokens as the policy it is
compared with, chosen uniformly at random (methods.md, CONF-KV ablation: 36.54 vs 30.92 PPL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_kv.policies.base import Policy, check_budget
from agent_kv.store import KVStore


@dataclass
class RandomEviction(Policy):
    """Keep `budget` unpinned tokens per layer, chosen at random (protected tokens kept).

    Parameters:
        budget (int, default 512): unpinned tokens kept per layer.
        seed (int, default 0): seeds the generator once; a run is reproducible step by step.
    """

    name = "random"
    budget_tokens: int = 512
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._generator = torch.Generator().manual_seed(self.seed)

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """The budget."""
        return {"budget_tokens": budget}

    def validate(self) -> None:
        super().validate()
        check_budget(self.name, "budget", self.budget_tokens, self.protect_recent)

    def budget(self, confidence: float | None) -> int:
        """The fixed budget, whatever the confidence."""
        return self.budget_tokens

    def rank(self, store: KVStore, layer_idx: int, candidates: torch.Tensor) -> torch.Tensor:
        """Uniform random ranks `[length]` from the policy's seeded generator."""
        return torch.rand(candidates.numel(), generator=self._generator).to(candidates.device)
