"""Perplexity at equal KV memory (docs/methods.md, "CONF-KV claims and figures": GPT-2, 2,048
tokens).

Each policy scores the same text teacher-forced (`Engine.score`, 16 tokens per forward call,
the policy evicting after each call with the confidence of the call's last next-token
distribution), and the perplexity is `exp(-mean log p)` over every scored token of every
segment. The rows, as in the paper:

- `full`: every token, the floor;
- `window W` (W = 512): the newest W tokens and no attention sinks (`sinks=0`), the
  reference memory;
- `window W + 4 sinks`: the same bytes, 4 of its W tokens the first ones (StreamingLLM's
  attention sinks, §3.1; the window policy's default): a window that does not lose the sinks;
- `conf-kv+int8`: CONF-KV with INT8 mixed precision (the newest 128 unpinned tokens FP, older
  ones INT8), its uncertain budget `N_low` the most tokens that fit in the bytes of `window W`
  (`budgets.tokens_for_bytes`), `N_high = N_low / 2`;
- `conf-kv-l+int8`: the same with CONF-KV-L's pyramid of per-layer budgets.

Memory is the live KV bytes after each call's eviction, averaged over the calls ("mean KV"),
and the largest size at any moment ("peak": the budget plus the chunk being scored), as the
bytes the buffers held (spare capacity included) with the live bytes beside them.
The share of the gap closed is `(ppl(window) - ppl(x)) / (ppl(window) - ppl(full))`, against
each window (paper:
74% for CONF-KV-L, which also lowers perplexity by 3.89 points at 34.2 MB against the
window's 38.7 MB; CONF-KV+INT8 by 3.11 at the window's bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from agent_kv.evals.report import EvalContext, Report, Table, new_figure, save_figure
from agent_kv.kv.budgets import tokens_for_bytes
from agent_kv.kv.policies import Policy, make_policy
from agent_kv.kv.policies.conf_kv import ConfidenceGate
from agent_kv.kv.store import Int8Config, KVStore
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import LoadedModel

SCORE_CHUNK = 16
SINKS = 4
"""Attention sinks (StreamingLLM §3.1) of the window that keeps them."""


@dataclass(frozen=True)
class Sizes:
    """One size of the experiment.

    Attributes:
        lengths: tokens per segment, one table block each.
        segments: segments per length, spread evenly over the text.
        window: `W`, the window's tokens per layer (the reference memory).
        int8: the mixed-precision settings of the CONF-KV rows.
    """

    lengths: tuple[int, ...]
    segments: int
    window: int
    int8: Int8Config


FULL = Sizes(lengths=(2048, 8192), segments=2, window=512, int8=Int8Config())
QUICK = Sizes(lengths=(640,), segments=1, window=192, int8=Int8Config(fp_window=32, group=16))


@dataclass
class Scored:
    """One policy's pass over one segment.

    Attributes:
        nll: summed negative log-likelihood, nats.
        tokens: tokens scored (the segment's length minus one).
        peak_bytes: the largest live KV size, bytes.
        peak_allocated_bytes: the most bytes the KV buffers held, spare capacity included.
        mean_bytes: live KV bytes after each call's eviction, averaged over calls.
        mean_budget: the policy's per-layer budget averaged over calls (None for `full`).
    """

    nll: float
    tokens: int
    peak_bytes: int
    peak_allocated_bytes: int
    mean_bytes: float
    mean_budget: float | None


@dataclass(frozen=True)
class Variant:
    """A row: a label, its policy and its precision."""

    label: str
    policy: Policy
    int8: Int8Config | None = None


def score_segment(loaded: LoadedModel, variant: Variant, ids: list[int]) -> Scored:
    """Teacher-forced pass of `variant` over `ids` from an empty cache.

    Raises:
        ValueError: fewer than two tokens.
    """
    engine = Engine(loaded.model, loaded.tokenizer, variant.policy, int8=variant.int8)
    session = engine.new_sequence()
    log_probs = engine.score(session, ids, chunk=SCORE_CHUNK)
    budgets = [s.budget for s in session.steps if s.budget is not None]
    return Scored(
        nll=-float(log_probs.sum()),
        tokens=log_probs.numel(),
        peak_bytes=session.store.figures.peak_bytes,
        peak_allocated_bytes=session.store.figures.peak_allocated_bytes,
        mean_bytes=sum(s.kv_live_bytes for s in session.steps) / len(session.steps),
        mean_budget=sum(budgets) / len(budgets) if budgets else None,
    )


@dataclass
class Totals:
    """A variant's passes over every segment of one length, summed."""

    nll: float = 0.0
    tokens: int = 0
    peak_bytes: int = 0
    peak_allocated_bytes: int = 0
    mean_bytes: float = 0.0
    mean_budget: float | None = None
    passes: int = 0

    def add(self, scored: Scored) -> None:
        self.nll += scored.nll
        self.tokens += scored.tokens
        self.peak_bytes = max(self.peak_bytes, scored.peak_bytes)
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, scored.peak_allocated_bytes)
        self.passes += 1
        self.mean_bytes += (scored.mean_bytes - self.mean_bytes) / self.passes
        if scored.mean_budget is not None:
            previous = self.mean_budget or 0.0
            self.mean_budget = previous + (scored.mean_budget - previous) / self.passes

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def peak_mb(self) -> str:
        """The peak KV in MB: allocated, live in parentheses."""
        return f"{self.peak_allocated_bytes / 1e6:.1f} ({self.peak_bytes / 1e6:.1f})"

    def as_dict(self) -> dict:
        return {
            "perplexity": self.perplexity,
            "nll": self.nll,
            "tokens": self.tokens,
            "peak_bytes": self.peak_bytes,
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "mean_bytes": self.mean_bytes,
            "mean_budget": self.mean_budget,
        }


