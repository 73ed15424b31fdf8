"""Torch threads under contention: prefill and decode time of `--model` (smollm2-135m) with 1
vs 2 intra-op threads (and 2 with `OMP_WAIT_POLICY=PASSIVE`), on an idle machine and under load.

Each setting runs in its own worker process (libgomp reads the wait policy when it loads, so
a setting cannot change inside one process), which sets its threads the way users get them
(`$AGENT_KV_THREADS` read by `load_model`), loads the model once and then, on each
request, prefills `--prefill` tokens of the Debian licence texts in a fresh conf-kv session
(`Engine`, default budgets, one chunk) and decodes `--decode` greedy tokens. The parent asks
the workers in turn, one at a time, `--reps` times per phase in a rotating order (so drift
and order effects spread over every setting): first the idle phase, then the loaded phase,
for which it starts `--load` busy-loop processes and kills them when the phase ends. It
prints the medians, each setting against 1 thread in the same phase, and loaded against idle.

    .venv/bin/python benchmarks/threads.py [--reps 5] [--load 2] [--prefill 500] [--decode 32] \
        [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = {
    "1 thread": {"AGENT_KV_THREADS": "1"},
    "2 threads": {"AGENT_KV_THREADS": "2"},
    "2 threads, passive": {"AGENT_KV_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
}
"""Setting name -> the environment of its worker process."""
BASELINE = "1 thread"
BUSY_LOOP = "while True: pass"


def worker(prefill: int, decode: int, model: str) -> None:
    """Serve measurement requests: one line on stdin -> one JSON line on stdout with
    `prefill_s` (seconds for the prefill) and `decode_ms` (milliseconds per decode step)."""
    import torch

    from agent_kv.evals.texts import licence_text
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.models.model_loading import load_model

    loaded = load_model(model)
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("conf-kv"), prefill_chunk=prefill)
    ids = loaded.tokenizer(licence_text(), add_special_tokens=False)["input_ids"][:prefill]

    def measure() -> dict:
        session = engine.new_sequence()
        started = time.perf_counter()
        logits = engine.prefill(session, ids)
        prefilled = time.perf_counter()
        for _ in range(decode):
            logits = engine.prefill(session, [int(logits.argmax())])
        done = time.perf_counter()
        return {"prefill_s": prefilled - started, "decode_ms": (done - prefilled) * 1e3 / decode}

    measure()  # warm-up
    print(json.dumps({"threads": torch.get_num_threads()}), flush=True)
    for _ in sys.stdin:
        print(json.dumps(measure()), flush=True)


def start_workers(prefill: int, decode: int, model: str) -> dict[str, subprocess.Popen]:
    """One worker per setting, started one after another (each loads the model alone)."""
    workers = {}
    for name, env in SETTINGS.items():
        proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", "--prefill", str(prefill)]
            + ["--decode", str(decode), "--model", model],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, **env},
        )
        workers[name] = proc
        ready = json.loads(proc.stdout.readline())
        print(f"{name}: worker ready, torch threads {ready['threads']}", file=sys.stderr)
    return workers


def run_phase(workers: dict[str, subprocess.Popen], reps: int) -> dict[str, list[dict]]:
    """`reps` measurements per worker, one worker at a time, rotating the order each round."""
    names = list(workers)
    results: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            proc = workers[name]
            proc.stdin.write("run\n")
            proc.stdin.flush()
            results[name].append(json.loads(proc.stdout.readline()))
    return results


def medians(results: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per setting, the median of each measured quantity."""
    return {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }


def table(idle: dict, loaded: dict) -> str:
    """The markdown table: medians, each setting / 1 thread per phase, loaded / idle."""
    rows = [
        "| setting | idle prefill s | idle decode ms | loaded prefill s | loaded decode ms "
        "| vs 1 thread idle (prefill, decode) | vs 1 thread loaded (prefill, decode) "
        "| loaded / idle (prefill, decode) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    base_idle, base_loaded = idle[BASELINE], loaded[BASELINE]
    for name in idle:
        i, lo = idle[name], loaded[name]
        rows.append(
            f"| {name} | {i['prefill_s']:.3f} | {i['decode_ms']:.1f} | {lo['prefill_s']:.3f} "
            f"| {lo['decode_ms']:.1f} "
            f"| {i['prefill_s'] / base_idle['prefill_s']:.2f}x, "
            f"{i['decode_ms'] / base_idle['decode_ms']:.2f}x "
            f"| {lo['prefill_s'] / base_loaded['prefill_s']:.2f}x, "
            f"{lo['decode_ms'] / base_loaded['decode_ms']:.2f}x "
            f"| {lo['prefill_s'] / i['prefill_s']:.2f}x, {lo['decode_ms'] / i['decode_ms']:.2f}x |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=5, help="measurements per setting and phase")
    parser.add_argument("--load", type=int, default=2, help="busy-loop processes when loaded")
    parser.add_argument("--prefill", type=int, default=500, help="prompt tokens")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.prefill, args.decode, args.model)
        return
    workers = start_workers(args.prefill, args.decode, args.model)
    busy: list[subprocess.Popen] = []
    try:
        print(f"idle phase, load average {os.getloadavg()[0]:.2f}", file=sys.stderr)
        idle = medians(run_phase(workers, args.reps))
        busy = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.load)]
        time.sleep(0.5)  # the loops are running before the first measurement
        print(f"loaded phase: {args.load} busy loops", file=sys.stderr)
        loaded = medians(run_phase(workers, args.reps))
        print(f"load average at the end {os.getloadavg()[0]:.2f}", file=sys.stderr)
    finally:
        for proc in busy:
            proc.kill()
            proc.wait()
        for proc in workers.values():
            proc.stdin.close()
            proc.wait()
    print(
        f"{args.prefill}-token prefill + {args.decode} decode steps, conf-kv, "
        f"medians of {args.reps}; loaded = {args.load} busy-loop processes "
        f"on {os.cpu_count()} CPUs\n"
    )
    print(table(idle, loaded))


if __name__ == "__main__":
    main()
