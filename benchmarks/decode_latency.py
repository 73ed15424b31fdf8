"""Decode step on this CPU: Hugging Face's own path, llama.cpp and agent_kv (full KV, CONF-KV,
CONF-KV + INT8; eager and as one compiled graph), side by side in one run.

For each context length, a random prompt is prefilled once per setting (512-token chunks);
every setting then decodes the same predetermined tokens, one step each in turn (round robin,
so machine noise falls on all of them alike), and the table gives the median step:
- `hf`: the same weights through transformers' own path (`attn_implementation="sdpa"`, a
  `DynamicCache`), eager: the reference for "full KV";
- `llama.cpp`: the model's GGUF file (its own quantized weights, f16 KV cache) through
  llama-cpp-python at the same thread count, when installed (`.venv/bin/pip install
  -e ".[decode-bench]"` builds it from source, a few minutes; the row is left out otherwise,
  and for a `--model` directory);
- `full`, `conf-kv`, `conf-kv+int8` (budget `--budget`, INT8 window 128): agent_kv's engine,
  `eager` (`Engine(compile=False)`) and `compiled` (`compile=True`: one `torch.compile`d
  graph per step, `agent_kv.runtime.engine.decode_graph`).
Per setting also: aten operators per decode step (torch profiler, every aten event, nested
ones included: the CPU-measurable proxy of a GPU's kernel launches) and, for the compiled
ones, the fused kernels inductor generated that the step ran; and the KV bytes held
(allocated/live MB). The weight-read floor is the model's weight bytes over the bandwidth of
a plain read of a 512 MB tensor at the same thread count, measured in the same run.

    .venv/bin/python benchmarks/decode_latency.py                 # 512, 2K, 8K: ~20 minutes
    .venv/bin/python benchmarks/decode_latency.py --lengths 512 --steps 6 --no-compiled
    .venv/bin/python benchmarks/decode_latency.py --profile       # + where the step goes

The first compiled step of each setting compiles (about a minute each on 2 cores; inductor
caches the result on disk for later runs); it is not timed.
"""

from __future__ import annotations

import argparse
import collections
import copy
import importlib.util
import statistics
import time
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile

from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model

PREFILL_CHUNK = 512


@dataclass
class Setting:
    """One row of the table: a step function over its own prefilled state."""

    label: str
    step: object  # callable(token) -> None
    ops: object = None  # callable() -> (aten ops, fused kernels) of one step
    kv: object = None  # callable() -> "allocated/live" MB
    times: dict[int, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    counts: dict[int, tuple[int, int]] = field(default_factory=dict)
    memory: dict[int, str] = field(default_factory=dict)


def read_bandwidth() -> float:
    """Bytes per second of a plain read (sum) of a 512 MB float32 tensor, best of 5."""
    data = torch.ones(2**27)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def count_ops(step) -> tuple[int, int]:
    """(aten operator events, inductor kernel events) of one call of `step`, profiled after
    two warm-up calls."""
    step()
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    names = [event.name for event in prof.events()]
    aten = sum(name.startswith("aten::") for name in names)
    fused = sum("cpp_fused" in name for name in names)
    return aten, fused


def hf_setting(source, prompt: list[int]) -> Setting:
    """transformers' own path: SDPA attention, a DynamicCache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        for start in range(0, len(prompt), PREFILL_CHUNK):
            chunk = torch.tensor([prompt[start : start + PREFILL_CHUNK]])
            model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)

    def step(token: int) -> None:
        with torch.no_grad():
            model(input_ids=torch.tensor([[token]]), past_key_values=cache, logits_to_keep=1)

    def kv() -> str:
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return f"{held / 1e6:.0f}/{held / 1e6:.0f}"

    return Setting("hf (sdpa, DynamicCache)", step, lambda: count_ops(lambda: step(5)), kv)


def llama_cpp_setting(model: str, prompt: list[int], threads: int) -> Setting | None:
    """llama.cpp on `model`'s GGUF file (a bundled model's, or a .gguf path), or None when
    llama-cpp-python is not installed or `model` is a model directory."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    source = bundled_models.locate(model)
    if isinstance(source, str):
        gguf, weights = bundled_models.resolve(source), bundled_models.MODELS[source].quantisation
    elif source.suffix.lower() == ".gguf":
        gguf, weights = source, "GGUF"
    else:
        return None
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(gguf), n_ctx=len(prompt) + 512, n_threads=threads,
        n_threads_batch=threads, n_batch=PREFILL_CHUNK, verbose=False,
    )  # fmt: skip
    llm.eval(prompt)
    return Setting(f"llama.cpp ({weights} weights, f16 KV)", lambda token: llm.eval([token]))


