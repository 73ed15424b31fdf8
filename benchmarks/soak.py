"""A bounded soak of one server: many sessions, many turns of random lengths and policies, under
a `--session-bytes` cap, sessions spilling to disk, coming back and expiring; at the end every
shared prefix block is back (the prefix cache empty once its sessions are gone) and the
process's memory is flat after warm-up.

Each session starts with one of two system prompts (pinned by the default pin rules, so its
leading blocks are shared with the other sessions that start alike), then turns of a user
message of random length (10 to `--max-user` tokens) and a reply of 1 to 8 tokens; its policy
is drawn from conf-kv, h2o, window (budgets 64 to 256) and full. Turns go round the sessions
in random order, `--sessions` x `--turns` in all, through `ChatService` (the server's path)
with a cap of `--cap-mb` (idle sessions spill to a temporary directory and come back on their
next turn). Sessions idle for `--ttl` turns' worth of a fake clock expire.

Printed every `--every` turns: turns done, the process's resident memory (MB), the sessions
in memory, their allocated and live KV (MB), the shared blocks held and their bytes. Then all
sessions are dropped: the shared blocks left (0 expected) and the resident memory after.

    .venv/bin/python benchmarks/soak.py                                  # 200 x 10 turns
    .venv/bin/python benchmarks/soak.py --sessions 12 --turns 3 --every 12
"""

from __future__ import annotations

import argparse
import gc
import random
import tempfile
from dataclasses import dataclass, field

from agent_kv.evals.texts import licence_text
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.model_loading import load_model
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionStore

MB = 1e6
SYSTEMS = (
    "You are a web agent. Each user message is a page; reply with exactly one action. " * 8,
    "You are a shopping assistant. Answer with the product's name and price only. " * 8,
)
POLICIES = ("conf-kv", "h2o", "window", "full")


def resident_bytes() -> int:
    """The process's resident set size in bytes (Linux: /proc/self/statm)."""
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class SoakSession:
    """One session's conversation and policy."""

    id: str
    policy_name: str
    budget: int | None
    messages: list[dict] = field(default_factory=list)

    def policy(self):
        """A fresh policy object of the session's kind (a policy object is not shared)."""
        if self.budget is None:
            return make_policy(self.policy_name)
        return make_policy(self.policy_name, budget=self.budget)


@dataclass
class SoakClock:
    """A fake monotonic clock that moves one second a turn."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def soak(loaded, sessions: int, turns: int, cap_mb: float, ttl: float, max_user: int,
         every: int, seed: int, report=print) -> dict:  # fmt: skip
    """Run the soak (module docstring); `report` receives each progress line. Returns the
    figures at the end: `samples` (per progress line: turns, resident MB, sessions in memory,
    allocated and live MB, shared blocks, shared MB), `shared_blocks_left`, `shared_runs_left`,
    `resident_after_mb`, `spilled`, `dropped` (expired)."""
    rng = random.Random(seed)
    words = loaded.tokenizer.decode(
        loaded.tokenizer(licence_text(), add_special_tokens=False)["input_ids"][:4000]
    ).split()
    engine = Engine(
        loaded.model, loaded.tokenizer, make_policy("full"), prefill_chunk=128,
        share_prefixes=True,
    )  # fmt: skip
    clock = SoakClock()
    with tempfile.TemporaryDirectory() as spill:
        store = SessionStore(engine, int(cap_mb * MB), idle_ttl_s=ttl, spill_dir=spill,
                             clock=clock)  # fmt: skip
        service = ChatService(engine, store, max_batch=1)
        pool = []
        for i in range(sessions):
            name = rng.choice(POLICIES)
            budget = None if name == "full" else rng.choice((64, 128, 256))
            if name == "conf-kv":
                budget = max(budget, 160)  # its confident half must exceed protect_recent
            system = {"role": "system", "content": rng.choice(SYSTEMS)}
            pool.append(SoakSession(f"s{i}", name, budget, [system]))
        order = [s for s in pool for _ in range(turns)]
        rng.shuffle(order)
        samples = []
        for done, session in enumerate(order, start=1):
            clock.now += 1.0
            start = rng.randrange(len(words) - max_user)
            text = " ".join(words[start : start + rng.randint(10, max_user)])
            session.messages.append({"role": "user", "content": text})
            params = SamplingParams(max_new_tokens=rng.randint(1, 8))
            turn = service.run(session.messages, params, session.id, policy=session.policy())
            session.messages.append({"role": "assistant", "content": turn.reply.text})
            if done % every == 0 or done == len(order):
                cache = engine.prefix_cache
                sample = {
                    "turns": done,
                    "resident_mb": resident_bytes() / MB,
                    "in_memory": len(store.in_memory()),
                    "allocated_mb": store.allocated_bytes() / MB,
                    "live_mb": store.live_bytes() / MB,
                    "shared_blocks": cache.blocks,
                    "shared_mb": cache.nbytes() / MB,
                }
                samples.append(sample)
                report(
                    f"| {done} | {sample['resident_mb']:.0f} | {sample['in_memory']} | "
                    f"{sample['allocated_mb']:.1f} | {sample['live_mb']:.1f} | "
                    f"{sample['shared_blocks']} | {sample['shared_mb']:.1f} |"
                )
        spilled, dropped = store.spilled, store.dropped
        for sid in store.ids():
            store.drop(sid)
        service.scheduler.close()
    del service, store
    gc.collect()
    return {
        "samples": samples,
        "shared_blocks_left": engine.prefix_cache.blocks,
        "shared_runs_left": engine.prefix_cache.runs,
        "resident_after_mb": resident_bytes() / MB,
        "spilled": spilled,
        "dropped": dropped,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--cap-mb", type=float, default=300.0)
    parser.add_argument("--ttl", type=float, default=600.0, help="idle seconds (1 per turn)")
    parser.add_argument("--max-user", type=int, default=120, help="words per user message")
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    thread_setting.choose(args.threads)
    thread_setting.apply()
    loaded = load_model(args.model, weights="fp32")
    print(f"model {loaded.name}: {args.sessions} sessions x {args.turns} turns, cap "
          f"{args.cap_mb:.0f} MB, idle TTL {args.ttl:.0f} turns")  # fmt: skip
    print("| turns | resident MB | sessions in memory | KV allocated MB | KV live MB | "
          "shared blocks | shared MB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    out = soak(loaded, args.sessions, args.turns, args.cap_mb, args.ttl, args.max_user,
               args.every, args.seed)  # fmt: skip
    print(
        f"\nall sessions dropped: {out['shared_blocks_left']} shared blocks and "
        f"{out['shared_runs_left']} runs left; resident {out['resident_after_mb']:.0f} MB; "
        f"{out['spilled']} spills, {out['dropped']} sessions expired"
    )


if __name__ == "__main__":
    main()
