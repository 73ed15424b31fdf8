"""GPU decode: full KV vs CONF-KV + INT8 on a random-weight model of a real shape, one run.

The model is Llama-3-8B's shape (32 layers, hidden 4096, 32 query / 8 KV heads of 128
channels, vocabulary 128,256) in bfloat16 with random weights, attention through the store
(`attn_implementation="agent_kv"`), so the decode read runs `kernels.dispatch` (the Triton
kernels on CUDA). For each context length and batch, three stores:
- `full`: every token, in bfloat16;
- `full+int8`: every token, all but the newest `--fp-window` in INT8 (the fused kernel's
  dequantizing read over the whole context);
- `conf-kv+int8`: CONF-KV at `--budget` with INT8 mixed precision.
Prefill is replaced by appending random keys and values straight into the store, in chunks
(`KVStore.begin_forward` + `append`, what the model's cache calls do): prefilling 32K tokens x
batch 8 through random weights would take most of the run and measure nothing here. The
policy then steps once as after a prompt chunk (no confidence signal: it evicts to its
uncertain budget and quantizes), and every decode step is the model call on one random token
per row followed by the policy step with the step's confidence (`Engine.generate_batch`'s
loop without sampling or a tokenizer).

Printed, one markdown table: median decode step (model call + policy, and each alone, the
device synchronised between them) and tokens/s with the
speed-up over `full`; the attention read of one layer timed alone (CUDA events) through the
Triton kernel and through the PyTorch path, their ratio and the largest output difference;
the Triton read's achieved bandwidth (bytes of live keys, values, scales and scale indices
per call / kernel time) against the device's copy bandwidth (a 1 GiB `copy_`, read + write);
and the peak of `torch.cuda.max_memory_allocated` over the decode steps and the timed reads
(weights included; the random fill before them is not counted).

    .venv/bin/python benchmarks/gpu_decode.py            # CUDA; a few minutes on one GPU
    .venv/bin/python benchmarks/gpu_decode.py --smoke    # tiny shapes, CPU, Triton interpreter

`--profile` then profiles 3 decode steps of each variant at the largest context and batch
(`torch.profiler`) and prints the operators with the most self time on the host and on the
device, and the device kernels launched per step.
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
from agent_kv.kv.confidence import confidence
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config, KVStore
from kernels import reference
from kernels.dispatch import kernel_mode


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
    group=32, steps=8, reps=20, copy_bytes=2**30,
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
VARIANTS = ("full", "full+int8", "conf-kv+int8")


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


def build_model(shape: Shape, device: torch.device) -> torch.nn.Module:
    """A random-weight Llama of `shape.config`, attention through the store."""
    # imported here: transformers' modeling code imports triton.language, which must come
    # after --smoke set TRITON_INTERPRET
    from transformers import LlamaConfig, LlamaForCausalLM

    from agent_kv.kv.attention import NAME, register_attention

    register_attention()
    config = LlamaConfig(**shape.config, attn_implementation=NAME)
    default = torch.get_default_dtype()
    torch.set_default_dtype(shape.dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def filled_store(model, shape: Shape, variant: str, context: int, batch: int):
    """A store holding `context` random tokens per row after the policy's first step, and the
    policy; see the module docstring."""
    int8 = None if variant == "full" else Int8Config(fp_window=shape.fp_window, group=shape.group)
    store = KVStore.for_model(model, batch=batch, int8=int8)
    policy = (
        make_policy("full")
        if variant.startswith("full")
        else make_policy("conf-kv", budget=shape.budget)
    )
    layer = store.layers[0]
    generator = torch.Generator(layer.device).manual_seed(context + batch)
    chunk = 4096
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        store.begin_forward(range(batch), n)
        for idx in range(len(store.layers)):
            kv_shape = (batch, layer.kv_heads, n, layer.head_dim)
            keys, values = (
                torch.randn(kv_shape, generator=generator, device=layer.device, dtype=layer.dtype)
                for _ in range(2)
            )
            store.append(idx, keys, values)
    policy.step(store, None)
    return store, policy


def decode_step(model, store, policy, cache) -> tuple[float, float]:
    """One decode step of every row: the model call on a random token, then the policy.
    Returns the seconds of each, the device synchronised around them."""
    device = store.layers[0].device
    rows = range(store.batch)
    sync(device)
    start = time.perf_counter()
    policy.prepare(store)
    position_ids = store.begin_forward(rows, 1)
    tokens = torch.randint(0, model.config.vocab_size, (store.batch, 1), device=position_ids.device)
    out = model(
        input_ids=tokens,
        position_ids=position_ids,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
        kv_store=store,
    )
    sync(device)
    called = time.perf_counter()
    policy.step(store, [float(c) for c in confidence(out.logits[:, -1].float())])
    sync(device)
    return called - start, time.perf_counter() - called


def read_bytes(store, layer_idx: int) -> int:
    """Bytes of live keys, values, scales and scale indices one attention call reads from a
    layer, over the store's rows."""
    layer = store.layers[layer_idx]
    per_slot = 2 * layer.kv_heads * layer.head_dim  # keys and values, per byte of element
    fp = sum(layer.fp_len) * per_slot * layer.keys.element_size()
    quantized = sum(layer.q_len) * (per_slot * layer.q_keys.element_size() + 8)  # + index
    scales = sum(layer.n_groups) * per_slot * layer.key_scales.element_size()
    return fp + quantized + scales