def segments(text_ids: list[int], length: int, count: int) -> list[list[int]]:
    """`count` segments of `length` tokens, starting at evenly spread offsets of the text.

    Raises:
        ValueError: the text is shorter than `length`.
    """
    if len(text_ids) < length:
        raise ValueError(f"the text has {len(text_ids)} tokens, fewer than {length}")
    room = len(text_ids) - length
    starts = [room * i // max(count - 1, 1) for i in range(count)] if count > 1 else [0]
    return [text_ids[start : start + length] for start in starts]


def int8_budget(model, window: int, int8: Int8Config) -> int:
    """Tokens per layer that fit, with `int8` mixed precision, in the bytes `window`
    full-precision tokens take (the FP window plus a waiting group at full precision)."""
    shape = KVStore.for_model(model)
    return tokens_for_bytes(
        window * shape.bytes_per_token(),
        shape.bytes_per_token(),
        shape.int8_bytes_per_token(int8.group),
        fp_tokens=int8.max_fp_tokens,
    )


def score_variants(
    ctx: EvalContext, variants: list[Variant], pieces: list[list[int]], length: int
) -> dict[str, Totals]:
    """Every variant over every segment; variants take turns on each segment."""
    totals = {v.label: Totals() for v in variants}
    for index, ids in enumerate(pieces):
        for variant in variants:
            scored = score_segment(ctx.loaded, variant, ids)
            totals[variant.label].add(scored)
            ctx.log(
                f"{length} tokens, segment {index + 1}/{len(pieces)}, {variant.label}: "
                f"ppl {math.exp(scored.nll / scored.tokens):.3f}, "
                f"mean KV {scored.mean_bytes / 1e6:.1f} MB"
            )
    return totals


def variants(loaded: LoadedModel, sizes: Sizes) -> list[Variant]:
    """The paper's four rows at `sizes.window`'s bytes, and the window with sinks."""
    budget = int8_budget(loaded.model, sizes.window, sizes.int8)
    return [
        Variant("full", make_policy("full")),
        Variant(f"window {sizes.window}", make_policy("window", budget=sizes.window, sinks=0)),
        Variant(
            f"window {sizes.window} + {SINKS} sinks",
            make_policy("window", budget=sizes.window, sinks=SINKS),
        ),
        Variant("conf-kv+int8", make_policy("conf-kv", budget=budget), sizes.int8),
        Variant("conf-kv-l+int8", make_policy("conf-kv-l", budget=budget), sizes.int8),
    ]


PAPER = {
    "conf-kv+int8": "-3.11 PPL vs window at its bytes (38.7 MB)",
    "conf-kv-l+int8": "-3.89 PPL, 74% of the gap, at 34.2 MB",
}


def run(ctx: EvalContext) -> Report:
    """Score every variant at every length; table, plot and raw numbers."""
    sizes = QUICK if ctx.quick else FULL
    rows = variants(ctx.loaded, sizes)
    budget = rows[3].policy.budget(None)
    windows = rows[1:3]
    table = Table(
        "Perplexity at equal KV memory",
        [
            "tokens",
            "policy",
            "budget (tokens/layer)",
            "perplexity",
            "vs window",
            "gap closed",
            "gap closed (window + sinks)",
            "mean KV MB",
            "peak KV MB allocated (live)",
            "mean KV vs window",
            "paper",
        ],
    )
    data: dict = {
        "sizes": {
            "lengths": sizes.lengths,
            "segments": sizes.segments,
            "window": sizes.window,
            "n_low": budget,
            "fp_window": sizes.int8.fp_window,
            "group": sizes.int8.group,
        },
        "lengths": {},
    }
    fig, axes = new_figure(ncols=len(sizes.lengths), width=5.5 * len(sizes.lengths))
    for ax, length in zip(axes, sizes.lengths, strict=True):
        pieces = segments(ctx.text_ids, length, sizes.segments)
        totals = score_variants(ctx, rows, pieces, length)
        full, window = totals["full"], totals[rows[1].label]
        for variant in rows:
            t = totals[variant.label]
            closed = [
                "-"
                if variant in (rows[0], reference)
                else f"{gap_closed(t, totals[reference.label], full):.0%}"
                for reference in windows
            ]
            table.add(
                length,
                variant.label,
                "-" if t.mean_budget is None else budget_cell(variant.policy),
                f"{t.perplexity:.3f}",
                f"{t.perplexity - window.perplexity:+.3f}",
                *closed,
                f"{t.mean_bytes / 1e6:.1f}",
                t.peak_mb,
                f"{t.mean_bytes / window.mean_bytes:.2f}x",
                PAPER.get(variant.label, "-"),
            )
            ax.scatter(t.mean_bytes / 1e6, t.perplexity, s=40)
            ax.annotate(
                variant.label,
                (t.mean_bytes / 1e6, t.perplexity),
                fontsize=8,
                xytext=(4, 4),
                textcoords="offset points",
            )
        data["lengths"][str(length)] = {label: t.as_dict() for label, t in totals.items()}
        ax.set_title(f"{length} tokens, {len(pieces)} segment(s)")
        ax.set_xlabel("mean KV memory (MB)")
        ax.set_ylabel("perplexity")
        ax.grid(alpha=0.3)
    figure = save_figure(fig, ctx.out / "perplexity_vs_memory.png")
    return Report(
        experiment="perplexity",
        title="Perplexity at equal KV memory",
        setup=(
            f"Model {ctx.loaded.name}; text: the Debian licence texts (or `--text`), "
            f"{sizes.segments} segment(s) per length at evenly spread offsets, scored "
            f"teacher-forced {SCORE_CHUNK} tokens per forward call. `window {sizes.window}` "
            f"is the reference memory; the CONF-KV rows keep the newest {sizes.int8.fp_window} "
            f"unpinned tokens FP and the older ones INT8 (groups of {sizes.int8.group}), with "
            f"N_low = {budget} tokens per layer (the most that fit in the window's bytes) and "
            f"N_high = {budget // 2}. Gap closed = (ppl(window) - ppl) / (ppl(window) - "
            f"ppl(full)), against the plain window and against the window keeping {SINKS} "
            "attention sinks."
        ),
        tables=[table],
        figures=[figure],
        notes=[
            "The paper measures GPT-2 on 2,048 generated tokens; this is SmolLM2-135M "
            "teacher-forced on packaged text, so absolute perplexities are not comparable; "
            "the gap closed and the memory ratios are.",
            "Mean KV is after each call's eviction; the peak adds the 16-token chunk being "
            "scored and the eviction slack.",
        ],
        data=data,
    )


def gap_closed(scored: Totals, window: Totals, full: Totals) -> float:
    """`(ppl(window) - ppl(scored)) / (ppl(window) - ppl(full))`: 1 is full KV's perplexity,
    0 the window's; NaN when the window is no worse than full."""
    gap = window.perplexity - full.perplexity
    return (window.perplexity - scored.perplexity) / gap if gap > 0 else float("nan")


def budget_cell(policy: Policy) -> str:
    """`N_high/N_low` for the confidence-gated policies, the single budget otherwise."""
    if isinstance(policy, ConfidenceGate):
        return f"{policy.n_high}/{policy.n_low}"
    return str(policy.budget(None))
