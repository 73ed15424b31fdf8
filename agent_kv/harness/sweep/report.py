"""A sweep's report: the policy table of `aggregate`'s rows, the per-task table linking each
episode's trace, success per k for a scripted sweep, the plots against KV memory, and
`write_report`, which writes them all under the sweep's directory."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

from agent_kv.harness.sweep.aggregate import aggregate, mean, row_label
from agent_kv.harness.sweep.decision_table import decision_tables
from agent_kv.harness.sweep.group_table import group_table
from agent_kv.harness.sweep.settings import (
    AGREEMENT_PLOT,
    MODES,
    PLOT,
    RESULTS,
    SETTING_FIELDS,
    SUMMARY,
    read_results,
    record_key,
    recorded_mode,
)
from agent_kv.harness.trace_view import TraceError, write_trace_html


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _percent_interval(interval: tuple[float, float] | None, signed: bool = False) -> str:
    """' (48-78%)' or ' (-12 to +3 points)'; '' for None."""
    if interval is None:
        return ""
    low, high = (round(100 * bound) for bound in interval)
    return f" ({low:+d} to {high:+d} points)" if signed else f" ({low}-{high}%)"


def _minus_full(row: dict[str, Any]) -> str:
    """The *minus full* cell: the difference in points with its paired interval."""
    if row.get("success_minus_full") is None:
        return "–"
    points = round(100 * row["success_minus_full"])
    return f"{points:+d}{_percent_interval(row.get('success_minus_full_ci95'), signed=True)}"


def _relative(row: dict[str, Any]) -> str:
    """The *vs full* cell: the ratio, or why there is none."""
    if row["relative_success"] is not None:
        return f"{row['relative_success']:.2f}"
    if row["full_success_rate"] == 0:
        return "n/a (full KV solved none)"
    return "n/a (no full KV run)"


def _agreement_cell(row: dict[str, Any]) -> str:
    """The *agreement* cell: the share and its step count, '–' for full KV itself."""
    if row["agreement"] is None:
        return "–"
    steps = row["agreement_steps"]
    return f"{row['agreement']:.0%} ({steps} step{'s' if steps != 1 else ''})"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `aggregate` as a markdown table."""
    header = (
        "| policy | budget | precision | agent | episodes | errors | success (95% CI) | "
        "minus full (95% CI) | vs full | "
        "peak KV (MB) | live KV (MB) | cold KV (MB) | reduction vs full | agreement | "
        "KL vs full | steps | "
        "decode tok/s | ref. action acc. | ref. NLL |"
    )
    lines = [header, "|" + "|".join([" --- "] * (header.count("|") - 1)) + "|"]
    for r in rows:
        ref = _fmt(r["reference_accuracy"], ".0%")
        if r["reference_accuracy"] is not None:
            steps = r["reference_steps"]
            ref += f" ({steps} step{'s' if steps != 1 else ''})"
        cells = [
            r["policy"],
            "–" if r["budget"] is None else str(r["budget"]),
            r["precision"],
            r["agent"],
            str(r["episodes"]),
            str(r["errors"]),
            _fmt(r["success_rate"], ".0%") + _percent_interval(r.get("success_ci95")),
            _minus_full(r),
            _relative(r),
            _fmt(r["peak_kv_mb"], ".1f"),
            _fmt(r.get("peak_kv_live_mb"), ".1f"),
            _fmt(r.get("peak_cold_kv_mb"), ".1f"),
            _fmt(r["reduction_vs_full"], ".2f", "x"),
            _agreement_cell(r),
            _fmt(r["mean_kl"], ".3f"),
            _fmt(r["mean_steps"], ".1f"),
            _fmt(r["decode_tokens_per_s"], ".1f"),
            ref,
            _fmt(r["reference_nll"], ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_vs_memory(rows: list[dict[str, Any]], path: Path, metric: str, what: str) -> None:
    """Write a PNG: `metric` (a share, 0-1, plotted in %) against mean peak allocated KV
    memory (MB), one point per row, named in the legend with its episode count (points often
    coincide: equal budgets, or no success anywhere); rows without a peak or without the
    metric are left out. The success rate is drawn with its 95% interval (`success_ci95`) as
    an error bar, and full KV's rate as a dashed line across the plot.

    Args:
        rows: `aggregate`'s rows.
        path: the PNG to write.
        metric: the row field plotted ("success_rate", "agreement").
        what: its name on the axis and in the title ("success rate").
    """
    # matplotlib: heavy (a second to import), and needed only to draw; the Agg backend is
    # chosen before pyplot loads
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for row in rows:
            if row["peak_kv_mb"] is None or row[metric] is None:
                continue
            x, y = row["peak_kv_mb"], row[metric] * 100
            marker = "s" if row["policy"] == "full" else "o"
            label = f"{row_label(row)}: {x:.1f} MB, {y:.0f}% (n={row['episodes']})"
            interval = row.get("success_ci95") if metric == "success_rate" else None
            spread = None
            if interval is not None:
                spread = [[y - interval[0] * 100], [interval[1] * 100 - y]]
            points = ax.errorbar(
                [x], [y], yerr=spread, fmt=marker, ms=6, alpha=0.8, capsize=3, label=label
            )
            if row["policy"] == "full":
                ax.axhline(y, ls="--", lw=1, color=points[0].get_color(), alpha=0.6)
        if ax.containers:
            ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("mean peak KV memory, allocated (MB)")
        ax.set_ylabel(f"{what} (%)")
        ax.set_ylim(-5, 105)
        ax.set_title(f"{what[0].upper()}{what[1:]} vs KV memory")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def _outcome(record: dict[str, Any]) -> str:
    if record.get("end_reason") == "error":
        return "error"
    return "✓" if record.get("success") else f"✗ {record.get('end_reason', '')}".strip()


def per_task_table(records: list[dict[str, Any]], out: Path) -> str:
    """Markdown: one row per task, one column per policy setting; each cell the episode's
    outcome (✓, ✗ and its end reason, or error), linked to its rendered trace when there is
    one (`traces/<job>/trace.html`, relative to `out`)."""
    labels: dict[tuple, str] = {}
    cells: dict[int, dict[tuple, str]] = {}
    for record in records:
        task_id, *setting = record_key(record)
        column = tuple(setting)
        labels[column] = row_label(dict(zip(SETTING_FIELDS, setting, strict=True)))
        text = _outcome(record)
        page = Path(record.get("trace_dir") or "") / "trace.html"
        if record.get("trace_dir") and page.is_file():
            link = os.path.relpath(page, out.resolve())
            text = f"[{text}]({link})"
        cells.setdefault(task_id, {})[column] = text
    columns = sorted(labels, key=lambda c: (c[0] != "full", labels[c]))
    lines = [
        "| task | " + " | ".join(labels[c] for c in columns) + " |",
        "|" + "|".join([" --- "] * (len(columns) + 1)) + "|",
    ]
    for task_id in sorted(cells):
        row = [cells[task_id].get(c, "") for c in columns]
        lines.append(f"| {task_id} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def recall_table(records: list[dict[str, Any]]) -> str:
    """Markdown: recall-suite success per policy setting (rows) and k, the pages between the
    fact and the question (columns), each cell `solved/tasks`, followed, where the records
    carry `full_kv_allocated_bytes`, by the mean KV reduction of those tasks against a full
    cache of the same history (`full_kv_allocated_bytes / peak_kv_allocated_bytes`: a full-KV
    row past the model's context stops at the overflow, so the reduction is taken against the
    history itself, not against full KV's record). Two last columns compare each row with full
    KV on the tasks full KV solved: how many of them the row solved too, and the smallest k
    among those it lost ("–" when it lost none, or when there is no full-KV row). Empty when
    no record has a `k` (a free-navigation sweep)."""
    recall = [r for r in records if r.get("k") is not None]
    if not recall:
        return ""
    ks = sorted({r["k"] for r in recall})
    rows: dict[tuple, dict[int, list[dict[str, Any]]]] = {}
    for record in recall:
        _, *setting = record_key(record)
        rows.setdefault(tuple(setting), {}).setdefault(record["k"], []).append(record)
    solved_by_full = {r["task_id"] for r in recall if r["policy"] == "full" and r.get("success")}
    lines = [
        "| policy | "
        + " | ".join(f"k={k}" for k in ks)
        + " | of full KV's solved | first k lost |",
        "|" + "|".join([" --- "] * (len(ks) + 3)) + "|",
    ]
    order = {row_label(r): i for i, r in enumerate(aggregate(recall))}
    labelled = {
        row_label(dict(zip(SETTING_FIELDS, setting, strict=True))): cells
        for setting, cells in rows.items()
    }
    for label in sorted(labelled, key=order.get):
        cells = labelled[label]
        done = [r for group in cells.values() for r in group if r["task_id"] in solved_by_full]
        lost = sorted(r["k"] for r in done if not r.get("success"))
        kept = f"{len(done) - len(lost)}/{len(done)}" if done else "–"
        lines.append(
            f"| {label} | "
            + " | ".join(_recall_cell(cells.get(k, [])) for k in ks)
            + f" | {kept} | {lost[0] if lost else '–'} |"
        )
    return "\n".join(lines)


def _recall_cell(records: list[dict[str, Any]]) -> str:
    """`solved/tasks`, and ` (N.Nx)`: the mean reduction vs a full cache of the same history
    over the records that report both byte counts (see `recall_table`)."""
    if not records:
        return ""
    cell = f"{sum(bool(r.get('success')) for r in records)}/{len(records)}"
    ratios = [
        r["full_kv_allocated_bytes"] / r["peak_kv_allocated_bytes"]
        for r in records
        if r.get("full_kv_allocated_bytes") and r.get("peak_kv_allocated_bytes")
    ]
    return f"{cell} ({mean(ratios):.1f}x)" if ratios else cell


AGREEMENT_TEXT = {
    "free": (
        "the share of steps of full KV's trajectory, replayed teacher-forced under the "
        "policy, whose greedy constrained action equals full KV's; *KL vs full* the mean "
        "KL(full || policy) of the next-token distributions over those actions' tokens (nats)"
    ),
    "scripted": (
        "the share of steps of the task's reference trajectory at which the model's own "
        "greedy constrained action under the policy equals its own under full KV "
        "(`agent_kv.harness.decisions`); *KL vs full* the mean KL(full || policy) of the "
        "next-token distributions over the first tokens of each scripted action (nats)"
    ),
}
"""What the summary's *agreement* and *KL vs full* columns measure, per mode."""


def write_report(out: Path) -> str:
    """Aggregate `out/results.jsonl` into `out/summary.md` (the policy table, then the
    per-task table linking each episode's rendered trace, written here where missing; for a
    scripted sweep, success per k), `out/success_vs_memory.png` and, for a free-navigation
    sweep, `out/agreement_vs_memory.png`; return the policy table.

    Raises:
        OSError: the files cannot be written.
    """
    records = read_results(out / RESULTS)
    for record in records:
        trace = Path(record.get("trace_dir") or "")
        if record.get("trace_dir") and trace.is_dir() and not (trace / "trace.html").exists():
            with contextlib.suppress(TraceError):
                write_trace_html(trace)
    rows = aggregate(records)
    table = format_table(rows)
    mode = recorded_mode(out)
    by_k = recall_table(records)
    by_k = (
        "## Success per k\n\nk is the pages between the fact and the question. Each cell is "
        "solved/tasks, with the mean reduction of peak allocated KV against a full cache of "
        "the same history; the last columns count the tasks full KV solved that the row "
        f"solved too, and the smallest k among those it lost.\n\n{by_k}\n\n"
        if by_k
        else ""
    )
    groups = group_table(records)
    if groups:
        groups = (
            "## Success per task group\n\nThe fitted long-horizon tasks' held-out and "
            "calibration halves, and the tasks with and without pages between the fact and the "
            "answer that show a fact of the same kind (tasks/README.md). Each cell: solved/tasks "
            "(rate; Wilson's 95% interval) and, beside full KV, the difference from it on the same "
            "tasks in points (95% paired bootstrap interval).\n\n"
            f"{groups}\n\n"
        )
    decisions = decision_tables(records)
    if decisions:
        decisions = (
            "## Decisions per step and per distance\n\nEach cell is agreed/steps: steps of "
            "the tasks' reference trajectories at which the policy's own greedy action equals "
            "full KV's, by step index, then by tokens since the task's first fact was read.\n\n"
            f"{decisions}\n\n"
        )
    plots = f"![success vs memory]({PLOT})"
    agreement = any(row["agreement"] is not None for row in rows)
    if agreement:
        plots += f"\n![agreement vs memory]({AGREEMENT_PLOT})"
    text = (
        f"# Sweep summary ({MODES[mode]})\n\n"
        f"{len(records)} episodes from `{RESULTS}`. "
        "Success counts errors as failures; *vs full* is the success rate relative to full "
        "KV on the same tasks; *peak KV* is the mean peak of the bytes the store's buffers "
        "held (allocated), *live KV* the mean peak of the live bytes; *reduction vs full* is "
        "full KV's mean peak allocated bytes over this row's, on the same tasks; *agreement* "
        f"is {AGREEMENT_TEXT[mode]}; *ref. action acc.* is the share of reference steps "
        "whose action is the model's greedy choice under the policy (teacher-forced); "
        "*ref. NLL* is the reference actions' mean negative log-likelihood per token "
        "(nats; lower is better). *success (95% CI)* carries Wilson's 95% interval over "
        "the row's episodes; *minus full (95% CI)* is the row's success rate minus full "
        "KV's on the same tasks, in percentage points, with the 95% percentile-bootstrap "
        "interval of that paired difference, tasks resampled (`agent_kv.harness.intervals`).\n\n"
        f"{table}\n\n{plots}\n\n"
        f"{by_k}{groups}{decisions}## Per task\n\nEach cell links the episode's trace.\n\n"
        f"{per_task_table(records, out)}\n"
    )
    (out / SUMMARY).write_text(text, encoding="utf-8")
    plot_vs_memory(rows, out / PLOT, "success_rate", "success rate")
    if agreement:
        plot_vs_memory(rows, out / AGREEMENT_PLOT, "agreement", "action agreement with full KV")
    return table
