"""Long-context key-value retrieval: accuracy against KV memory, per policy, side by side.

A context of `--context` tokens of the Debian licence texts (`agent_kv.texts`) carries
`--facts` sentences "The code of the <colour> <thing> is <4 digits>." at evenly spread
depths. After the whole context, the questions are asked one after another in the same
session, as an agent asks about what it saw turns ago, as a cloze "The code of the <colour>
<thing> is" (SmolLM2-135M answers that form with full KV; a "Question: ... Answer:" form
confuses it even then), greedy, `--answer-tokens` tokens; an answer is right when its first
four digits are the code. Each of `--contexts`
contexts uses its own slice of text, facts and codes (seeded), the same for every policy.

Per policy: accuracy (and retained vs `full`); the KV bytes held (mean over the moments right
after each answer) and the peak, each with its reduction vs `full`; the share of live tokens
held quantized (same moments, all layers); decode tokens/s (and ratio vs `full`) and prefill
tokens/s. The context is prefilled in chunks of `--prefill-chunk` tokens; a policy evicts
after each chunk, so its peak is about its budget plus one chunk. Policies run
in turn on each context, so machine noise falls on all of them alike.

Default: ARKV and its baselines at a quarter of the context's bytes (`--budget` FP tokens per
layer; ARKV's target, methods.md: 4x lower memory at >= 97% of full-KV accuracy), with
window and conf-kv+arkv (whose `--budget` is its uncertain budget; confident steps hold half).

    .venv/bin/python benchmarks/kv_retrieval.py --context 3000 --facts 8 --contexts 3
"""

from __future__ import annotations

import argparse
import random
import re
import time

from agent_kv.engine import Engine
from agent_kv.model_loading import load_model
from agent_kv.policies import POLICIES, make_policy
from agent_kv.sampling import SamplingParams
from agent_kv.texts import licence_text

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey"]
THINGS = ["door", "box", "car", "lamp", "chair", "boat", "clock", "bag", "gate", "cup"]
DEFAULT_POLICIES = "full,window,arkv,base-origin,base-quant,conf-kv+arkv"


def build_context(text_ids: list[int], tokenizer, size: int, facts: int, seed: int):
    """A context of about `size` tokens with `facts` facts at evenly spread depths.

    Returns:
        `(context token ids, [(name, code)])`.

    Raises:
        ValueError: the text is too short for the context.
    """
    rng = random.Random(seed)
    names = rng.sample([f"{c} {t}" for c in COLOURS for t in THINGS], facts)
    codes = [str(rng.randint(1000, 9999)) for _ in names]
    sentences = [
        tokenizer(f" The code of the {n} is {c}. ", add_special_tokens=False)["input_ids"]
        for n, c in zip(names, codes, strict=True)
    ]
    filler = size - sum(len(s) for s in sentences)
    start = rng.randrange(0, len(text_ids) - filler)
    if filler < facts or start < 0:
        raise ValueError(f"the text is too short for a {size}-token context")
    piece = text_ids[start : start + filler]
    ids, cut = [], 0
    for i, sentence in enumerate(sentences):
        depth = (i + 0.5) / facts  # evenly spread, never at the very ends
        nxt = int(depth * len(piece))
        ids += piece[cut:nxt] + sentence
        cut = nxt
    return ids + piece[cut:], list(zip(names, codes, strict=True))


