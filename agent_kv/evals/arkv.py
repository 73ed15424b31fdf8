"""ARKV on long-context key-value retrieval (docs/methods.md, "ARKV claims and figures": 4x
lower KV memory with 97.2% of the baseline's accuracy on LongBench; ~14.4% of tokens
quantized; ~86% of its tokens/s).

The QA set is built offline from the packaged text: a context of `context` tokens of the text
carries `facts` sentences " The code of the <colour> <thing> is <4 digits>. " at evenly spread
depths ((i + 0.5) / facts). After the whole context the questions are asked one after another
in the same session, as an agent asks about what it saw turns ago, as the cloze
"\\nThe code of the <colour> <thing> is" (SmolLM2-135M answers that form with full KV; a
"Question: ... Answer:" form confuses it even then), greedy, 6 tokens; an answer is right when
its first run of digits is the code. Every context has its own slice of text, facts and codes
(seeded), the same for every policy, and the policies take turns on each context.

Per policy and budget: accuracy and the share of full KV's kept; the KV bytes held (mean over
the moments right after each answer) and the peak, each as a reduction vs `full`; the share of
live tokens held quantized (same moments, all layers); decode tokens/s and its ratio to
`full`'s. `budget` is in full-precision tokens per layer: ARKV and `base-origin` hold at most
those bytes, `window` those tokens (the newest, without attention sinks: `POLICY_PARAMS`),
`conf-kv+arkv` those bytes when uncertain and half when confident; `full` and `base-quant`
(every token FP8) take none. A `+recall` row is its policy with a cold tier: what it evicts
moves to host memory, and each question brings back the pages its queries attend; the cold
tier's bytes are reported apart from the hot ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from agent_kv.evals.answers import is_right
from agent_kv.evals.report import EvalContext, Report, Table, new_figure, save_figure
from agent_kv.kv.policies import POLICIES, make_policy
from agent_kv.kv.policy_names import base_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey"]
THINGS = ["door", "box", "car", "lamp", "chair", "boat", "clock", "bag", "gate", "cup"]
BUDGETED = [
    "window", "arkv", "base-origin", "conf-kv+arkv", "kvzip", "window+recall", "arkv+recall",
]  # fmt: skip
"""`+recall`: the same policy at the same hot budget, its evictions kept in a cold tier and
recalled by each question's queries (`agent_kv.kv.policies.cold_recall`)."""
POLICY_PARAMS = {"window": {"sinks": 0}}
"""Parameters besides the budget: the window row is the plain sliding window, no sinks."""
ANSWER_TOKENS = 6
PREFILL_CHUNK = 128
PAPER = {
    "arkv": "4x less memory at 97.2% of full accuracy; 14.4% quantized; 86% of tokens/s",
    "base-quant": "uniform quantization: 39.8% of full accuracy (LongBench)",
}


@dataclass(frozen=True)
class Sizes:
    """One size: tokens per context, facts per context, contexts, and the budgets (FP tokens
    per layer; the first is a quarter of the context, ARKV's 4x)."""

    context: int
    facts: int
    contexts: int
    budgets: tuple[int, ...]


FULL = Sizes(context=1000, facts=4, contexts=6, budgets=(250, 500))
QUICK = Sizes(context=512, facts=2, contexts=1, budgets=(256,))


def build_context(
    text_ids: list[int], tokenizer, size: int, facts: int, seed: int
) -> tuple[list[int], list[tuple[str, str]]]:
    """A context of `size` tokens with `facts` facts at evenly spread depths.

    Returns:
        `(context token ids, [(name, code)])`.

    Raises:
        ValueError: the text is too short for the context.
    """
    rng = random.Random(seed)
    names = rng.sample([f"{c} {t}" for c in COLOURS for t in THINGS], facts)
    codes = [str(rng.randint(1000, 9999)) for _ in names]
    sentences = [
        tokenizer(f" The code of the {n} is {c}. ", add_special_tokens=False)["input_ids"]
        for n, c in zip(names, codes, strict=True)
    ]
    filler = size - sum(len(s) for s in sentences)
    if filler < facts or len(text_ids) <= filler:
        raise ValueError(f"the text is too short for a {size}-token context")
    start = rng.randrange(0, len(text_ids) - filler)
    piece = text_ids[start : start + filler]
    ids, cut = [], 0
    for i, sentence in enumerate(sentences):
        nxt = int((i + 0.5) / facts * len(piece))
        ids += piece[cut:nxt] + sentence
        cut = nxt
    return ids + piece[cut:], list(zip(names, codes, strict=True))


