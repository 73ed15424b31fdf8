"""Page faults, system time and wall time of a chunked prefill with glibc's default heap
thresholds against the ones `load_model` sets (`model_loading._reuse_freed_memory`), each in
a fresh process (the thresholds are per process), the two taken in turn `--rounds` times.

A prefill chunk de-quantizes every 4-bit weight into a float temporary and frees it; with
glibc's defaults each temporary is mapped and faulted in anew.

    .venv/bin/python benchmarks/prefill_page_faults.py --tokens 1024 --chunk 128 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def measure(model: str | None, tokens: int, chunk: int, defaults: bool) -> dict:
    """Load `model` (with glibc's default thresholds kept when `defaults`), prefill `chunk`
    tokens once to warm up, then `tokens` tokens in `chunk`-token calls under full KV."""
    import torch

    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.models import model_loading

    torch.set_num_threads(1)
    if defaults:
        model_loading._reuse_freed_memory = lambda: None
    loaded = model_loading.load_model(model)
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"), chunk)
    ids = [1000 + i % 5000 for i in range(tokens)]
    engine.prefill(engine.new_sequence(), ids[:chunk])
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    engine.prefill(engine.new_sequence(), ids)
    after, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter() - start
    return {
        "heap": "glibc defaults" if defaults else "load_model's",
        "minor_faults": after.ru_minflt - before.ru_minflt,
        "system_s": round(after.ru_stime - before.ru_stime, 2),
        "user_s": round(after.ru_utime - before.ru_utime, 2),
        "wall_s": round(wall, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's heap
    args = parser.parse_args()
    if args.one is not None:
        row = measure(args.model, args.tokens, args.chunk, args.one == "defaults")
        print(json.dumps(row))
        return
    rows: dict[str, list[dict]] = {"defaults": [], "reuse": []}
    for _ in range(args.rounds):
        for heap in rows:
            command = [sys.executable, __file__, "--one", heap, "--tokens", str(args.tokens)]
            command += ["--chunk", str(args.chunk)] + (
                ["--model", args.model] if args.model else []
            )
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            rows[heap].append(json.loads(out.strip().splitlines()[-1]))
            print(rows[heap][-1], flush=True)
    keys = ("minor_faults", "system_s", "user_s", "wall_s")
    print("\n| heap | " + " | ".join(f"median {k}" for k in keys) + " |\n|" + "---|" * 5)
    for runs in rows.values():
        medians = [round(statistics.median(r[k] for r in runs), 2) for k in keys]
        print(f"| {runs[0]['heap']} | " + " | ".join(str(m) for m in medians) + " |")
    ratio = statistics.median(r["system_s"] for r in rows["defaults"]) / max(
        statistics.median(r["system_s"] for r in rows["reuse"]), 1e-9
    )
    print(f"\nsystem time, defaults over load_model's: {ratio:.1f}x")


if __name__ == "__main__":
    main()
