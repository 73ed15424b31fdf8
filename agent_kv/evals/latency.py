"""Decode latency and throughput, full KV against CONF-KV, over context length and batch size.

The claims (docs/methods.md, "CONF-KV claims and figures"): a decode step 1.8x faster than
with full KV (GPT-2, Qwen-32B), and at batch size 8 2.06x full KV's throughput. Rerun here on
the loaded model, on this CPU:

- **Batch 1.** For each context length the first `L` tokens of the long text are prefilled
  (chunks of 512) under `full` and under `conf-kv` at one budget (`n_low` = budget, `n_high` =
  budget // 2); the prefill's wall time is the time to first token. Then both sessions decode
  greedily, one step each in turn (`interleaved_decode`), so machine noise falls on both
  alike. Reported: the median and mean step (ms), the speed-up `full / conf-kv` (median),
  the share of conf-kv's step spent in its policy eviction (ranking, eviction, compaction; the
  attention-mass statistics are folded in the model call's commit), and the KV bytes each
  holds at the end.
- **Batch 8.** `Engine.generate_batch` decodes 8 prompts of the same length (slices of the
  text spread over it) for a fixed number of tokens each (EOS ignored), under `full`, then
  under `conf-kv`, then again if a second round fits the time. Throughput is the generated
  tokens of all rows over the decode wall time (seconds after the first token; one forward
  call per generated token), pooled over rounds; the ratio is `conf-kv / full`, beside the
  batch-1 throughput (1000 / mean ms per step) at the same length.

Optional work (longer batch contexts, second rounds) runs only when its cost, predicted from
the batch-1 prefill and step times, keeps the whole run inside `Size.time_budget_s`.

`Timed`, `decode_step` and `interleaved_decode` are shared with `benchmarks/decode_latency.py`.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from agent_kv.errors import ConfigError
from agent_kv.evals.report import EvalContext, Report, Table, new_figure, save_figure
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.batched_calls import BatchGeneration
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.sampling import SamplingParams

PAPER_SPEEDUP = 1.8
"""CONF-KV's per-step latency reduction over full KV (docs/methods.md, "CONF-KV claims and
figures"), x."""
PAPER_BATCH_THROUGHPUT = 2.06
"""CONF-KV's throughput over full KV at batch size 8 (docs/methods.md, "CONF-KV claims and
figures"), x."""
BATCH = 8
"""Rows of the batched measurement (the paper's batch size)."""
POLICIES = ("full", "conf-kv")
PREFILL_CHUNK = 512
"""Tokens per prefill forward call."""
WARMUP_TOKENS = 32
"""Prompt tokens of the throwaway warm-up session each engine runs first."""


@dataclass(frozen=True)
class Size:
    """One size of the experiment.

    Attributes:
        contexts: batch-1 context lengths (tokens).
        budget: conf-kv's `--budget` (tokens per layer: `n_low`; `n_high` is half).
        steps: batch-1 decode steps per policy and context.
        batch_contexts: batch-8 context lengths always run (tokens); each is one of `contexts`.
        optional_batch_contexts: batch-8 lengths run only if predicted to fit the time budget.
        new_tokens: tokens generated per row in the batch-8 runs.
        rounds: batch-8 rounds per length (full then conf-kv each); rounds after the first
            run only if predicted to fit.
        time_budget_s: seconds the whole run should stay under; optional work that would
            pass it is skipped (and said so).
    """

    contexts: tuple[int, ...]
    budget: int
    steps: int
    batch_contexts: tuple[int, ...]
    optional_batch_contexts: tuple[int, ...]
    new_tokens: int
    rounds: int
    time_budget_s: float


FULL = Size(
    contexts=(512, 2048, 4096, 8000),
    budget=1024,
    steps=48,
    batch_contexts=(512, 2048),
    optional_batch_contexts=(4096,),
    new_tokens=32,
    rounds=2,
    time_budget_s=840.0,
)
QUICK = Size(
    contexts=(256, 768),
    budget=256,
    steps=4,
    batch_contexts=(256,),
    optional_batch_contexts=(),
    new_tokens=4,
    rounds=1,
    time_budget_s=60.0,
)


