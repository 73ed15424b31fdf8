"""`agent-kv serve --replicas 2` on a local Ray cluster on this machine, with SmolLM2 (one
torch thread per replica): sessions stick to their replica, and killing a replica's process
loses no completed turn. The turn in flight on it fails with a retryable 503; the next turn
of every session answers as in a run without the kill."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest
from processes import CLI, agent_kv_serve, free_port

SESSIONS = 4
TURNS = 3
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    spill = tmp_path_factory.mktemp("spill")
    with agent_kv_serve(
        "--replicas", "2", "--model", "smollm2-135m", "--threads", "1", "--policy", "full",
        "--max-batch", "1", "--spill-dir", str(spill), timeout=600,
    ) as url:  # fmt: skip
        with httpx.Client(base_url=url, timeout=120) as client:
            yield client


def user_message(session: int, turn: int) -> dict:
    return {"role": "user", "content": f"Agent {session}, step {turn}: list three colours."}


def run_turn(client: httpx.Client, sid: str, messages: list[dict], **extra) -> httpx.Response:
    body = {"session_id": sid, "messages": messages, "max_tokens": MAX_TOKENS, **extra}
    return client.post("/chat", json=body)


def turn_with_retries(client: httpx.Client, sid: str, messages: list[dict]) -> dict:
    """One turn, retried on 503 (a replica lost) as a client following Retry-After would."""
    for _ in range(60):
        response = run_turn(client, sid, messages)
        if response.status_code != 503:
            assert response.status_code == 200, response.text
            return response.json()
        time.sleep(0.5)
    raise AssertionError(f"{sid}: still 503 after 30 s")


def holders(client: httpx.Client, ids: set[str]) -> dict[str, str]:
    """The replica holding each session of `ids`, once every one of them is reported."""
    for _ in range(100):
        listed = {s["id"]: s["replica"] for s in client.get("/sessions").json()["data"]}
        if ids <= set(listed):
            return {sid: listed[sid] for sid in ids}
        time.sleep(0.1)
    raise AssertionError(f"sessions not all reported: {ids - set(listed)}")


def test_sessions_stick_to_one_replica_and_their_cache_grows_turn_after_turn(cluster):
    histories = {f"stick-{i}": [] for i in range(SESSIONS)}
    cached = {sid: [] for sid in histories}
    placed = []
    for turn in range(TURNS):
        for i, (sid, history) in enumerate(histories.items()):
            history.append(user_message(i, turn))
            reply = turn_with_retries(cluster, sid, history)
            history.append({"role": "assistant", "content": reply["message"]["content"]})
            cached[sid].append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
        placed.append(holders(cluster, set(histories)))
    assert all(p == placed[0] for p in placed)  # every turn on the same replica
    assert len(set(placed[0].values())) == 2  # the sessions spread over both replicas
    for sid, counts in cached.items():
        assert counts[0] == 0 and counts[1] > 0 and counts[2] > counts[1], (sid, counts)
    replicas = cluster.get("/replicas").json()["data"]
    assert {r["id"] for r in replicas} == set(placed[0].values())
    assert all(r["sessions"] >= 1 and r["kv_allocated_bytes"] > 0 for r in replicas)
    summed = f'agent_kv_requests_total{{endpoint="/chat",status="200"}} {SESSIONS * TURNS}.0'
    for _ in range(50):  # the replicas report every half second
        metrics = cluster.get("/metrics").text
        if summed in metrics:
            break
        time.sleep(0.1)
    assert summed in metrics and "agent_kv_replicas 2.0" in metrics


def test_a_replica_killed_loses_no_completed_turn_and_its_sessions_answer_as_without_it(
    cluster,
):
    def conversation(prefix: str, kill_before: int | None) -> dict[str, list[str]]:
        histories = {f"{prefix}-{i}": [] for i in range(SESSIONS)}
        replies = {sid: [] for sid in histories}
        for turn in range(TURNS):
            if turn == kill_before:
                kill_during_a_turn(histories)
            for i, (sid, history) in enumerate(histories.items()):
                history.append(user_message(i, turn))
                reply = turn_with_retries(cluster, sid, history)
                history.append({"role": "assistant", "content": reply["message"]["content"]})
                replies[sid].append(reply["message"]["content"])
                if turn == kill_before:
                    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
                    assert cached > 0, f"{sid} started again instead of resuming"
        return {sid.split("-")[1]: texts for sid, texts in replies.items()}

    def kill_during_a_turn(histories: dict[str, list]) -> None:
        victim = next(iter(histories))
        where = holders(cluster, set(histories))[victim]
        pid = next(r["pid"] for r in cluster.get("/replicas").json()["data"] if r["id"] == where)
        outcome = {}

        def long_turn() -> None:
            messages = [*histories[victim], {"role": "user", "content": "Write a long story."}]
            no_end = {"0": -100, "2": -100}  # SmolLM2's end tokens: it decodes all 400
            outcome["response"] = run_turn(
                cluster, victim, messages, max_tokens=400, logit_bias=no_end
            )

        worker = threading.Thread(target=long_turn)
        worker.start()
        time.sleep(1.5)  # the turn is decoding
        os.kill(pid, signal.SIGKILL)
        worker.join(120)
        lost = outcome["response"]
        assert lost.status_code == 503 and lost.headers["retry-after"]
        assert lost.json()["error"]["code"] == "replica_unavailable"

    reference = conversation("ref", kill_before=None)
    assert conversation("run", kill_before=2) == reference


def test_more_replicas_than_the_cluster_has_cpus_for_is_an_error_at_start():
    done = subprocess.run(
        [*CLI, "serve", "--replicas", "64", "--threads", "1", "--model", "smollm2-135m",
         "--no-compile", "--port", str(free_port())],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0
    assert "64 replicas of 1 thread(s) need 64 CPUs; the Ray cluster has" in done.stderr


def test_streams_anonymous_agents_and_bad_requests_pass_through_the_gateway_as_on_one_server(
    cluster,
):
    body = {"messages": [user_message(9, 0)], "max_tokens": MAX_TOKENS, "user": "streamed"}
    with cluster.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3
    history = [{"role": "system", "content": "You are a web agent."}, user_message(8, 0)]
    first = cluster.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
    reply = first.json()["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": reply}, user_message(8, 1)]
    later = cluster.post("/v1/chat/completions", json={"messages": history, "max_tokens": 4})
    assert later.headers["x-session-id"] == first.headers["x-session-id"]  # the same replica
    assert later.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    bad = cluster.post("/chat", content=b"{not json", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    huge = cluster.post("/chat", content=b"x" * (8 * 2**20 + 1))
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
