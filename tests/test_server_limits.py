"""The server's limits hold while it runs: the KV byte cap during turns (polled on
`/metrics` under load), a turn's bound on what its session can allocate, work stopped when a
client leaves, idle sessions expiring without traffic, saved sessions known after a
restart (live uvicorn servers and the session store directly)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_kv.kv.policies import make_policy
from agent_kv.kv.store import Int8Config
from agent_kv.kv.store.figures import StoreFigures
from agent_kv.kv.store.pins import flag_runs
from agent_kv.runtime.chat.pin_rules import ChatPins, PinRules, protected_spans
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceOutline
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.session_store import SessionStore
from api.app import create_app
from tests.conftest import serving

pytestmark = pytest.mark.enable_socket

SESSION_BYTES = 256 * 46_080  # 256 fp32 token slots of SmolLM2-135M


def _gauges(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


def _story(i: int) -> list[dict]:
    facts = " ".join(f"Shelf {i}-{j} holds item {i * 100 + j}." for j in range(25))
    return [{"role": "system", "content": facts}, {"role": "user", "content": "Which shelf?"}]


def test_the_kv_cap_holds_while_turns_run(smollm, tmp_path):
    cap = 3 * SESSION_BYTES
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), prefill_chunk=128)
    sessions = SessionStore(engine, max_kv_bytes=cap, spill_dir=tmp_path)
    service = ChatService(engine, sessions)
    with serving(create_app(service, "smollm2-135m")) as url:
        peaks = {"agent_kv_kv_allocated_bytes": 0.0, "agent_kv_kv_live_bytes": 0.0}
        done = threading.Event()

        def poll():
            while not done.is_set():
                for name, value in _gauges(url).items():
                    if name in peaks:
                        peaks[name] = max(peaks[name], value)
                time.sleep(0.01)

        poller = threading.Thread(target=poll)
        poller.start()
        statuses = []

        def agent(i: int):
            with httpx.Client(base_url=url, timeout=300) as http:
                for _ in range(2):
                    body = {"messages": _story(i), "max_tokens": 8, "session_id": f"a{i}"}
                    statuses.append(http.post("/chat", json=body).status_code)

        agents = [threading.Thread(target=agent, args=(i,)) for i in range(4)]
        for thread in agents:
            thread.start()
        for thread in agents:
            thread.join()
        done.set()
        poller.join()
        listed = httpx.get(f"{url}/sessions").json()["data"]
    allocated, live = peaks["agent_kv_kv_allocated_bytes"], peaks["agent_kv_kv_live_bytes"]
    print(f"cap {cap} B; peak allocated {allocated:.0f} B, live {live:.0f} B; "
          f"{sessions.spilled} sessions spilled")  # fmt: skip
    assert statuses == [200] * 8
    assert 0 < live <= allocated <= cap
    assert sessions.spilled >= 2  # four sessions of ~320 tokens (512 slots each) did not all fit
    assert {s["where"] for s in listed} == {"memory", "disk"}


@pytest.mark.parametrize(
    "policy,int8",
    [
        (make_policy("full"), None),
        (make_policy("conf-kv", budget=160), None),
        (make_policy("conf-kv-l", budget=160, protect_recent=16), Int8Config(fp_window=32)),
        (make_policy("window", budget=64, sinks=4), None),
        (make_policy("arkv", budget=96), None),
    ],
)
def test_a_turn_never_allocates_more_than_its_bound(
    tiny_qwen, qwen_tokenizer, policy, int8, monkeypatch
):
    """Four turns under each policy, the last rewritten by the client: no store of a turn
    allocates more than the bound the service computed for it. What the model writes does not
    matter (up to 12 tokens a reply): a random-weight model behind the default model's
    tokenizer and template."""
    engine = Engine(tiny_qwen, qwen_tokenizer, policy, prefill_chunk=64, int8=int8)
    service = ChatService(engine)
    rules = PinRules(roles=frozenset({"system"}))
    peak = [0]
    note_allocated = StoreFigures.note_allocated

    def measured(figures, allocated):  # every allocation any store of the turn makes
        peak[0] = max(peak[0], allocated)
        note_allocated(figures, allocated)

    monkeypatch.setattr(StoreFigures, "note_allocated", measured)
    history: list[dict] = []
    kinds = []
    for turn in range(4):
        facts = _story(turn)[0]["content"]
        if turn == 3:  # the client rewrote its history: cut back, or rebuilt from scratch
            history = [{"role": "system", "content": facts}]
        else:
            history += [{"role": "system" if turn == 0 else "tool", "content": facts}]
        with service.sessions.use("s") as session:
            outline = SequenceOutline.describe(session)
        peak[0] = outline.footprint.allocated_bytes
        prompt = service.render(history).token_ids
        spans = protected_spans(service.render(history), history, rules)
        pinned = sum(end - start for start, end in spans)
        bound = service.turn_kv_bound(policy, prompt, pinned, 12, outline)
        reply = service.run(history, SamplingParams(max_new_tokens=12), "s", rules)
        history.append({"role": "assistant", "content": reply.reply.text})
        kinds.append(reply.kv.rebuild)
        assert peak[0] <= bound, (turn, peak[0], bound)
    assert kinds[:3] == ["none"] * 3 and kinds[3] != "none"


def test_a_turn_chooses_its_pins_once_and_pins_what_it_reserved_for(smollm, monkeypatch):
    """A server turn chooses its pins once: the same choice sizes its KV reservation and is
    what its session pins."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=64, sinks=4))
    service = ChatService(engine, SessionStore(engine, max_kv_bytes=1 << 30))
    rules = PinRules(roles=frozenset({"system"}), patterns=(r"item \d+",))
    choices, reserved = [], []
    choose, bound = ChatPins.choose.__func__, service.turn_kv_bound

    def counted_choose(cls, *args):
        choices.append(choose(cls, *args))
        return choices[-1]

    def counted_bound(policy, prompt_ids, pinned_tokens, *rest):
        reserved.append(pinned_tokens)
        return bound(policy, prompt_ids, pinned_tokens, *rest)

    monkeypatch.setattr(ChatPins, "choose", classmethod(counted_choose))
    monkeypatch.setattr(service, "turn_kv_bound", counted_bound)
    history = [_story(1)[0], {"role": "user", "content": "Which shelf holds item 104?"}]
    turn = service.run(history, SamplingParams(max_new_tokens=4), "s", rules)
    assert len(choices) == 1
    pinned = choices[0].merged()
    assert reserved == [choices[0].pinned_tokens] and choices[0].pinned_tokens > 100
    assert len(pinned) > 1  # the system message and the pattern match in the user's message
    with service.sessions.use("s") as session:
        held = flag_runs(session.store.pins.positions().tolist())
    assert held == pinned, (held, pinned, turn.prompt_tokens)