@dataclass
class Tally:
    """One policy's answers and measurements, summed over contexts."""

    right: int = 0
    asked: int = 0
    peak: int = 0
    """The most bytes the KV buffers held (spare capacity included)."""
    peak_live: int = 0
    """The most live KV bytes."""
    peak_cold: int = 0
    """The most bytes of the cold tier (0 without one)."""
    held: list[int] = field(default_factory=list)
    shares: list[float] = field(default_factory=list)
    decoded: int = 0
    decode_s: float = 0.0
    answers: list[dict] = field(default_factory=list)

    @property
    def accuracy(self) -> float:
        return self.right / self.asked

    @property
    def mean_held(self) -> float:
        return sum(self.held) / len(self.held)

    @property
    def tokens_per_s(self) -> float:
        return self.decoded / self.decode_s if self.decode_s > 0 else float("nan")


def ask_all(engine: Engine, context: list[int], facts, tally: Tally) -> None:
    """Prefill `context`, then ask every fact's question in turn, adding to `tally`."""
    session = engine.new_sequence()
    engine.prefill(session, context)
    params = SamplingParams(max_new_tokens=ANSWER_TOKENS)
    for name, code in facts:
        ids = engine.tokenizer(f"\nThe code of the {name} is", add_special_tokens=False)
        reply = engine.generate(session, ids["input_ids"], params)
        right = is_right(reply.text, code)
        tally.right += right
        tally.asked += 1
        tally.decoded += len(reply.token_ids)
        tally.decode_s += reply.decode_s
        store = session.store
        tally.shares.append(sum(store.quantized_lengths()) / max(sum(store.lengths()), 1))
        tally.held.append(store.nbytes())
        tally.answers.append({"name": name, "code": code, "reply": reply.text, "right": right})
    tally.peak = max(tally.peak, session.store.figures.peak_allocated_bytes)
    tally.peak_live = max(tally.peak_live, session.store.figures.peak_bytes)
    tally.peak_cold = max(tally.peak_cold, session.store.recall.peak_bytes)


def labels(sizes: Sizes) -> dict[str, tuple[str, int | None]]:
    """Row label -> (policy, budget), the policies that evict nothing first. An unbudgeted
    policy that evicts (`pins-only`, the floor of pinned runs) is left out: this context has no
    pinned span, so it would hold its newest 64 tokens only."""
    rows = {
        name: (name, None)
        for name, cls in POLICIES.items()
        if not cls.takes_budget and not cls.evicts
    }
    for budget in sizes.budgets:
        rows |= {f"{name} {budget}": (name, budget) for name in BUDGETED}
    return rows


