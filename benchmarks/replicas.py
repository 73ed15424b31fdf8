"""Serving on Ray Serve replicas (`agent-kv serve --replicas N`), measured on this machine.

- `throughput`: `--sessions` agents, each a client thread running `--turns` turns in order
  (a system prompt, then a page-sized user message and a reply of up to `--max-tokens`
  tokens each turn), all at once, against four servers in turn: one server without Ray on 1
  torch thread and on 2, then 1 replica and 2 replicas of 1 thread each. Printed per server:
  wall seconds, turns/s, tokens/s (prompt tokens prefilled plus tokens generated: an agent's
  turn is mostly prefill), generated tokens/s, and the ratio to 1 replica; the whole round
  runs `--rounds` times (A B C D A B C D: this machine is noisy).
- `hop`: one server without Ray and one replica behind the gateway, both started and both
  idle but for these requests, sent alternately one at a time: the median latency of
  `GET /health` and of a turn of one new token in a session already cached, on each, and
  the difference (what the gateway and Ray Serve's routing add).
- `routers`: `--sessions` agents at once on 2 replicas, one session in four with pages
  8 times longer, under each `--router` (`least-loaded`, Ray Serve's consistent `hash`):
  wall seconds, later turns that found their session's cache, sessions moved between replicas
  (restored from the shared spill by a replica that did not hold them: affinity), and the
  allocated KV bytes each replica holds at the end (balance).
- `kill`: `--sessions` sessions x `--turns` turns on 2 replicas, run once without a kill
  (the reference) and once with the replica holding the first session killed (SIGKILL)
  while a long turn of that session decodes, after turn `--kill-before` - 1. Printed: the
  lost turn's status, completed turns lost (a turn after the kill whose prompt the cache
  held fewer tokens of than in the reference run), and replies identical to the
  reference's.

    .venv/bin/python benchmarks/replicas.py                       # all three, default model
    .venv/bin/python benchmarks/replicas.py --part kill --sessions 20 --turns 5
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx

SYSTEM = (
    "You are a web agent. Each user message is the page you are on, as text; reply with "
    "one action: click [id], type [id] [text], scroll, go_back or stop [answer]. "
) * 6
PAGE = "Forum > Books > Thread {n}: a reader asks for novels about the sea; {k} replies. " * 4


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def server(model: str, *args: str) -> Iterator[httpx.Client]:
    """`agent-kv serve` with `args` on a free port, until the block ends."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "agent_kv.cli", "serve", "--port", str(port), "--no-compile",
         "--model", model, *args],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        for line in proc.stderr:
            if "ready on" in line:
                break
        else:
            raise RuntimeError(f"the server exited with {proc.wait()}")
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            yield client
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def message(session: int, turn: int) -> dict:
    return {"role": "user", "content": PAGE.format(n=100 * session + turn, k=turn + 3)}


def turn(client: httpx.Client, sid: str, history: list[dict], max_tokens: int, **extra) -> dict:
    """One turn; retried while the answer is a 503 (a replica lost), as Retry-After asks."""
    body = {"session_id": sid, "messages": history, "max_tokens": max_tokens, **extra}
    for _ in range(240):
        response = client.post("/chat", json=body)
        if response.status_code != 503:
            response.raise_for_status()
            return response.json()
        time.sleep(0.5)
    raise RuntimeError(f"{sid}: 503 for two minutes")


def agent(client, sid: str, index: int, turns: int, max_tokens: int, out: list) -> None:
    """One session's turns in order, each reply appended to its history."""
    history = [{"role": "system", "content": SYSTEM}]
    for t in range(turns):
        history.append(message(index, t))
        reply = turn(client, sid, history, max_tokens)
        history.append({"role": "assistant", "content": reply["message"]["content"]})
        out.append(reply)


def run_agents(agents: list[tuple]) -> float:
    """Run each `(target, *args)` in a thread of its own, all at once; the wall seconds."""
    threads = [threading.Thread(target=target, args=args) for target, *args in agents]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


def throughput_once(client, tag: str, sessions: int, turns: int, max_tokens: int) -> dict:
    replies: list = []
    wall = run_agents(
        [(agent, client, f"{tag}-{i}", i, turns, max_tokens, replies) for i in range(sessions)]
    )
    generated = sum(r["usage"]["completion_tokens"] for r in replies)
    prefilled = sum(
        r["usage"]["prompt_tokens"] - r["usage"]["prompt_tokens_details"]["cached_tokens"]
        for r in replies
    )
    return {
        "wall_s": wall,
        "turns_per_s": len(replies) / wall,
        "tokens_per_s": (prefilled + generated) / wall,
        "generated_per_s": generated / wall,
    }


