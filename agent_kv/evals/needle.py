"""Needle in a haystack: pass-key retrieval per policy at equal budget, over lengths and depths.

The claim (docs/methods.md, "CONF-KV claims and figures"): up to 32K tokens, CONF-KV
retrieves 91.4% of the needles, a sliding window 53.8% and H2O 80.6%.

A trial: a context of `length` tokens (all sizes in tokens of the loaded model) is a slice of
the long text (`ctx.text_ids`) with the needle

    "\\nThe pass key is 58213. Remember it. 58213 is the pass key.\\n"

(a seeded 5-digit key) inserted at `depth` (0 = first tokens, 1 = last, snapped to the
nearest line break of the text), followed by the cloze question "\\nWhat is the pass key? The
pass key is"; context and question are one prompt, prefilled in chunks, and the reply is
decoded greedily for `ANSWER_TOKENS` tokens. The answer is right when its first run of digits
is the key exactly. Probes of SmolLM2-135M-Instruct with full KV (depths 0-100%, 2-4 keys per
length): right 12/12 at 512 and 1K tokens, 6/6 at 2K and 4K; at 8K everywhere but at depth 0
(6/8). A bare "The secret number is N." (same 8K misses) and "The code of the red door is N."
(5/6 at 2K) did no better, nor did a header announcing the pass key.

Lengths up to the model's context run at original positions (the longest leaves `RESERVE`
tokens for question and answer); longer ones with rerotate positions (StreamingLLM), where
full KV cannot run (n/a). Policies other than `full` share one `--budget` (unpinned tokens per
layer, `make_policy(name, budget=B)`; the window with 4 attention sinks). Each (length,
seed) draws one haystack slice and key, the same for every depth and policy, and the policies
run in turn on each context, so machine noise falls on all of them alike.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

from agent_kv.evals.answers import is_right
from agent_kv.evals.report import EvalContext, Report, Table, new_figure, save_figure
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_names import base_policy, split_recall
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

POLICIES = [
    "full", "window", "h2o", "conf-kv", "kvzip",
    "window+recall", "h2o+recall", "conf-kv+recall",
]  # fmt: skip
"""The default policies (`agent-kv eval needle --policies` picks others): each with and without
its cold tier and recall (`+recall`, at the same hot budget:
`agent_kv.kv.policies.cold_recall`), and KVzip's query-agnostic reconstruction score, side
by side on the same contexts."""
# StreamingLLM's window keeps 4 attention sinks (within its budget). Without them SmolLM2 loses
# the thread even with the needle inside the window: at depth 100% the window without sinks
# answered 1 of 4 probes (512 and 2K tokens), with 4 sinks 4 of 4.
POLICY_PARAMS = {"window": {"sinks": 4}}
PAPER = {"conf-kv": "91.4%", "window": "53.8%", "h2o": "80.6%"}  # accuracy up to 32K
NEEDLE = "\nThe pass key is {key}. Remember it. {key} is the pass key.\n"
QUESTION = "\nWhat is the pass key? The pass key is"
KEY_DIGITS = 5
ANSWER_TOKENS = 8
RESERVE = 32  # tokens left under the model's context for the question and the answer
TRIALS = "trials.jsonl"
"""Each trial as a JSON line under the run's directory, written as it ends (a run stopped
midway keeps what it measured; `results.json` comes with the report at the end)."""


@dataclass(frozen=True)
class Size:
    """One run's grid.

    Attributes:
        lengths: context lengths in tokens at original positions (capped at the model's
            context minus `RESERVE`).
        rerotate_lengths: context lengths in tokens run with rerotate positions.
        depths: needle depths, fractions of the context.
        seeds: trials per (policy, length, depth) cell; each seed draws one haystack slice
            and key per length, shared by every depth and policy.
        budget: unpinned tokens per layer for every policy but `full`.
        prefill_chunk: tokens per prefill forward call (a policy evicts after each).
    """

    lengths: tuple[int, ...]
    rerotate_lengths: tuple[int, ...]
    depths: tuple[float, ...]
    seeds: int
    budget: int
    prefill_chunk: int


# B = 1024 is an eighth of the model's 8K context: 1K contexts lose only their first few dozen
# tokens (when the question arrives), longer ones keep 1/2 to 1/16 of theirs. Two trials per
# cell: ~75 min on one busy CPU core (an 8K full-KV trial ~60 s, a 16K rerotate one ~63 s per
# policy, ~3.7 ms per token evicting), so about 40-50 min on two; one seed halves it. The
# quick size: ~45 s on one core.
FULL = Size((1024, 2048, 4096, 8192), (16384,), (0.0, 0.25, 0.5, 0.75, 1.0), 1, 1024, 512)
QUICK = Size((512,), (512,), (0.0, 0.5, 1.0), 1, 256, 128)


def line_breaks(ids: list[int], tokenizer) -> list[int]:
    """Positions in `ids` that start a line (0, every index after a token holding a newline,
    and `len(ids)`): where a needle can go without splitting a word."""
    newline = {t for t in set(ids) if "\n" in tokenizer.decode([t])}
    return sorted({0, len(ids), *(i + 1 for i, t in enumerate(ids) if t in newline)})


def insert_needle(haystack: list[int], needle: list[int], depth: float, breaks: list[int]):
    """`(context, at)`: `needle` inserted into `haystack` at the line start in `breaks`
    nearest to `depth * len(haystack)` tokens; `at` is the needle's first index."""
    target = depth * len(haystack)
    at = min(breaks, key=lambda b: (abs(b - target), b))
    return haystack[:at] + needle + haystack[at:], at


