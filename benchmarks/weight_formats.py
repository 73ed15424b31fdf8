"""Weight formats on this CPU: decode ms/token and prefill tokens/s at growing context lengths,
for Hugging Face's own path, llama.cpp and agent_kv (full KV and CONF-KV, each `--weights`
format), side by side in one run.

Every setting holds its own state and grows it through the lengths (`--lengths`, default 512,
2K, 8K, 16K and 32,000 tokens: 32K less room for the decode steps inside the model's 32,768
positions): at each length every setting first prefills up to it, in 512-token chunks (its
prefill rate at that length is the length over its prefill time from the start: a prompt of
that length), then all decode `--steps` tokens in turn, one step each (round robin, so machine
noise falls on all of them alike), and the table gives each setting's median step. A few
decoded tokens stay in each state between lengths, as they would in a conversation.

Settings:
- `hf fp32`, `hf bf16`: the model through transformers' own path (`attn_implementation=
  "sdpa"`, a `DynamicCache`, chunked prefill), in that dtype: the reference for "full KV";
- `llama.cpp`: the model's GGUF file (its own Q4_K_M weights, f16 KV cache) through
  llama-cpp-python at the same thread count (`pip install -e ".[decode-bench]"`; the row is
  left out when it is not installed);
- `full <weights>`, `conf-kv <weights>`: agent_kv's engine (`--weights`, eager unless marked
  `compiled`: one `torch.compile`d graph per decode step); CONF-KV at `--budget`.
bf16 rows stop at `--bf16-max` tokens (8K): on a CPU without AVX-512 BF16, bf16 prefill runs
~6x slower than fp32 (a 32K prompt would take most of an hour per row); `int8` rows the same,
their eager decode being the slowest. The first compiled step compiles (a minute or more on 2
cores) and is not timed.

    .venv/bin/python benchmarks/weight_formats.py                      # ~2 hours on 2 cores
    .venv/bin/python benchmarks/weight_formats.py --lengths 512 2048 --steps 4 --settings \\
        "hf fp32" llama.cpp "full fp16"                                  # a quick look
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model, transformers_directory

PREFILL_CHUNK = 512
SETTINGS = (
    "hf fp32", "hf bf16", "llama.cpp",
    "full fp32", "full fp16", "full bf16", "full int8", "full gguf",
    "conf-kv fp32 compiled", "conf-kv fp16", "conf-kv fp16 compiled", "conf-kv int8",
    "conf-kv gguf", "conf-kv gguf compiled",
)  # fmt: skip


@dataclass
class Setting:
    """One row: a state that grows by `extend(tokens)` (prefill) and `step(token)` (decode)."""

    label: str
    extend: Callable[[list[int]], None]
    step: Callable[[int], None]
    max_tokens: int
    kv_mb: Callable[[], str] = lambda: "-"
    fed: int = 0  # prompt tokens prefilled so far (decoded tokens come on top)
    prefill_s: float = 0.0
    prefill_rate: dict[int, float] = field(default_factory=dict)
    decode_ms: dict[int, float] = field(default_factory=dict)
    memory: dict[int, str] = field(default_factory=dict)

    def grow_to(self, tokens: list[int]) -> None:
        """Prefill `tokens[self.fed:]` in chunks, timing it."""
        for start in range(self.fed, len(tokens), PREFILL_CHUNK):
            chunk = tokens[start : start + PREFILL_CHUNK]
            began = time.perf_counter()
            self.extend(chunk)
            self.prefill_s += time.perf_counter() - began
        self.fed = max(self.fed, len(tokens))


class Models:
    """The loaded models, one per (path, dtype or weights), loaded on first use."""

    def __init__(self, model: str):
        self.model = model
        self._loaded: dict[tuple, object] = {}

    def agent_kv(self, weights: str):
        key = ("agent_kv", weights)
        if key not in self._loaded:
            self._loaded[key] = load_model(self.model, weights=weights)
        return self._loaded[key]

    def hf(self, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        key = ("hf", dtype)
        if key not in self._loaded:
            source = transformers_directory(self.model)
            self._loaded[key] = AutoModelForCausalLM.from_pretrained(
                source, dtype=dtype, attn_implementation="sdpa"
            ).eval()
        return self._loaded[key]


def hf_setting(models: Models, label: str, max_tokens: int) -> Setting:
    """transformers' own path in fp32 or bf16."""
    from transformers import DynamicCache

    model = models.hf(torch.bfloat16 if "bf16" in label else torch.float32)
    cache = DynamicCache(config=model.config)

    @torch.no_grad()
    def extend(chunk: list[int]) -> None:
        model(input_ids=torch.tensor([chunk]), past_key_values=cache, logits_to_keep=1)

    def kv_mb() -> str:
        held = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        return f"{held / 1e6:.0f}/{held / 1e6:.0f}"

    return Setting(label, extend, lambda token: extend([token]), max_tokens, kv_mb)