def throughput(model: str, sessions: int, turns: int, max_tokens: int, rounds: int) -> None:
    setups = {
        "one server, 1 thread": ["--threads", "1"],
        "one server, 2 threads": ["--threads", "2"],
        "1 replica": ["--replicas", "1", "--threads", "1"],
        "2 replicas": ["--replicas", "2", "--threads", "1"],
    }
    results: dict[str, list[dict]] = {name: [] for name in setups}
    for r in range(rounds):
        for name, args in setups.items():
            with server(model, *args) as client:
                throughput_once(client, f"warm{r}", 2, 1, 4)  # first calls pay one-time costs
                results[name].append(throughput_once(client, f"r{r}", sessions, turns, max_tokens))
            print(f"round {r + 1}: {name}: {results[name][-1]}", file=sys.stderr)
    base = statistics.median(x["tokens_per_s"] for x in results["1 replica"])
    print(f"\n{sessions} sessions x {turns} turns, up to {max_tokens} tokens a reply, {model}")
    print("| server | wall s | turns/s | in+out tok/s | generated tok/s | vs 1 replica |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in runs[0]}
        print(
            f"| {name} | {med['wall_s']:.1f} | {med['turns_per_s']:.2f} | "
            f"{med['tokens_per_s']:.1f} | {med['generated_per_s']:.1f} | "
            f"{med['tokens_per_s'] / base:.2f}x |"
        )


def hop(model: str, requests: int) -> None:
    with (
        server(model, "--threads", "1") as plain,
        server(model, "--replicas", "1", "--threads", "1") as replica,
    ):
        timings: dict[str, list[float]] = {}
        history = [{"role": "system", "content": SYSTEM}, message(0, 0)]
        for client in (plain, replica):
            turn(client, "hop", history, 1)  # the session cached on both
        for _ in range(requests):
            for name, client in (("one server", plain), ("1 replica", replica)):
                started = time.perf_counter()
                client.get("/health").raise_for_status()
                timings.setdefault(f"{name}: GET /health", []).append(time.perf_counter() - started)
                started = time.perf_counter()
                turn(client, "hop", history, 1)
                timings.setdefault(f"{name}: turn", []).append(time.perf_counter() - started)
    med = {name: statistics.median(values) * 1000 for name, values in timings.items()}
    print(f"\n{requests} requests each, alternating, {model}")
    print("| request | one server ms | 1 replica ms | added by the hop ms |")
    print("|---|---|---|---|")
    for what in ("GET /health", "turn"):
        plain_ms, replica_ms = med[f"one server: {what}"], med[f"1 replica: {what}"]
        print(f"| {what} | {plain_ms:.2f} | {replica_ms:.2f} | {replica_ms - plain_ms:.2f} |")


def routers(model: str, sessions: int, turns: int, max_tokens: int) -> None:
    rows = {}
    for router in ("least-loaded", "hash"):
        args = ["--replicas", "2", "--threads", "1", "--router", router]
        with server(model, *args) as client:
            replies: list = []
            wall = run_agents(
                [(skewed_agent, client, i, turns, max_tokens, replies) for i in range(sessions)]
            )
            time.sleep(1.0)  # the replicas' last reports
            kv = [r["kv_allocated_bytes"] for r in client.get("/replicas").json()["data"]]
            moved = summed(client.get("/metrics").text, "agent_kv_sessions_taken_over_total")
        later = [r for r in replies if r["turn"] > 0]
        sticky = sum(r["cached"] > 0 for r in later)
        rows[router] = (wall, sticky, len(later), moved, kv)
    print(f"\n{sessions} sessions of skewed sizes x {turns} turns at once on 2 replicas, {model}")
    print("| router | wall s | later turns with a cache | sessions moved | KV MB per replica |")
    print("|---|---|---|---|---|")
    for router, (wall, sticky, later, moved, kv) in rows.items():
        per = " / ".join(f"{b / 1e6:.0f}" for b in kv)
        print(f"| {router} | {wall:.1f} | {sticky} of {later} | {moved:.0f} | {per} |")


def summed(metrics: str, name: str) -> float:
    """The value of the series `name` without a `replica` label (summed over replicas)."""
    return next(
        float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name + " ")
    )