def _label(length: int, rerotate: bool) -> str:
    size = f"{length // 1024}K" if length % 1024 == 0 else str(length)
    return f"{size} rerotate" if rerotate else size


def run(ctx: EvalContext) -> Report:
    """Every (length, seed, depth) context under every policy in turn; the report's `data`
    holds each trial and each policy x length x depth cell.

    Raises:
        ValueError: the text is shorter than the longest context.
    """
    size = QUICK if ctx.quick else FULL
    policies = ctx.policies or POLICIES
    model, tokenizer = ctx.loaded.model, ctx.loaded.tokenizer
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if ctx.lengths is not None:
        rows = [(n, bool(limit) and n > limit) for n in ctx.lengths]
    else:
        rows = [(n, False) for n in size.lengths] + [(n, True) for n in size.rerotate_lengths]
    engines = {
        (name, rerotate): Engine(
            model,
            tokenizer,
            make_policy(
                name,
                budget=None if name == "full" else size.budget,
                recall=ctx.recall if split_recall(name)[1] else None,
                **POLICY_PARAMS.get(base_policy(name), {}),
            ),
            prefill_chunk=size.prefill_chunk,
            rerotate=rerotate,
        )
        for name in policies
        for rerotate in sorted({r for _, r in rows})
        if not (name == "full" and rerotate)
    }
    question = tokenizer(QUESTION, add_special_tokens=False)["input_ids"]
    params = SamplingParams(max_new_tokens=ANSWER_TOKENS)
    sizes = {n: n if rerotate or not limit else min(n, limit - RESERVE) for n, rerotate in rows}
    longest = max(sizes.values())
    if longest > len(ctx.text_ids):  # before any trial, not after hours of them
        raise ValueError(
            f"the text is too short for a {longest}-token context ({len(ctx.text_ids)} tokens): "
            "give a longer one (--text)"
        )
    trials = []
    written = ctx.out / TRIALS
    written.unlink(missing_ok=True)
    for length, rerotate in rows:
        label = _label(length, rerotate)
        tokens = sizes[length]
        for seed in range(size.seeds):
            rng = random.Random(f"needle/{length}/{seed}")
            key = str(rng.randrange(10 ** (KEY_DIGITS - 1), 10**KEY_DIGITS))
            needle = tokenizer(NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
            filler = tokens - len(needle)
            start = rng.randrange(len(ctx.text_ids) - filler + 1)
            haystack = ctx.text_ids[start : start + filler]
            breaks = line_breaks(haystack, tokenizer)
            for depth in size.depths:
                context, at = insert_needle(haystack, needle, depth, breaks)
                for name in policies:
                    if name == "full" and rerotate:
                        continue
                    engine = engines[(name, rerotate)]
                    session = engine.new_sequence()
                    reply = engine.generate(session, context + question, params)
                    right = is_right(reply.text, key)
                    trials.append(
                        {
                            "policy": name,
                            "length": label,
                            "tokens": len(context),
                            "rerotate": rerotate,
                            "depth": depth,
                            "needle_at": at,
                            "seed": seed,
                            "key": key,
                            "answer": reply.text,
                            "right": right,
                            "peak_kv_allocated_bytes": session.store.figures.peak_allocated_bytes,
                            "peak_kv_live_bytes": session.store.figures.peak_bytes,
                            "peak_cold_kv_bytes": session.store.recall.peak_bytes,
                            "recall_s": round(_recall_s(session.store), 3),
                            "prefill_s": round(reply.ttft_s, 2),
                        }
                    )
                    with written.open("a") as out:  # kept if the run stops midway
                        out.write(json.dumps(trials[-1]) + "\n")
                    ctx.log(
                        f"needle {label} seed {seed} depth {depth:.0%} {name}: "
                        f"{reply.text!r} {'right' if right else 'wrong'} ({reply.ttft_s:.1f} s)"
                    )
    labels = [_label(n, r) for n, r in rows]
    return _report(ctx, size, labels, trials, policies)


def _recall_s(store) -> float:
    """Seconds the store spent recalling cold pages (0 without a cold tier)."""
    return 0.0 if store.recall.tier is None else store.recall.tier.recall_s


def _accuracy(trials: list[dict]) -> float | None:
    return sum(t["right"] for t in trials) / len(trials) if trials else None


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _peak_mb(trials: list[dict]) -> str:
    """The trials' largest peak hot KV in MB: allocated, live in parentheses, and the cold
    tier's peak after a `+` when there is one."""
    if not trials:
        return "n/a"
    allocated = max(t["peak_kv_allocated_bytes"] for t in trials)
    live = max(t["peak_kv_live_bytes"] for t in trials)
    cold = max(t["peak_cold_kv_bytes"] for t in trials)
    text = f"{allocated / 1e6:.1f} ({live / 1e6:.1f})"
    return text + (f" + {cold / 1e6:.1f} cold" if cold else "")


def _recall_share(trials: list[dict]) -> str:
    """Recall's seconds over the prefill's, summed over the trials (a turn's prefill includes
    its recalls)."""
    prefill = sum(t["prefill_s"] for t in trials)
    if not trials or not prefill or not any(t["recall_s"] for t in trials):
        return "-"
    return f"{sum(t['recall_s'] for t in trials) / prefill:.1%}"


def _recall_settings(ctx: EvalContext) -> str:
    """The `+recall` policies' cold-tier settings as text: the defaults, or those changed."""
    if ctx.recall is None:
        return "default"
    default = ColdConfig()
    changed = {k: v for k, v in vars(ctx.recall).items() if getattr(default, k) != v}
    return ", ".join(f"{k}={v}" for k, v in changed.items()) or "default"


def _report(
    ctx: EvalContext, size: Size, labels: list[str], trials: list[dict], policies: list[str]
) -> Report:
    """The run's report: the accuracy, peak-KV and recall-cost tables, the heatmap, the setup
    and notes, and in `data` every trial and policy x length x depth cell."""
    cells = _cells(size, labels, trials, policies)
    tables, overall = _tables(size, labels, trials, policies)
    figure = _heatmap(ctx, size, labels, cells, policies)
    return Report(
        experiment="needle",
        title="Needle in a haystack: pass-key retrieval at equal KV budget",
        setup=_setup(ctx, size, labels),
        tables=tables,
        figures=[figure],
        notes=_notes(ctx, size, labels),
        data={
            "budget": size.budget,
            "lengths": labels,
            "depths": list(size.depths),
            "seeds": size.seeds,
            "recall": None if ctx.recall is None else vars(ctx.recall),
            "overall": overall,
            "cells": cells,
            "trials": trials,
        },
    )


def _picked(trials: list[dict], **match) -> list[dict]:
    """The trials whose fields equal `match`'s values."""
    return [t for t in trials if all(t[k] == v for k, v in match.items())]


def _cells(size: Size, labels: list[str], trials: list[dict], policies: list[str]) -> list[dict]:
    """Per policy x length x depth: its trials, how many were right, and the accuracy."""
    return [
        {
            "policy": name,
            "length": label,
            "depth": depth,
            "trials": len(hits := _picked(trials, policy=name, length=label, depth=depth)),
            "right": sum(t["right"] for t in hits),
            "accuracy": _accuracy(hits),
        }
        for name in policies
        for label in labels
        for depth in size.depths
    ]


def _tables(
    size: Size, labels: list[str], trials: list[dict], policies: list[str]
) -> tuple[list[Table], dict[str, float | None]]:
    """`([accuracy, peak KV, recall cost], overall accuracy per policy)`: a row per policy
    (the recall cost's for `+recall` policies only), a column per length."""
    accuracy = Table(
        f"Retrieval accuracy by context length (budget {size.budget} tokens per layer)",
        ["policy", *labels, "overall", "paper (up to 32K)"],
    )
    peaks = Table(
        "Peak hot KV MB allocated (live), and the cold tier's peak, largest over a length's trials",
        ["policy", *labels],
    )
    recall_cost = Table(
        "Recall's share of the prefill time (all trials of a length)", ["policy", *labels]
    )
    overall = {}
    for name in policies:
        per_length = [_picked(trials, policy=name, length=label) for label in labels]
        overall[name] = _accuracy(_picked(trials, policy=name))
        accuracy.add(
            name,
            *(_percent(_accuracy(hits)) for hits in per_length),
            _percent(overall[name]),
            PAPER.get(name, "-"),
        )
        peaks.add(name, *map(_peak_mb, per_length))
        if split_recall(name)[1]:
            recall_cost.add(name, *map(_recall_share, per_length))
    return [accuracy, peaks, recall_cost], overall


def _setup(ctx: EvalContext, size: Size, labels: list[str]) -> str:
    """The report's setup paragraph: model, needle, question, depths, lengths and budget."""
    per_cell = f"{size.seeds} trial{'s' if size.seeds > 1 else ''}"
    return (
        f"{ctx.loaded.name}, greedy. Each trial hides a 5-digit pass key "
        f'("{NEEDLE.strip().format(key="58213")}") in a slice of the long text (by default the '
        f"Debian licence texts) at a "
        f"depth of {', '.join(f'{d:.0%}' for d in size.depths)} of the context, then asks "
        f'"{QUESTION.strip()}"; right when the answer\'s first run of digits is the key. '
        f"Context lengths {', '.join(labels)} tokens (an original-position context is capped "
        f"at the model's window less {RESERVE} tokens for question and answer); "
        f'"rerotate" rows use StreamingLLM positions and run without full KV (n/a), which '
        "cannot pass the model's window. "
        f"{per_cell} per policy x length x depth cell; one haystack slice and key per length "
        "and seed, shared by every depth, "
        f"the same for every policy; window, h2o and conf-kv at `--budget {size.budget}` "
        f"(unpinned tokens per layer), prefill in chunks of {size.prefill_chunk} tokens."
    )


def _notes(ctx: EvalContext, size: Size, labels: list[str]) -> list[str]:
    """The report's notes: how the setup differs from the paper's, what equal budget means
    for each policy, what `+recall` adds, and what the overall accuracy covers."""
    return [
        f"Not the paper's setup: {ctx.loaded.name}, contexts up to {labels[-1]} (a "
        "rerotate row is past the model's context), a licence-text haystack; the paper's "
        "budget and needle format are not given, so its "
        "figures sit beside ours as a reference, not a like-for-like comparison.",
        f"Equal budget B = {size.budget}: window keeps the newest B tokens, 4 of them the "
        "first (attention sinks; without them SmolLM2 fails even with the needle in the "
        "window), h2o B tokens (B/2 recent, B/2 "
        "heavy hitters), conf-kv B when uncertain and B/2 when confident; full keeps "
        "everything. The question comes after the context, so no policy knows which tokens it "
        "will need when it evicts.",
        "`+recall` is the same policy at the same hot budget with its evictions kept in a "
        "cold tier (host memory, INT8 pages; `agent_kv.kv.policies.cold_recall`, settings "
        f"{_recall_settings(ctx)}): at every prefill chunk the chunk's last queries score "
        "each layer's cold pages and the best return to the cache (with `select=vote`, "
        "chosen by the layers' votes), ranked first within the budget until the next recall. "
        "The cold tier's bytes are shown apart from the hot ones.",
        "Overall accuracy is over every cell a policy ran; full KV's excludes the rerotate rows.",
    ]


def _heatmap(
    ctx: EvalContext, size: Size, labels: list[str], cells: list[dict], policies: list[str]
) -> str:
    """One panel per policy: depth (rows) x length (columns), colour = accuracy."""
    import matplotlib
    import numpy as np

    cmap = matplotlib.colormaps["RdYlGn"].with_extremes(bad="lightgrey")  # grey: n/a
    fig, axes = new_figure(ncols=len(policies), width=3.2 * len(policies), height=3.6)
    for ax, name in zip(axes, policies, strict=True):
        grid = np.full((len(size.depths), len(labels)), np.nan)
        for cell in cells:
            if cell["policy"] == name and cell["accuracy"] is not None:
                i, j = size.depths.index(cell["depth"]), labels.index(cell["length"])
                grid[i, j] = cell["accuracy"]
        ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap=cmap, aspect="auto")
        for i in range(len(size.depths)):
            for j in range(len(labels)):
                value = "n/a" if np.isnan(grid[i, j]) else f"{grid[i, j]:.0%}"
                ax.text(j, i, value, ha="center", va="center", fontsize=8)
        ax.set_title(name)
        ax.set_xticks(range(len(labels)), [label.replace(" rerotate", "\nrr") for label in labels])
        ax.set_yticks(range(len(size.depths)), [f"{d:.0%}" for d in size.depths])
        ax.set_xlabel("context tokens")
    axes[0].set_ylabel("needle depth")
    return save_figure(fig, ctx.out / "needle_heatmap.png")
