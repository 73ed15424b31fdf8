"""What an evaluation produces: tables, figures and raw numbers, written under its `--out`.

Every experiment returns one `Report`. `Report.write` saves `summary.md` (the setup, the
tables with the paper's figure beside the measured one, the figures) and `results.json` (the
raw measurements) in the experiment's directory; the command line prints `markdown()`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.runtime.models.model_loading import LoadedModel

SUMMARY = "summary.md"
RESULTS = "results.json"


@dataclass
class Table:
    """A markdown table: `rows` of already formatted cells, one per header."""

    title: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        """Append a row; raises `ValueError` when the cell count differs from the headers."""
        if len(cells) != len(self.headers):
            raise ValueError(f"{self.title}: {len(cells)} cells for {len(self.headers)} columns")
        self.rows.append([str(cell) for cell in cells])

    def markdown(self) -> str:
        lines = [
            f"**{self.title}**",
            "",
            "| " + " | ".join(self.headers) + " |",
            "|" + "---|" * len(self.headers),
        ]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Report:
    """One experiment's results.

    Attributes:
        experiment: its command name (`agent-kv eval NAME`).
        title: a one-line heading.
        setup: what was run and how, in a few sentences (model, text, sizes, definitions).
        tables: the result tables.
        figures: file names of the plots saved in the experiment's directory.
        notes: lines on what the figures mean or where the setup departs from the paper.
        data: the raw measurements, saved as `results.json`.
    """

    experiment: str
    title: str
    setup: str
    tables: list[Table] = field(default_factory=list)
    figures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def markdown(self) -> str:
        parts = [f"## {self.title}", "", self.setup, ""]
        for table in self.tables:
            parts += [table.markdown(), ""]
        parts += [f"- {note}" for note in self.notes]
        if self.notes:
            parts.append("")
        parts += [f"![{name}]({name})" for name in self.figures]
        return "\n".join(parts).rstrip() + "\n"

    def write(self, out: Path) -> None:
        """Write `summary.md` and `results.json` under `out` (created if missing).

        Raises:
            OSError: `out` cannot be written.
        """
        out.mkdir(parents=True, exist_ok=True)
        (out / SUMMARY).write_text(self.markdown())
        payload = {"experiment": self.experiment, "title": self.title, **self.data}
        (out / RESULTS).write_text(json.dumps(_finite(payload), indent=2) + "\n")


def _finite(value: Any) -> Any:
    """`value` with every NaN or infinite float replaced by None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


@dataclass
class EvalContext:
    """What every experiment gets.

    Attributes:
        loaded: the model and tokenizer.
        text_ids: token ids of the long text (`agent_kv.evals.texts.licence_text` by default).
        quick: run the minutes-long size (the one CI tests) instead of the full one.
        out: the experiment's output directory (exists).
        log: prints one progress line (to stderr).
        policies: the policies an experiment that compares a list of them runs (needle,
            arkv; `POLICY_EXPERIMENTS`), None for its own list.
        recall: the cold tier's settings for those policies' `+recall` names (None: the
            defaults).
        lengths: needle's context lengths in tokens instead of its own (each past the
            model's context with rerotate positions), or None.
    """

    loaded: LoadedModel
    text_ids: list[int]
    quick: bool
    out: Path
    log: Callable[[str], None]
    policies: list[str] | None = None
    recall: ColdConfig | None = None
    lengths: tuple[int, ...] | None = None


def save_figure(fig, path: Path) -> str:
    """Save a matplotlib figure as PNG, close it, and return the file name."""
    import matplotlib.pyplot as plt

    try:
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
    return path.name


def new_figure(ncols: int = 1, width: float = 6.5, height: float = 4.2):
    """A matplotlib `(figure, [axes, ...])`, `ncols` axes side by side, on the Agg backend (no
    display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height), dpi=110, squeeze=False)
    return fig, list(axes[0])
