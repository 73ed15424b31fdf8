"""Full KV: keep every token. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.errors import ConfigError
from agent_kv.policies.base import Policy


@dataclass
class FullKV(Policy):
    """Never evicts; `budget` is None at every step."""

    name = "full"

    def validate(self) -> None:
        """`protect_recent` has no meaning when nothing is evicted; it must stay 0."""
        if self.protect_recent:
            raise ConfigError("policy 'full' keeps every token; protect_recent does not apply")

    def budget(self, confidence: float | None) -> None:
        """Always None: no limit."""
        return None