def engine_settings(loaded, prompt: list[int], args) -> list[Setting]:
    """agent_kv's settings, eager and compiled, each on its own copy of one prefill."""
    variants = [
        ("full", make_policy("full"), None),
        ("conf-kv", make_policy("conf-kv", budget=args.budget), None),
        ("conf-kv+int8", make_policy("conf-kv", budget=args.budget), Int8Config()),
    ]
    settings = []
    for label, policy, int8 in variants:
        eager = Engine(loaded.model, loaded.tokenizer, policy, PREFILL_CHUNK, int8)
        prefilled = eager.new_sequence()
        eager.prefill(prefilled, prompt)
        modes = [("eager", False)] + ([("compiled", True)] if args.compiled else [])
        for mode, compiled in modes:
            engine = Engine(
                loaded.model, loaded.tokenizer, policy, PREFILL_CHUNK, int8, compile=compiled
            )
            sequence = copy.deepcopy(prefilled)
            settings.append(_engine_setting(f"{label} {mode}", engine, sequence))
    return settings


def _engine_setting(label: str, engine: Engine, sequence) -> Setting:
    def step(token: int) -> None:
        engine.prefill(sequence, [token])

    def kv() -> str:
        store = sequence.store
        return f"{store.allocated_nbytes() / 1e6:.0f}/{store.nbytes() / 1e6:.0f}"

    step(5)  # a compiled setting compiles here, untimed
    return Setting(label, step, lambda: count_ops(lambda: step(5)), kv)


def run_length(loaded, length: int, args, settings_out: dict) -> list[Setting]:
    generator = torch.Generator().manual_seed(length)
    vocab = loaded.model.config.vocab_size
    prompt = torch.randint(100, vocab, (length,), generator=generator).tolist()
    tokens = torch.randint(100, vocab, (args.steps,), generator=generator).tolist()
    settings = [hf_setting(loaded.source, prompt)]
    native = llama_cpp_setting(args.model, prompt, torch.get_num_threads())
    if native is not None:
        settings.append(native)
    settings += engine_settings(loaded, prompt, args)
    for token in tokens:  # round robin
        for setting in settings:
            start = time.perf_counter()
            setting.step(token)
            setting.times[length].append(time.perf_counter() - start)
    for setting in settings:
        if setting.ops is not None:
            setting.counts[length] = setting.ops()
        if setting.kv is not None:
            setting.memory[length] = setting.kv()
        settings_out.setdefault(setting.label, []).append(setting)
    return settings


def print_table(settings_by_label: dict, lengths: list[int], floor_ms: float) -> None:
    hf = {
        length: _median(settings_by_label["hf (sdpa, DynamicCache)"], length) for length in lengths
    }
    head = " | ".join(f"{n} ms (vs hf)" for n in lengths)
    print(f"\n| setting | {head} | aten ops / step | fused kernels | KV MB alloc/live (longest) |")
    print("|---|" + "---:|" * (len(lengths) + 3))
    for label, runs in settings_by_label.items():
        cells = []
        for length in lengths:
            ms = _median(runs, length)
            cells.append(f"{ms:.1f} ({ms / hf[length]:.2f}x)")
        counts = [run.counts[n] for run in runs for n in run.counts]
        ops = "-" if not counts else f"{counts[-1][0]:,}"
        fused = "-" if not counts or not counts[-1][1] else f"{counts[-1][1]:,}"
        memory = [run.memory[n] for run in runs for n in run.memory]
        print(
            f"| {label} | {' | '.join(cells)} | {ops} | {fused} | {memory[-1] if memory else '-'} |"
        )
    print(
        f"\nweight-read floor: {floor_ms:.1f} ms per step (fp32 weights over a plain read's "
        "bandwidth, same threads)"
    )


def _median(runs: list[Setting], length: int) -> float:
    times = [t for run in runs for t in run.times.get(length, [])]
    return statistics.median(times) * 1e3


def profile_step(loaded, args) -> None:
    """Where the compiled conf-kv step at the longest length spends its time."""
    length = max(args.lengths)
    prompt = list(range(100, 100 + length))
    engine = Engine(
        loaded.model, loaded.tokenizer, make_policy("conf-kv", budget=args.budget),
        PREFILL_CHUNK, compile=True,
    )  # fmt: skip
    sequence = engine.new_sequence()
    engine.prefill(sequence, prompt)
    for _ in range(3):
        engine.prefill(sequence, [5])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            engine.prefill(sequence, [5])
    print(f"\nconf-kv compiled, {length} tokens: 5 decode steps, by self time")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8000])
    parser.add_argument("--budget", type=int, default=1024, help="conf-kv's --budget")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per setting")
    parser.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads")
    parser.add_argument("--compiled", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True  # fused kernels in the profile
    loaded = load_model(args.model)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    bandwidth = read_bandwidth()
    print(
        f"model {loaded.name}: {weights / 1e6:.0f} MB of weights; {torch.get_num_threads()} "
        f"threads; plain read {bandwidth / 1e9:.1f} GB/s"
    )
    by_label: dict[str, list[Setting]] = {}
    for length in args.lengths:
        run_length(loaded, length, args, by_label)
        print(f"  {length} tokens done", flush=True)
    print_table(by_label, args.lengths, weights / bandwidth * 1e3)
    if args.profile:
        profile_step(loaded, args)


if __name__ == "__main__":
    main()
