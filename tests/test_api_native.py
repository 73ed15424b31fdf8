"""The native `/chat` endpoint, anonymous sessions matched by prefix, `/metrics`, and the
413/422/429/503 statuses (httpx AsyncClient over ASGITransport)."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

SYSTEM = "You help a web agent. Item id 4817 is the red bicycle at http://shop.local/item/4817."


@pytest.fixture
def service(smollm):
    engine = Engine(
        smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256, protect_recent=32)
    )
    return ChatService(engine, max_waiting=1, queue_timeout_s=1.0)


@pytest.fixture
async def client(service):
    app = create_app(service, "smollm2-135m", max_body_bytes=64 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def _metrics(text: str) -> dict[tuple[str, tuple], float]:
    """`{(sample name, sorted labels): value}` of a Prometheus exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


async def test_native_chat_reports_kv_stats_pins_and_confidence(client, service):
    body = {
        "session_id": "agent-7",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Which item is the red bicycle? " + "Think. " * 150},
        ],
        "max_tokens": 4,
        "pin": {"roles": [], "latest_observations": 0, "patterns": [r"http://[\w./]+\d"]},
    }
    response = await client.post("/chat", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["session_id"] == "agent-7"
    kv = data["kv"]
    # only the URL is pinned: its tokens, not the system message's
    url_tokens = len(service.engine.tokenizer(" http://shop.local/item/4817")["input_ids"])
    assert kv["pinned_tokens"] == url_tokens
    assert kv["policy"] == "conf-kv"
    # one gated call for the prompt (one chunk), one per generated token fed back (not EOS)
    confidence = kv["confidence"]
    fed = data["usage"]["completion_tokens"] - (data["finish_reason"] == "stop")
    assert confidence["steps"] == 1 + fed
    assert 0.0 <= confidence["min"] <= confidence["mean"] <= 1.0
    assert confidence["min"] <= confidence["last"] <= 1.0
    assert data["usage"]["prompt_tokens"] > 256 and kv["evicted_tokens"] > 0
    assert kv["kv_live_bytes"] <= kv["peak_kv_live_bytes"] < kv["full_kv_live_bytes"]
    assert kv["kv_live_bytes"] <= kv["kv_allocated_bytes"] <= kv["peak_kv_allocated_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["peak_kv_allocated_bytes"]
    assert kv["kv_shared_bytes"] == 0 and kv["cold_kv_bytes"] == 0  # no sharing, no recall
    # the deprecated aliases, for one release: the live figures under their old names
    assert (kv["kv_bytes"], kv["peak_kv_bytes"], kv["full_kv_bytes"]) == (
        kv["kv_live_bytes"],
        kv["peak_kv_live_bytes"],
        kv["full_kv_live_bytes"],
    )
    assert data["timing"]["ttft_s"] > 0 and data["timing"]["wait_s"] >= 0

    # the next turn: the default rules pin the whole system message; the first turn's
    # tokens are not prefilled again
    body.pop("pin")
    body["messages"] += [data["message"], {"role": "user", "content": "And its price?"}]
    again = (await client.post("/chat", json=body)).json()
    assert again["kv"]["pinned_tokens"] > 2 * url_tokens
    assert (
        again["usage"]["prompt_tokens_details"]["cached_tokens"] >= data["usage"]["prompt_tokens"]
    )


async def test_shared_prefix_blocks_are_reported_apart(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"), share_prefixes=True)
    service = ChatService(engine)
    app = create_app(service, "smollm2-135m")
    system = SYSTEM + " Answer with one short line." * 8  # several whole 32-token blocks
    kvs = []
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        for question in ("Which item is red?", "Where is it?"):
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": question},
            ]
            body = {"session_id": question, "messages": messages, "max_tokens": 1}
            kvs.append((await http.post("/chat", json=body)).json()["kv"])
        samples = _metrics((await http.get("/metrics")).text)
    shared = engine.prefix_cache.nbytes()
    # both sessions read the same blocks, held once, apart from each session's own bytes
    assert [kv["kv_shared_bytes"] for kv in kvs] == [shared, shared] and shared > 0
    assert samples[("agent_kv_kv_shared_bytes", ())] == shared
    assert samples[("agent_kv_kv_live_bytes", ())] == sum(kv["kv_live_bytes"] for kv in kvs)
    assert samples[("agent_kv_kv_allocated_bytes", ())] == shared + sum(
        kv["kv_allocated_bytes"] for kv in kvs
    )


async def test_native_chat_policy_override_applies_to_that_turn_only(client, service):
    messages = [{"role": "user", "content": "Count the words. " + "word " * 200}]
    body = {"messages": messages, "max_tokens": 2, "policy": {"name": "window", "budget": 64}}
    data = (await client.post("/chat", json=body)).json()
    assert data["kv"]["policy"] == "window" and data["kv"]["pinned_tokens"] == 0
    with service.sessions.use(data["session_id"]) as session:
        per_token = session.store.bytes_per_token()
    # the window keeps at most 64 tokens per layer, and it did evict
    assert 32 * per_token <= data["kv"]["kv_live_bytes"] <= 64 * per_token
    assert data["kv"]["evicted_tokens"] > 0
    assert service.engine.policy.name == "conf-kv"
    follow = {"messages": messages, "max_tokens": 2, "session_id": data["session_id"]}
    assert (await client.post("/chat", json=follow)).json()["kv"]["policy"] == "conf-kv"


async def test_a_turn_with_recall_settings_keeps_a_cold_tier(client):
    messages = [{"role": "user", "content": "Count the words. " + "word " * 300}]
    recall = {"pages": 2, "page_tokens": 32, "cap_bytes": "1MB"}
    body = {
        "messages": messages,
        "max_tokens": 2,
        "policy": {"name": "h2o", "budget": 64, "recall": recall},
    }
    data = (await client.post("/chat", json=body)).json()
    assert data["kv"]["policy"] == "h2o+recall" and data["kv"]["evicted_tokens"] > 0
    assert 0 < data["kv"]["cold_kv_bytes"] <= 1_000_000


async def test_an_arkv_turn_quantizes_and_a_second_format_is_refused(client, service):
    messages = [{"role": "user", "content": "Count the words. " + "word " * 400}]
    arkv = {"name": "arkv", "budget": 160, "params": {"protect_recent": 32}}
    body = {"messages": messages, "max_tokens": 2, "policy": arkv}
    data = (await client.post("/chat", json=body)).json()
    assert data["kv"]["policy"] == "arkv" and data["kv"]["quantized_tokens"] > 0
    with service.sessions.use(data["session_id"]) as session:
        assert session.store.precision.quantized_format() == "fp8"
        seen = session.store.seen_tokens
    int8 = {**arkv, "params": {"protect_recent": 32, "quantized": "int8"}}
    follow = {**body, "session_id": data["session_id"], "policy": int8}
    response = await client.post("/chat", json=follow)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["param"] == "policy" and "holds fp8 tokens" in error["message"]
    with service.sessions.use(data["session_id"]) as session:
        assert session.store.seen_tokens == seen  # the refused turn left the cache alone


async def test_pins_hold_from_the_first_chunk_of_a_long_first_prompt(client, service):
    # the prompt is far over the window: pins must be in place before it is prefilled
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Read this. " + "filler " * 300},
        {"role": "tool", "content": "[12] link 'Red bicycle - $120'"},
    ]
    body = {"messages": messages, "max_tokens": 2, "policy": {"name": "window", "budget": 16}}
    data = (await client.post("/chat", json=body)).json()
    pinned = data["kv"]["pinned_tokens"]
    assert pinned > 40 and data["kv"]["evicted_tokens"] > 0
    with service.sessions.use(data["session_id"]) as session:
        store = session.store
        for layer in range(store.num_layers):
            assert int(store.pins.mask(layer).sum()) == pinned  # every pinned token is live
            assert store.lengths()[layer] <= pinned + 16


@pytest.mark.parametrize(
    "extra,status,param",
    [
        ({"pin": {"patterns": ["(unclosed"]}}, 422, "pin.patterns"),
        ({"policy": {"name": "conf-kv", "params": {"tau": 3.0}}}, 422, "policy"),
        ({"policy": {"name": "lru"}}, 400, "policy.name"),
        ({"policy": {"name": "full", "budget": 64}}, 422, "policy"),
        ({"policy": {"name": "arkv", "params": {"quantized": "fp4"}}}, 422, "policy"),
        ({"policy": {"name": "window", "params": {"window": "big"}}}, 422, "policy"),
        ({"policy": {"name": "window", "params": {"window": [1]}}}, 400, "policy.params.window"),
        ({"policy": {"name": "full", "recall": {}}}, 422, "policy"),
        ({"policy": {"name": "h2o", "recall": {"pages": 0}}}, 422, "policy"),
        ({"policy": {"name": "h2o", "recall": {"pgaes": 2}}}, 422, "policy"),
        ({"policy": {"name": "h2o", "recall": {"cap_bytes": "lots"}}}, 422, "policy"),
        ({"policy": {"name": "h2o", "recall": {"pages": [2]}}}, 400, "policy.recall.pages"),
        ({"pin": {"latest_observations": -1}}, 400, "pin.latest_observations"),
        ({"pin": {"roles": ["wizard"]}}, 400, "pin.roles.0"),
        ({"sesion_id": "typo"}, 400, "sesion_id"),
        ({"session_id": ""}, 400, "session_id"),
    ],
)
async def test_native_chat_bad_controls(client, extra, status, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, **extra}
    response = await client.post("/chat", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


async def test_anonymous_conversations_are_matched_by_prefix(client):
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Name one thing people sell on classifieds sites."},
    ]
    first = await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
    session = first.json()["kv"]["session_id"]
    assert session.startswith("auto-") and first.headers["x-session-id"] == session
    messages += [
        {"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And another one?"},
    ]
    second = (
        await client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5})
    ).json()
    assert second["kv"]["session_id"] == session
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= (first.json()["usage"]["prompt_tokens"])
    )
    # another conversation that shares only the system message gets its own session
    other = [messages[0], {"role": "user", "content": "What is a bicycle?"}]
    third = (
        await client.post("/v1/chat/completions", json={"messages": other, "max_tokens": 5})
    ).json()
    assert third["kv"]["session_id"] not in {session} and third["kv"]["rebuild"] == "none"
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_per_message_pin_flag(client):
    note = "Remember: the locker code is 5521."
    plain = [{"role": "user", "content": note}, {"role": "user", "content": "Hi."}]
    flagged = [{**plain[0], "pin": True}, plain[1]]
    counts = []
    for i, messages in enumerate([plain, flagged]):
        headers = {"X-Session-Id": f"pin-{i}"}
        body = {"messages": messages, "max_tokens": 1}
        data = (await client.post("/v1/chat/completions", json=body, headers=headers)).json()
        counts.append(data["kv"]["pinned_tokens"])
    assert counts[0] == 0 and counts[1] >= 10  # the flagged message's tokens, template included


