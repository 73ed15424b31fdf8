"""The policy interface and the eviction step every policy shares.

A policy answers two questions each step (after every forward call, prefill chunk or decode
token): how many tokens may each layer keep (`budget`, from the current confidence), and how
much is each live token worth keeping (`rank`). The shared step here does the rest, the same
for every policy (docs/architecture.md, Decisions, "One policy interface"; docs/methods.md,
"Shared eviction step"): protect the `protect_recent` newest tokens and the pinned ones, take
the top-ranked others up to the budget (which counts unpinned tokens only), compact the store,
and move what left the FP window into INT8 when the store keeps mixed precision.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.store import KVStore
from kernels.formats import QUANT_FORMATS

HELD_RANK = torch.finfo(torch.float32).max
"""The rank of a recalled token: above any score, below the `inf` of protected tokens."""


@dataclass
class Policy(ABC):
    """Base class of KV-cache policies.

    Attributes:
        protect_recent: the `P` most recent unpinned tokens of every layer are never evicted.
        sinks: the first `sinks` positions are never evicted either (attention sinks,
            StreamingLLM §3.1); they count in the budget.
        evict_slack: a layer over budget is cut to `budget - evict_slack` tokens, so the
            compaction (a gather of the whole layer) runs once per `evict_slack + 1` new
            tokens instead of after every token; 0 keeps exactly `budget`; a layer is never
            cut below half its budget (the slack of a budget of 40 is 20). Default 32: with
            0 the compaction after every decode token costs ~19% of a step on SmolLM2-135M at
            a 1,024-token budget, with 32 about 4.5% (benchmarks/decode_latency.py).
    """

    name: ClassVar[str]
    takes_budget: ClassVar[bool] = True
    """Whether `--budget` means anything to the policy (see `budget_params`)."""
    manages_precision: ClassVar[bool] = False
    """The policy quantizes tokens itself (ARKV's tiers): it cannot share a store with
    age-based mixed precision (`Int8Config`)."""
    reconstructs: ClassVar[bool] = False
    """The engine runs a reconstruction pass after each prefill chunk, before the policy
    steps (KVzip, `agent_kv.kv.policies.kvzip`)."""
    protect_recent: int = 0
    sinks: int = 0
    evict_slack: int = 32

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """The dataclass fields one `--budget N` (unpinned tokens per layer) sets, given the
        other `params` the user chose. Raises `ConfigError` for policies without a budget."""
        raise ConfigError(f"policy {cls.name!r} keeps every token and takes no budget")

    def params(self) -> dict:
        """The policy's settings as plain values (what a record says it ran with)."""
        return asdict(self)

    def validate(self) -> None:
        """Check parameters; raises `ConfigError` with a message naming the parameter."""
        if self.protect_recent < 0:
            raise ConfigError(
                f"{self.name}: protect_recent must be >= 0, got {self.protect_recent}"
            )
        if self.sinks < 0:
            raise ConfigError(f"{self.name}: sinks must be >= 0, got {self.sinks}")
        if self.evict_slack < 0:
            raise ConfigError(f"{self.name}: evict_slack must be >= 0, got {self.evict_slack}")

    def prepare(self, store: KVStore) -> None:
        """Called before every forward call on `store`: say what the call should measure
        besides the attention mass. Default: no prefill attention statistics (no profile, no
        observation window)."""
        store.profile_prefill = False
        store.observation_window = 0
        store.recalling = False

    @abstractmethod
    def budget(self, confidence: float | None) -> int | None:
        """Unpinned tokens each layer may keep after this step; None keeps everything.

        `confidence` is None when the step gives no signal (a prompt chunk before the last).
        """

    def layer_budgets(self, confidence: float | None, num_layers: int) -> list[int] | None:
        """Per-layer budgets for this step; default: `budget(confidence)` in every layer."""
        budget = self.budget(confidence)
        return None if budget is None else [budget] * num_layers

    def max_kept_tokens(self, num_layers: int) -> list[int] | None:
        """Per layer, the most unpinned tokens the layer can keep after any step, whatever the
        confidence; None when the policy keeps everything or bounds bytes rather than tokens
        (a quantized tier fits more tokens than FP ones in the same bytes). Default: the
        no-signal budgets, the largest a confidence gate gives (`n_low >= n_high`)."""
        if self.manages_precision:
            return None
        return self.layer_budgets(None, num_layers)

    def rank(
        self, store: KVStore, layer_idx: int, row: int, candidates: torch.Tensor
    ) -> torch.Tensor:
        """`[length]` float over the row's live slots (logical order): higher means keep
        first. Only the `candidates` (`[length]` bool: neither pinned nor protected) compete.
        Default: recency (newest highest)."""
        return store.layers[layer_idx].live_positions(row).float()

    def keep_scores(
        self, store: KVStore, layer_idx: int, row: int, candidates: torch.Tensor
    ) -> torch.Tensor:
        """`rank`, with the tokens the layer's last recall brought back
        (`KVStore.held_mask`) above every other candidate: they stay first within the
        budget until the next recall."""
        ranks = self.rank(store, layer_idx, row, candidates).clone()
        held = store.held_mask(layer_idx, row)
        if held is not None:
            ranks[held] = HELD_RANK
        return ranks

    def step(
        self,
        store: KVStore,
        confidence: float | None | list[float | None],
        rows: range | None = None,
    ) -> int:
        """Evict down to this step's budget in every layer of `rows` (default: every row),
        then move the tokens that left the FP window into INT8 (when the store has INT8 on);
        return the tokens evicted.

        `confidence` is one value for every row or a list with one per row, so each row of a
        batch follows its own sawtooth. The budget counts unpinned tokens: pinned tokens are
        held in addition to it (and counted in every memory figure), so pins can never crowd
        out the newest tokens. Among the unpinned, the newest `protect_recent` always stay
        and the top-ranked others fill the rest of the budget.
        """
        evicted = 0
        for row, row_confidence in row_confidences(store, confidence, rows):
            budgets = self.layer_budgets(row_confidence, len(store.layers))
            for idx in range(len(store.layers)):
                if budgets is not None:
                    evicted += self._evict(store, idx, row, budgets[idx])
                self.quantize(store, idx, row)
        return evicted

    def quantize(self, store: KVStore, idx: int, row: int) -> int:
        """After a layer's eviction: move what its precision rule says to the quantized tier;
        returns the tokens moved. Default: the store's age-based mixed precision, if on
        (`KVStore.quantize_stale`)."""
        return store.quantize_stale(idx, row)

    def protected(self, store: KVStore, idx: int, row: int, pinned: torch.Tensor) -> torch.Tensor:
        """`[length]` bool over the row's live slots: pinned, attention sinks (the first
        `sinks` positions) and the `protect_recent` newest unpinned tokens."""
        positions = store.layers[idx].live_positions(row)
        protected = pinned | (positions < self.sinks)
        if self.protect_recent:
            unpinned = (~pinned).nonzero().squeeze(1)
            newest = torch.topk(positions[unpinned], min(self.protect_recent, unpinned.numel()))
            protected[unpinned[newest.indices]] = True
        return protected

    def _evict(self, store: KVStore, idx: int, row: int, budget: int) -> int:
        pinned = store.pinned_mask(idx, row)  # [n], logical order
        n, n_pinned = pinned.numel(), int(pinned.sum())
        if n - n_pinned <= budget:
            return 0
        protected = self.protected(store, idx, row, pinned)
        ranks = self.keep_scores(store, idx, row, ~protected)  # [n]
        ranks[protected] = float("inf")
        slack = min(self.evict_slack, budget // 2)  # a small budget is never cut below half
        keep_count = max(n_pinned + budget - slack, int(protected.sum()))
        keep = torch.topk(ranks, keep_count, sorted=False).indices.sort().values
        store.compact(idx, keep, row)
        return n - keep_count


@dataclass
class FixedBudgetPolicy(Policy):
    """A policy whose budget ignores the confidence: `budget_tokens` every step.

    Parameters:
        budget_tokens (int, default 512): unpinned tokens kept per layer (`--budget`).
    """

    budget_tokens: int = 512

    @classmethod
    def budget_params(cls, budget: int, params: dict) -> dict:
        """The budget."""
        return {"budget_tokens": budget}

    def validate(self) -> None:
        super().validate()
        check_budget(self.name, "budget", self.budget_tokens, self.protect_recent + self.sinks)

    def budget(self, confidence: float | None) -> int:
        """The fixed budget, whatever the confidence."""
        return self.budget_tokens


def row_confidences(
    store: KVStore, confidence: float | None | list[float | None], rows: range | None
) -> list[tuple[int, float | None]]:
    """`(row, confidence)` for each of `rows` (default: every row of the store), given one
    confidence for all or a list with one per row."""
    rows = range(store.batch) if rows is None else rows
    per_row = confidence if isinstance(confidence, list) else [confidence] * len(rows)
    return list(zip(rows, per_row, strict=True))


def check_quantized(policy_name: str, quantized: str, group: int) -> None:
    """Raise `ConfigError` unless `quantized` names a format of `kernels.formats` and `group`
    is a whole number of tokens >= 1."""
    if quantized not in QUANT_FORMATS:
        raise ConfigError(
            f"{policy_name}: quantized must be one of {', '.join(QUANT_FORMATS)}, got {quantized!r}"
        )
    if group < 1:
        raise ConfigError(f"{policy_name}: group must be >= 1, got {group}")


def check_budget(policy_name: str, label: str, value: int, protect_recent: int = 0) -> None:
    """Raise `ConfigError` unless `value` is a positive token count above `protect_recent`
    (the recent window plus the sinks)."""
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(
            f"{policy_name}: {label} must be a positive number of tokens, got {value!r}"
        )
    if value <= protect_recent:
        raise ConfigError(
            f"{policy_name}: {label}={value} cannot hold the protection window of "
            f"{protect_recent} recent and sink tokens; raise the budget or lower "
            "protect_recent/sinks"
        )
