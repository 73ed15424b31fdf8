"""What reading a decode step's keys and values through a block table costs on this CPU,
against the contiguous read the store does today: the question a paged KV pool (fixed-size
blocks from one pool, a block table per sequence, as vLLM's `kv_cache_manager` keeps them)
must answer before it replaces contiguous segments.

For each history length, one layer's decode read (`kernels.dispatch.decode_attention` over one
FP segment and the step's own token, the path a CPU decode step takes) is timed on:
- `contiguous`: keys and values `[1, H, W, D]`, one slice of the store's buffers;
- `table`: the same tokens in 32-token blocks scattered over a pool `[N, H, 32, D]`, gathered
  through a block table into `[1, H, W, D]` (`index_select`) before the same read: what a
  block-table read costs without a kernel that walks the table itself;
- `compiled_table`: a decode read written over the pool and the block table and compiled by
  `torch.compile` (inductor's C++ backend), whose loops index the pool through the table: the
  kernel that walks the table, as far as this CPU's compiler generates one.
Both side by side in one process, alternating, medians of `--reps`; printed as one JSON line per
length with the ratio `table / contiguous`.

    .venv/bin/python benchmarks/block_table_read.py --heads 2 --dim 64 --query-heads 14
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kernels.dispatch import decode_attention
from kernels.torch_attention import Segment

BLOCK = 32


def measure(width: int, heads: int, query_heads: int, dim: int, reps: int) -> dict:
    """One length's medians (microseconds) and ratios to the contiguous read, reads alternating."""
    gen = torch.Generator().manual_seed(width)
    blocks = width // BLOCK
    pool_keys = torch.randn(blocks * 2, heads, BLOCK, dim, generator=gen)  # half of it free
    pool_values = torch.randn(blocks * 2, heads, BLOCK, dim, generator=gen)
    table = torch.randperm(blocks * 2, generator=gen)[:blocks]  # the sequence's blocks

    def gathered(pool: torch.Tensor) -> torch.Tensor:
        picked = pool.index_select(0, table)  # [blocks, H, 32, D]
        return picked.permute(1, 0, 2, 3).reshape(1, heads, width, dim)

    keys, values = gathered(pool_keys).contiguous(), gathered(pool_values).contiguous()
    query = torch.randn(1, query_heads, 1, dim, generator=gen)
    new = torch.randn(1, heads, 1, dim, generator=gen)
    lengths = torch.tensor([width])
    last = Segment(keys=new, values=new, lengths=torch.tensor([1]), causal=True)
    scale = dim**-0.5

    def contiguous() -> torch.Tensor:
        segment = Segment(keys=keys, values=values, lengths=lengths)
        return decode_attention(query, [segment, last], scale)[0]

    def through_table() -> torch.Tensor:
        segment = Segment(gathered(pool_keys), gathered(pool_values), lengths)
        return decode_attention(query, [segment, last], scale)[0]

    group = query_heads // heads

    def read_pool(query: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        grouped = query.view(heads, group, 1, 1, dim)
        block_keys = pool_keys[table].permute(1, 0, 2, 3)[:, None]  # [H, 1, blocks, 32, D]
        block_values = pool_values[table].permute(1, 0, 2, 3)[:, None]
        scores = (grouped * block_keys).sum(-1).reshape(heads, group, width) * scale
        probs = torch.softmax(scores, dim=-1).view(heads, group, blocks, BLOCK, 1)
        return (probs * block_values).sum((2, 3)).reshape(1, 1, query_heads, dim)

    compiled = torch.compile(read_pool, dynamic=False)
    old_keys, old_values = keys[:, :, :-1], values[:, :, :-1]
    whole = Segment(keys=old_keys, values=old_values, lengths=lengths - 1)
    own = Segment(keys[:, :, -1:], values[:, :, -1:], torch.tensor([1]), causal=True)
    expected = decode_attention(query, [whole, own], scale)[0]
    torch.testing.assert_close(compiled(query, table), expected, rtol=1e-4, atol=1e-4)

    def compiled_table() -> torch.Tensor:
        return compiled(query, table)

    torch.testing.assert_close(contiguous(), through_table())
    reads = (
        ("contiguous", contiguous),
        ("table", through_table),
        ("compiled_table", compiled_table),
    )
    times: dict[str, list[float]] = {name: [] for name, _ in reads}
    for _ in range(reps):
        for name, read in reads:
            started = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    return {
        "tokens": width,
        "contiguous_us": round(medians["contiguous"], 1),
        "table_us": round(medians["table"], 1),
        "compiled_table_us": round(medians["compiled_table"], 1),
        "ratio": round(medians["table"] / medians["contiguous"], 2),
        "compiled_ratio": round(medians["compiled_table"] / medians["contiguous"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--heads", type=int, default=2, help="KV heads (Qwen2.5-0.5B: 2)")
    parser.add_argument("--query-heads", type=int, default=14)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for width in args.lengths:
        print(json.dumps(measure(width, args.heads, args.query_heads, args.dim, args.reps)))


if __name__ == "__main__":
    main()