class Timed:
    """Accumulates the wall time (seconds) spent in wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn: Callable) -> Callable:
        """`fn`, adding the seconds each call takes to `self.seconds`."""

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_step(engine: Engine, session: SequenceState) -> float:
    """Seconds for one greedy decode step (argmax of the last logits + forward + policy)."""
    start = time.perf_counter()
    engine.prefill(session, [int(session.last_logits.argmax())])
    return time.perf_counter() - start


def interleaved_decode(
    runs: dict[str, tuple[Engine, SequenceState]], steps: int
) -> dict[str, list[float]]:
    """Decode `steps` greedy tokens in each prefilled session, one step of each in turn, so
    noise on the machine falls on all of them alike.

    Returns:
        per label, the seconds of each of its steps.
    """
    times: dict[str, list[float]] = {label: [] for label in runs}
    for _ in range(steps):
        for label, (engine, session) in runs.items():
            times[label].append(decode_step(engine, session))
    return times


@dataclass
class BatchRun:
    """One `generate_batch` call: `rows` prompts of `context` tokens, `new_tokens` each.

    Attributes:
        generated: tokens generated, summed over rows.
        decode_s: decode wall time (seconds after the first token; the longest row's).
        wall_s: seconds of the whole call (prefill of every row + decode).
        kv_live_bytes: live KV bytes of the batch's store at the end, all rows.
        kv_allocated_bytes: bytes its buffers held at the end, spare capacity included.
        peak_kv_live_bytes: the store's peak live KV bytes.
    """

    policy: str
    context: int
    rows: int
    new_tokens: int
    generated: int
    decode_s: float
    wall_s: float
    kv_live_bytes: int
    kv_allocated_bytes: int
    peak_kv_live_bytes: int
    per_row_generated: list[int] = field(default_factory=list)


def run(ctx: EvalContext) -> Report:
    """Measure batch-1 step latency and batch-8 throughput, full vs conf-kv.

    Contexts longer than the text, or than the model's trained context, are skipped (and
    said so in the notes).

    Raises:
        ConfigError: no context fits.
    """
    size = QUICK if ctx.quick else FULL
    started = time.perf_counter()
    model, tokenizer = ctx.loaded.model, ctx.loaded.tokenizer
    limit = getattr(model.config, "max_position_embeddings", None) or math.inf
    available = len(ctx.text_ids)
    contexts = [n for n in size.contexts if n + size.steps <= limit and n <= available]
    skipped = [
        f"context {n}: {n} + {size.steps} decode steps pass the model's {limit}-token context"
        if n + size.steps > limit
        else f"context {n}: the text has only {available} tokens"
        for n in size.contexts
        if n not in contexts
    ]
    if not contexts:
        raise ConfigError(
            f"latency: no context of {list(size.contexts)} fits both the model's {limit}-token "
            f"context and the text's {available} tokens"
        )
    engines = {
        "full": Engine(model, tokenizer, make_policy("full"), prefill_chunk=PREFILL_CHUNK),
        "conf-kv": Engine(
            model,
            tokenizer,
            make_policy("conf-kv", budget=size.budget),
            prefill_chunk=PREFILL_CHUNK,
        ),
    }
    for engine in engines.values():
        # a run decodes exactly the tokens asked for (throughput benchmarks ignore EOS)
        engine.eos_ids = set()
    _warm_up(engines, ctx.text_ids)
    threads = torch.get_num_threads()
    ctx.log(
        f"latency: {ctx.loaded.name}, {_threads(threads)}, conf-kv budget {size.budget}, "
        f"contexts {contexts}, {size.steps} steps"
    )

    single = [_batch1(engines, ctx, n, size.steps) for n in contexts]
    by_context = {row["context"]: row for row in single}

    batch_runs: list[BatchRun] = []

    def runnable(n: int) -> bool:
        return n in by_context and n + size.new_tokens <= limit

    planned = [(n, 1, False) for n in size.batch_contexts if runnable(n)]
    planned += [(n, 1, True) for n in size.optional_batch_contexts if runnable(n)]
    repeats = range(2, size.rounds + 1)
    planned += [(n, r, True) for r in repeats for n in size.batch_contexts if runnable(n)]
    skipped += [
        f"batch {BATCH} at {n}: no batch-1 run at that length, or past the model's context"
        for n in (*size.batch_contexts, *size.optional_batch_contexts)
        if not runnable(n)
    ]
    for n, round_no, optional in planned:
        if optional:
            cost = _predicted_batch_s(by_context[n], size.new_tokens, batch_runs)
            left = size.time_budget_s - (time.perf_counter() - started)
            if cost > left:
                skipped.append(
                    f"batch {BATCH} at {n} tokens, round {round_no}: predicted {cost:.0f} s, "
                    f"{max(left, 0):.0f} s of the {size.time_budget_s:.0f} s budget left"
                )
                ctx.log(f"latency: skip {skipped[-1]}")
                continue
        prompts = _row_prompts(ctx.text_ids, n, BATCH)
        for label in POLICIES:
            batch_runs.append(_batch_run(engines[label], label, prompts, size.new_tokens))
            done = batch_runs[-1]
            ctx.log(
                f"latency: batch {BATCH} x {n} tokens, {label}, round {round_no}: "
                f"{done.generated / done.decode_s:.2f} tok/s ({done.wall_s:.1f} s)"
            )

    batched = _pool(batch_runs, by_context)
    elapsed = time.perf_counter() - started
    figure = _plot(single, batched, ctx)
    fit = _fit(single)
    return Report(
        experiment="latency",
        title="Latency and throughput: full KV vs CONF-KV (docs/methods.md, CONF-KV claims)",
        setup=_setup(ctx, size, contexts, threads),
        tables=[_latency_table(single, size), _memory_table(single), _batch_table(batched, size)],
        figures=[figure],
        notes=_notes(ctx, single, batched, fit, skipped, threads, elapsed),
        data={
            "model": ctx.loaded.name,
            "device": "cpu",
            "threads": threads,
            "size": asdict(size),
            "quick": ctx.quick,
            "batch1": single,
            "batch8_runs": [asdict(r) for r in batch_runs],
            "batch8": batched,
            "fit_full_ms": fit,
            "skipped": skipped,
            "elapsed_s": elapsed,
        },
    )


def _warm_up(engines: dict[str, Engine], text_ids: list[int]) -> None:
    """Run each engine once on a throwaway session (first-call allocations, lazy init)."""
    for engine in engines.values():
        session = engine.new_sequence()
        engine.prefill(session, text_ids[:WARMUP_TOKENS])
        decode_step(engine, session)
        decode_step(engine, session)


def _batch1(engines: dict[str, Engine], ctx: EvalContext, context: int, steps: int) -> dict:
    """Prefill the first `context` tokens under each policy, then decode `steps` interleaved
    steps; the row of raw timings (seconds) and bytes for this context."""
    prompt = ctx.text_ids[:context]
    runs: dict[str, tuple[Engine, SequenceState]] = {}
    timers: dict[str, Timed] = {}
    prefill_s: dict[str, float] = {}
    for label, engine in engines.items():
        session = engine.new_sequence()
        timers[label] = Timed()
        start = time.perf_counter()
        engine.prefill(session, prompt)
        prefill_s[label] = time.perf_counter() - start
        runs[label] = (engine, session)
    originals = {label: engine.policy.evict for label, engine in engines.items()}
    try:
        for label, engine in engines.items():
            timers[label].seconds = 0.0
            engine.policy.evict = timers[label].wrap(originals[label])
        times = interleaved_decode(runs, steps)
    finally:
        for engine in engines.values():
            vars(engine.policy).pop("evict", None)  # back to the class's method
    row: dict = {"context": context, "steps": steps}
    for label, (_, session) in runs.items():
        store = session.store
        row[label] = {
            "prefill_s": prefill_s[label],
            "step_s": times[label],
            "median_ms": statistics.median(times[label]) * 1e3,
            "mean_ms": statistics.fmean(times[label]) * 1e3,
            "policy_share": timers[label].seconds / sum(times[label]),
            "kv_live_bytes": store.nbytes(),
            "kv_allocated_bytes": store.allocated_nbytes(),
            "peak_kv_live_bytes": store.figures.peak_bytes,
            "live_tokens": max(store.lengths()),
            "seen_tokens": store.seen_tokens,
        }
    row["speedup_median"] = row["full"]["median_ms"] / row["conf-kv"]["median_ms"]
    row["speedup_mean"] = row["full"]["mean_ms"] / row["conf-kv"]["mean_ms"]
    ctx.log(
        f"latency: batch 1 at {context} tokens: full {row['full']['median_ms']:.1f} ms, "
        f"conf-kv {row['conf-kv']['median_ms']:.1f} ms ({row['speedup_median']:.2f}x)"
    )
    return row


def _row_prompts(text_ids: list[int], context: int, rows: int) -> list[list[int]]:
    """`rows` slices of `context` tokens, their starts spread evenly over the text."""
    stride = (len(text_ids) - context) // max(rows - 1, 1)
    return [text_ids[i * stride : i * stride + context] for i in range(rows)]


def _batch_run(engine: Engine, label: str, prompts: list[list[int]], new_tokens: int) -> BatchRun:
    """One timed `generate_batch` of greedy `new_tokens` per prompt."""
    start = time.perf_counter()
    result: BatchGeneration = engine.generate_batch(
        prompts, SamplingParams(max_new_tokens=new_tokens)
    )
    wall = time.perf_counter() - start
    per_row = [len(g.token_ids) for g in result.generations]
    return BatchRun(
        policy=label,
        context=len(prompts[0]),
        rows=len(prompts),
        new_tokens=new_tokens,
        generated=sum(per_row),
        decode_s=max(g.decode_s for g in result.generations),
        wall_s=wall,
        kv_live_bytes=result.store.nbytes(),
        kv_allocated_bytes=result.store.allocated_nbytes(),
        peak_kv_live_bytes=result.store.figures.peak_bytes,
        per_row_generated=per_row,
    )


def _predicted_batch_s(single: dict, new_tokens: int, done: list[BatchRun]) -> float:
    """Seconds one round of both policies at `single`'s context should take: a finished
    round's wall time at that length if any, else each row's batch-1 prefill plus
    `new_tokens` batch-1 mean steps per row (an upper bound: batching shares the weights)."""
    same = [r.wall_s for r in done if r.context == single["context"]]
    if len(same) >= len(POLICIES):
        return sum(same[: len(POLICIES)])
    return sum(
        BATCH * (single[p]["prefill_s"] + new_tokens * single[p]["mean_ms"] / 1e3) for p in POLICIES
    )


def _pool(runs: list[BatchRun], by_context: dict[int, dict]) -> list[dict]:
    """Per batch context: throughput (tokens/s) of each policy pooled over its rounds, the
    ratio conf-kv / full, and batch-1 throughput (1000 / mean ms) at the same length."""
    pooled = []
    for context in sorted({r.context for r in runs}):
        row: dict = {"context": context}
        for label in POLICIES:
            mine = [r for r in runs if r.context == context and r.policy == label]
            generated = sum(r.generated for r in mine)
            seconds = sum(r.decode_s for r in mine)
            row[label] = {
                "rounds": len(mine),
                "generated": generated,
                "asked": sum(r.rows * r.new_tokens for r in mine),
                "decode_s": seconds,
                "tokens_per_s": generated / seconds,
                "batch1_tokens_per_s": 1e3 / by_context[context][label]["mean_ms"],
                "kv_live_bytes": mine[-1].kv_live_bytes,
                "kv_allocated_bytes": mine[-1].kv_allocated_bytes,
                "peak_kv_live_bytes": max(r.peak_kv_live_bytes for r in mine),
            }
        row["throughput_ratio"] = row["conf-kv"]["tokens_per_s"] / row["full"]["tokens_per_s"]
        pooled.append(row)
    return pooled


def _fit(single: list[dict]) -> dict | None:
    """Least-squares `full median ms = fixed_ms + per_1k_ms * context / 1000` over the batch-1
    contexts (None with fewer than two)."""
    if len(single) < 2:
        return None
    xs = [row["context"] / 1e3 for row in single]
    ys = [row["full"]["median_ms"] for row in single]
    slope, intercept = statistics.linear_regression(xs, ys)
    return {"fixed_ms": intercept, "per_1k_tokens_ms": slope}


def _threads(n: int) -> str:
    return f"{n} torch thread{'' if n == 1 else 's'}"


def _mb(figures: dict) -> str:
    """A row's KV bytes in MB: allocated (spare capacity included), live beside it."""
    return f"{figures['kv_allocated_bytes'] / 1e6:.1f} ({figures['kv_live_bytes'] / 1e6:.1f} live)"


