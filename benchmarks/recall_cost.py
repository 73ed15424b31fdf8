"""What recall costs: per turn against the turn's prefill, and per decode step.

In one process, interleaved, `--reps` times in a rotating order, each setting prefills
`--tokens` tokens of the Debian licence texts in 512-token chunks with `--model`
(smollm2-135m), then asks one more message (`--question`, a turn's prefill of its own) and
decodes `--decode` tokens. The settings: the policy at `--budget` alone, with recall
(`ColdRecall`, default settings: a recall at every multi-token call), and with recall at every
decode token too (`every=1`). It prints, as medians, the prefill of the whole context and of
the question turn, the seconds recall itself took inside each (`ColdTier.recall_s`) and its
share, and the milliseconds per decode step, each against the policy alone.

    AGENT_KV_THREADS=1 .venv/bin/python benchmarks/recall_cost.py [--tokens 8192] \
        [--budget 1024] [--policy h2o] [--decode 32] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from agent_kv.evals.texts import licence_text
from agent_kv.kv.cold_tier import ColdConfig
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams

SETTINGS = {"alone": None, "recall": ColdConfig(), "recall every=1": ColdConfig(every=1)}


def run_once(loaded, policy: str, budget: int, recall, ids, question, decode) -> dict:
    """One fresh session: the context, then the question turn and `decode` tokens."""
    engine = Engine(
        loaded.model, loaded.tokenizer, make_policy(policy, budget=budget, recall=recall), 512
    )
    session = engine.new_sequence()
    started = time.perf_counter()
    engine.prefill(session, ids)
    context_s = time.perf_counter() - started
    cold = session.store.recall.tier
    context_recall = 0.0 if cold is None else cold.recall_s
    started = time.perf_counter()
    engine.prefill(session, question)
    turn_s = time.perf_counter() - started
    turn_recall = 0.0 if cold is None else cold.recall_s - context_recall
    reply = engine.generate(session, [], SamplingParams(max_new_tokens=decode))
    decoded = max(len(reply.token_ids) - 1, 1)
    return {
        "context_s": context_s,
        "context_recall_s": context_recall,
        "turn_s": turn_s,
        "turn_recall_s": turn_recall,
        "decode_ms": 1000 * reply.decode_s / decoded,
        "cold_bytes": session.store.recall.nbytes(),
        "hot_peak_bytes": session.store.figures.peak_allocated_bytes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--policy", default="h2o")
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--question", default="\nWhat did the licence say about warranty? It")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    loaded = load_model(args.model)
    ids = loaded.tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    ids = ids[: args.tokens - 64]
    question = loaded.tokenizer(args.question, add_special_tokens=False)["input_ids"]
    names = list(SETTINGS)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    run_once(loaded, args.policy, args.budget, None, ids[:1024], question, 2)  # warm-up
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            runs[name].append(
                run_once(
                    loaded, args.policy, args.budget, SETTINGS[name], ids, question, args.decode
                )
            )

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print(
        f"{args.policy} {args.budget}, {len(ids)} context tokens in 512-token chunks, then a "
        f"{len(question)}-token question and {args.decode} decode tokens; medians of {args.reps}"
    )
    print(
        "| setting | context prefill (s) | recall in it | question turn (s) | recall in it "
        "| decode ms/token | vs alone | cold tier MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    base = med("alone", "decode_ms")
    for name in names:
        context, turn = med(name, "context_s"), med(name, "turn_s")
        print(
            f"| {name} | {context:.2f} | {med(name, 'context_recall_s') / context:.1%} "
            f"| {turn:.3f} | {med(name, 'turn_recall_s') / turn:.1%} "
            f"| {med(name, 'decode_ms'):.1f} | {med(name, 'decode_ms') / base:.2f}x "
            f"| {med(name, 'cold_bytes') / 1e6:.1f} |"
        )


if __name__ == "__main__":
    main()