async def test_metrics_count_what_the_turns_did(client, service):
    messages = [{"role": "user", "content": "Say yes. " * 50}]
    replies = []
    for _ in range(2):
        body = {"messages": messages, "max_tokens": 3}
        response = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Session-Id": "m"}
        )
        replies.append(response.json())
        messages += [replies[-1]["choices"][0]["message"], {"role": "user", "content": "Again."}]
    await client.post("/chat", json={"messages": [{"role": "user", "content": "hi"}], "bad": 1})
    text = (await client.get("/metrics")).text
    samples = _metrics(text)
    assert samples[("agent_kv_ttft_seconds_count", ())] == 2
    reused = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies)
    prompt = sum(r["usage"]["prompt_tokens"] for r in replies)
    assert samples[("agent_kv_prompt_tokens_total", (("source", "reused"),))] == reused > 0
    assert samples[("agent_kv_prompt_tokens_total", (("source", "prefilled"),))] == prompt - reused
    assert samples[("agent_kv_completion_tokens_total", ())] == sum(
        r["usage"]["completion_tokens"] for r in replies
    )
    live = service.sessions.live_bytes()
    assert samples[("agent_kv_kv_live_bytes", ())] == live > 0
    assert samples[("agent_kv_kv_bytes", ())] == live  # the deprecated alias
    assert samples[("agent_kv_kv_allocated_bytes", ())] == service.sessions.allocated_bytes()
    assert samples[("agent_kv_kv_shared_bytes", ())] == 0  # an engine without prefix sharing
    assert samples[("agent_kv_sessions", (("where", "memory"),))] == 1
    evicted = replies[-1]["kv"]["evicted_tokens"]
    assert samples[("agent_kv_evicted_tokens_total", ())] == evicted > 0
    rebuilds = [r["kv"]["rebuild"] for r in replies if r["kv"]["rebuild"] != "none"]
    for kind in ("truncated", "scratch"):
        counted = samples.get(("agent_kv_cache_rebuilds_total", (("kind", kind),)), 0)
        assert counted == rebuilds.count(kind)
    ok = (("endpoint", "/v1/chat/completions"), ("status", "200"))
    assert samples[("agent_kv_requests_total", ok)] == 2
    assert samples[("agent_kv_requests_total", (("endpoint", "/chat"), ("status", "400")))] == 1