def _latency_table(single: list[dict], size: Size) -> Table:
    table = Table(
        title=(
            f"Batch 1: decode step (ms, median of {size.steps} interleaved steps), "
            f"conf-kv budget {size.budget}"
        ),
        headers=[
            "context (tokens)",
            "full ms/step",
            "conf-kv ms/step",
            "speed-up full/conf-kv",
            "paper",
            "speed-up (means)",
            "conf-kv policy-eviction share",
        ],
    )
    for row in single:
        table.add(
            row["context"],
            f"{row['full']['median_ms']:.1f}",
            f"{row['conf-kv']['median_ms']:.1f}",
            f"{row['speedup_median']:.2f}x",
            f"{PAPER_SPEEDUP:.1f}x",
            f"{row['speedup_mean']:.2f}x",
            f"{row['conf-kv']['policy_share']:.1%}",
        )
    return table


def _memory_table(single: list[dict]) -> Table:
    table = Table(
        title="Batch 1: time to first token (prefill, s) and KV held after decoding (MB)",
        headers=[
            "context (tokens)",
            "TTFT full s",
            "TTFT conf-kv s",
            "TTFT full/conf-kv",
            "KV full MB allocated (live)",
            "KV conf-kv MB allocated (live)",
            "conf-kv tokens held (largest layer)",
        ],
    )
    for row in single:
        full, conf = row["full"], row["conf-kv"]
        table.add(
            row["context"],
            f"{full['prefill_s']:.2f}",
            f"{conf['prefill_s']:.2f}",
            f"{full['prefill_s'] / conf['prefill_s']:.2f}x",
            _mb(full),
            _mb(conf),
            conf["live_tokens"],
        )
    return table