def llama_cpp_setting(model: str, max_tokens: int, steps_room: int) -> Setting | None:
    """llama.cpp on the model's GGUF file, or None without llama-cpp-python or a GGUF."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None
    source = bundled_models.locate(model)
    if isinstance(source, str):
        gguf = bundled_models.resolve(source)
    elif source.suffix.lower() == ".gguf":
        gguf = source
    else:
        return None
    from llama_cpp import Llama

    threads = torch.get_num_threads()
    llm = Llama(
        model_path=str(gguf), n_ctx=max_tokens + steps_room, n_threads=threads,
        n_threads_batch=threads, n_batch=PREFILL_CHUNK, verbose=False,
    )  # fmt: skip
    return Setting("llama.cpp", llm.eval, lambda token: llm.eval([token]), max_tokens)


def engine_setting(models: Models, label: str, budget: int, max_tokens: int) -> Setting:
    """agent_kv's engine: `full` or `conf-kv`, a weight format, eager or `compiled`."""
    policy_name, weights, *mode = label.split()
    loaded = models.agent_kv(weights)
    policy = make_policy(policy_name, budget=None if policy_name == "full" else budget)
    engine = Engine(
        loaded.model, loaded.tokenizer, policy, PREFILL_CHUNK, compile=mode == ["compiled"]
    )
    sequence = engine.new_sequence()

    def kv_mb() -> str:
        store = sequence.store
        return f"{store.allocated_nbytes() / 1e6:.0f}/{store.nbytes() / 1e6:.0f}"

    return Setting(
        label,
        lambda chunk: engine.prefill(sequence, chunk),
        lambda token: engine.prefill(sequence, [token]),
        max_tokens,
        kv_mb,
    )


def make_settings(args) -> list[Setting]:
    models = Models(args.model)
    longest = max(args.lengths)
    settings = []
    for label in args.settings:
        cap = args.bf16_max if ("bf16" in label or "int8" in label) else longest
        if label.startswith("hf"):
            settings.append(hf_setting(models, label, cap))
        elif label == "llama.cpp":
            native = llama_cpp_setting(args.model, cap, args.steps * len(args.lengths) + 8)
            if native is not None:
                settings.append(native)
        else:
            settings.append(engine_setting(models, label, args.budget, cap))
    return settings


def run(settings: list[Setting], args) -> None:
    vocab_generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 20000, (max(args.lengths),), generator=vocab_generator).tolist()
    decoded = torch.randint(100, 20000, (args.steps,), generator=vocab_generator).tolist()
    for length in args.lengths:
        active = [s for s in settings if length <= s.max_tokens]
        for setting in active:
            setting.grow_to(prompt[:length])
            setting.prefill_rate[length] = length / setting.prefill_s
            if setting.label.endswith("compiled"):
                setting.step(decoded[0])  # compiles here, untimed
        times: dict[str, list[float]] = {s.label: [] for s in active}
        for token in decoded:
            for setting in active:
                began = time.perf_counter()
                setting.step(token)
                times[setting.label].append(time.perf_counter() - began)
        for setting in active:
            setting.decode_ms[length] = statistics.median(times[setting.label]) * 1e3
            setting.memory[length] = setting.kv_mb()
        print(f"  {length} tokens done", flush=True)


def print_tables(settings: list[Setting], lengths: list[int]) -> None:
    native = next((s for s in settings if s.label == "llama.cpp"), None)

    def cells(values: dict[int, float], fmt: str, reference: dict[int, float] | None) -> str:
        out = []
        for length in lengths:
            if length not in values:
                out.append("-")
                continue
            text = fmt.format(values[length])
            if reference is not None and length in reference:
                text += f" ({values[length] / reference[length]:.2f}x)"
            out.append(text)
        return " | ".join(out)

    head = " | ".join(str(n) for n in lengths)
    ref = native.decode_ms if native else None
    print(f"\ndecode ms/token (vs llama.cpp)\n\n| setting | {head} | KV MB alloc/live |")
    print("|---|" + "---:|" * (len(lengths) + 1))
    for s in settings:
        memory = s.memory[max(s.memory)] if s.memory else "-"
        print(f"| {s.label} | {cells(s.decode_ms, '{:.1f}', ref)} | {memory} |")
    ref = native.prefill_rate if native else None
    print(f"\nprefill tokens/s (vs llama.cpp)\n\n| setting | {head} |")
    print("|---|" + "---:|" * len(lengths))
    for s in settings:
        print(f"| {s.label} | {cells(s.prefill_rate, '{:.1f}', ref)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192, 16384, 32000])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=SETTINGS)
    parser.add_argument("--budget", type=int, default=1024, help="conf-kv's --budget")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per setting and length")
    parser.add_argument("--bf16-max", type=int, default=8192, help="longest bf16/int8 length")
    parser.add_argument("--threads", type=int, default=None, help="torch (and llama.cpp) threads")
    parser.add_argument("--model", default=bundled_models.DEFAULT_MODEL)
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON")
    args = parser.parse_args()
    args.lengths = sorted(args.lengths)
    thread_setting.choose(args.threads)
    threads = thread_setting.apply()  # before any row is built: llama.cpp takes the same count
    print(
        f"model {args.model}; {threads} thread(s); CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}",
        flush=True,
    )
    settings = make_settings(args)
    run(settings, args)
    print_tables(settings, args.lengths)
    if args.out is not None:
        figures = {
            s.label: {"decode_ms": s.decode_ms, "prefill_tokens_per_s": s.prefill_rate,
                      "kv_mb_allocated_live": s.memory}
            for s in settings
        }  # fmt: skip
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, **figures}))


if __name__ == "__main__":
    main()
