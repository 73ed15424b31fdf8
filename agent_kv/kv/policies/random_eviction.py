"""Random eviction: the ablation baseline that keeps as many tokens as the policy it is
compared with, chosen uniformly at random (docs/methods.md, "Random eviction"; CONF-KV's
ablation: 36.54 vs 30.92 PPL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.base import FixedBudgetPolicy, SlotView
from agent_kv.kv.store import KVStore

SEED_RANGE = (-(2**63), 2**64)
"""Seeds `torch.Generator.manual_seed` takes: [start, stop)."""


@dataclass
class RandomEviction(FixedBudgetPolicy):
    """Keep `budget` unpinned tokens per layer, chosen at random (protected tokens kept).

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`).
        seed (int, default 0): seeds the generator once; a run is reproducible call by call.
    """

    name = "random"
    order = 40
    summary = "the budget's worth of tokens chosen at random, seeded: the ablation baseline"
    paper = "CONF-KV's ablation"
    seed: int = 0
    _generator: torch.Generator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        """Seed the generator; raises `ConfigError` for a seed torch cannot take."""
        if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ConfigError(f"{self.name}: seed must lie in [-2**63, 2**64), got {self.seed}")
        self._generator = torch.Generator().manual_seed(self.seed)

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Uniform random ranks `[L, R, S]` from the policy's seeded generator."""
        return torch.rand(candidates.shape, generator=self._generator).to(candidates.device)
