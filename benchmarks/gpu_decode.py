"""GPU decode: Hugging Face's own path against agent_kv's full KV and CONF-KV + INT8, each of
agent_kv's decode steps one captured CUDA graph, on a random-weight model of a real shape.

The model is Llama-3-8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128
channels, vocabulary 128,256) in bfloat16 with random weights. For each context length and
batch, three settings decode from caches filled with random keys and values (prefilling 32K
tokens x batch 8 through random weights would take most of the run and measure nothing here):
- `hf`: transformers' own path, eager, as users run it (`attn_implementation="sdpa"`, a
  `DynamicCache` filled by its own `update`);
- `full`: agent_kv's engine with every token kept (`Engine(compile=True)`: each step a CUDA
  graph, `agent_kv.runtime.engine.decode_graph`), the store filled by
  `agent_kv.kv.forward_call.append_kv`;
- `conf-kv+int8`: CONF-KV at `--budget` with INT8 mixed precision, the same way, after one
  policy eviction with no confidence signal (evicted to its uncertain budget, quantized).
Every agent_kv step is `Engine.decode`: the graph (model call, attention read, commit), then the
policy with the step's confidences.

Printed, one markdown table per run: the median step and tokens/s, against `hf` and `full`;
kernel launches per step (torch profiler over 3 steps: device kernels, and the host's launch
calls, `cudaLaunchKernel` and `cudaGraphLaunch` together); the weight-read limit, `batch /
(weight bytes / read bandwidth)` tokens/s with the read bandwidth half the measured copy
bandwidth (read + write), and each setting's share of it; the fused Triton read of layer 0's
stored segments timed alone (CUDA events) and its achieved bandwidth (bytes of live keys,
values, scales and scale rows read) against the copy bandwidth; the peak of
`torch.cuda.max_memory_allocated` over the decode steps (weights included).

    .venv/bin/python benchmarks/gpu_decode.py            # one H200: a few minutes
    .venv/bin/python benchmarks/gpu_decode.py --smoke    # tiny shapes, CPU, Triton interpreter

`--smoke` runs the same code on tiny shapes on the CPU (steps eager: CUDA graphs need a GPU),
to check the script, not to measure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from agent_kv.kv.cache import StoreCache
from agent_kv.kv.forward_call import ForwardCall, append_kv
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config, KVStore
from agent_kv.runtime.engine.engine import Engine


@dataclass(frozen=True)
class Shape:
    """What one run measures."""

    config: dict
    dtype: torch.dtype
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    budget: int
    fp_window: int
    group: int
    steps: int
    reps: int
    copy_bytes: int


FULL = Shape(
    config={
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
    },
    dtype=torch.bfloat16, contexts=(8192, 32768), batches=(1, 8), budget=2048, fp_window=128,
    group=32, steps=10, reps=20, copy_bytes=2**30,
)  # fmt: skip
SMOKE = Shape(
    config={
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024,
        "max_position_embeddings": 4096,
    },
    dtype=torch.float32, contexts=(256,), batches=(1, 2), budget=160, fp_window=32, group=16,
    steps=2, reps=1, copy_bytes=2**24,
)  # fmt: skip
SETTINGS = ("hf", "full", "conf-kv+int8")


class _NoTokenizer:
    """The engine's tokenizer slot: decode steps here feed token ids directly."""

    eos_token_id = None


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_call(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Mean seconds of `fn()` over `reps` calls after one warm-up call (CUDA events on a GPU:
    device time of the calls back to back)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - start) / reps
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync(device)
    begin.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / reps


