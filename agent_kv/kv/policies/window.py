"""Sliding window (StreamingLLM-style): keep the most recent tokens, optionally the first few.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023), §3: the first
tokens absorb attention mass ("attention sinks"); keeping them stabilises a windowed cache.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.kv.policies.base import Policy, check_budget


@dataclass
class SlidingWindow(Policy):
    """Keep the newest `window` unpinned tokens per layer (sinks included in that count;
    pinned tokens are kept on top of it).

    Parameters:
        window (int, default 512): tokens kept per layer.
        sinks (int, default 0): the first `sinks` positions are kept as attention sinks.
    """

    name = "window"
    window: int = 512

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """The budget is the window."""
        return {"window": budget}

    def validate(self) -> None:
        super().validate()
        check_budget(self.name, "window", self.window, self.protect_recent + self.sinks)

    def budget(self, confidence: float | None) -> int:
        """The window, whatever the confidence."""
        return self.window
