"""Sessions per gigabyte: the KV bytes N server sessions hold when they start alike, with shared
prefix blocks (`Engine(share_prefixes=True)`, what `agent-kv serve` runs) and without, side by
side in one run; and how many such sessions stay in memory under one `--session-bytes` cap.

Two workloads, each N sessions of one turn through `ChatService` (the server's path: default
pin rules, so the system turn is pinned), every session its own observation:
- `chat`: a system prompt of about `--system` tokens (a web agent's instructions and worked
  examples), then a distinct user message of `--user` tokens; CONF-KV at `--budget`;
- `tools`: the tool agent's system turn (its instructions and the 12 action tools' schemas,
  rendered by the chat template), then a distinct observation; the same policy.
Each session replies at most `--reply` tokens. Reported per workload and mode: allocated and live KV
of all sessions (their own buffers, plus the shared blocks once), one session's alone, the ratio,
and sessions per GB of allocated KV; then, under a cap of `--cap-mb`, how many of `--sessions`
sessions (sent one after another) are still in memory at the end.

    .venv/bin/python benchmarks/session_memory.py                       # SmolLM2-135M, 8 + 16
    .venv/bin/python benchmarks/session_memory.py --model qwen2.5-coder-0.5b --sessions 16
"""

from __future__ import annotations

import argparse
import gc

from agent_kv.evals.texts import licence_text
from agent_kv.harness.action_formats import TOOLS_SYSTEM_PROMPT
from agent_kv.harness.action_tools import ACTION_TOOLS
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import ReplySpec, ToolChoice
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionStore

MB = 1e6


def text_of(tokenizer, start: int, size: int) -> str:
    """`size` tokens of the licence texts from token `start`, as text."""
    ids = tokenizer(licence_text(), add_special_tokens=False)["input_ids"]
    start %= max(len(ids) - size, 1)
    return tokenizer.decode(ids[start : start + size])


def conversations(tokenizer, workload: str, sessions: int, system_tokens: int, user: int):
    """Per session, its messages and reply spec."""
    if workload == "chat":
        system = "You are a web agent. Follow these worked examples.\n" + text_of(
            tokenizer, 0, system_tokens
        )
        spec = ReplySpec()
    else:
        system, spec = TOOLS_SYSTEM_PROMPT, ReplySpec(ACTION_TOOLS, ToolChoice("auto"))
    return [
        (
            [
                {"role": "system", "content": system},
                {"role": "user", "content": text_of(tokenizer, 5000 + 97 * i, user)},
            ],
            spec,
        )
        for i in range(sessions)
    ]


def held(service: ChatService) -> tuple[int, int]:
    """Allocated and live KV bytes of the service's sessions, the shared blocks once."""
    sessions = service.sessions
    return sessions.allocated_bytes(), sessions.live_bytes() + sessions.shared_bytes()


def run(loaded, args, workload: str, share: bool, sessions: int, cap: int | None):
    """Serve `sessions` one-turn sessions; returns (allocated, live) after the first and after
    all, and the sessions still in memory."""
    policy = make_policy("conf-kv", budget=args.budget)
    engine = Engine(loaded.model, loaded.tokenizer, policy, share_prefixes=share)
    service = ChatService(engine, SessionStore(engine, max_kv_bytes=cap), max_batch=1)
    params = SamplingParams(max_new_tokens=args.reply)
    first = None
    for i, (messages, spec) in enumerate(
        conversations(loaded.tokenizer, workload, sessions, args.system, args.user)
    ):
        service.run(messages, params, session_id=f"s{i}", reply=spec)
        if first is None:
            first = held(service)
    out = first, held(service), len(service.sessions.in_memory())
    service.scheduler.close()
    del service, engine
    gc.collect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--system", type=int, default=1540, help="chat system prompt tokens")
    parser.add_argument("--user", type=int, default=30, help="tokens of each user message")
    parser.add_argument("--sessions", type=int, default=8, help="chat sessions (tools: twice)")
    parser.add_argument("--reply", type=int, default=8)
    parser.add_argument("--cap-mb", type=float, default=600.0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    thread_setting.apply()
    loaded = load_model(args.model, weights="fp32")
    print(f"model {loaded.name}, conf-kv budget {args.budget}, reply {args.reply} tokens")
    print("| workload | sessions | prefix blocks | one session (MB alloc / live) | "
          "all (MB alloc / live) | all / one | sessions per GB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for workload, sessions in (("chat", args.sessions), ("tools", 2 * args.sessions)):
        for share in (False, True):
            (one_alloc, one_live), (alloc, live), _ = run(
                loaded, args, workload, share, sessions, None
            )
            print(
                f"| {workload} | {sessions} | {'shared' if share else 'own copies'} | "
                f"{one_alloc / MB:.1f} / {one_live / MB:.1f} | {alloc / MB:.1f} / "
                f"{live / MB:.1f} | {alloc / one_alloc:.2f}x | {sessions * 1e9 / alloc:.0f} |"
            )
    cap = int(args.cap_mb * MB)
    sessions = 4 * args.sessions
    print(f"\nunder --session-bytes {args.cap_mb:.0f} MB, {sessions} chat sessions sent:")
    for share in (False, True):
        *_, kept = run(loaded, args, "chat", share, sessions, cap)
        print(f"- {'shared' if share else 'own copies'}: {kept} sessions in memory")


if __name__ == "__main__":
    main()
