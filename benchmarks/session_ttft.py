"""Time to first token per turn of a long agent conversation: one session reused across
turns vs re-prefilling the whole history every turn (what a stateless backend does).

The conversation: a system prompt, then per turn an observation of about `--obs-tokens`
tokens (consecutive slices of the Debian licence texts, so every turn is new text of equal
size) and the model's own reply (`--reply-tokens`, greedy). Each turn runs twice, side by
side:
- reuse: `ChatService.run` in one session; only the reply tail and the new observation are
  prefilled, the history is matched against the cache;
- stateless: the same messages in a fresh session, so the whole history is prefilled (one
  token generated: only the TTFT is wanted).
TTFT is `ChatTurn.ttft_s`: from the model being free to the first reply token, prefill
included. Both runs use the same policy and positions; the default, conf-kv with its own
budgets (N_low 1024, N_high 512) and `rerotate` positions, lets a 15-turn conversation with
600-token observations (~9K tokens) pass SmolLM2's 8K context.

    .venv/bin/python benchmarks/session_ttft.py --turns 15 --obs-tokens 600
"""

from __future__ import annotations

import argparse

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService

SYSTEM = (
    "You are a web agent. Each user message is the accessibility tree of the current page. "
    "Reply with exactly one action: click [id], type [id] [text], scroll [down], or "
    "stop [answer]."
)


def observations(tokenizer, turns: int, size: int) -> list[str]:
    """`turns` consecutive slices of `size` tokens of the licence texts, as text.

    Raises:
        ValueError: the texts are too short for that many tokens.
    """
    ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    if turns * size > len(ids):
        raise ValueError(f"{turns} x {size} tokens exceed the text's {len(ids)} tokens")
    return [tokenizer.decode(ids[t * size : (t + 1) * size]) for t in range(turns)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--obs-tokens", type=int, default=600)
    parser.add_argument("--reply-tokens", type=int, default=8)
    parser.add_argument("--policy", default="conf-kv")
    parser.add_argument("--budget", type=int, default=None, help="default: the policy's own")
    parser.add_argument("--positions", choices=["original", "rerotate"], default="rerotate")
    parser.add_argument("--int8", action="store_true")
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()

    loaded = load_model(args.model)
    engine = Engine(
        loaded.model,
        loaded.tokenizer,
        make_policy(args.policy, args.budget),
        int8=Int8Config() if args.int8 else None,
        rerotate=args.positions == "rerotate",
    )
    service = ChatService(engine)
    pages = observations(loaded.tokenizer, args.turns, args.obs_tokens)
    reply_params = SamplingParams(max_new_tokens=args.reply_tokens)
    first_token = SamplingParams(max_new_tokens=1)
    print(
        f"{args.turns} turns, ~{args.obs_tokens}-token observations, {args.reply_tokens}-token "
        f"replies; {engine.policy}, positions {args.positions}, "
        f"int8 {args.int8}"
    )
    print(
        f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefill':>7} {'rebuild':>9} "
        f"{'reuse s':>8} {'stateless s':>11} {'ratio':>6} {'KV MB':>7}"
    )
    messages = [{"role": "system", "content": SYSTEM}]
    reuse, stateless = [], []
    for turn, page in enumerate(pages, start=1):
        messages.append({"role": "user", "content": page})
        kept = service.run(messages, reply_params, session_id="episode")
        fresh = service.run(messages, first_token, session_id=f"stateless-{turn}")
        service.sessions.drop(f"stateless-{turn}")
        reuse.append(kept.ttft_s)
        stateless.append(fresh.ttft_s)
        messages.append({"role": "assistant", "content": kept.reply.text})
        print(
            f"{turn:>4} {kept.prompt_tokens:>7} {kept.sync.reused_tokens:>7} "
            f"{kept.sync.prefilled_tokens:>7} {kept.sync.rebuild:>9} {kept.ttft_s:>8.2f} "
            f"{fresh.ttft_s:>11.2f} {fresh.ttft_s / kept.ttft_s:>5.1f}x "
            f"{kept.kv.kv_live_bytes / 1e6:>7.1f}"
        )
    print(
        f"\nturn {args.turns} / turn 1 TTFT: reuse {reuse[-1] / reuse[0]:.2f}x (target <= 1.3x), "
        f"stateless {stateless[-1] / stateless[0]:.2f}x"
    )
    print(
        f"total TTFT over {args.turns} turns: reuse {sum(reuse):.1f} s, "
        f"stateless {sum(stateless):.1f} s ({sum(stateless) / sum(reuse):.1f}x)"
    )


if __name__ == "__main__":
    main()
