"""How much KV memory a sequence may take under its policy: the one place that answers it.

Three questions, asked of one `KVMemory` per engine (its model's sliding windows, its prefill
chunk, whether its stores keep mixed precision):
- before every forward call, how far a store's segments may grow before the policy's next
  eviction (`bound_store`: the policy's slot bounds plus one chunk, `KVStore.bound_capacity`);
- before a chat turn, the most allocated KV bytes a sequence can reach while `N` more tokens
  are fed under a policy (`allocated_bound`): the session store reserves that much under its
  cap before the turn runs, so the cap holds while every running turn grows;
- as a turn joins the batch, the most allocated KV bytes its sequence can reach while it runs
  (`turn_bound`, the same bound read off the store itself): the batch scheduler admits turns
  while their bounds fit its cap, so a batch never allocates past it.

Under a policy that bounds tokens (`Policy.max_kept_tokens`, `B` per layer), a layer holding
`L` tokens never holds more than `max(L, pinned + B)` after a step, plus the one prefill chunk
appended before the next eviction; a sliding-window layer, whatever the policy, never more
than `max(L, window - 1 + ATTENTION_WINDOW_SLACK)` plus the chunk
(`agent_kv.kv.attention_windows`); the store's growth rule then bounds its buffers
(`StoreFootprint.allocation_bound`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from agent_kv.kv.attention_windows import attention_windows
from agent_kv.kv.store import ATTENTION_WINDOW_SLACK, KVStore, StoreFootprint

if TYPE_CHECKING:
    from agent_kv.kv.policies import Policy


@dataclass(frozen=True)
class KVMemory:
    """The KV memory rules of one engine's sequences (module docstring).

    Attributes:
        prefill_chunk: tokens per prefill forward call: what a layer may hold past its
            policy's bound before the next eviction.
        attention_window_holds: per layer, the most tokens a sliding-window layer holds
            between calls (`window - 1 + ATTENTION_WINDOW_SLACK`), or None for a
            full-attention layer.
        mixed_precision: the stores keep age-based mixed precision (`Int8Config`), so tokens
            may move to the quantized segment whatever the policy.
    """

    prefill_chunk: int
    attention_window_holds: tuple[int | None, ...]
    mixed_precision: bool = False

    @classmethod
    def for_model(cls, config, prefill_chunk: int, mixed_precision: bool) -> KVMemory:
        """The rules for a transformers model's `config` (its sliding windows)."""
        holds = tuple(
            None if window is None else window - 1 + ATTENTION_WINDOW_SLACK
            for window in attention_windows(config)
        )
        return cls(prefill_chunk, holds, mixed_precision)

    def bound_store(self, store: KVStore, policy: Policy) -> None:
        """Before a forward call under `policy`: bound `store`'s segments by what they can
        need before the policy's next eviction (`Policy.slot_bounds` and one prefill chunk,
        `KVStore.bound_capacity`)."""
        store.bound_capacity(*policy.slot_bounds(store), self.prefill_chunk)

    def layer_token_bounds(
        self, held: list[int], policy: Policy, appended: int, pinned: int
    ) -> list[int]:
        """Per layer, the most tokens a row holding `held[i]` tokens in layer `i` can hold
        while `appended` more tokens are fed under `policy`, `pinned` of the row's tokens
        pinned (module docstring).

        Raises:
            ValueError: `held` does not have one entry per layer.
        """
        if len(held) != len(self.attention_window_holds):
            raise ValueError(
                f"need {len(self.attention_window_holds)} per-layer lengths, got {len(held)}"
            )
        budgets = policy.max_kept_tokens(len(held))
        most = []
        for layer, tokens in enumerate(held):
            grown = tokens + appended
            hold = self.attention_window_holds[layer]
            if hold is not None:  # a sliding-window layer: its window bounds it, not the policy
                grown = min(grown, max(tokens, hold) + self.prefill_chunk)
            elif budgets is not None:
                grown = min(grown, max(tokens, pinned + budgets[layer]) + self.prefill_chunk)
            most.append(grown)
        return most

    def allocated_bound(
        self,
        footprint: StoreFootprint,
        policy: Policy,
        appended: int,
        pinned: int,
        kept_tokens: int | None = None,
    ) -> int:
        """The most allocated KV bytes a sequence whose buffers `footprint` describes can
        reach while `appended` more tokens are fed under `policy` (`pinned` of its tokens
        pinned).

        Args:
            kept_tokens: the sequence's history is first cut back to this many tokens (a
                client that changed its history), or None.
        """
        held = list(footprint.lengths)
        if kept_tokens is not None:
            held = [min(tokens, kept_tokens) for tokens in held]
        most = self.layer_token_bounds(held, policy, appended, pinned)
        quantizes = self.mixed_precision or policy.manages_precision
        return footprint.allocation_bound(most, quantizes)

    def turn_bound(self, store: KVStore, policy: Policy, appended: int) -> int:
        """The most allocated KV bytes `store` (one sequence) can reach while `appended` more
        tokens are fed under `policy` (`allocated_bound` of its footprint, its pinned tokens
        those pinned now and those pinned ahead among the next `appended`), and never less
        than it has allocated now."""
        pinned = store.pins.tokens() + store.pins.counts(range(1), appended)[0]
        bound = self.allocated_bound(store.footprint(), policy, appended, pinned)
        return max(bound, store.allocated_nbytes())