def skewed_agent(client, index: int, turns: int, max_tokens: int, out: list) -> None:
    """An agent whose pages are 8 times longer in one session of four."""
    history = [{"role": "system", "content": SYSTEM}]
    repeat = 8 if index % 4 == 0 else 1
    for t in range(turns):
        page = message(index, t)
        history.append({"role": "user", "content": page["content"] * repeat})
        reply = turn(client, f"skew-{index}", history, max_tokens)
        history.append({"role": "assistant", "content": reply["message"]["content"]})
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        out.append({"turn": t, "cached": cached})


def kill(model: str, sessions: int, turns: int, max_tokens: int, kill_before: int) -> None:
    spill = tempfile.mkdtemp(prefix="agent-kv-kill-")
    args = ["--replicas", "2", "--threads", "1", "--spill-dir", spill, "--max-batch", "1"]
    with server(model, *args) as client:
        reference = conversations(client, "ref", sessions, turns, max_tokens, None)
        run = conversations(client, "run", sessions, turns, max_tokens, kill_before)
    lost = same = compared = 0
    for i in range(sessions):
        for t in range(kill_before, turns):
            ref, got = reference["replies"][i][t], run["replies"][i][t]
            compared += 1
            same += ref["message"]["content"] == got["message"]["content"]
            cached = "prompt_tokens_details"
            lost += got["usage"][cached]["cached_tokens"] < ref["usage"][cached]["cached_tokens"]
    print(f"\n{sessions} sessions x {turns} turns on 2 replicas, {model}; replica killed")
    print(f"- the turn in flight: {run['killed']}")
    print(f"- completed turns lost: {lost} of {sessions * kill_before}")
    print(f"- replies identical to the run without the kill: {same} of {compared}")


def conversations(client, tag, sessions, turns, max_tokens, kill_before) -> dict:
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(sessions)]
    replies: list[list[dict]] = [[] for _ in range(sessions)]
    killed = None
    for t in range(turns):
        if t == kill_before:
            killed = kill_during_turn(client, f"{tag}-0", histories[0])
        for i in range(sessions):
            histories[i].append(message(i, t))
            reply = turn(client, f"{tag}-{i}", histories[i], max_tokens)
            histories[i].append({"role": "assistant", "content": reply["message"]["content"]})
            replies[i].append(reply)
    return {"replies": replies, "killed": killed}


def kill_during_turn(client, sid: str, history: list[dict]) -> str:
    """Kill the replica holding `sid` while a long turn of it decodes; that turn's answer."""
    for _ in range(100):
        held = {s["id"]: s["replica"] for s in client.get("/sessions").json()["data"]}
        if sid in held:
            break
        time.sleep(0.1)
    pid = next(r["pid"] for r in client.get("/replicas").json()["data"] if r["id"] == held[sid])
    outcome = {}

    ends = client.post("/tokenize", json={"content": "<|im_end|><|endoftext|>"}).json()
    no_end = {str(token): -100 for token in ends["tokens"]}  # the turn decodes all 200 tokens

    def long_turn() -> None:
        body = {"session_id": sid, "messages": [*history, message(99, 99)], "max_tokens": 200}
        outcome["response"] = client.post("/chat", json={**body, "logit_bias": no_end})

    worker = threading.Thread(target=long_turn)
    worker.start()
    time.sleep(1.5)
    os.kill(pid, signal.SIGKILL)
    worker.join()
    response = outcome["response"]
    if response.status_code == 200:
        usage = response.json()["usage"]
        return f"HTTP 200: it ended before the kill ({usage['completion_tokens']} tokens)"
    return f"HTTP {response.status_code} {response.json()['error']['code']}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parts = ["throughput", "hop", "routers", "kill", "all"]
    parser.add_argument("--part", choices=parts, default="all")
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--kill-before", type=int, default=2)
    args = parser.parse_args()
    if args.part in ("throughput", "all"):
        throughput(args.model, args.sessions, args.turns, args.max_tokens, args.rounds)
    if args.part in ("hop", "all"):
        hop(args.model, args.requests)
    if args.part in ("routers", "all"):
        routers(args.model, args.sessions, args.turns, args.max_tokens)
    if args.part in ("kill", "all"):
        kill(args.model, args.sessions, args.turns, args.max_tokens, args.kill_before)


if __name__ == "__main__":
    main()