def run(ctx: EvalContext) -> Report:
    """Every policy at every budget on every context; one table per budget and a plot."""
    sizes = QUICK if ctx.quick else FULL
    loaded = ctx.loaded
    rows = labels(sizes)
    if ctx.policies:
        rows = {k: v for k, v in rows.items() if v[0] == "full" or v[0] in ctx.policies}
        for name in ctx.policies:
            budgets = [None] if not POLICIES[base_policy(name)].takes_budget else sizes.budgets
            rows |= {f"{name} {b}" if b else name: (name, b) for b in budgets}
    engines = {
        label: Engine(
            loaded.model,
            loaded.tokenizer,
            make_policy(
                name,
                budget=budget if POLICIES[base_policy(name)].takes_budget else None,
                **POLICY_PARAMS.get(base_policy(name), {}),
            ),
            prefill_chunk=PREFILL_CHUNK,
        )
        for label, (name, budget) in rows.items()
    }
    tallies = {label: Tally() for label in rows}
    for c in range(sizes.contexts):
        context, facts = build_context(
            ctx.text_ids, loaded.tokenizer, sizes.context, sizes.facts, seed=c
        )
        for label, engine in engines.items():
            before = tallies[label].right
            ask_all(engine, context, facts, tallies[label])
            ctx.log(
                f"context {c + 1}/{sizes.contexts} {label}: "
                f"{tallies[label].right - before}/{len(facts)} right"
            )
    full = tallies["full"]
    tables = []
    fig, (ax,) = new_figure()
    for budget in sizes.budgets:
        table = Table(
            f"{sizes.context}-token contexts, budget {budget} FP tokens per layer "
            f"({sizes.context / budget:.0f}x fewer than the context)",
            [
                "policy",
                "accuracy",
                "retained vs full",
                "KV held MB",
                "vs full",
                "peak KV MB allocated (live)",
                "vs full",
                "cold tier peak MB",
                "quantized share",
                "decode tok/s",
                "vs full",
                "paper",
            ],
        )
        for label, (name, row_budget) in rows.items():
            if row_budget not in (None, budget):
                continue
            t = tallies[label]
            retained = t.accuracy / full.accuracy if full.accuracy else float("nan")
            table.add(
                label,
                f"{t.accuracy:.1%}",
                f"{retained:.1%}",
                f"{t.mean_held / 1e6:.1f}",
                f"{full.mean_held / t.mean_held:.2f}x",
                f"{t.peak / 1e6:.1f} ({t.peak_live / 1e6:.1f})",
                f"{full.peak / t.peak:.2f}x",
                f"{t.peak_cold / 1e6:.1f}" if t.peak_cold else "-",
                f"{sum(t.shares) / len(t.shares):.1%}",
                f"{t.tokens_per_s:.1f}",
                f"{t.tokens_per_s / full.tokens_per_s:.2f}x",
                PAPER.get(name, "-") if row_budget in (None, sizes.budgets[0]) else "-",
            )
        tables.append(table)
    for label, t in tallies.items():
        x, y = full.mean_held / t.mean_held, t.accuracy * 100
        ax.scatter([x], [y], s=36, label=f"{label}: {x:.2f}x, {y:.0f}%")
    ax.axhline(full.accuracy * 100 * 0.972, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("KV memory reduction vs full (held after each answer)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_ylim(-5, 105)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3)
    figure = save_figure(fig, ctx.out / "accuracy_vs_memory.png")
    asked = sizes.contexts * sizes.facts
    return Report(
        experiment="arkv",
        title="ARKV: long-context key-value retrieval against KV memory",
        setup=(
            f"Model {loaded.name}; {sizes.contexts} context(s) of {sizes.context} tokens of "
            f"the text, each with {sizes.facts} facts 'The code of the <colour> <thing> is "
            f"<4 digits>.' at depths (i + 0.5)/{sizes.facts}, asked after the whole context "
            f"as a cloze, greedy, {ANSWER_TOKENS} tokens: {asked} questions per policy (one "
            f"question is {1 / asked:.1%} of accuracy). Prefill in chunks of {PREFILL_CHUNK}; "
            "KV held is the mean live size right after each answer; the peak (the bytes "
            "the buffers held, live bytes in parentheses) includes one prefill chunk on top "
            "of the budget. The dashed line is 97.2% of full KV's "
            "accuracy (the paper's retained share)."
        ),
        tables=tables,
        figures=[figure],
        notes=[
            "The paper evaluates LLaMA3 and Qwen3 (3-8B) on LongBench; this is SmolLM2-135M on "
            "a synthetic retrieval set, where the questions come only after the whole context: "
            "eviction that does not know the question loses the facts it drops.",
            "Quantized tokens are FP8 (float8_e4m3fn) with per-channel scales per group of 8.",
        ],
        data={
            "sizes": {
                "context": sizes.context,
                "facts": sizes.facts,
                "contexts": sizes.contexts,
                "budgets": list(sizes.budgets),
            },
            "policies": {
                label: {
                    "policy": rows[label][0],
                    "budget": rows[label][1],
                    "accuracy": t.accuracy,
                    "right": t.right,
                    "asked": t.asked,
                    "mean_held_bytes": t.mean_held,
                    "peak_bytes": t.peak,
                    "peak_live_bytes": t.peak_live,
                    "peak_cold_bytes": t.peak_cold,
                    "quantized_share": sum(t.shares) / len(t.shares),
                    "decode_tokens_per_s": t.tokens_per_s,
                    "answers": t.answers,
                }
                for label, t in tallies.items()
            },
        },
    )