def attention_read(model, store, shape: Shape) -> dict:
    """Layer 0's attention read timed alone, through the Triton kernel and the PyTorch path,
    for one random decode query per row."""
    from kernels import triton_attention  # after --smoke set TRITON_INTERPRET (see main)

    config = model.config
    device = store.layers[0].device
    head_dim = config.hidden_size // config.num_attention_heads
    query = torch.randn(
        store.batch, config.num_attention_heads, 1, head_dim, device=device, dtype=shape.dtype
    )
    segments = store.segments(0)
    scaling = head_dim**-0.5
    out, _ = triton_attention.segmented_attention(query, segments, scaling)
    ref_out, _ = reference.segmented_attention(query, segments, scaling)
    return {
        "triton": seconds_per_call(
            lambda: triton_attention.segmented_attention(query, segments, scaling),
            shape.reps,
            device,
        ),
        "torch": seconds_per_call(
            lambda: reference.segmented_attention(query, segments, scaling), shape.reps, device
        ),
        "diff": float((out.float() - ref_out.float()).abs().max()),
        "bytes": read_bytes(store, 0),
    }


def measure(model, shape: Shape, variant: str, context: int, batch: int) -> dict:
    """Decode latency, the attention read and peak memory of one variant at one size."""
    device = next(model.parameters()).device
    store, policy = filled_store(model, shape, variant, context, batch)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # the decode's peak, not the fill's
    cache = StoreCache(store)
    decode_step(model, store, policy, cache)  # warm-up: kernel compilation
    times = [decode_step(model, store, policy, cache) for _ in range(shape.steps)]
    layer = store.layers[0]
    result = {
        "step": statistics.median(model_s + policy_s for model_s, policy_s in times),
        "model": statistics.median(model_s for model_s, _ in times),
        "policy": statistics.median(policy_s for _, policy_s in times),
        "tokens": layer.length(0),
        "int8": layer.q_len[0],
        "kv_gib": store.allocated_nbytes() / 2**30,
        "kv_live_gib": store.nbytes() / 2**30,
        **attention_read(model, store, shape),
    }
    result["peak_gib"] = (
        torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    )
    return result


def profile(model, shape: Shape, variant: str, context: int, batch: int) -> None:
    """Print where 3 decode steps of `variant` spend their time: the 12 operators with the
    most self host (CPU) time, the 12 with the most self device time, and kernels per step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    device = next(model.parameters()).device
    store, policy = filled_store(model, shape, variant, context, batch)
    cache = StoreCache(store)
    decode_step(model, store, policy, cache)
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = 3
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            decode_step(model, store, policy, cache)
    events = prof.key_averages()
    print(f"\n### {variant}, context {context}, batch {batch}: {steps} decode steps profiled\n")
    for key in ("self_cpu_time_total", "self_device_time_total")[: len(activities)]:
        print(events.table(sort_by=key, row_limit=12, max_name_column_width=48))
    if device.type == "cuda":
        kernels = sum(e.count for e in events if e.device_type.name == "CUDA")
        print(f"device kernels per step: {kernels / steps:.0f}")


def table(rows: list[tuple[int, int, str, dict]], copy_bw: float) -> None:
    print(
        "| context | batch | variant | live tokens/row (INT8) | KV GiB allocated (live) "
        "| step ms | model ms | policy ms | tok/s "
        "| vs full | attn ms Triton | attn ms torch | torch/Triton | max abs diff "
        "| attn GB/s | of copy BW | peak GiB |"
    )
    print("|" + "---:|" * 2 + "---|" + "---:|" * 14)
    full_step = {}
    for context, batch, variant, r in rows:
        if variant == "full":
            full_step[context, batch] = r["step"]
        bandwidth = r["bytes"] / r["triton"]
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(
            f"| {context} | {batch} | {variant} | {r['tokens']} ({r['int8']}) "
            f"| {r['kv_gib']:.3g} ({r['kv_live_gib']:.3g}) "
            f"| {r['step'] * 1e3:.1f} | {r['model'] * 1e3:.1f} "
            f"| {r['policy'] * 1e3:.1f} | {batch / r['step']:.1f} "
            f"| {full_step[context, batch] / r['step']:.2f}x "
            f"| {r['triton'] * 1e3:.3g} | {r['torch'] * 1e3:.3g} "
            f"| {r['torch'] / r['triton']:.3g}x | {r['diff']:.1e} "
            f"| {bandwidth / 1e9:.3g} | {bandwidth / copy_bw:.1%} | {peak} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU under Triton's interpreter"
    )
    parser.add_argument(
        "--profile", action="store_true", help="then profile each variant's decode steps"
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
    torch.manual_seed(0)
    model = build_model(shape, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (interpreter)"
    copy_bw = copy_bandwidth(shape.copy_bytes, device)
    print(
        f"{name}; {shape.config['num_hidden_layers']} layers, hidden {shape.config['hidden_size']}"
        f", {shape.dtype}; AGENT_KV_KERNELS={kernel_mode()}; conf-kv budget {shape.budget}, "
        f"INT8 fp_window {shape.fp_window} group {shape.group}; median of {shape.steps} steps; "
        f"copy bandwidth {copy_bw / 1e9:.1f} GB/s\n"
    )
    rows = []
    with torch.no_grad():
        for context in shape.contexts:
            for batch in shape.batches:
                for variant in VARIANTS:
                    rows.append(
                        (context, batch, variant, measure(model, shape, variant, context, batch))
                    )
    table(rows, copy_bw)
    if args.profile:
        with torch.no_grad():
            for variant in VARIANTS:
                profile(model, shape, variant, shape.contexts[-1], shape.batches[-1])


if __name__ == "__main__":
    main()
