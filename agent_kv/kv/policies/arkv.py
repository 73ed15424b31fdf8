"""ARKV: an adaptive tri-state KV cache under a memory budget (docs/methods.md, ARKV).

Every live token is Original (the model's dtype), Quantized (FP8 `float8_e4m3fn` or INT8,
per-channel scales over groups of tokens, `kernels.formats`) or Evicted. At each eviction, per
layer: the protected window of the newest `W` (`protect_recent`) tokens and the pinned tokens stay
Original; the other tokens are ranked by the heavy-hitter score

    S_k = mu_k + gamma * sigma_k^2

(mean plus `gamma` times variance of the relative attention token k received per forward call,
Welford-style per KV head, kept by the store: `ForwardCall.record_attention`; averaged over the
layer's KV heads); the top ones fill the layer's Original slots, the next its Quantized slots,
the rest are evicted. A Quantized token is never promoted back (its precision is gone); it can
still be evicted. Tokens are quantized in whole groups, so up to `group - 1` tokens due for
the Quantized tier may wait in FP until a later eviction.

**Per-layer plan.** The paper derives each layer's Original:Quantized ratio and its share of
the memory budget from the layer's prefill attention statistics (entropy, variance, kurtosis),
without giving the formula. This project's mapping (`layer_plan`):
1. Per layer, the mean over prefill calls, scored queries and heads of the normalised entropy
   `h`, the log concentration `v = log(1 + n^2 Var(p))` and the log kurtosis `k` of the
   attention weights (`kernels.torch_attention.attention_profile`).
2. Flatness `f = (z(h) - z(v) - z(k)) / 3`, each statistic standardised across layers
   (`z(x) = (x - mean) / std`). Flat attention spreads over many tokens: eviction and
   quantization both cost such a layer more, so flatness stands for sensitivity.
3. `u = tanh(f)` in (-1, 1); the layer's Original fraction `r = clip(oq_ratio + oq_spread * u,
   0, 1)` and its budget share `s = 1 + share_spread * u`, rescaled to mean 1. Before any
   prefill statistics `u = 0`: every layer gets `oq_ratio` and an equal share.

**Budget.** `--budget N` is bytes, counted in full-precision tokens: every layer may hold on
average as many bytes as `N` Original tokens (the bytes of `window N`). A layer with share `s`
and ratio `r` holds `T = floor(N s / (r + rho (1 - r)))` tokens, `round(r T)` of them Original
and the rest Quantized, where `rho` is the bytes of a quantized token (a byte per value plus
its share of the scales) over those of an Original one. The Quantized tier is rounded down to
whole groups `Q`, and the Original tier gets what is left, `O = floor(N s - rho Q - (group - 1)
(1 - rho))` (at least `W + sinks`): the last term is room for the up to `group - 1` tokens that
wait in FP until they make a group. So after every eviction a layer holds at most the bytes of
`N s` FP tokens, as every policy holds at most its budget. Pinned tokens are held besides the
budget, as in every policy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.call_plan import CallPlan
from agent_kv.kv.policies.base import (
    FixedBudgetPolicy,
    Policy,
    SlotView,
    check_quantized,
    row_confidences,
)
from agent_kv.kv.store import KVStore, kept_first
from agent_kv.kv.token_statistics import Column, Measured, TokenStatistic


@dataclass(frozen=True)
class RelativeAttentionMoments(TokenStatistic):
    """ARKV's per-token heavy-hitter statistics: the mean and the sum of squared deviations of
    the relative attention `x = a * L` the token receives per call (`a` the call's mean
    attention, `Measured.mean_mass`; `L` the row's live tokens after it), by Welford's update
    (Welford, 1962): `count += 1; d = x - mean; mean += d / count; m2 += d * (x - mean)`; a
    new token starts at count 1, mean `x`. `hits` counts the calls (one value per token)."""

    columns = (Column("hit_mean"), Column("hit_m2"), Column("hits", per_head=False))

    def fold(self, measured: Measured, new: bool) -> dict[str, torch.Tensor]:
        x = measured.mean_mass() * measured.live
        if new:
            return {"hit_mean": x, "hits": torch.ones_like(x[:, :, 0])}
        valid = measured.valid
        counted = measured.stored["hits"] + valid[:, :, 0].float()
        mean = measured.stored["hit_mean"]
        delta = x - mean
        moved = mean + delta / counted[:, :, None].clamp_min(1.0)
        m2 = measured.stored["hit_m2"]
        return {
            "hit_m2": torch.where(valid, m2 + delta * (x - moved), m2),
            "hit_mean": torch.where(valid, moved, mean),
            "hits": counted,
        }


@dataclass(frozen=True)
class LayerPlan:
    """One layer's tri-state budget for an eviction, in unpinned tokens.

    Attributes:
        original: tokens kept in the model's dtype (the protected window included).
        quantized: tokens kept quantized.
    """

    original: int
    quantized: int


def layer_sensitivity(profile: torch.Tensor | None, num_layers: int) -> torch.Tensor:
    """`u` per layer in (-1, 1): how flat (so how sensitive to compression) each layer's
    prefill attention is relative to the other layers (module docstring, step 2-3).

    Args:
        profile: `[num_layers, 3]` mean normalised entropy, log concentration, log kurtosis
            (`KVStore.profile_means`), or None (no statistics yet: all zeros).
        num_layers: layers of the model.

    Returns:
        `[num_layers]` float32.
    """
    if profile is None or num_layers < 2:
        return torch.zeros(num_layers)
    z = (profile - profile.mean(dim=0)) / profile.std(dim=0).clamp_min(1e-6)
    flatness = (z[:, 0] - z[:, 1] - z[:, 2]) / 3.0
    return torch.tanh(flatness)


@dataclass
class TriState(Policy):
    """ARKV's tri-state eviction inside a budget chosen by a subclass (`layer_budgets`).

    Parameters:
        protect_recent (int, default 64): `W`, the newest unpinned tokens, always Original.
        gamma (float, default 0.1): weight of the variance in the heavy-hitter score.
        oq_ratio (float, default 0.85): mean share of a layer's kept tokens held Original.
        oq_spread (float, default 0.1): how far the Original share moves with sensitivity.
        share_spread (float, default 0.3): how far a layer's budget share moves with it, in
            [0, 1).
        quantized (str, default "fp8"): the Quantized tier's format, "fp8" or "int8".
        group (int, default 8): tokens quantized together (one scale per KV head and
            channel). Small, because up to `group - 1` tokens wait in FP for a whole group and
            the plan keeps room for them: at 8, with fp32 storage, the scales cost 0.25 byte
            per value and the room 5 FP tokens per layer; at 32, 0.06 byte and 23 tokens.
    """

    manages_precision: ClassVar[bool] = True
    statistics = (RelativeAttentionMoments(),)
    protect_recent: int = 64
    gamma: float = 0.1
    oq_ratio: float = 0.85
    oq_spread: float = 0.1
    share_spread: float = 0.3
    quantized: str = "fp8"
    group: int = 8

    def validate(self) -> None:
        super().validate()
        if self.gamma < 0:
            raise ConfigError(f"{self.name}: gamma must be >= 0, got {self.gamma}")
        if not 0.0 < self.oq_ratio <= 1.0:
            raise ConfigError(f"{self.name}: oq_ratio must lie in (0, 1], got {self.oq_ratio}")
        if not 0.0 <= self.oq_spread <= 1.0:
            raise ConfigError(f"{self.name}: oq_spread must lie in [0, 1], got {self.oq_spread}")
        if not 0.0 <= self.share_spread < 1.0:
            raise ConfigError(
                f"{self.name}: share_spread must lie in [0, 1), got {self.share_spread}"
            )
        check_quantized(self.name, self.quantized, self.group)

    def prepare(self, store: KVStore) -> CallPlan:
        """Measure the prefill's attention statistics too (the per-layer plan's input)."""
        return replace(super().prepare(store), profile=True)

    def layer_plan(self, store: KVStore, budgets: list[int]) -> list[LayerPlan]:
        """Each layer's Original and Quantized token counts for this eviction (module docstring,
        "Budget"), from the eviction's mean budgets `budgets` (FP tokens per layer)."""
        num_layers = store.num_layers
        u = layer_sensitivity(store.profile_means(), num_layers)
        shares = 1.0 + self.share_spread * u
        shares = shares / shares.mean()
        ratios = (self.oq_ratio + self.oq_spread * u).clamp(0.0, 1.0)
        rho = self._quantized_cost(store)
        floor = self.protect_recent + self.sinks
        plans = []
        for budget, share, ratio in zip(budgets, shares.tolist(), ratios.tolist(), strict=True):
            layer_bytes = budget * share  # in FP tokens
            tokens = math.floor(layer_bytes / (ratio + rho * (1.0 - ratio)))
            original = max(round(ratio * tokens), floor)
            quantized = max(tokens - original, 0) // self.group * self.group
            # what whole groups cannot use goes to the Original tier, less room for the
            # tokens that wait in FP until they make a group
            waiting = (self.group - 1) * (1.0 - rho) if quantized else 0.0
            original = max(math.floor(layer_bytes - rho * quantized - waiting), floor)
            plans.append(LayerPlan(original, quantized))
        return plans

    def slot_bounds(self, store: KVStore) -> tuple[int | None, int | None]:
        """The largest plan's tiers (at the no-signal budgets, the largest), the Original one
        with room for the `group - 1` tokens that wait in FP for a whole group."""
        plans = self.layer_plan(store, self.layer_budgets(None, store.num_layers))
        return (
            max(plan.original for plan in plans) + self.group - 1,
            max(plan.quantized for plan in plans),
        )

    def _quantized_cost(self, store: KVStore) -> float:
        """Bytes of a quantized token (codes and its share of the scales) over those of an
        Original one."""
        return store.int8_bytes_per_token(self.group) / store.bytes_per_token()

    def rank(self, store: KVStore, view: SlotView, candidates: torch.Tensor) -> torch.Tensor:
        """Heavy-hitter score `S = mean + gamma * variance` of the relative attention each
        token received, averaged over KV heads; `[L, R, S]`."""
        hits = store.joint("hits", rows=view.rows).clamp_min(1.0)[:, :, None]
        variance = store.joint("hit_m2", rows=view.rows) / hits
        return (store.joint("hit_mean", rows=view.rows) + self.gamma * variance).mean(dim=2)

    def evict(
        self,
        store: KVStore,
        confidence: float | None | list[float | None],
        rows: range | None = None,
    ) -> int:
        """The tri-state assignment in every layer of `rows`; returns the tokens evicted."""
        rows = range(store.batch) if rows is None else rows
        store.ensure_columns(self.statistics)
        rho = self._quantized_cost(store)
        evicted = 0
        for row, row_confidence in row_confidences(store, confidence, rows):
            budgets = self.layer_budgets(row_confidence, store.num_layers)
            evicted += self._assign(store, row, self.layer_plan(store, budgets), rho)
        return evicted

    def _assign(self, store: KVStore, row: int, plans: list[LayerPlan], rho: float) -> int:
        """Original / Quantized / Evicted for every layer of one row; returns tokens evicted.

        A layer is assigned when it holds more unpinned tokens than its plan, or a whole
        group more FP tokens than its Original slots. Over the plan, the Original tier is cut
        `evict_slack` below its size (fewer compactions, as in `Policy.evict`). Tokens due for
        the Quantized tier go in whole groups, the lowest-scored first; the others wait in FP
        while the layer's bytes allow (`original + rho * quantized` FP tokens), and the
        lowest-scored of them are evicted when they do not. The layers' choices are applied
        together: one compaction and one quantization. Sliding-window layers keep their
        window, unassigned (`agent_kv.kv.policies.base`).
        """
        pinned_live = store.pins.live()
        due_layers = []
        for idx, plan in enumerate(plans):
            if (
                store.attention_windows[idx] is not None
            ):  # its window is its policy (`Policy.evict`)
                continue
            unpinned = store.length(idx, row) - pinned_live[idx][row]
            fp_unpinned = unpinned - store.q.lengths[idx][row]  # pinned tokens are all FP
            over = unpinned > plan.original + plan.quantized
            due = plan.quantized > 0 and fp_unpinned >= plan.original + self.group
            if over or due:
                due_layers.append((idx, plan, over))
        if not due_layers:
            return 0
        span = slice(row, row + 1)
        view = SlotView.of(store, span)
        protected_all = self.protected(store, view)
        scores = self.keep_scores(store, view, view.valid & ~protected_all)
        keep = view.valid.clone()  # [L, 1, S]
        to_quantize = torch.zeros_like(keep)
        for idx, plan, over in due_layers:
            slots = view.valid[idx, 0].nonzero().squeeze(1)  # the logical order
            kept, going = self._choose(
                store.q.lengths[idx][row],
                view.pinned[idx, 0, slots],
                protected_all[idx, 0, slots],
                scores[idx, 0, slots],
                plan,
                over,
                rho,
            )
            keep[idx, 0, slots] = kept
            to_quantize[idx, 0, slots[going]] = True
        evicted = store.compact_joint(keep, slice(None), span)
        cq = store.q.capacity
        # the FP slots to quantize, renumbered as the compaction moved them
        move = torch.take_along_dim(to_quantize[..., cq:], kept_first(keep[..., cq:]), dim=-1)
        store.precision.quantize_joint(move, self.group, self.quantized, slice(None), span)
        return evicted

    def _choose(
        self,
        q_len: int,
        pinned: torch.Tensor,
        protected: torch.Tensor,
        score: torch.Tensor,
        plan: LayerPlan,
        over: bool,
        rho: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's row in logical order (`[n]` each): which tokens stay (bool) and which
        FP tokens go to the Quantized tier now (int64 logical slots)."""
        n = pinned.numel()
        is_fp = torch.arange(n, device=pinned.device) >= q_len
        # Original: the protected tokens, then the best FP candidates
        slack = min(self.evict_slack, plan.original // 2) if over else 0
        protected_unpinned = int((protected & ~pinned).sum())
        free = max(plan.original - slack - protected_unpinned, 0)
        fp_candidates = (~protected & is_fp).nonzero().squeeze(1)
        free = min(free, fp_candidates.numel())
        original = protected.clone()
        original[fp_candidates[torch.topk(score[fp_candidates], free).indices]] = True
        # Quantized: the best of the rest (FP candidates left over and quantized tokens)
        rest = (~original).nonzero().squeeze(1)
        chosen = rest[torch.topk(score[rest], min(plan.quantized, rest.numel())).indices]
        keep = original.clone()
        keep[chosen] = True
        due_fp = chosen[is_fp[chosen]]
        due_fp = due_fp[torch.argsort(score[due_fp])]  # lowest-scored first
        whole = due_fp.numel() // self.group * self.group
        going, waiting = due_fp[:whole], due_fp[whole:]
        used = protected_unpinned + free + rho * (chosen.numel() - waiting.numel())
        excess = math.ceil(used + waiting.numel() - (plan.original + rho * plan.quantized))
        keep[waiting[: max(excess, 0)]] = False
        return keep, going


@dataclass
class Arkv(TriState, FixedBudgetPolicy):
    """ARKV at a fixed byte budget (module docstring).

    Parameters: `budget_tokens` (int, default 512, `--budget`): the mean bytes each layer may
    hold, in FP tokens; the rest as `TriState`.
    """

    name = "arkv"
    order = 70
    summary = (
        "ARKV's tri-state cache: per layer, the top tokens by heavy-hitter score `S = mu + gamma "
        "* sigma^2` stay Original, the next are quantized, the rest evicted; the newest `W` "
        "always Original; each layer's Original share and budget share set from its prefill "
        "attention statistics (flatter layers keep more); the budget counts bytes, in FP tokens "
        "per layer"
    )
    paper = "ARKV, Method"


@dataclass
class BaseOrigin(Arkv):
    """ARKV's "Base Origin" baseline: Original tokens only, at ARKV's byte budget, ranked and
    shared across layers as ARKV does; nothing is quantized (`oq_ratio` is 1).

    Parameters: as `Arkv`; `oq_ratio` and `oq_spread` are fixed at 1 and 0.
    """

    name = "base-origin"
    order = 90
    summary = "ARKV with Original tokens only, at ARKV's bytes"
    paper = "ARKV's baselines"
    oq_ratio: float = 1.0
    oq_spread: float = 0.0

    def validate(self) -> None:
        super().validate()
        if self.oq_ratio != 1.0 or self.oq_spread != 0.0:
            raise ConfigError("base-origin keeps every token Original: oq_ratio is 1, oq_spread 0")
