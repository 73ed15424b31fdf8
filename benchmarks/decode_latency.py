"""Decode latency per token: full KV vs a policy in FP and with INT8, side by side in one run.

Part 1, per context length: the same random prompt is prefilled under `full`, the policy
with every token in the model's dtype, and the policy with INT8 mixed precision; then all
three decode the same number of tokens, one step each in turn, so machine noise hits them
alike (the timing helpers are `agent_kv.evals.latency`'s; `agent-kv eval latency` measures
full vs conf-kv on real text, batch 1 and 8, inside the evaluation suite). Printed: the
median decode step of each, the speed-up over full, the policy's own share of its step
(scoring + eviction + compaction + quantization: the time spent in `record_attention` and
`Policy.step`), and the KV bytes each holds (allocated/live: its buffers, spare capacity
included, and its live tokens).

Part 2, KV bytes held by every policy at the same token budget after the same prompt and
decode steps, FP and INT8 (the policies that do not choose
their quantized tokens themselves), allocated with live beside them.

    .venv/bin/python benchmarks/decode_latency.py --lengths 2048 4096 8000 --budget 1024
"""

from __future__ import annotations

import argparse
import statistics

import torch

from agent_kv.evals.latency import Timed, decode_step, interleaved_decode
from agent_kv.kv.policies import POLICIES, make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine import Engine
from agent_kv.runtime.model_loading import load_model


def latency_table(loaded, args, prompts: dict[int, list[int]]) -> None:
    int8 = Int8Config(fp_window=args.fp_window)
    engines = {"full": Engine(loaded.model, loaded.tokenizer, make_policy("full"))}
    timers = {}
    for label, precision in (("fp", None), ("int8", int8)):
        slack = {} if args.slack is None else {"evict_slack": args.slack}
        policy = make_policy(args.policy, budget=args.budget, **slack)
        timers[label] = Timed()
        policy.step = timers[label].wrap(policy.step)
        engines[label] = Engine(loaded.model, loaded.tokenizer, policy, int8=precision)
    print(
        f"\n{args.policy} budget {args.budget}, evict_slack {policy.evict_slack}, INT8 fp_window "
        f"{args.fp_window}; median of {args.steps} decode steps (ms/token)"
    )
    print(
        f"{'context':>8} {'full':>7} {'fp':>7} {'int8':>7} {'full/fp':>8} {'full/int8':>10} "
        f"{'ovh fp':>7} {'ovh int8':>9} {'full MB a/l':>13} {'fp MB a/l':>11} "
        f"{'int8 MB a/l':>11}"
    )
    for length, prompt in prompts.items():
        sessions = {label: engine.new_sequence() for label, engine in engines.items()}
        for label in ("fp", "int8"):
            store = sessions[label].store
            store.record_attention = timers[label].wrap(store.record_attention)
        for label, engine in engines.items():
            engine.feed(sessions[label], prompt)
        for timer in timers.values():
            timer.seconds = 0.0
        runs = {label: (engine, sessions[label]) for label, engine in engines.items()}
        times = interleaved_decode(runs, args.steps)
        ms = {label: statistics.median(t) * 1e3 for label, t in times.items()}
        share = {label: timers[label].seconds / sum(times[label]) for label in timers}
        mb = {
            label: _mb(s.store.allocated_nbytes(), s.store.nbytes())
            for label, s in sessions.items()
        }
        print(
            f"{length:>8} {ms['full']:>7.1f} {ms['fp']:>7.1f} {ms['int8']:>7.1f} "
            f"{ms['full'] / ms['fp']:>7.2f}x {ms['full'] / ms['int8']:>9.2f}x "
            f"{share['fp']:>7.1%} {share['int8']:>9.1%} "
            f"{mb['full']:>13} {mb['fp']:>11} {mb['int8']:>11}"
        )


def bytes_table(loaded, args, prompt: list[int]) -> None:
    print(
        f"\nKV bytes held at budget {args.budget} after a {len(prompt)}-token prompt and "
        f"{args.steps} decode steps (peak = largest after any append), MB allocated/live"
    )
    print(
        f"{'policy':>10} {'FP MB':>11} {'FP peak':>11} {'INT8 MB':>11} {'INT8 peak':>11} "
        f"{'ratio':>6}"
    )
    for name, cls in POLICIES.items():
        if cls.manages_precision:  # ARKV's tiers are its own; they refuse INT8 mixed precision
            continue
        held = []
        for precision in (None, Int8Config(fp_window=args.fp_window)):
            budget = {"budget": args.budget} if cls.takes_budget else {}
            engine = Engine(
                loaded.model, loaded.tokenizer, make_policy(name, **budget), int8=precision
            )
            session = engine.new_sequence()
            engine.feed(session, prompt)
            for _ in range(args.steps):
                decode_step(engine, session)
            held.append(session.store)
        fp, q = held
        print(
            f"{name:>10} {_mb(fp.allocated_nbytes(), fp.nbytes()):>11} "
            f"{_mb(fp.peak_allocated_bytes, fp.peak_bytes):>11} "
            f"{_mb(q.allocated_nbytes(), q.nbytes()):>11} "
            f"{_mb(q.peak_allocated_bytes, q.peak_bytes):>11} "
            f"{fp.allocated_nbytes() / q.allocated_nbytes():>5.2f}x"
        )


def _mb(allocated: int, live: int) -> str:
    """KV bytes as `allocated/live` MB."""
    return f"{allocated / 1e6:.1f}/{live / 1e6:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--budget", type=int, default=1024, help="the policy's --budget")
    parser.add_argument("--policy", default="conf-kv")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slack", type=int, default=None, help="the policy's evict_slack (default: its own)"
    )
    parser.add_argument("--fp-window", type=int, default=128, help="INT8's FP window W")
    parser.add_argument("--skip-bytes", action="store_true", help="only the latency table")
    args = parser.parse_args()
    loaded = load_model()
    generator = torch.Generator().manual_seed(args.seed)
    vocab = loaded.model.config.vocab_size
    prompts = {
        n: torch.randint(100, vocab, (n,), generator=generator).tolist() for n in args.lengths
    }
    print(f"model {loaded.name}, {torch.get_num_threads()} threads")
    latency_table(loaded, args, prompts)
    if not args.skip_bytes:
        bytes_table(loaded, args, prompts[min(prompts)])


if __name__ == "__main__":
    main()
