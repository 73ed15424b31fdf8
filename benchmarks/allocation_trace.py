"""Allocated against live KV at every forward call of recorded episodes: whether the bytes the
store's buffers held during each call stayed within a tenth of the live bytes after the call's
append plus one block of tokens per layer and row (`agent_kv.kv.store.BLOCK_TOKENS`).

Reads each episode directory's `kv_steps.jsonl` (one record per forward call: the most
allocated bytes during the call and the policy eviction after it, and the live bytes after the
call's append) and its `summary.json` (the peaks, and the tokens seen for the bytes per token).

    .venv/bin/python benchmarks/allocation_trace.py runs/readme/task424-*
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent_kv.kv.store import BLOCK_TOKENS, KEEP_SHARE

MB = 1e6


def first(record: dict, *names: str):
    """The value of the first of `names` that `record` holds (figures renamed since)."""
    for name in names:
        if name in record:
            return record[name]
    raise KeyError(f"none of {names} in the record")


def check(directory: Path) -> dict:
    """Per-call figures of one episode directory (module docstring)."""
    summary = json.loads((directory / "summary.json").read_text())
    records = [json.loads(line) for line in (directory / "kv_steps.jsonl").read_text().split("\n")
               if line.strip()]  # fmt: skip
    full_live = first(summary, "full_kv_live_bytes")
    seen = max(record["seen_tokens"] for record in records)
    block = BLOCK_TOKENS * full_live // seen  # bytes of one block of tokens, every layer
    ratios, over = [], 0
    for record in records:
        allocated = first(record, "kv_allocated_bytes", "allocated_kv_bytes")
        live = first(record, "appended_kv_live_bytes", "appended_kv_bytes")
        ratios.append(allocated / live)
        over += allocated > (1 + KEEP_SHARE) * live + block
    return {
        "calls": len(records),
        "over": over,
        "max_ratio": max(ratios),
        "mean_ratio": sum(ratios) / len(ratios),
        "peak_allocated": first(summary, "peak_kv_allocated_bytes", "peak_kv_bytes"),
        "peak_live": summary["peak_kv_live_bytes"],
        "full_allocated": first(summary, "full_kv_allocated_bytes", "full_kv_bytes"),
        "full_live": full_live,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("episodes", nargs="+", type=Path, help="episode trace directories")
    args = parser.parse_args()
    print("| episode | calls | calls over 1.1x live + 1 block | allocated / live, max | mean | "
          "peak MB (allocated / live) | full KV MB (allocated / live) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for directory in args.episodes:
        c = check(directory)
        print(
            f"| {directory.name} | {c['calls']} | {c['over']} | {c['max_ratio']:.2f} | "
            f"{c['mean_ratio']:.2f} | {c['peak_allocated'] / MB:.1f} / {c['peak_live'] / MB:.1f}"
            f" | {c['full_allocated'] / MB:.1f} / {c['full_live'] / MB:.1f} |"
        )


if __name__ == "__main__":
    main()
