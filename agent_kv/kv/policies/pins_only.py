"""Pins only: the pinned tokens and the newest few, every other token evicted after every
forward call.

The floor under every budgeted policy: what a cache holds when it keeps the pinned spans
(system prompt and examples, the latest page, the agent's pinned notes), the `protect_recent`
newest tokens, and nothing the policy chose. A result where a budgeted policy beats full KV
must also beat this one to show that the policy's choice of tokens, not only the removal of
history, is what helps. With `+reencode` the kept tokens are encoded again without the
evicted history (`Engine.reencode`).

The newest tokens stay because without them the floor cannot answer at all: with nothing
unpinned kept, each decoded token was evicted once its call had run, and the question's
tokens before the answer's last prefill chunk were gone too. On the recall task 424 and the
carry tasks 541-544 it then stopped right after the forced answer key (`pixel_pilot karma:`),
its pinned note of the fact intact. The default is CONF-KV's own recent window
(`ConfidenceGate.protect_recent`, 64), so the two differ only in the tokens CONF-KV chooses
beyond it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_kv.errors import ConfigError
from agent_kv.kv.policies.base import Policy
from agent_kv.kv.policies.conf_kv import ConfidenceGate


@dataclass
class PinsOnly(Policy):
    """Keeps the pinned tokens and the `protect_recent` (default 64) newest unpinned ones per
    layer: its budget beyond them is 0 at every eviction, so every older unpinned token goes
    once a forward call has run."""

    name = "pins-only"
    order = 5
    summary = (
        "the pinned tokens and the newest `protect_recent`, every other token evicted after "
        "each call: the floor"
    )
    takes_budget = False
    evict_slack: int = field(default=0, init=False)
    protect_recent: int = ConfidenceGate.protect_recent

    def validate(self) -> None:
        """Attention sinks would keep more unpinned tokens than the newest: `sinks` stays 0
        (and `evict_slack` is fixed at 0, not a parameter).

        Raises:
            ConfigError: `sinks` is set, or `protect_recent` is negative.
        """
        super().validate()
        if self.sinks:
            raise ConfigError(
                f"policy {self.name!r} keeps pinned and recent tokens only; sinks do not apply"
            )

    def budget(self, confidence: float | None) -> int:
        """Always 0: no unpinned token beyond the newest `protect_recent` stays."""
        return 0