def run_policy(engine: Engine, context: list[int], facts, answer_tokens: int) -> dict:
    """Prefill `context`, ask every fact's question in turn; return the measurements."""
    tokenizer = engine.tokenizer
    session = engine.new_session()
    start = time.perf_counter()
    engine.feed(session, context)
    prefill_s = time.perf_counter() - start
    right, decoded, decode_s, shares, held = 0, 0, 0.0, [], []
    params = SamplingParams(max_new_tokens=answer_tokens)
    for name, code in facts:
        question = f"\nThe code of the {name} is"
        ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        reply = engine.generate(session, ids, params)
        digits = re.sub(r"\D", "", reply.text)[:4]
        right += digits == code
        decoded += len(reply.token_ids)
        decode_s += reply.decode_s
        store = session.store
        shares.append(sum(store.quantized_lengths()) / max(sum(store.lengths()), 1))
        held.append(store.nbytes())
    return {
        "right": right,
        "asked": len(facts),
        "peak": session.store.peak_bytes,
        "held": sum(held) / len(held),
        "share": sum(shares) / len(shares),
        "decoded": decoded,
        "decode_s": decode_s,
        "prefilled": len(context),
        "prefill_s": prefill_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=3000, help="tokens per context")
    parser.add_argument("--facts", type=int, default=8, help="facts (and questions) per context")
    parser.add_argument("--contexts", type=int, default=3)
    parser.add_argument("--answer-tokens", type=int, default=6)
    parser.add_argument(
        "--budget", type=int, default=None, help="FP tokens per layer (default: context / 4)"
    )
    parser.add_argument("--policies", default=DEFAULT_POLICIES)
    parser.add_argument("--prefill-chunk", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    budget = args.budget or args.context // 4
    names = args.policies.split(",")
    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        parser.error(f"unknown policy {unknown[0]!r}: choose from {', '.join(POLICIES)}")
    loaded = load_model()
    tokenizer = loaded.tokenizer
    text_ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    engines = {
        name: Engine(
            loaded.model,
            tokenizer,
            make_policy(name, budget=budget if POLICIES[name].takes_budget else None),
            prefill_chunk=args.prefill_chunk,
        )
        for name in names
    }
    totals = {name: [] for name in names}
    for c in range(args.contexts):
        context, facts = build_context(text_ids, tokenizer, args.context, args.facts, args.seed + c)
        for name in names:
            result = run_policy(engines[name], context, facts, args.answer_tokens)
            totals[name].append(result)
            print(
                f"context {c + 1}/{args.contexts} {name:>13}: {result['right']}/{result['asked']}"
                f" right, held {result['held'] / 1e6:.1f} MB, peak {result['peak'] / 1e6:.1f} MB,"
                f" quantized {result['share']:.1%}",
                flush=True,
            )
    print_table(totals, names, budget, args)


def print_table(totals: dict, names: list[str], budget: int, args) -> None:
    """The markdown summary, ratios against `full` when it ran."""

    def summed(name, key):
        return sum(r[key] for r in totals[name])

    def accuracy(name):
        return summed(name, "right") / summed(name, "asked")

    def peak(name):
        return max(r["peak"] for r in totals[name])

    def held(name):
        return sum(r["held"] for r in totals[name]) / len(totals[name])

    def decode_rate(name):
        return summed(name, "decoded") / summed(name, "decode_s")

    base = "full" if "full" in totals else None
    print(
        f"\n{args.contexts} contexts x {args.facts} facts, {args.context} tokens each; "
        f"budget {budget} FP tokens per layer, prefill chunks of {args.prefill_chunk}\n"
    )
    print(
        "| policy | accuracy | retained vs full | KV held MB | vs full | peak KV MB | vs full | "
        "quantized share | decode tok/s | vs full | prefill tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        retained = f"{accuracy(name) / accuracy(base):.1%}" if base and accuracy(base) else "-"
        reduction = f"{peak(base) / peak(name):.2f}x" if base else "-"
        held_reduction = f"{held(base) / held(name):.2f}x" if base else "-"
        speed = f"{decode_rate(name) / decode_rate(base):.2f}x" if base else "-"
        share = sum(r["share"] for r in totals[name]) / len(totals[name])
        prefill = summed(name, "prefilled") / summed(name, "prefill_s")
        print(
            f"| {name} | {accuracy(name):.1%} | {retained} | {held(name) / 1e6:.1f} | "
            f"{held_reduction} | {peak(name) / 1e6:.1f} | {reduction} | {share:.1%} | "
            f"{decode_rate(name):.1f} | {speed} | {prefill:.0f} |"
        )


if __name__ == "__main__":
    main()