def _batch_table(batched: list[dict], size: Size) -> Table:
    table = Table(
        title=(
            f"Batch {BATCH}: decode throughput (tokens/s, all rows), {size.new_tokens} tokens "
            "per row, pooled over rounds"
        ),
        headers=[
            "context (tokens)",
            "rounds",
            "full tok/s",
            "conf-kv tok/s",
            "conf-kv/full",
            "paper",
            "batch-1 full tok/s",
            "batch-1 conf-kv tok/s",
            "KV full MB allocated (live)",
            "KV conf-kv MB allocated (live)",
        ],
    )
    for row in batched:
        full, conf = row["full"], row["conf-kv"]
        table.add(
            row["context"],
            full["rounds"],
            f"{full['tokens_per_s']:.2f}",
            f"{conf['tokens_per_s']:.2f}",
            f"{row['throughput_ratio']:.2f}x",
            f"{PAPER_BATCH_THROUGHPUT:.2f}x",
            f"{full['batch1_tokens_per_s']:.2f}",
            f"{conf['batch1_tokens_per_s']:.2f}",
            _mb(full),
            _mb(conf),
        )
    return table


def _plot(single: list[dict], batched: list[dict], ctx: EvalContext) -> str:
    """Left: median ms/step against context, both policies; right: the measured ratios
    against the paper's. Returns the PNG's file name."""
    fig, (left, right) = new_figure(ncols=2, width=10.0)
    xs = [row["context"] for row in single]
    for label, marker in zip(POLICIES, ("o", "s"), strict=True):
        left.plot(xs, [row[label]["median_ms"] for row in single], marker=marker, label=label)
    left.set_xlabel("context (tokens)")
    left.set_ylabel("decode step (ms, median)")
    left.set_title("Batch 1: step latency")
    left.set_ylim(0, 1.15 * max(row[p]["median_ms"] for row in single for p in POLICIES))
    left.legend()
    right.plot(xs, [row["speedup_median"] for row in single], marker="o", label="batch 1 latency")
    if batched:
        right.plot(
            [row["context"] for row in batched],
            [row["throughput_ratio"] for row in batched],
            marker="s",
            linestyle="--",
            label=f"batch {BATCH} throughput",
        )
    right.axhline(PAPER_SPEEDUP, color="C0", linestyle=":", label=f"paper {PAPER_SPEEDUP}x")
    right.axhline(
        PAPER_BATCH_THROUGHPUT, color="C1", linestyle=":", label=f"paper {PAPER_BATCH_THROUGHPUT}x"
    )
    right.axhline(1.0, color="grey", linewidth=0.8)
    right.set_xlabel("context (tokens)")
    right.set_ylabel("conf-kv advantage over full (x)")
    right.set_title("Speed-up")
    ratios = [row["speedup_median"] for row in single]
    ratios += [row["throughput_ratio"] for row in batched]
    right.set_ylim(0, 1.15 * max(*ratios, PAPER_SPEEDUP, PAPER_BATCH_THROUGHPUT))
    right.legend()
    return save_figure(fig, ctx.out / "latency.png")


