"""Success per task group of a sweep over the fitted long-horizon tasks: the held-out and the
calibration halves (`Task.split`) and the tasks with and without pages in between that show a
fact of the same kind (`Task.distractors`), one row per policy setting, each cell with
Wilson's 95% interval and, beside full KV, the paired difference from it on the same tasks
with its 95% bootstrap interval (`agent_kv.harness.intervals`)."""

from __future__ import annotations

from typing import Any

from agent_kv.harness.intervals import paired_difference_interval, success_interval
from agent_kv.harness.sweep.aggregate import row_label
from agent_kv.harness.sweep.settings import SETTING_FIELDS, record_key
from envs.tasks import Task, TaskError, load_task

GROUPS = (
    ("held-out", lambda task: task.split == "held-out"),
    ("calibration", lambda task: task.split == "calibration"),
    ("without distractors", lambda task: task.distractors is False),
    ("with distractors", lambda task: task.distractors is True),
)
"""The columns: a name and which tasks it holds."""


def _grouped_task(task_id: int) -> Task | None:
    """The bundled task, when it carries a group (`split` or `distractors`); else None."""
    try:
        task = load_task(task_id)
    except TaskError:
        return None
    return task if task.split is not None or task.distractors is not None else None


def _cell(outcomes: dict[int, bool], full: dict[int, bool] | None) -> str:
    """'7/12 (58%; 32-81%)', then ', -8 (-25 to +8 points)' against full KV on the tasks
    both ran; '–' for no task."""
    if not outcomes:
        return "–"
    solved, n = sum(outcomes.values()), len(outcomes)
    low, high = success_interval(solved, n)
    text = f"{solved}/{n} ({solved / n:.0%}; {round(100 * low)}-{round(100 * high)}%)"
    if full is None:
        return text
    shared = sorted(set(outcomes) & set(full))
    if not shared:
        return text
    ours = [float(outcomes[t]) for t in shared]
    theirs = [float(full[t]) for t in shared]
    points = round(100 * (sum(ours) - sum(theirs)) / len(shared))
    interval = paired_difference_interval(ours, theirs)
    if interval is None:
        return f"{text}; {points:+d} vs full"
    lo, hi = (round(100 * bound) for bound in interval)
    return f"{text}; {points:+d} ({lo:+d} to {hi:+d}) vs full"


def group_table(records: list[dict[str, Any]]) -> str:
    """Markdown: a row per policy setting and a column per group of `GROUPS`, over the
    records whose task carries a group (the last record of each task and setting); "" when
    none does. Errors count as failures."""
    tasks = {tid: _grouped_task(tid) for tid in {r["task_id"] for r in records}}
    rows: dict[str, dict[int, bool]] = {}
    order: list[str] = []
    for record in records:
        if tasks[record["task_id"]] is None:
            continue
        _, *setting = record_key(record)
        label = row_label(dict(zip(SETTING_FIELDS, setting, strict=True)))
        if label not in rows:
            rows[label] = {}
            order.append(label)
        rows[label][record["task_id"]] = bool(record.get("success"))
    if not rows:
        return ""
    full = rows.get("full")
    lines = [
        "| policy | " + " | ".join(name for name, _ in GROUPS) + " |",
        "|" + "|".join([" --- "] * (len(GROUPS) + 1)) + "|",
    ]
    for label in sorted(order, key=lambda name: (name != "full", order.index(name))):
        cells = []
        for _, member in GROUPS:
            outcomes = {t: ok for t, ok in rows[label].items() if member(tasks[t])}
            against = None
            if full is not None and label != "full":
                against = {t: ok for t, ok in full.items() if member(tasks[t])}
            cells.append(_cell(outcomes, against))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
