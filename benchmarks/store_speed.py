"""Prefill and decode time of the engine over the KV store, for comparing two versions of the
store: run it at each commit in turn, several times, and compare the medians pair by pair
(this machine's speed drifts; a change must show in every pair).

One process: the model loaded once; per setting (full KV, CONF-KV at `--budget`, each eager
and, with `--compile`, as the compiled decode graph), a `--prompt`-token random prompt
prefilled in `--chunk`-token chunks (timed whole), then `--steps` decode steps (each timed; the
median is printed, after `--warm` untimed steps that compile where compiling). Printed as one
JSON line per setting: `prefill_s`, `decode_ms` (median), `steps`.

    .venv/bin/python benchmarks/store_speed.py --model smollm2-135m
    git worktree add /tmp/old OLD && PYTHONPATH=/tmp/old .venv/bin/python benchmarks/store_speed.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--warm", type=int, default=4)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    thread_setting.apply()
    loaded = load_model(args.model, weights="fp32")
    generator = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prompt,), generator=generator).tolist()
    tokens = torch.randint(0, vocab, (args.warm + args.steps,), generator=generator).tolist()
    settings = [("full", {}), ("conf-kv", {"budget": args.budget})]
    for name, params in settings:
        for compiled in (False, True) if args.compile else (False,):
            engine = Engine(loaded.model, loaded.tokenizer, make_policy(name, **params),
                            prefill_chunk=args.chunk, compile=compiled)  # fmt: skip
            sequence = engine.new_sequence()
            started = time.perf_counter()
            engine.prefill(sequence, prompt)
            prefill_s = time.perf_counter() - started
            times = []
            for i, token in enumerate(tokens):
                started = time.perf_counter()
                engine.prefill(sequence, [token])
                if i >= args.warm:
                    times.append(time.perf_counter() - started)
            print(json.dumps({
                "setting": name + (" compiled" if compiled else " eager"),
                "prefill_s": round(prefill_s, 3),
                "decode_ms": round(1000 * statistics.median(times), 2),
                "steps": len(times),
            }))  # fmt: skip


if __name__ == "__main__":
    main()
