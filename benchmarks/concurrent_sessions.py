"""Many agents on one model: the aggregate decode throughput of N sessions served together
(continuous batching, `ChatService(max_batch=N)`) against the same sessions served one turn
at a time (`max_batch=1`, what the server did before), and the time to first token of a turn
that arrives while they decode, against the same turn on an idle server; side by side in
one run.

Each session is an agent episode in progress: a system prompt and an observation of about
`--history` tokens already in its cache (a first turn of one token, untimed), then a timed
turn: a short user message and exactly `--reply` decoded tokens (end-of-turn ignored).
Throughput is all the timed turns' decoded tokens over the wall time from their submission to
the last one's end (prefill of the short messages included), with nothing else running. Then
each session sends one more such turn, and when they have decoded about a third of their
tokens a new session arrives with a `--history`-token prompt; its time to first token is
measured from its submission (waiting included) to its first token, and compared with the
same turn sent to the idle server.

    .venv/bin/python benchmarks/concurrent_sessions.py                  # 8 sessions, conf-kv
    .venv/bin/python benchmarks/concurrent_sessions.py --sessions 4 --reply 16 --compile
"""

from __future__ import annotations

import argparse
import threading
import time

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService

SYSTEM = (
    "You are a web agent. Each user message is the accessibility tree of the current page. "
    "Reply with exactly one action."
)


def observation(tokenizer, index: int, size: int) -> str:
    """The `index`-th slice of `size` tokens of the licence texts, as text."""
    ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    start = (index * size) % max(len(ids) - size, 1)
    return tokenizer.decode(ids[start : start + size])


def messages(tokenizer, index: int, size: int, replies: list[str] = ()) -> list[dict]:
    """A session's conversation: the system prompt and an observation, then each of the
    model's `replies` so far (as the cache holds them), each followed by a short user turn."""
    history = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": observation(tokenizer, index, size)},
    ]
    for reply in replies:
        history += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "The page scrolled. What next?"},
        ]
    return history


def make_service(loaded, args, max_batch: int) -> ChatService:
    engine = Engine(
        loaded.model, loaded.tokenizer, make_policy(args.policy, budget=args.budget),
        compile=args.compile,
    )  # fmt: skip
    engine.eos_ids = set()  # every timed turn decodes exactly --reply tokens
    engine.warm_up()
    return ChatService(engine, max_batch=max_batch)


def run(loaded, args, max_batch: int) -> dict:
    """One setting: N sessions' timed turns submitted together (the throughput), then N
    more with a turn arriving while they decode (its time to first token)."""
    service = make_service(loaded, args, max_batch)
    tokenizer = loaded.tokenizer
    replies: list[list[str]] = [[] for _ in range(args.sessions)]
    for i in range(args.sessions):  # each session's history, untimed
        turn = service.run(
            messages(tokenizer, i, args.history), SamplingParams(max_new_tokens=1),
            session_id=f"s{i}",
        )  # fmt: skip
        replies[i].append(turn.reply.text)
    # the arriving turn alone first (its own session, then dropped)
    arriving = messages(tokenizer, args.sessions, args.history)
    alone = service.run(arriving, SamplingParams(max_new_tokens=1), session_id="alone")
    alone_ttft = alone.wait_s + alone.ttft_s
    service.sessions.drop("alone")
    params = SamplingParams(max_new_tokens=args.reply)
    decoded: list[int] = []
    rebuilds: list[str] = []

    def timed(i: int) -> None:
        turn = service.run(messages(tokenizer, i, args.history, replies[i]), params, f"s{i}")
        replies[i].append(turn.reply.text)
        decoded.append(len(turn.reply.token_ids))
        rebuilds.append(turn.sync.rebuild)

    def start_turns() -> list[threading.Thread]:
        threads = [threading.Thread(target=timed, args=(i,)) for i in range(args.sessions)]
        for thread in threads:
            thread.start()
        return threads

    scheduler = service.scheduler
    rows_before, iterations_before = scheduler.rows, scheduler.iterations
    started = time.perf_counter()
    for thread in start_turns():  # the throughput: the timed turns alone
        thread.join()
    wall = time.perf_counter() - started
    iterations = scheduler.iterations - iterations_before
    mean_batch = (scheduler.rows - rows_before) / max(iterations, 1)
    tokens = sum(decoded)
    threads = start_turns()  # the time to first token: a turn arrives while they decode
    arrival = {}

    def arrive() -> None:
        turn = service.run(arriving, SamplingParams(max_new_tokens=1), session_id="arriving")
        arrival["ttft"] = turn.wait_s + turn.ttft_s

    arrival_thread = threading.Thread(target=arrive)
    third = scheduler.rows + args.sessions * args.reply // 3  # decode rows run so far
    while all(t.is_alive() for t in threads) and scheduler.rows < third:
        time.sleep(0.01)
    arrival_thread.start()
    for thread in [*threads, arrival_thread]:
        thread.join()
    scheduler.close()
    assert rebuilds == ["none"] * 2 * args.sessions, rebuilds  # each turn extends its history
    return {
        "step_ms": wall / iterations * 1e3,
        "tokens": tokens,
        "wall": wall,
        "alone_ttft": alone_ttft,
        "loaded_ttft": arrival["ttft"],
        "mean_batch": mean_batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--history", type=int, default=400, help="tokens of each history")
    parser.add_argument("--reply", type=int, default=32, help="tokens each timed turn decodes")
    parser.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="the batched setting's max_batch (serve's default)",
    )
    parser.add_argument("--policy", default="conf-kv")
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="a bundled model, a model directory or a .gguf file (default: smollm2-135m, the "
        "model of the documented figures)",
    )
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    loaded = load_model(args.model)
    results = {}
    for label, max_batch in [("one at a time", 1), (f"{args.sessions} together", args.max_batch)]:
        results[label] = run(loaded, args, max_batch)
        print(f"  {label} done", flush=True)
    base = results["one at a time"]
    base_rate = base["tokens"] / base["wall"]
    print(
        f"\n{args.sessions} sessions x {args.reply} decoded tokens, {args.history}-token "
        f"histories, {args.policy} budget {args.budget}, compile {args.compile}\n"
    )
    print("| serving | decode tok/s (all sessions) | vs one at a time | mean rows per call "
          "| ms per call | arriving turn's TTFT, loaded / alone |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        rate = r["tokens"] / r["wall"]
        ratio = r["loaded_ttft"] / r["alone_ttft"]
        print(
            f"| {label} | {rate:.1f} | {rate / base_rate:.2f}x | {r['mean_batch']:.1f} | "
            f"{r['step_ms']:.0f} | {r['loaded_ttft']:.2f} s / {r['alone_ttft']:.2f} s "
            f"({ratio:.2f}x) |"
        )


if __name__ == "__main__":
    main()
