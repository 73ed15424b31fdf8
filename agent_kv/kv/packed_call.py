"""One model call over several stores: the new tokens of several sequences (a decode token
each, or a prefill chunk), packed one after another into a single row, so the model's weight
matrices are read once for all of them (continuous batching, as vLLM packs its batches).

Everything in the model but attention works token by token, so packing changes nothing for
it; the registered attention function (`agent_kv.kv.attention`) splits the packed queries,
keys and values at each sequence's span and runs that sequence's own `ForwardCall` on it,
over its own store: each sequence keeps its store, policy, budget and pins.
"""

from __future__ import annotations

import torch

from agent_kv.kv.forward_call import ForwardCall


class PackedCall:
    """Several one-row `ForwardCall`s (each of its own store) run as one model call.

    Args:
        calls: one call per sequence, in packing order, each over one row of its store
            (`ForwardCall.open(store, range(r, r + 1), n, plan)`); a store appears at most once.

    Raises:
        ValueError: no call, a call over more than one row, or one store twice.
    """

    def __init__(self, calls: list[ForwardCall]):
        if not calls:
            raise ValueError("a packed call needs at least one call")
        if any(len(call.rows) != 1 for call in calls):
            raise ValueError("each call of a packed call covers one row of its store")
        if len({id(call.store) for call in calls}) != len(calls):
            raise ValueError("a packed call holds one call per store")
        self.calls = calls
        ends = torch.tensor([call.n for call in calls]).cumsum(0).tolist()
        self.spans = list(zip([0, *ends[:-1]], ends, strict=True))
        """Per call, `(start, end)`: its tokens' positions in the packed row."""

    @property
    def tokens(self) -> int:
        """Tokens in the packed row (the sum of the calls' `n`)."""
        return self.spans[-1][1]

    def position_ids(self) -> torch.Tensor:
        """`[1, tokens]` int64: each call's rotary positions, one after another."""
        return torch.cat([call.tensors.position_ids for call in self.calls], dim=1)

    def last_indices(self) -> torch.Tensor:
        """int64 `[len(calls)]`: each call's last token in the packed row (the logits each
        sequence samples from)."""
        device = self.calls[0].store.device
        return torch.tensor([end - 1 for _, end in self.spans], device=device)

    def close(self) -> None:
        """Close every call (`ForwardCall.close`): its tokens written, its store moved on."""
        for call in self.calls:
            call.close()
