"""Recall: any policy, with its evictions kept in a cold tier and brought back on demand.

A wrapper in the manner of kvpress's composed presses: `ColdRecall(inner, config)` evicts exactly
as `inner` does, at `inner`'s budgets, with the same ranks, the same quantized tier and the
same statistics; what it adds is that

- every token `inner` evicts moves to the store's cold tier (`agent_kv.kv.cold_tier`: pages of
  `config.page_tokens`, quantized, each with a key digest) instead of being lost;
- at the start of every multi-token forward call (a new message: its queries carry the
  question), and every `config.every` decode tokens if set, each layer's cold pages are
  scored against the call's last `config.queries` queries by their digest bound, and the best
  `config.pages` return to the hot store at their original positions before the call's
  attention reads it (`RecallTier.recall`);
- the recalled tokens are ranked above every other candidate until the layer's next recall
  (`Policy.keep_scores`), inside `inner`'s budget: the hot tier is bounded as without recall.

The recall is query-aware, the eviction is not: an eviction made before a question is asked
cannot know what it will need, a recall made when it is asked can.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, replace

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.kv.policies.base import Policy, SlotView
from agent_kv.kv.store import KVStore


def _from_inner(attribute: str) -> property:
    """A read-only property that is the wrapped policy's `attribute`."""
    return property(
        lambda self: getattr(self.inner, attribute),
        doc=f"The inner policy's `{attribute}`.",
    )


class ColdRecall(Policy):
    """`inner` with a cold tier and query-aware recall (module docstring).

    Args:
        inner: the policy that ranks, evicts and quantizes; not itself a `ColdRecall`.
        config: the cold tier's page, recall and cap settings.

    Raises:
        ConfigError: `inner` is a `ColdRecall`, keeps every token (nothing to recall), or the
            settings are invalid.
    """

    def __init__(self, inner: Policy, config: ColdConfig):
        if isinstance(inner, ColdRecall):
            raise ConfigError("recall wraps a policy once")
        if not inner.evicts:
            raise ConfigError(f"policy {inner.name!r} evicts nothing: there is nothing to recall")
        config.validate()
        self.inner = inner
        self.config = config

    def __repr__(self) -> str:
        return f"ColdRecall({self.inner!r}, {self.config!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ColdRecall) and (self.inner, self.config) == (
            other.inner,
            other.config,
        )

    @property
    def name(self) -> str:
        """The inner policy's name with `+recall`."""
        return f"{self.inner.name}+recall"

    takes_budget = _from_inner("takes_budget")
    evicts = _from_inner("evicts")
    statistics = _from_inner("statistics")
    manages_precision = _from_inner("manages_precision")
    protect_recent = _from_inner("protect_recent")
    sinks = _from_inner("sinks")
    evict_slack = _from_inner("evict_slack")
    quantized = _from_inner("quantized")
    """The inner policy's quantized format, for policies with their own quantized tier
    (AttributeError for the others)."""

    def params(self) -> dict:
        """The inner policy's settings, with the cold tier's under `recall`."""
        return {**self.inner.params(), "recall": asdict(self.config)}

    def validate(self) -> None:
        self.inner.validate()
        self.config.validate()

    def maxima_pass_tokens(
        self, chunk: list[int], encode: Callable[[str], list[int]]
    ) -> list[int] | None:
        """The inner policy's maxima pass."""
        return self.inner.maxima_pass_tokens(chunk, encode)

    def prepare(self, store: KVStore) -> CallPlan:
        """The inner policy's plan with recall on, the store's cold tier attached
        (`RecallTier.attach`)."""
        store.recall.attach(self.config)
        return replace(self.inner.prepare(store), recall=True)

    def budget(self, confidence: float | None) -> int | None:
        return self.inner.budget(confidence)

    def layer_budgets(self, confidence: float | None, num_layers: int) -> list[int] | None:
        return self.inner.layer_budgets(confidence, num_layers)

    def max_kept_tokens(self, num_layers: int) -> list[int] | None:
        """The inner policy's bound plus one recall (`pages * page_tokens` per layer), which
        a call holds on top of the budget between its recall and its policy's eviction."""
        inner = self.inner.max_kept_tokens(num_layers)
        extra = self.config.pages * self.config.page_tokens
        return None if inner is None else [tokens + extra for tokens in inner]

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        return self.inner.rank(store, view, candidates)

    def slot_bounds(self, store: KVStore) -> tuple[int | None, int | None]:
        """The inner policy's bound plus one recall in the FP segment (`max_kept_tokens`)."""
        fp, q = self.inner.slot_bounds(store)
        extra = self.config.pages * self.config.page_tokens
        return (None if fp is None else fp + extra), q

    def evict(
        self,
        store: KVStore,
        confidence: float | None | list[float | None],
        rows: range | None = None,
    ) -> int:
        """The inner policy's eviction (its evicted tokens go to the cold tier,
        `KVStore.compact`)."""
        return self.inner.evict(store, confidence, rows)
