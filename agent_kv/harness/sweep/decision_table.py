"""The decision-agreement tables of a scripted sweep: agreement with full KV per step index
and per distance from the task's first fact, one row per policy setting
(`agent_kv.harness.decisions` records the steps)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent_kv.harness.sweep.aggregate import row_label
from agent_kv.harness.sweep.settings import SETTING_FIELDS, record_key

STEP_BINS = ((1, 5), (6, 10), (11, 15), (16, 20), (21, 30), (31, None))
"""Step-index columns (1-based, inclusive; None: no upper end)."""
DISTANCE_BINS = ((0, 4_000), (4_000, 8_000), (8_000, 16_000), (16_000, 24_000), (24_000, None))
"""Columns of tokens since the first fact's page (lower inclusive, upper exclusive)."""


def _bin_label(low: int, high: int | None, thousands: bool) -> str:
    def text(n: int) -> str:
        return f"{n // 1000}K" if thousands else str(n)

    if high is None:
        return f"{text(low)}+"
    return f"{text(low)}-{text(high)}" if thousands else f"{low}-{high}"


def _table(
    records: list[dict[str, Any]],
    bins: tuple[tuple[int, int | None], ...],
    value: Callable[[dict[str, Any]], int | None],
    inclusive: bool,
    thousands: bool,
    first: str,
) -> str:
    """Rows per setting, a column per bin of `value(step)`; each cell `agreed/steps`."""
    rows: dict[str, list[list[int]]] = {}
    for record in records:
        _, *setting = record_key(record)
        label = row_label(dict(zip(SETTING_FIELDS, setting, strict=True)))
        cells = rows.setdefault(label, [[0, 0] for _ in bins])
        for step in record["agreement_steps"]:
            x = value(step)
            if x is None:
                continue
            for cell, (low, high) in zip(cells, bins, strict=True):
                if x >= low and (high is None or (x <= high if inclusive else x < high)):
                    cell[0] += step["agree"]
                    cell[1] += 1
                    break
    head = [_bin_label(low, high, thousands) for low, high in bins]
    lines = [
        f"| {first} | " + " | ".join(head) + " |",
        "|" + "|".join([" --- "] * (len(bins) + 1)) + "|",
    ]
    for label in sorted(rows):
        cells = [f"{a}/{n} ({a / n:.0%})" if n else "–" for a, n in rows[label]]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def decision_tables(records: list[dict[str, Any]]) -> str:
    """Markdown: two tables of agreement with full KV, per step index and per tokens since the
    task's first fact was read, over the records that compared decisions (`agreement_steps`
    holding `since_fact_tokens`, as scripted runs with decisions write them); "" when none
    did."""
    compared = [
        r
        for r in records
        if r.get("agreement_steps") and "since_fact_tokens" in r["agreement_steps"][0]
    ]
    if not compared:
        return ""
    by_step = _table(compared, STEP_BINS, lambda s: s["step"], True, False, "policy \\ step")
    by_distance = _table(
        compared, DISTANCE_BINS, lambda s: s["since_fact_tokens"], False, True,
        "policy \\ tokens since the fact",
    )  # fmt: skip
    return f"{by_step}\n\n{by_distance}"
