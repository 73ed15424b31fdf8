"""Memory and load time of each weight format (`--weights`): seconds to load, resident memory
after loading and after a full-KV prefill of `--context` tokens, and the peak; each format in
a fresh process (resident memory is per process), one after another.

Resident memory is the process's RSS (`/proc/self/statm`: anonymous memory and the pages of
the GGUF file it touched); peak is `ru_maxrss`. The KV cache at `--context` tokens is
float32 in every format, so the difference between two rows at that length is the weights'.

    .venv/bin/python benchmarks/weight_memory.py --model qwen2.5-coder-0.5b \\
        --formats fp32 fp16 int8 gguf --context 8192
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def _resident_gb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize() / 1e9


def measure(model: str, weights: str, context: int) -> dict:
    """Load `model` in `weights`, then prefill `context` tokens under full KV; the figures."""
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.models.model_loading import load_model

    start = time.perf_counter()
    loaded = load_model(model, weights=weights)
    load_s = time.perf_counter() - start
    at_load = _resident_gb()
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    sequence = engine.new_sequence()
    engine.prefill(sequence, [1000 + i % 5000 for i in range(context)])
    return {
        "weights": weights,
        "load_s": round(load_s, 1),
        "resident_at_load_gb": round(at_load, 2),
        f"resident_at_{context}_gb": round(_resident_gb(), 2),
        "peak_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--formats", nargs="+", default=["fp32", "fp16", "int8", "gguf"])
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's format
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.model, args.one, args.context)))
        return
    rows = []
    for weights in args.formats:
        command = [sys.executable, __file__, "--one", weights, "--context", str(args.context)]
        if args.model:
            command += ["--model", args.model]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(rows[-1], flush=True)
    keys = list(rows[0])
    print("\n| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()
