"""Pins only: every token no pin protects is evicted after every forward call.

The floor under every budgeted policy: what a cache holds when it keeps the pinned spans
(system prompt and examples, the latest page, the agent's pinned notes) and nothing the policy
chose. A result where a budgeted policy beats full KV must also beat this one to show that the
policy's choice of tokens, not only the removal of history, is what helps. With `+reencode` the
pinned tokens are encoded again without the evicted history (`Engine.reencode`).
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.base import Policy


@dataclass
class PinsOnly(Policy):
    """Keeps no unpinned token: `budget` is 0 at every eviction (the current call's tokens are
    evicted once it has run, so each forward call still reads its own chunk)."""

    name = "pins-only"
    order = 5
    summary = "the pinned tokens only, every other token evicted after each call: the floor"
    takes_budget = False
    evict_slack: int = 0

    def validate(self) -> None:
        """`protect_recent`, `sinks` and `evict_slack` would keep unpinned tokens: all stay 0."""
        if self.protect_recent or self.sinks or self.evict_slack:
            raise ConfigError(
                f"policy {self.name!r} keeps pinned tokens only; protect_recent, sinks and "
                "evict_slack do not apply"
            )

    def budget(self, confidence: float | None) -> int:
        """Always 0: no unpinned token stays."""
        return 0
