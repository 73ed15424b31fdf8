"""One batch of prompts that start alike (`Engine.generate_batch`): the KV it holds and the time
it takes with the common prefix computed once and read by every row from shared blocks
(`Engine(share_prefixes=True)`), and without, side by side in one run.

`--prompts` prompts, each a system text of about `--system` tokens (the same for all: a web
agent's instructions and worked examples, from the licence texts) followed by a distinct
`--user`-token text, rendered by the chat template; `--reply` greedy tokens each, under
`--policy` (default full KV, so both runs keep the same tokens and must give the same replies).
Printed per mode: the batch store's own allocated and live KV, the shared blocks it reads,
the two together, the wall time of the batch, and whether the replies are the same.

    .venv/bin/python -m benchmarks.batch_prefix                      # SmolLM2-135M, 4 prompts
"""

from __future__ import annotations

import argparse
import gc
import time

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from benchmarks.session_memory import text_of

MB = 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--policy", default="full")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--system", type=int, default=1540)
    parser.add_argument("--user", type=int, default=30)
    parser.add_argument("--reply", type=int, default=8)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    thread_setting.apply()
    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    system = "You are a web agent. Follow these worked examples.\n" + text_of(
        tokenizer, 0, args.system
    )
    texts = [
        tokenizer.apply_chat_template(
            [
                {"role": "system", "content": system},
                {"role": "user", "content": text_of(tokenizer, 5000 + 97 * i, args.user)},
            ],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.prompts)
    ]
    prompts = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    params = SamplingParams(max_new_tokens=args.reply)
    replies = {}
    print(f"model {args.model}: {args.prompts} prompts of {[len(p) for p in prompts]} tokens")
    print("| mode | own KV MB alloc / live | shared MB | all MB alloc | batch s |")
    print("|---|---|---|---|---|")
    for share in (False, True):
        engine = Engine(loaded.model, tokenizer, make_policy(args.policy), share_prefixes=share)
        started = time.perf_counter()
        batch = engine.generate_batch(prompts, params)
        seconds = time.perf_counter() - started
        store = batch.store
        allocated, live, shared = store.allocated_nbytes(), store.nbytes(), store.prefix.nbytes()
        replies[share] = [g.token_ids for g in batch.generations]
        mode = f"shared prefix ({store.prefix.tokens} tokens)" if share else "own copies"
        print(
            f"| {mode} | {allocated / MB:.1f} / {live / MB:.1f} | {shared / MB:.1f} | "
            f"{(allocated + shared) / MB:.1f} | {seconds:.1f} |"
        )
        del batch, store, engine
        gc.collect()
    print(f"same replies: {replies[True] == replies[False]}")


if __name__ == "__main__":
    main()
