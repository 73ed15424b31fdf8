"""Decode latency per token, full KV vs a policy, side by side in one run (CPU or GPU).

For each context length the same prompt is prefilled under `full` and under the policy,
then both decode the same number of tokens; steps alternate between the two sessions so
machine noise hits both alike. Printed per length: median decode step of each, their ratio,
the policy's own share of its step (scoring + eviction + compaction, timed around
`record_attention` and `Policy.step`), and the KV bytes each session holds.

    .venv/bin/python benchmarks/decode_latency.py --lengths 2048 4096 8000 --budget 1024
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from agent_kv.engine import Engine
from agent_kv.model_loading import load_model
from agent_kv.policies import make_policy
from agent_kv.session import Session
from agent_kv.store import KVStore


class Timed:
    """Accumulates wall time spent in wrapped callables."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def decode_step(engine: Engine, session: Session) -> float:
    """Seconds for one greedy decode step (sample + forward + policy)."""
    start = time.perf_counter()
    engine.feed(session, [int(session.last_logits.argmax())])
    return time.perf_counter() - start


def run(
    lengths: list[int], budget: int, policy_name: str, steps: int, seed: int, slack: int
) -> None:
    loaded = load_model()
    vocab = loaded.model.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    full_engine = Engine(loaded.model, loaded.tokenizer, make_policy("full"))
    policy = make_policy(policy_name, budget=budget, evict_slack=slack)
    policy_engine = Engine(loaded.model, loaded.tokenizer, policy)
    overhead = Timed()
    policy.step = overhead.wrap(policy.step)
    print(
        f"model {loaded.name}, policy {policy_name} (budget {budget}, evict_slack {slack}), "
        f"{steps} decode steps"
    )
    print(
        f"{'context':>8} {'full ms/tok':>12} {'policy ms/tok':>14} {'speed-up':>9} "
        f"{'overhead':>9} {'full KV MB':>11} {'policy KV MB':>13}"
    )
    for length in lengths:
        prompt = torch.randint(100, vocab, (length,), generator=generator).tolist()
        full_session, policy_session = full_engine.new_session(), policy_engine.new_session()
        store: KVStore = policy_session.store
        store.record_attention = overhead.wrap(store.record_attention)
        full_engine.feed(full_session, prompt)
        policy_engine.feed(policy_session, prompt)
        full_times, policy_times = [], []
        overhead.seconds = 0.0
        for _ in range(steps):
            full_times.append(decode_step(full_engine, full_session))
            policy_times.append(decode_step(policy_engine, policy_session))
        full_ms = statistics.median(full_times) * 1e3
        policy_ms = statistics.median(policy_times) * 1e3
        share = overhead.seconds / sum(policy_times)
        print(
            f"{length:>8} {full_ms:>12.1f} {policy_ms:>14.1f} {full_ms / policy_ms:>8.2f}x "
            f"{share:>8.1%} {full_session.store.nbytes() / 1e6:>11.1f} "
            f"{store.nbytes() / 1e6:>13.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8000])
    parser.add_argument("--budget", type=int, default=1024, help="the policy's --budget")
    parser.add_argument("--policy", default="conf-kv")
    parser.add_argument("--steps", type=int, default=16, help="decode steps per length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slack", type=int, default=0, help="the policy's evict_slack")
    args = parser.parse_args()
    run(args.lengths, args.budget, args.policy, args.steps, args.seed, args.slack)


if __name__ == "__main__":
    main()