def copy_bandwidth(nbytes: int, device: torch.device) -> float:
    """Bytes per second a large `copy_` moves on `device` (read + write)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / seconds_per_call(lambda: dst.copy_(src), 5, device)


def build_model(shape: Shape, device: torch.device, attention: str) -> torch.nn.Module:
    """A random-weight Llama of `shape.config` (seeded: every build has the same weights)."""
    # imported here: transformers' modeling code imports triton.language, which must come
    # after --smoke set TRITON_INTERPRET
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent_kv.kv.attention import register_attention

    register_attention()
    config = LlamaConfig(**shape.config, attn_implementation=attention)
    default = torch.get_default_dtype()
    torch.set_default_dtype(shape.dtype)
    torch.manual_seed(0)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def random_kv(generator, shape: tuple, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(shape, generator=generator, device=device, dtype=dtype) for _ in "kv")


class HFRun:
    """transformers' own path over a DynamicCache of `context` random tokens per row."""

    def __init__(self, model, context: int, batch: int):
        from transformers import DynamicCache

        self.model = model
        config = model.config
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        heads = config.num_key_value_heads
        dim = config.hidden_size // config.num_attention_heads
        self.cache = DynamicCache(config=config)
        generator = torch.Generator(device).manual_seed(context + batch)
        for start in range(0, context, 4096):
            n = min(4096, context - start)
            for layer in range(config.num_hidden_layers):
                keys, values = random_kv(generator, (batch, heads, n, dim), device, dtype)
                self.cache.update(keys, values, layer)
        self.batch, self.device, self.vocab = batch, device, config.vocab_size

    def step(self) -> None:
        tokens = torch.randint(0, self.vocab, (self.batch, 1), device=self.device)
        self.model(input_ids=tokens, past_key_values=self.cache, logits_to_keep=1)


class EngineRun:
    """agent_kv's engine over a store of `context` random tokens per row; every step
    `Engine.decode` (with `compile`: one CUDA graph per step on a GPU)."""

    def __init__(self, model, shape: Shape, setting: str, context: int, batch: int, graphs: bool):
        int8 = None
        policy = make_policy("full")
        if setting == "conf-kv+int8":
            int8 = Int8Config(fp_window=shape.fp_window, group=shape.group)
            policy = make_policy("conf-kv", budget=shape.budget)
        self.engine = Engine(model, _NoTokenizer(), policy, 4096, int8, compile=graphs)
        store = KVStore.for_model(model, batch=batch, int8=int8)
        self.cache = StoreCache(store)
        device, dtype = store.device, store.dtype
        generator = torch.Generator(device).manual_seed(context + batch)
        kv_shape = (store.num_layers, batch, store.kv_heads, 0, store.head_dim)
        for start in range(0, context, 4096):
            n = min(4096, context - start)
            store.bound_capacity(*policy.slot_bounds(store), 4096)
            keys, values = random_kv(generator, (*kv_shape[:3], n, kv_shape[4]), device, dtype)
            append_kv(store, keys, values)
            policy.evict(store, None)
        self.store, self.vocab = store, model.config.vocab_size

    def step(self) -> None:
        tokens = torch.randint(0, self.vocab, (self.store.batch,)).tolist()
        self.engine.decode(self.cache, tokens)

    def read(self, model, shape: Shape) -> dict:
        """Layer 0's attention read timed alone through the Triton kernel, for one random
        decode query per row (the stored segments and the query's own token)."""
        from kernels import triton_attention  # after --smoke set TRITON_INTERPRET (see main)

        store = self.store
        config = model.config
        dim = config.hidden_size // config.num_attention_heads
        shape_q = (store.batch, config.num_attention_heads, 1, dim)
        query = torch.randn(shape_q, device=store.device, dtype=shape.dtype)
        new = torch.randn(
            store.batch, store.kv_heads, 1, dim, device=store.device, dtype=shape.dtype
        )
        call = ForwardCall.open(store, range(store.batch), 1, static=True)
        segments = [*call.segments(0), call.new_segment(new, new)]
        seconds = seconds_per_call(
            lambda: triton_attention.segmented_attention(query, segments, dim**-0.5),
            shape.reps,
            store.device,
        )
        return {"read_s": seconds, "read_bytes": _read_bytes(store)}


def _read_bytes(store) -> int:
    """Bytes of live keys, values, scales and scale rows one decode read of layer 0 covers,
    over the store's rows."""
    per_slot = 2 * store.kv_heads * store.head_dim  # keys and values, per byte of element
    fp = sum(store.fp.lengths[0]) * per_slot * store.fp["keys"].element_size()
    quantized = sum(store.q.lengths[0]) * (per_slot * store.q["keys"].element_size() + 8)
    scales = sum(store.scales.lengths[0]) * per_slot * store.scales["keys"].element_size()
    return fp + quantized + scales