def test_a_grown_session_takes_a_new_conversation_within_the_cap(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    cap = 600 * 46_080  # room for the first turn's ~510 tokens (544 slots), not for two
    service = ChatService(engine, SessionStore(engine, max_kv_bytes=cap))
    params = SamplingParams(max_new_tokens=4)
    long = [{"role": "user", "content": "Shelf 7 holds the red bicycle. " * 52}]
    first = service.run(long, params, "s")
    assert 450 < first.kv.full_kv_live_bytes // 46_080 <= 512  # nearly fills 512 slots
    # a new conversation in the same session: cut back to the shared template prefix, so
    # the turn needs no more than the session already holds (its bound once counted the
    # 500 tokens about to be forgotten, 47 MB)
    again = service.run([{"role": "user", "content": "hi"}], params, "s")
    assert again.kv.rebuild == "truncated"
    assert service.sessions.allocated_bytes() <= cap


def test_a_client_that_leaves_a_plain_request_stops_its_turn(live_service, caplog):
    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    url, service = live_service
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a red bicycle."}],
        "max_tokens": 300,
    }
    with httpx.Client(base_url=url) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "left"},
                      timeout=1.5)  # fmt: skip
        quick = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        started = time.perf_counter()
        assert http.post("/chat", json=quick, timeout=120).status_code == 200
        waited = time.perf_counter() - started
        metrics = http.get("/metrics").text
    with service.sessions.use("left") as session:
        generated = len(session.token_ids) - len(service.render(body["messages"]).token_ids)
    print(
        f"after the client left: {generated} tokens generated, next request waited {waited:.2f} s"
    )
    assert generated < 150 and waited < 10  # stopped soon after the client left
    closed = 'agent_kv_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0'
    assert closed in metrics
    lines = [json.loads(r.message) for r in caplog.records if r.name == "agent_kv.requests"]
    (left,) = [line for line in lines if line["status"] == 499]  # logged, though nobody read it
    assert (left["route"], left["session"], left["error_code"]) == (
        "/v1/chat/completions",
        "left",
        "client_closed",
    )


def test_idle_sessions_expire_without_traffic(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=64))
    service = ChatService(engine, SessionStore(engine, idle_ttl_s=1.0))
    app = create_app(service, "smollm2-135m", sweep_interval_s=0.2)
    with serving(app) as url:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert httpx.post(f"{url}/chat", json={**body, "session_id": "idle"}).status_code == 200
        assert service.sessions.ids() == ["idle"]
        deadline = time.monotonic() + 10
        while service.sessions.ids() and time.monotonic() < deadline:
            time.sleep(0.1)  # no requests: only the server's sweeper can expire it
    assert service.sessions.ids() == [] and service.sessions.dropped == 1


