"""Full KV: keep every token. The reference every other policy is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.policies.base import Policy


@dataclass
class FullKV(Policy):
    """Never evicts; `budget` is None at every step."""

    name = "full"

    def budget(self, confidence: float | None) -> None:
        """Always None: no limit."""
        return None
