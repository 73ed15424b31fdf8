"""What scoring a whole prefill chunk costs, and what it changes in the kept set.

A prefill chunk longer than `agent_kv.kv.attention.SCORED_QUERIES` takes its output from
torch's fused attention and its attention mass (what the policies rank by) from every
`SCORE_STRIDE`-th query, counted back from its last. This benchmark sets the stride in turn
(1: every query; the chunk's length: its last query only, the least a mass can cost) and, in
one process, interleaved, `--reps` times in a rotating order, prefills `--tokens` tokens of
the Debian licence texts in `--chunk`-token chunks with `--model` (smollm2-135m) under h2o at
`--budget`. It prints the median prefill time per stride against the last-query-only
baseline, and, per stride, how the kept heavy hitters (all layers, the recent window left
out) fall across the prompt when the same prompt is prefilled in chunks of 512, 256 and 128:
the share of them in the last quarter of a 512-token chunk (1/4 when chunk boundaries do not
matter) and the total variation distance of their distribution over 128-token bins between
chunk sizes 512 and 128.

    AGENT_KV_THREADS=1 .venv/bin/python benchmarks/chunk_scoring.py [--tokens 8192] \
        [--chunk 512] [--budget 1024] [--reps 3] [--strides 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agent_kv.evals.texts import licence_text
from agent_kv.kv import attention
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model

BIN = 128
"""Tokens per bin of the kept-position distribution."""


def prefill_s(loaded, ids: list[int], chunk: int, budget: int) -> float:
    """Seconds to prefill `ids` in `chunk`-token chunks in a fresh h2o session."""
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("h2o", budget=budget), chunk)
    session = engine.new_sequence()
    started = time.perf_counter()
    engine.prefill(session, ids)
    return time.perf_counter() - started


def kept_heavy_hitters(loaded, ids: list[int], chunk: int, budget: int) -> torch.Tensor:
    """Original positions of the heavy hitters h2o at `budget` keeps after prefilling `ids`
    in `chunk`-token chunks: every layer's, the recent window (`budget // 2`) left out."""
    policy = make_policy("h2o", budget=budget)
    engine = Engine(loaded.model, loaded.tokenizer, policy, chunk)
    session = engine.new_sequence()
    engine.prefill(session, ids)
    store = session.store
    positions = torch.cat([store.live_positions(layer) for layer in range(store.num_layers)])
    return positions[positions < len(ids) - policy.protect_recent]


def distribution(positions: torch.Tensor, tokens: int) -> torch.Tensor:
    """Share of `positions` per `BIN`-token bin of `[0, tokens)`."""
    counts = torch.bincount(positions // BIN, minlength=-(-tokens // BIN)).float()
    return counts / counts.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--strides", default="1,2,4,8,16")
    parser.add_argument("--kept-tokens", type=int, default=2048)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model)
    ids = loaded.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    ids = ids[: args.tokens]
    strides = [*map(int, args.strides.split(",")), args.chunk]  # the last: last query only
    times: dict[int, list[float]] = {s: [] for s in strides}
    prefill_s(loaded, ids[:1024], args.chunk, args.budget)  # warm-up
    for rep in range(args.reps):
        for stride in strides[rep % len(strides) :] + strides[: rep % len(strides)]:
            attention.SCORE_STRIDE = stride
            times[stride].append(prefill_s(loaded, ids, args.chunk, args.budget))
    base = statistics.median(times[args.chunk])
    print(f"prefill of {len(ids)} tokens in {args.chunk}-token chunks, h2o {args.budget}")
    print("| scored queries | median prefill (s) | vs last query only |")
    print("|---|---|---|")
    for stride in strides:
        label = "last only" if stride == args.chunk else f"every {stride}"
        median = statistics.median(times[stride])
        print(f"| {label} | {median:.2f} | {median / base:.2f}x |")
    short = ids[: args.kept_tokens]
    budget = args.kept_tokens // 8
    print(f"\nkept heavy hitters, h2o {budget} over {len(short)} tokens")
    print("| scored queries | in the last quarter of a 512-chunk | TV(512, 128) |")
    print("|---|---|---|")
    for stride in strides:
        attention.SCORE_STRIDE = stride
        kept = {c: kept_heavy_hitters(loaded, short, c, budget) for c in (512, 128)}
        tail = ((kept[512] % 512) >= 384).float().mean().item()
        spread = {c: distribution(p, len(short)) for c, p in kept.items()}
        tv = 0.5 * (spread[512] - spread[128]).abs().sum().item()
        label = "last only" if stride == args.chunk else f"every {stride}"
        print(f"| {label} | {tail:.2f} | {tv:.3f} |")


if __name__ == "__main__":
    main()
