"""Full KV: keep every token. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.base import Policy


@dataclass
class FullKV(Policy):
    """Never evicts; `budget` is None at every eviction."""

    name = "full"
    order = 0
    summary = "every token"
    takes_budget = False
    evicts = False
    evict_slack: int = 0

    def validate(self) -> None:
        """`protect_recent` and `evict_slack` mean nothing when nothing is evicted: both stay 0."""
        if self.protect_recent or self.evict_slack:
            raise ConfigError(
                f"policy {self.name!r} keeps every token; protect_recent and evict_slack do "
                "not apply"
            )

    def budget(self, confidence: float | None) -> None:
        """Always None: no limit."""
        return None
