"""Ablations of CONF-KV (docs/methods.md, "CONF-KV claims and figures": random eviction 36.54
vs CONF-KV 30.92 PPL).

Every row scores the same segments teacher-forced, as `agent_kv.evals.perplexity` does, and
starts from the reference: CONF-KV with INT8 mixed precision, `N_low` the tokens that fit in
the bytes of `window W`, `N_high = N_low / 2`, `tau` 0.6. Each ablation changes one thing:

- *ranking*: `random` eviction keeping, every step, CONF-KV's mean budget over the run (the
  same ratio of tokens kept), with the same INT8 storage and the same `protect_recent`, so the
  only difference is which older tokens stay;
- *gate off*: a fixed budget, `tau = 0` (every step confident: always `N_high`) and `tau = 1`
  (never confident: always `N_low`);
- *window with attention sinks*: the reference memory's window keeping its first 4 tokens
  (StreamingLLM), so the perplexity gap is also measured against a window that does not lose
  the sinks;
- *mixed precision off*: every token in the model's dtype, at the same token budgets (more
  bytes) and at the bytes of the window (budget `W`).
"""

from __future__ import annotations

from agent_kv.evals.perplexity import (
    FULL,
    QUICK,
    SINKS,
    Variant,
    budget_cell,
    int8_budget,
    score_variants,
    segments,
)
from agent_kv.evals.report import EvalContext, Report, Table, new_figure, save_figure
from agent_kv.kv.policies import make_policy

PAPER = {"conf-kv+int8 (reference)": "30.92 PPL", "random+int8, same ratio": "36.54 PPL"}


def run(ctx: EvalContext) -> Report:
    """Score the reference and its ablations on the shorter length's segments."""
    sizes = QUICK if ctx.quick else FULL
    length = min(sizes.lengths)
    budget = int8_budget(ctx.loaded.model, sizes.window, sizes.int8)
    reference = Variant(
        "conf-kv+int8 (reference)", make_policy("conf-kv", budget=budget), sizes.int8
    )
    pieces = segments(ctx.text_ids, length, sizes.segments)
    first = score_variants(ctx, [Variant("full", make_policy("full")), reference], pieces, length)
    mean_budget = round(first[reference.label].mean_budget)
    protect = reference.policy.protect_recent
    rows = [
        Variant(
            f"window {sizes.window} + {SINKS} sinks",
            make_policy("window", budget=sizes.window, sinks=SINKS),
        ),
        Variant(
            "random+int8, same ratio",
            make_policy("random", budget=mean_budget, protect_recent=protect),
            sizes.int8,
        ),
        Variant(
            "gate off: always N_high", make_policy("conf-kv", budget=budget, tau=0.0), sizes.int8
        ),
        Variant(
            "gate off: always N_low", make_policy("conf-kv", budget=budget, tau=1.0), sizes.int8
        ),
        Variant("int8 off, same tokens", make_policy("conf-kv", budget=budget)),
        Variant("int8 off, same bytes", make_policy("conf-kv", budget=sizes.window)),
    ]
    totals = {**first, **score_variants(ctx, rows, pieces, length)}
    ref = totals[reference.label]
    policies = {v.label: v.policy for v in [reference, *rows]}
    table = Table(
        f"CONF-KV ablations, {length} tokens",
        [
            "variant",
            "budget (tokens/layer)",
            "perplexity",
            "vs reference",
            "mean KV MB",
            "peak KV MB allocated (live)",
            "mean budget",
            "paper",
        ],
    )
    for label, t in totals.items():
        table.add(
            label,
            "-" if t.mean_budget is None else budget_cell(policies[label]),
            f"{t.perplexity:.3f}",
            f"{t.perplexity - ref.perplexity:+.3f}",
            f"{t.mean_bytes / 1e6:.1f}",
            t.peak_mb,
            "-" if t.mean_budget is None else f"{t.mean_budget:.0f}",
            PAPER.get(label, "-"),
        )
    fig, (ax,) = new_figure(width=7.5, height=4.0)
    labels = list(totals)
    ax.barh(labels, [totals[label].perplexity for label in labels], color="tab:blue")
    for i, label in enumerate(labels):
        t = totals[label]
        ax.annotate(
            f"{t.perplexity:.2f} ({t.mean_bytes / 1e6:.1f} MB)",
            (t.perplexity, i),
            xytext=(3, -3),
            textcoords="offset points",
            fontsize=8,
        )
    ax.invert_yaxis()
    ax.set_xlabel(f"perplexity over {length}-token segments")
    ax.set_xlim(0, max(t.perplexity for t in totals.values()) * 1.3)
    figure = save_figure(fig, ctx.out / "ablations.png")
    return Report(
        experiment="ablations",
        title="CONF-KV ablations",
        setup=(
            f"Model {ctx.loaded.name}; {len(pieces)} segment(s) of {length} tokens of the text, "
            f"scored as in the perplexity experiment. Reference: conf-kv, N_low = {budget}, "
            f"N_high = {budget // 2} tokens per layer (the bytes of window {sizes.window} with "
            f"INT8 after the newest {sizes.int8.fp_window}), tau 0.6. Random eviction keeps "
            f"the reference's mean budget, {mean_budget} tokens per layer, and the same "
            f"protect_recent ({protect})."
        ),
        tables=[table],
        figures=[figure],
        notes=[
            "The paper's figures are GPT-2 perplexities; compare the direction and the size of "
            "each change against the reference, not the absolute values.",
        ],
        data={
            "length": length,
            "segments": len(pieces),
            "n_low": budget,
            "random_budget": mean_budget,
            "variants": {label: t.as_dict() for label, t in totals.items()},
        },
    )
