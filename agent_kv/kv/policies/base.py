"""The policy interface and the eviction every policy shares.

A policy answers two questions at each eviction (after every forward call, prefill chunk or decode
token): how many tokens may each layer keep (`budget`, from the current confidence), and how
much is each live token worth keeping (`rank`). The shared eviction here does the rest, the same
for every policy and for every layer and row of the store at once (docs/architecture.md,
Decisions, "One policy interface"; docs/methods.md, "Shared eviction"): protect the
`protect_recent` newest tokens and the pinned ones, take the top-ranked others up to the budget
(which counts unpinned tokens only), compact the store, and move what left the FP window into
INT8 when the store keeps mixed precision. Ranks, protection and the choice are tensors over
`[layers, rows, slots]` (the store's joint slot space: `KVStore.valid`), so an eviction is a fixed
handful of operations whatever the number of layers and rows.

Policies evict in the full-attention layers only: a sliding-window layer (Mistral, Gemma-2/3,
gpt-oss) keeps its window, which the store trims after every call
(`KVStore.trim_attention_windows`), and no budget, pin or rank changes what it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.policies.registry import POLICIES
from agent_kv.kv.policy_names import is_policy_class
from agent_kv.kv.store import KVStore
from agent_kv.kv.token_statistics import TokenStatistic
from kernels.formats import QUANT_FORMATS

HELD_RANK = torch.finfo(torch.float32).max
"""The rank of a recalled token: above any score, below the `inf` of protected tokens."""
NEAR_RANK = HELD_RANK / 2
"""The rank of a hot token near a recalled one (`ColdConfig.neighbours`): below the recalled
tokens, above any score."""


@dataclass(frozen=True)
class SlotView:
    """What an eviction sees of the rows it evicts in, over the joint slot space `[L, R, S]`
    (`S = Cq + C`: quantized slots, then FP slots).

    Attributes:
        rows: the store's rows, contiguous.
        valid: bool, live slots.
        positions: int64, each live slot's original position (-1 for free slots).
        pinned: bool, live slots holding a pinned token.
    """

    rows: slice
    valid: torch.Tensor
    positions: torch.Tensor
    pinned: torch.Tensor

    @classmethod
    def of(cls, store: KVStore, rows: slice) -> SlotView:
        """The view of `rows` of `store`, every layer."""
        layers = slice(None)
        valid = store.valid(layers, rows)
        positions = torch.where(valid, store.joint("positions", layers, rows), -1)
        return cls(rows, valid, positions, store.pins.joint(layers, rows))


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
            0 the compaction after every decode token costs ~19% of a decode step on SmolLM2-135M at
            a 1,024-token budget, with 32 about 4.5% (benchmarks/decode_latency.py).
    """

    name: ClassVar[str]
    """What `make_policy` and `--policy` take; a subclass that sets it registers itself
    (`agent_kv.kv.policies.registry`)."""
    order: ClassVar[int] = 1000
    """Its place in `POLICIES` and every listing of the policies (ties by name)."""
    summary: ClassVar[str]
    """What the policy keeps and evicts, one phrase of the docs' table
    (`agent_kv.kv.policies.table`); every registered policy sets its own."""
    paper: ClassVar[str | None] = None
    """The paper and section the policy follows, short (`H2O §3-4`); None for none. Read from
    the class's own body: a subclass does not inherit its parent's."""
    takes_budget: ClassVar[bool] = True
    """Whether `--budget` means anything to the policy (see `budget_params`)."""
    evicts: ClassVar[bool] = True
    """Whether the policy ever evicts a token (false for full KV only): recall and re-encoding
    need something evicted."""
    manages_precision: ClassVar[bool] = False
    """The policy quantizes tokens itself (ARKV's tiers): it cannot share a store with
    age-based mixed precision (`Int8Config`)."""
    statistics: ClassVar[tuple[TokenStatistic, ...]] = ()
    """The per-token statistics the policy ranks by, each declared in the policy's own module
    (`agent_kv.kv.token_statistics`): forward calls fold only these, into columns the store
    adds for them (a policy that keeps everything, or ranks by recency, asks for none, and
    its calls pay for no bookkeeping)."""
    protect_recent: int = 0
    sinks: int = 0
    evict_slack: int = 32

    def __init_subclass__(cls, **kwargs) -> None:
        """Register a subclass that sets its own `name` (`registry.PolicyRegistry.add`)."""
        super().__init_subclass__(**kwargs)
        if is_policy_class(cls):
            POLICIES.add(cls)

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

    def maxima_pass_tokens(
        self, chunk: list[int], encode: Callable[[str], list[int]]
    ) -> list[int] | None:
        """The tokens of a maxima pass (`CallPlan.maxima_pass`) the engine runs after a
        forward call of `chunk` and before this policy evicts, or None for none (the default;
        KVzip's reconstruction pass). `encode` tokenizes text with the engine's tokenizer."""
        return None

    def prepare(self, store: KVStore) -> CallPlan:
        """Called before every forward call on `store`: what the call should measure (its
        `CallPlan`): the per-token statistics the policy ranks by (`statistics`), and by
        default no prefill attention statistics (no profile, no observation window) and no
        recall."""
        return CallPlan(statistics=self.statistics)

    @abstractmethod
    def budget(self, confidence: float | None) -> int | None:
        """Unpinned tokens each layer may keep after this eviction; None keeps everything.

        `confidence` is None when the call gives no signal (a prompt chunk before the last).
        """

    def layer_budgets(self, confidence: float | None, num_layers: int) -> list[int] | None:
        """Per-layer budgets for this eviction; default: `budget(confidence)` in every layer."""
        budget = self.budget(confidence)
        return None if budget is None else [budget] * num_layers

    def max_kept_tokens(self, num_layers: int) -> list[int] | None:
        """Per layer, the most unpinned tokens the layer can keep after any eviction, whatever the
        confidence; None when the policy keeps everything or bounds bytes rather than tokens
        (a quantized tier fits more tokens than FP ones in the same bytes). Default: the
        no-signal budgets, the largest a confidence gate gives (`n_low >= n_high`)."""
        if self.manages_precision:
            return None
        return self.layer_budgets(None, num_layers)

    def slot_bounds(self, store: KVStore) -> tuple[int | None, int | None]:
        """The most unpinned tokens a layer's row holds after any eviction, in the FP segment and
        in the quantized one (`KVStore.bound_capacity`: what its buffers are sized by); None
        for a segment the policy does not bound. Default: `max_kept_tokens`, all FP, or with
        the store's INT8 mixed precision at most its FP window plus a group waiting in FP."""
        kept = self.max_kept_tokens(store.num_layers)
        if kept is None:
            return None, None
        most = max(kept)
        if store.int8 is None:
            return most, 0
        return min(most, store.int8.max_fp_tokens), most

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """`[L, R, S]` float over the joint slot space of `view`: higher means keep first.
        Only the `candidates` (`[L, R, S]` bool: live, neither pinned nor protected) compete;
        other slots may rank anything. Default: recency (newest highest)."""
        return view.positions.float()

    def keep_scores(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """`rank`, with the tokens each layer's last recall brought back
        (`RecallTier.held_joint`) above every other candidate, and the hot tokens that were
        near them (`RecallTier.near_joint`) right after: they stay first within the budget
        until the next recall."""
        ranks = self.rank(store, view, candidates)
        near = store.recall.near_joint(slice(None), view.rows)
        if near is not None:
            ranks = torch.where(near, NEAR_RANK, ranks)
        held = store.recall.held_joint(slice(None), view.rows)
        return ranks if held is None else torch.where(held, HELD_RANK, ranks)

    def evict(
        self,
        store: KVStore,
        confidence: float | None | list[float | None],
        rows: range | None = None,
    ) -> int:
        """Evict down to this call's budget in every layer of `rows` (default: every row),
        then move the tokens that left the FP window into INT8 (when the store has INT8 on);
        return the tokens evicted.

        `confidence` is one value for every row or a list with one per row, so each row of a
        batch follows its own sawtooth. The budget counts unpinned tokens: pinned tokens are
        held in addition to it (and counted in every memory figure), so pins can never crowd
        out the newest tokens. Among the unpinned, the newest `protect_recent` always stay
        and the top-ranked others fill the rest of the budget. Whether any layer is over its
        budget is decided on the host from the store's host counts, so an eviction with nothing to
        evict runs no tensor operation. Sliding-window layers are left as they are (module
        docstring).
        """
        rows = range(store.batch) if rows is None else rows
        store.ensure_columns(self.statistics)
        budgets = [
            self.layer_budgets(row_confidence, store.num_layers)
            for _, row_confidence in row_confidences(store, confidence, rows)
        ]
        evicted = 0
        if budgets[0] is not None and _over_budget(store, rows, budgets):
            evicted = self._cut_to_budgets(store, slice(rows.start, rows.stop), budgets)
        self.quantize(store, rows)
        return evicted

    def quantize(self, store: KVStore, rows: range) -> int:
        """After the eviction: move what the policy's precision rule says to the quantized
        tier, in every layer of `rows`; returns the tokens moved. Default: the store's
        age-based mixed precision, if on (`PrecisionTiers.quantize_stale`)."""
        return store.precision.quantize_stale(rows=slice(rows.start, rows.stop))

    def protected(self, store: KVStore, view: SlotView) -> torch.Tensor:
        """`[L, R, S]` bool: the live slots every eviction keeps: pinned, attention sinks (the first
        `sinks` positions) and the `protect_recent` newest unpinned tokens."""
        protected = view.pinned | (view.valid & (view.positions < self.sinks))
        if self.protect_recent:
            unpinned = view.valid & ~view.pinned
            newest = _descending_rank(torch.where(unpinned, view.positions, -1))
            protected |= unpinned & (newest < self.protect_recent)
        return protected

    def _cut_to_budgets(self, store: KVStore, rows: slice, budgets: list[list[int]]) -> int:
        """Cut every layer's row that holds more unpinned tokens than its budget to
        `budget - slack` (never below the protected tokens), keeping the top-ranked: one rank,
        one sort and one compaction for all layers and rows."""
        view = SlotView.of(store, rows)
        budget = torch.tensor(budgets, device=store.device).T  # [L, R]
        held = view.valid.sum(dim=-1)
        pinned = view.pinned.sum(dim=-1)
        protected = self.protected(store, view)
        ranks = self.keep_scores(store, view, view.valid & ~protected)
        ranks = torch.where(protected, torch.inf, ranks)
        ranks = torch.where(view.valid, ranks, -torch.inf)
        slack = torch.clamp(budget // 2, max=self.evict_slack)  # never below half the budget
        keep_count = torch.maximum(pinned + budget - slack, protected.sum(dim=-1))
        over = (held - pinned > budget) & store.global_layers()[:, None]
        keep_count = torch.where(over, keep_count, held)
        keep = _descending_rank(ranks) < keep_count[..., None]
        return store.compact_joint(keep, slice(None), rows)


def _descending_rank(values: torch.Tensor) -> torch.Tensor:
    """int64, same shape as `values` `[..., S]`: each entry's place when the last dimension is
    sorted in descending order (0 for the largest; ties in slot order)."""
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    places = torch.arange(values.shape[-1], device=values.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, places)


def _over_budget(store: KVStore, rows: range, budgets: list[list[int]]) -> bool:
    """Whether some full-attention layer of `rows` holds more unpinned tokens than its budget
    (host counts: no tensor is read)."""
    pinned = store.pins.live()
    return any(
        store.length(layer, row) - pinned[layer][row] > budget[layer]
        for row, budget in zip(rows, budgets, strict=True)
        for layer in range(store.num_layers)
        if store.attention_windows[layer] is None
    )


@dataclass
class FixedBudgetPolicy(Policy):
    """A policy whose budget ignores the confidence: `budget_tokens` at every eviction.

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
