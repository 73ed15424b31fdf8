"""Keep a scripted sweep's records in the repository, and put them back to resume it.

A sweep of the long-horizon suite runs for many hours from a fixed commit in a separate
checkout (`runs/` is not committed); its records must outlive the machine it ran on. `save`
copies what resuming and reporting need into a directory of the repository: `results.jsonl`,
`settings.json`, each run's `decisions.json` and the full-KV runs' `recall.json` (full KV's
decisions, pages and replies are the reference every later policy run of the task reads and
is compared with: `agent_kv.harness.decisions`), then writes the summary and plots there.
`restore` copies them back into a sweep directory, so that `agent-kv bench` with the same
`--out` skips the finished jobs and compares new ones with the saved full-KV runs.

    .venv/bin/python -m scripts.long_tasks.sweep_records save runs/lh \
        docs/results/long-horizon/sweep
    .venv/bin/python -m scripts.long_tasks.sweep_records restore \
        docs/results/long-horizon/sweep runs/lh
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from agent_kv.harness.decisions import DECISIONS_JSON
from agent_kv.harness.scripted_episode import TRACE_JSON
from agent_kv.harness.sweep.report import write_report
from agent_kv.harness.sweep.settings import RESULTS, SETTINGS

TRACES = "traces"


def copy_records(source: Path, target: Path) -> int:
    """Copy `source`'s results, settings, every run's decisions and the full-KV runs' traces
    (`TRACE_JSON`) into `target` (created); returns the decision files copied.

    Raises:
        FileNotFoundError: `source` holds no results.
    """
    if not (source / RESULTS).is_file():
        raise FileNotFoundError(f"{source} holds no {RESULTS}")
    target.mkdir(parents=True, exist_ok=True)
    for name in (RESULTS, SETTINGS):
        shutil.copy2(source / name, target / name)
    copied = 0
    for path in sorted((source / TRACES).glob(f"*/{DECISIONS_JSON}")):
        destination = target / TRACES / path.parent.name / DECISIONS_JSON
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, destination)
        copied += 1
        if path.parent.name.endswith("-full") and (path.parent / TRACE_JSON).is_file():
            shutil.copy2(path.parent / TRACE_JSON, destination.parent / TRACE_JSON)
    return copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    args = parser.parse_args()
    copied = copy_records(args.source, args.target)
    if args.action == "save":
        write_report(args.target)
    print(f"{args.action}d {args.source} -> {args.target}: results, settings, {copied} decisions")


if __name__ == "__main__":
    main()
