"""A hostile client cannot take the server down, and the server says who may use it: text the
tokenizer cannot take, pin patterns that would backtrack, oversized work before admission,
the API key and the Host allowlist, the session listing and `/tokenize`, the OpenAPI
document's statuses (httpx AsyncClient over ASGITransport)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.pin_rules import MAX_PATTERN_CHARS, MAX_PATTERNS
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def service(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))
    return ChatService(engine, max_waiting=1, queue_timeout_s=30.0)


async def _client(app, base_url="http://127.0.0.1:8000"):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url=base_url)


@pytest.fixture
async def client(service):
    async with await _client(create_app(service, "smollm2-135m")) as http:
        yield http


def _raw(body: dict) -> dict:
    """Request kwargs sending `body` as JSON text with `\\ud800`-style escapes kept (a lone
    surrogate survives `json.dumps` only as an escape)."""
    return {"content": json.dumps(body), "headers": {"content-type": "application/json"}}


def _says(content, role: str = "user") -> dict:
    return {"messages": [{"role": role, "content": content}]}


COMPLETIONS = "/v1/chat/completions"


@pytest.mark.parametrize(
    "route,body,param",
    [
        (COMPLETIONS, _says("a\ud800b"), "messages.0.content"),
        (COMPLETIONS, {**_says("\udfff"), "stream": True}, "messages.0.content"),
        (COMPLETIONS, _says([{"type": "text", "text": "\ud83d"}]), "messages.0.content"),
        (COMPLETIONS, {"messages": HI, "stop": ["\ud800"]}, "stop"),
        (COMPLETIONS, {"messages": HI, "user": "s\ud800"}, "user"),
        ("/chat", _says("x\ud800", "tool"), "messages.0.content"),
        ("/chat", {"messages": HI, "pin": {"patterns": ["\ud800"]}}, "pin.patterns.0"),
        ("/tokenize", {"content": "\ud800"}, "content"),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_the_field(client, route, body, param):
    body = {"max_tokens": 1, **body} if route != "/tokenize" else body
    response = await client.post(route, **_raw(body))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].startswith(param) and "unicode" in error["message"].lower()


def test_the_connection_survives_a_lone_surrogate(live_server):
    with httpx.Client(base_url=live_server, timeout=60) as http:
        bad = http.post(
            "/v1/chat/completions", **_raw({"messages": [{"role": "user", "content": "\ud800"}]})
        )
        assert bad.status_code == 400 and bad.headers.get("connection") != "close"
        good = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1})
        assert good.status_code == 200  # same keep-alive connection, not reset
        assert (
            http.post(
                "/chat", **_raw({"messages": [{"role": "user", "content": "\ud800"}]})
            ).status_code
            == 400
        )


async def test_a_backtracking_pin_pattern_is_matched_in_linear_time(client):
    text = "a" * 5000 + "!"
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": 1}
    started = time.perf_counter()
    slow = await client.post("/chat", json={**body, "pin": {"patterns": ["(a+)+$"]}})
    # Python's re takes exponential time here (hours); RE2 finds there is no match at once
    print(f"(a+)+$ over 5,001 characters: answered in {time.perf_counter() - started:.2f} s")
    assert slow.status_code == 200 and time.perf_counter() - started < 60
    assert slow.json()["kv"]["pinned_tokens"] == 0
    matched = await client.post("/chat", json={**body, "pin": {"patterns": ["(a+)+!"]}})
    assert matched.json()["kv"]["pinned_tokens"] > 100  # the run of a's and the "!"


@pytest.mark.parametrize(
    "patterns,says",
    [
        ([r"(a)\1"], "not valid RE2 syntax"),
        ([r"(?=a)b"], "not valid RE2 syntax"),
        (["(unclosed"], "not valid RE2 syntax"),
        (["a" * (MAX_PATTERN_CHARS + 1)], f"at most {MAX_PATTERN_CHARS}"),
        (["a"] * (MAX_PATTERNS + 1), f"at most {MAX_PATTERNS}"),
        (["((a{100}){100}){100}"], "not valid RE2 syntax"),
    ],
)
async def test_pin_patterns_re2_refuses_are_422(client, patterns, says):
    body = {"messages": HI, "max_tokens": 1, "pin": {"patterns": patterns}}
    response = await client.post("/chat", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["param"] == "pin.patterns" and says in response.text


async def test_admission_comes_before_any_tokenizing(service, client, monkeypatch):
    calls = []
    original = service.render
    monkeypatch.setattr(service, "render", lambda *a: calls.append(1) or original(*a))
    big = {"messages": [{"role": "user", "content": "word " * 400_000}], "max_tokens": 1}
    admitted = service.admit()  # the one place in the queue is taken
    started = time.perf_counter()
    refused = await client.post("/v1/chat/completions", json=big)
    assert refused.status_code == 429 and calls == []  # refused before templating
    assert time.perf_counter() - started < 5
    admitted.release()
    overflow = await client.post("/v1/chat/completions", json=big)  # 2 MB: off the loop
    assert overflow.status_code == 400 and len(calls) == 1
    assert overflow.json()["error"]["code"] == "context_length_exceeded"


async def test_the_event_loop_answers_while_a_big_body_is_tokenized(client):
    big = {"messages": [{"role": "user", "content": "word " * 400_000}], "max_tokens": 1}
    request = asyncio.create_task(client.post("/chat", json=big))
    await asyncio.sleep(0.05)
    gaps = []
    while not request.done():
        started = time.perf_counter()
        assert (await client.get("/health")).status_code == 200
        gaps.append(time.perf_counter() - started)
        await asyncio.sleep(0.01)
    assert (await request).status_code == 400
    # tokenizing 2 MB takes about a second on two cores; /health answers throughout
    print(f"/health during a 2 MB body: {len(gaps)} answers, slowest {max(gaps):.3f} s")
    assert len(gaps) >= 3 and max(gaps) < 1.0


async def test_api_key_and_host_allowlist(service):
    app = create_app(
        service, "smollm2-135m", api_key="sk-local", allowed_hosts=["127.0.0.1", "localhost"]
    )
    async with await _client(app, "http://localhost:8000") as http:
        missing = await http.get("/v1/models")
        assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "invalid_api_key"
        wrong = await http.post(
            "/chat", json={"messages": HI}, headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 401
        assert (await http.get("/health")).status_code == 200  # liveness needs no key
        auth = {"Authorization": "Bearer sk-local"}
        assert (await http.get("/v1/models", headers=auth)).status_code == 200
        body = {"messages": HI, "max_tokens": 1}
        assert (await http.post("/chat", json=body, headers=auth)).status_code == 200
        doc = (await http.get("/openapi.json", headers=auth)).json()
        assert "401" in doc["paths"]["/chat"]["post"]["responses"]
        assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    async with await _client(app, "http://evil.example:8000") as http:
        rebound = await http.get("/health")  # a page on a rebinding domain reaching 127.0.0.1
        assert rebound.status_code == 400
        assert rebound.json()["error"]["code"] == "host_not_allowed"


async def test_sessions_are_listed(client, service):
    body = {"messages": HI, "max_tokens": 2, "session_id": "ep-1", "pin": {"roles": ["user"]}}
    assert (await client.post("/chat", json=body)).status_code == 200
    policy = {"name": "window", "budget": 64}
    body = {"messages": HI, "max_tokens": 2, "session_id": "ep-2", "policy": policy}
    assert (await client.post("/chat", json=body)).status_code == 200
    listed = (await client.get("/sessions")).json()
    assert listed["object"] == "list" and [s["id"] for s in listed["data"]] == ["ep-1", "ep-2"]
    first, second = listed["data"]
    with service.sessions.use("ep-1") as session:
        assert first["tokens"] == len(session.token_ids) > 0
        assert first["kv_live_bytes"] == session.store.nbytes() > 0
        assert first["kv_allocated_bytes"] == session.store.allocated_nbytes()
        assert first["kv_allocated_bytes"] >= first["kv_live_bytes"]
        assert first["kv_bytes"] == first["kv_live_bytes"]  # the deprecated alias
        assert first["pinned_tokens"] == session.store.pins.tokens() > 0
    assert (first["policy"], second["policy"]) == ("conf-kv", "window")
    assert first["where"] == "memory" and first["busy"] is False
    assert abs(second["last_used"] - time.time()) < 60


async def test_tokenize(client, service):
    text = "Click [12] to open the red bicycle."
    plain = (await client.post("/tokenize", json={"content": text})).json()
    assert plain["tokens"] == service.engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 8192
    chat = (await client.post("/tokenize", json={"messages": HI})).json()
    assert chat["tokens"] == service.render(HI).token_ids
    for body in ({}, {"content": "a", "messages": HI}):
        response = await client.post("/tokenize", json=body)
        assert (
            response.status_code == 400
            and response.json()["error"]["type"] == "invalid_request_error"
        )


async def test_streamed_replies_carry_the_session_header(client):
    body = {"messages": HI, "max_tokens": 2, "stream": True}
    named = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s-9"})
    assert named.status_code == 200 and named.headers["x-session-id"] == "s-9"
    anonymous = await client.post("/v1/chat/completions", json=body)
    assert anonymous.headers["x-session-id"].startswith("auto-")
    assert f'"session_id": "{anonymous.headers["x-session-id"]}"' in anonymous.text
    too_long = await client.post(
        "/v1/chat/completions", json=body, headers={"X-Session-Id": "s" * 257}
    )
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "x-session-id"


async def test_a_stream_refused_before_it_starts_keeps_its_status(client):
    body = {"messages": HI, "max_tokens": 9000, "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_the_openapi_document_matches_the_statuses(client):
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    completions = paths["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "413", "429", "503"} <= set(completions) and "422" not in completions
    assert "text/event-stream" in completions["200"]["content"]
    assert "422" in paths["/chat"]["post"]["responses"]
    assert set(paths["/sessions/{session_id}"]["delete"]["responses"]) >= {"404", "409"}
    assert list(paths["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "HTTPValidationError" not in json.dumps(doc)
    invalid = await client.post("/v1/chat/completions", json={"messages": []})
    assert invalid.status_code == 400  # what the document says, not FastAPI's 422
    wrong_method = await client.get("/v1/chat/completions")
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_huge_policy_numbers_are_refused_not_a_500(client):
    for params in ({"seed": 2**70}, {"seed": -(2**63) - 1}, {"window": 10**30}):
        policy = {"name": "random" if "seed" in params else "window", "params": params}
        body = {"messages": HI, "max_tokens": 1, "policy": policy}
        response = await client.post("/chat", json=body)
        assert response.status_code == 422, response.text
        assert response.json()["error"]["param"] == "policy"


async def test_a_utf8_session_header_names_the_same_session_as_the_body(client, service):
    sid = "épisode-ü"
    body = {"messages": HI, "max_tokens": 1}
    by_header = await client.post(
        "/v1/chat/completions", json=body, headers={"X-Session-Id": sid.encode()}
    )
    assert by_header.json()["kv"]["session_id"] == sid
    by_body = await client.post("/v1/chat/completions", json={**body, "user": sid})
    assert by_body.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert service.sessions.ids() == [sid]


async def test_an_internal_error_is_a_500_counted_and_naming_no_path(service, monkeypatch):
    def broken(*args, **kwargs):
        raise FileNotFoundError("/very/private/path/session.pt")

    monkeypatch.setattr(service, "run", broken)
    transport = httpx.ASGITransport(app=create_app(service, "m"), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        response = await client.post("/chat", json={"messages": HI, "max_tokens": 2})
        metrics = (await client.get("/metrics")).text
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "private" not in error["message"]
    assert "FileNotFoundError" in error["message"]
    assert 'agent_kv_requests_total{endpoint="/chat",status="500"} 1.0' in metrics
