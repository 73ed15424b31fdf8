"""Time to first token when a client rewrites its last message every step (browser-use's
request shape: one long system prompt, then one user message holding the current page,
replaced, not appended, at each step).

Each step runs twice, side by side:
- session: `ChatService.run` in one named session. After the first step eviction has run (the
  user message is over the policy's budget), so the cache cannot be cut back exactly to where
  the new message diverges; it keeps its intact prefix (`KVStore.intact_tokens`: the system
  turn, pinned by the default rules) and prefills the rest;
- fresh: the same messages in a new session (the whole prompt prefilled).
The system prompt and each step's message are slices of the Debian licence texts (new text
of the same size every step). TTFT is `ChatTurn.ttft_s` (prefill included).

    .venv/bin/python benchmarks/rewritten_history.py --steps 4 --system-tokens 5800 \
        --user-tokens 1400
"""

from __future__ import annotations

import argparse
import statistics

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=5800)
    parser.add_argument("--user-tokens", type=int, default=1400)
    parser.add_argument("--policy", default="conf-kv")
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model")
    args = parser.parse_args()

    loaded = load_model(args.model)
    tokenizer = loaded.tokenizer
    engine = Engine(loaded.model, tokenizer, make_policy(args.policy))
    service = ChatService(engine)
    ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    need = args.system_tokens + args.steps * args.user_tokens
    if need > len(ids):
        raise SystemExit(f"{need} tokens asked; the licence texts have {len(ids)}")
    system = tokenizer.decode(ids[: args.system_tokens])
    params = SamplingParams(max_new_tokens=1)
    print(
        f"{args.steps} steps: ~{args.system_tokens}-token system prompt, a rewritten "
        f"~{args.user_tokens}-token user message; {engine.policy}, {args.model}"
    )
    print(
        f"{'step':>4} {'prompt':>7} {'cached':>7} {'rebuild':>9} {'evicted':>8} "
        f"{'session s':>9} {'fresh s':>8} {'ratio':>6}"
    )
    ratios = []
    for step in range(args.steps):
        start = args.system_tokens + step * args.user_tokens
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": tokenizer.decode(ids[start : start + args.user_tokens])},
        ]
        kept = service.run(messages, params, session_id="agent")
        fresh = service.run(messages, params, session_id=f"fresh-{step}")
        service.sessions.drop(f"fresh-{step}")
        if step:
            ratios.append(kept.ttft_s / fresh.ttft_s)
        print(
            f"{step + 1:>4} {kept.prompt_tokens:>7} {kept.sync.reused_tokens:>7} "
            f"{kept.sync.rebuild:>9} {kept.kv.evicted_tokens:>8} {kept.ttft_s:>9.2f} "
            f"{fresh.ttft_s:>8.2f} {kept.ttft_s / fresh.ttft_s:>5.2f}x"
        )
    if ratios:
        print(
            f"\nsteps 2-{args.steps}: session TTFT / fresh TTFT, median "
            f"{statistics.median(ratios):.2f}x (goal <= 0.33x)"
        )


if __name__ == "__main__":
    main()
