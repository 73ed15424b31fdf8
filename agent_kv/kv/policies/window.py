"""Sliding window with attention sinks (StreamingLLM): keep the first few and the most recent
tokens.

Xiao et al., "Efficient Streaming Language Models with Attention Sinks" (2023), §3: the first
tokens absorb attention mass ("attention sinks"); keeping them stabilises a windowed cache, and
§3.2 keeps 4 of them, the default here. `sinks=0` gives the plain window that drops them.
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
        sinks (int, default 4): the first `sinks` positions are kept as attention sinks
            (StreamingLLM §3.2's four); 0 keeps the newest `window` tokens only.
    """

    name = "window"
    order = 10
    summary = (
        "the first `sinks` tokens (attention sinks) and the newest ones, `window` in all per "
        "layer; `sinks=0` gives the plain window"
    )
    paper = "StreamingLLM §3"
    sinks: int = 4
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