def _setup(ctx: EvalContext, size: Size, contexts: list[int], threads: int) -> str:
    return (
        f"{ctx.loaded.name} on CPU ({_threads(threads)}), `full` against `conf-kv` at budget "
        f"{size.budget} (n_low {size.budget}, n_high {size.budget // 2}), prefill chunks of "
        f"{PREFILL_CHUNK}. Batch 1: the first {', '.join(map(str, contexts))} tokens of the "
        f"long text, prefilled under each policy (TTFT = prefill wall time), then "
        f"{size.steps} greedy decode steps alternating between the two sessions; a step is "
        f"one forward call plus the policy (ms). Batch {BATCH}: `generate_batch` on {BATCH} "
        f"slices of the text of equal length, {size.new_tokens} greedy tokens per row (EOS "
        "ignored), full then conf-kv per round; throughput = generated tokens of all rows / "
        "decode wall seconds (after the first token). Ratios: latency full/conf-kv, "
        "throughput conf-kv/full."
    )


def _notes(
    ctx: EvalContext,
    single: list[dict],
    batched: list[dict],
    fit: dict | None,
    skipped: list[str],
    threads: int,
    elapsed: float,
) -> list[str]:
    dtype = str(next(ctx.loaded.model.parameters()).dtype).removeprefix("torch.")
    notes = [
        f"Hardware: this machine's CPU ({_threads(threads)}), not the paper's GPUs; model "
        f"{ctx.loaded.name} ({dtype}), not GPT-2 or Qwen-32B. Absolute times depend on the "
        "machine's load; the ratios are taken from interleaved runs so load falls on both.",
    ]
    if fit is not None and fit["per_1k_tokens_ms"] <= 0:
        notes.append(
            f"What a step costs here: full KV's step does not measurably grow over these "
            f"contexts (fit: {fit['fixed_ms']:.1f} ms + {fit['per_1k_tokens_ms']:.2f} ms per "
            "1,000 tokens): the weights' matrix products and per-layer overhead dominate, and "
            "eviction has nothing to save."
        )
    elif fit is not None:
        longest = single[-1]
        held = longest["conf-kv"]["live_tokens"]
        fixed = fit["fixed_ms"]
        per_k = fit["per_1k_tokens_ms"]
        predicted = (fixed + per_k * longest["context"] / 1e3) / (fixed + per_k * held / 1e3)
        notes.append(
            f"What a step costs here: a linear fit of full KV's median step gives {fixed:.1f} ms "
            f"that do not depend on the context (the weights' matrix products, the LM head "
            f"over the vocabulary, per-layer Python overhead) plus {per_k:.2f} ms per 1,000 "
            "cached tokens (reading the cache in attention and scoring it). Evicting only "
            f"removes the second part, so at {longest['context']} tokens, with conf-kv holding "
            f"{held} tokens in its largest layer, the fit predicts a speed-up near "
            f"{predicted:.2f}x: eviction can only save the share of a step that grows with "
            "the cache."
        )
    short = [
        row for row in single if row["conf-kv"]["seen_tokens"] <= row["conf-kv"]["live_tokens"]
    ]
    if short:
        notes.append(
            "Below the budget conf-kv evicts nothing and is full KV plus a policy eviction "
            f"(contexts {', '.join(str(r['context']) for r in short)}): the paper's stated "
            "limit, a no-op for short contexts."
        )
    notes.append(
        "The full-KV baseline runs the same store and attention path as conf-kv without the "
        "attention-mass statistics (a policy that evicts nothing records none); the "
        "policy-eviction share column is the time inside conf-kv's `Policy.evict`."
    )
    if batched:
        notes.append(
            f"Batch {BATCH} throughput counts every row's tokens over the batch's decode wall "
            "time; batch-1 throughput (1000 / mean ms per step) is beside it for scale."
        )
    notes += [f"Skipped: {line}." for line in skipped]
    notes.append(f"Run time: {elapsed:.0f} s.")
    return notes