def test_saved_sessions_are_known_after_a_restart(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    one = 64 * 46_080  # what a 50-token session allocates: 50 + 5%, in whole 32-token blocks
    first = SessionStore(engine, max_kv_bytes=one, spill_dir=tmp_path)
    for sid in ("old", "new"):
        with first.use(sid, policy="full") as session:
            engine.prefill(session, list(range(10, 60)))
    assert first.in_memory() == ["new"]  # "old" was saved to make room
    expected = first.describe()[0]
    old_file = next(tmp_path.glob("*.pt"))
    (tmp_path / "0123456789abcdef0123456789abcdef.pt").write_bytes(b"not a session")
    os.utime(old_file, (time.time() - 50, time.time() - 50))
    restarted = SessionStore(engine, idle_ttl_s=100, spill_dir=tmp_path)
    listed = restarted.describe()
    assert [s.id for s in listed] == ["old"] and listed[0].where == "disk"
    assert (listed[0].tokens, listed[0].kv_live_bytes) == (50, expected.kv_live_bytes)
    assert listed[0].policy == "full"
    assert list(tmp_path.glob("*.pt")) == [old_file]  # the unreadable file is gone
    later = SessionStore(engine, idle_ttl_s=30, spill_dir=tmp_path)  # saved 50 s ago
    assert later.ids() == [] and not old_file.exists() and later.dropped == 1


def test_a_server_that_stops_saves_its_sessions_for_the_next(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=64))
    service = ChatService(engine, SessionStore(engine, spill_dir=tmp_path))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serving(create_app(service, "smollm2-135m")) as url:
        for sid in ("a", "b"):
            assert httpx.post(f"{url}/chat", json={**body, "session_id": sid}).status_code == 200
        assert list(tmp_path.glob("*.pt")) == []  # no cap: both in memory while it runs
    restarted = SessionStore(engine, spill_dir=tmp_path)
    assert sorted(s.id for s in restarted.describe() if s.where == "disk") == ["a", "b"]


async def test_a_turn_the_cap_cannot_hold_fails_alone_and_clearly(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    token = 46_080  # bytes of one full-KV token of SmolLM2
    cap = 1000 * token
    sessions = SessionStore(engine, max_kv_bytes=cap, spill_dir=tmp_path)
    service = ChatService(engine, sessions, queue_timeout_s=1.0)
    app = create_app(service, "smollm2-135m")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        short = {"messages": _story(0), "max_tokens": 4, "session_id": "a"}
        first = await http.post("/chat", json=short)
        assert first.status_code == 200
        first_prompt = first.json()["usage"]["prompt_tokens"]
        # a turn that cannot fit even alone: a 400 saying why, before any prefill
        long = [{"role": "user", "content": "Shelf 7 holds the red bicycle. " * 150}]
        refused = await http.post("/v1/chat/completions", json={"messages": long, "user": "b"})
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["code"] == "kv_capacity_exceeded" and "cap on all sessions" in error["message"]
        # one that could fit, but not beside a request holding the room: a 503 after its wait
        with sessions.use("hog", need=lambda outline: cap - 100 * token):  # "a" leaves memory
            waited = await http.post("/chat", json={**short, "session_id": "c"})
        assert waited.status_code == 503 and waited.headers["Retry-After"]
        assert waited.json()["error"]["code"] == "timeout"
        where = {s["id"]: s["where"] for s in (await http.get("/sessions")).json()["data"]}
        assert where["a"] == "disk" and "c" not in where
        # the session that fitted is intact (saved, then restored): its next turn reads its cache
        reply = {"role": "assistant", "content": first.json()["message"]["content"]}
        again = {**short, "messages": [*_story(0), reply, {"role": "user", "content": "And?"}]}
        second = await http.post("/chat", json=again)
        assert second.status_code == 200
        cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first_prompt
        listed = {s["id"] for s in (await http.get("/sessions")).json()["data"]}
        assert "b" not in listed and "a" in listed


async def test_a_damaged_spill_file_is_never_half_restored(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    sessions = SessionStore(engine, spill_dir=tmp_path)
    app = create_app(ChatService(engine, sessions), "smollm2-135m")
    transport = httpx.ASGITransport(app=app)
    body = {"messages": _story(0), "max_tokens": 3, "session_id": "a"}
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        first = await http.post("/chat", json=body)
        assert first.status_code == 200
        sessions.save_all()
        path = next(tmp_path.glob("*.pt"))
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut short
        again = await http.post("/chat", json=body)
        assert again.status_code == 200  # started again from the history the client sent
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again.json()["message"] == first.json()["message"]  # greedy: the same reply
        assert not path.exists() and sessions.unreadable == 1
        metrics = (await http.get("/metrics")).text
        assert "agent_kv_sessions_unreadable_total 1.0" in metrics


def test_a_session_that_cannot_be_saved_is_dropped_and_counted(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    spill = tmp_path / "spill"
    (spill / "0123456789abcdef0123456789abcdef.pt").mkdir(parents=True)  # not a file: ignored
    sessions = SessionStore(engine, max_kv_bytes=64 * 46_080, spill_dir=spill)  # one session
    assert sessions.ids() == []
    with sessions.use("a") as session:
        engine.prefill(session, list(range(10, 60)))
    shutil.rmtree(spill)  # the disk is gone: "a" cannot be saved when "b" needs the room
    with sessions.use("b") as session:
        engine.prefill(session, list(range(10, 60)))
    assert sessions.ids() == ["b"] and sessions.spill_failures == 1 and sessions.dropped == 1
