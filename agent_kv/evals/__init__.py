"""The evaluation suite: each claim of docs/methods.md ("CONF-KV claims and figures", "ARKV
claims and figures") rerun on the loaded model.

`agent-kv eval NAME [--out DIR] [--quick]` runs one experiment (or `all`, in this order),
prints its tables and writes `summary.md`, `results.json` and its plots under `DIR/NAME`.
Each experiment is a module with `run(ctx: EvalContext) -> Report`:

- `perplexity`: perplexity at equal KV memory, full vs window (with and without attention
  sinks) vs conf-kv+INT8 vs conf-kv-l+INT8.
- `ablations`: random eviction at conf-kv's ratio, the confidence gate off, INT8 off.
- `needle`: needle-in-a-haystack accuracy per policy over context lengths and depths.
- `mechanistic`: confidence against the KL shift that evicting context causes.
- `latency`: decode step time and throughput against context length and batch size.
- `arkv`: ARKV and its baselines on long-context key-value retrieval.

`--quick` sizes run in minutes on two CPU cores; the tests run them. `--policies` runs
`needle` or `arkv` on other policies (any name `make_policy` takes, `+recall` included),
`--recall-param` sets their cold tier, and `--lengths` gives `needle` other context lengths.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from pathlib import Path

from agent_kv.evals.report import SUMMARY, EvalContext, Report
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.runtime.models.model_loading import LoadedModel

EXPERIMENTS = ["perplexity", "ablations", "needle", "mechanistic", "latency", "arkv"]
POLICY_EXPERIMENTS = ("needle", "arkv")
"""The experiments whose policy list `--policies` replaces (arkv keeps `full`, its
reference)."""


def experiment_names(name: str) -> list[str]:
    """`[name]`, or every experiment for `all`.

    Raises:
        ValueError: an unknown name.
    """
    if name == "all":
        return list(EXPERIMENTS)
    if name not in EXPERIMENTS:
        raise ValueError(
            f"unknown experiment {name!r}: choose all or one of {', '.join(EXPERIMENTS)}"
        )
    return [name]


def run_experiments(
    names: list[str],
    loaded: LoadedModel,
    text_ids: list[int],
    out: Path,
    quick: bool = False,
    log: Callable[[str], None] | None = None,
    policies: list[str] | None = None,
    recall: ColdConfig | None = None,
    lengths: tuple[int, ...] | None = None,
) -> list[Report]:
    """Run `names` in turn, writing each under `out/NAME`; with more than one, also write
    `out/summary.md` gathering them (rewritten after each, so finished ones stay written).
    `policies` replaces the policy list of the experiments in `POLICY_EXPERIMENTS`; `recall`
    sets their `+recall` policies' cold tier; `lengths` replaces needle's context lengths.

    Raises:
        OSError: `out` cannot be written.
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    reports = []
    for name in names:
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        module = importlib.import_module(f"agent_kv.evals.{name}")
        log(f"eval {name}{' (quick)' if quick else ''}: writing under {directory}")
        ctx = EvalContext(loaded, text_ids, quick, directory, log, policies, recall, lengths)
        report = module.run(ctx)
        report.write(directory)
        reports.append(report)
        if len(names) > 1:
            gathered = "\n".join(_relinked(r) for r in reports)
            (out / SUMMARY).write_text(f"# Evaluation results ({loaded.name})\n\n{gathered}")
    return reports


def _relinked(report: Report) -> str:
    """The report's markdown with figure links relative to the parent directory."""
    text = report.markdown()
    for name in report.figures:
        text = text.replace(f"]({name})", f"]({report.experiment}/{name})")
    return text


__all__ = ["EXPERIMENTS", "EvalContext", "Report", "experiment_names", "run_experiments"]