async def test_oversized_body_is_a_413(client):
    body = {"messages": [{"role": "user", "content": "x" * 70_000}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "request_too_large"


async def test_busy_model_gives_429_then_503(client, service, monkeypatch):
    """One turn at a time (`max_batch` 1) and the running one stuck in its forward call: the
    next turn waits (the one place in the queue), a third is refused at once, and the waiting
    one gives up after `queue_timeout_s`."""
    service.scheduler.max_batch = 1
    held, release = threading.Event(), threading.Event()
    step = service.engine.step

    def stuck(parts):
        held.set()
        release.wait(10)
        return step(parts)

    monkeypatch.setattr(service.engine, "step", stuck)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    holder = threading.Thread(
        target=service.run, args=(body["messages"], SamplingParams(max_new_tokens=1))
    )
    holder.start()
    assert held.wait(10)
    waiting = asyncio.create_task(client.post("/v1/chat/completions", json=body))
    for _ in range(100):
        if service.queue_full():
            break
        await asyncio.sleep(0.01)
    refused = await client.post("/chat", json=body)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "busy"
    timed_out = await waiting  # queue_timeout_s is 1 s
    assert timed_out.status_code == 503 and timed_out.json()["error"]["code"] == "timeout"
    release.set()
    holder.join()
    monkeypatch.setattr(service.engine, "step", step)
    assert (await client.post("/chat", json=body)).status_code == 200