def launches(step: Callable[[], None], device: torch.device, steps: int = 3) -> tuple[float, float]:
    """(device kernels, host launch calls) per step over `steps` profiled steps."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return float("nan"), float("nan")
    step()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    events = prof.events()
    kernels = sum(1 for e in events if e.device_type.name == "CUDA" and "Memcpy" not in e.name)
    host = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cudaGraphLaunch"))
    return kernels / steps, host / steps


def measure(run, device: torch.device, steps: int) -> dict:
    """Median step seconds (the device synchronised after each step), launches, peak memory."""
    run.step()  # warm-up (an engine's first graph step runs eagerly, the second captures)
    run.step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        run.step()
        sync(device)
        times.append(time.perf_counter() - start)
    kernels, host = launches(run.step, device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"step": statistics.median(times), "kernels": kernels, "host": host, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter"
    )
    args = parser.parse_args()
    if args.smoke:
        # read when a @triton.jit function is defined, triton.language's own included: set
        # before transformers' modeling code and kernels.triton_attention are imported
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["AGENT_KV_KERNELS"] = "triton"
        shape, device = SMOKE, torch.device("cpu")
    else:
        if not torch.cuda.is_available():
            sys.exit("benchmarks/gpu_decode.py needs a CUDA device (--smoke runs on the CPU)")
        shape, device = FULL, torch.device("cuda")
    graphs = device.type == "cuda"
    ours = build_model(shape, device, "agent_kv")
    theirs = build_model(shape, device, "sdpa")
    weights = sum(p.numel() * p.element_size() for p in ours.parameters())
    copy_bw = copy_bandwidth(shape.copy_bytes, device)
    read_bw = copy_bw / 2
    name = torch.cuda.get_device_name(device) if graphs else "CPU (interpreter)"
    print(
        f"{name}; {shape.config['num_hidden_layers']} layers, hidden {shape.config['hidden_size']}"
        f", {shape.dtype}, {weights / 1e9:.1f} GB of weights; conf-kv budget {shape.budget}, "
        f"INT8 fp_window {shape.fp_window} group {shape.group}; median of {shape.steps} steps; "
        f"copy bandwidth {copy_bw / 1e9:.0f} GB/s (read + write); decode steps as CUDA graphs: "
        f"{graphs}\n"
    )
    print(
        "| context | batch | setting | KV GiB alloc (live) | step ms | tok/s | vs hf | vs full "
        "| kernels / step | host launches / step | of weight-read limit | Triton read GB/s "
        "| of copy BW | peak GiB |"
    )
    print("|---:|---:|---|" + "---:|" * 11)
    with torch.no_grad():
        for context in shape.contexts:
            for batch in shape.batches:
                limit = batch / (weights / read_bw)  # tokens/s with only the weights read
                base = {}
                for setting in SETTINGS:
                    if setting == "hf":
                        run = HFRun(theirs, context, batch)
                        kv, extra = "-", {}
                    else:
                        run = EngineRun(ours, shape, setting, context, batch, graphs)
                        store = run.store
                        kv = (
                            f"{store.allocated_nbytes() / 2**30:.3g} ({store.nbytes() / 2**30:.3g})"
                        )
                        extra = run.read(ours, shape)
                    r = measure(run, device, shape.steps)
                    base[setting] = r["step"]
                    tok_s = batch / r["step"]
                    read = "- | -"
                    if extra:
                        gbs = extra["read_bytes"] / extra["read_s"]
                        read = f"{gbs / 1e9:.3g} | {gbs / copy_bw:.1%}"
                    versus = "-" if setting == "hf" else f"{base['full'] / r['step']:.2f}x"
                    peak = "-" if r["peak"] is None else f"{r['peak']:.1f}"
                    print(
                        f"| {context} | {batch} | {setting} | {kv} | {r['step'] * 1e3:.1f} "
                        f"| {tok_s:.1f} | {base['hf'] / r['step']:.2f}x | {versus} "
                        f"| {r['kernels']:.0f} | {r['host']:.0f} | {tok_s / limit:.1%} | {read} "
                        f"| {peak} |",
                        flush=True,
                    )
                    del run
                    if graphs:
                        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
