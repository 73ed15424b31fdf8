"""The OpenAI-compatible API in-process (httpx AsyncClient over ASGITransport)."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app


@pytest.fixture
async def client(smollm):
    engine = Engine(
        smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256, protect_recent=32)
    )
    app = create_app(ChatService(engine), "smollm2-135m")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def test_health_and_models(client):
    assert (await client.get("/health")).json() == {
        "status": "ok",
        "model": "smollm2-135m",
        "policy": "conf-kv",
    }
    models = (await client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["smollm2-135m"]


async def test_chat_completion_reports_usage_and_kv(client):
    body = {
        "model": "smollm2-135m",
        "messages": [{"role": "user", "content": "Name a colour of the sky. " * 40}],
        "max_tokens": 8,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    data = response.json()
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in {"stop", "length"}
    usage = data["usage"]
    assert usage["prompt_tokens"] > 256
    assert 1 <= usage["completion_tokens"] <= 8
    # cut at max_tokens exactly when the reply ran out of tokens, not when it stopped
    assert (choice["finish_reason"] == "length") == (usage["completion_tokens"] == 8)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    kv = data["kv"]
    assert kv["evicted_tokens"] > 0
    assert kv["peak_kv_live_bytes"] < kv["full_kv_live_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["peak_kv_allocated_bytes"]
    # the deprecated aliases, for one release: the live figures under their old names
    assert (kv["kv_bytes"], kv["peak_kv_bytes"], kv["full_kv_bytes"]) == (
        kv["kv_live_bytes"],
        kv["peak_kv_live_bytes"],
        kv["full_kv_live_bytes"],
    )


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "stream_options": {"include_usage": "maybe"},
            },
            "stream_options.include_usage",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "functions": [{"name": "f"}],
            },
            "functions",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": [""]}, "stop.0"),
        ({"messages": [{"role": "user", "content": "word " * 9000}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, "seed"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": list("abcde")}, "stop"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "frequency_penalty": 3},
            "frequency_penalty",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": -2.5},
            "presence_penalty",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 101}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"x": 1}}, "logit_bias.x"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"99999999": 1}},
            "logit_bias",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]},
            "modalities",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"},
            "reasoning_effort",
        ),
        (
            {"messages": [{"role": "user", "content": "hi"}], "web_search_options": {"x": 1}},
            "web_search_options",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "prediction": {"type": "content", "content": "x"},
            },
            "prediction",
        ),
        (
            {"messages": [{"role": "tool", "content": "r"}, {"role": "user", "content": "go"}]},
            "messages.0.tool_call_id",
        ),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_object", "json_schema": 3},
            },
            "response_format.json_object.json_schema",
        ),
    ],
)
async def test_bad_requests_are_openai_shaped_400s(client, body, param):
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


async def test_malformed_json_is_a_400(client):
    response = await client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] is None and error["code"] == "invalid_json"


async def test_unknown_routes_are_openai_shaped(client):
    missing = await client.get("/v1/nothing")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "Not Found"
    wrong_method = await client.get("/v1/chat/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"


async def test_text_parts_developer_role_and_null_tools_are_accepted(client):
    body = {
        "messages": [
            {"role": "developer", "content": "Answer briefly."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi."}],
            },
        ],
        "tools": None,
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "max_tokens": 3,
    }
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


async def test_a_session_reuses_its_cache_across_turns(client):
    messages = [
        {"role": "system", "content": "You are a terse assistant for a classifieds site."},
        {"role": "user", "content": "Name one thing people sell on classifieds sites."},
    ]
    body = {"messages": messages, "max_tokens": 6}
    headers = {"X-Session-Id": "episode-1"}
    first = (await client.post("/v1/chat/completions", json=body, headers=headers)).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert first["kv"]["session_id"] == "episode-1" and first["kv"]["rebuild"] == "none"
    messages += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And another one?"},
    ]
    second = (await client.post("/v1/chat/completions", json=body, headers=headers)).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1  # the first turn is not prefilled again
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]
    # the body's `user` names the same session; another id is a separate cache
    other = {**body, "user": "episode-2"}
    third = (await client.post("/v1/chat/completions", json=other)).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await client.delete("/sessions/episode-1")).json() == {
        "id": "episode-1",
        "deleted": True,
    }
    missing = await client.delete("/sessions/episode-1")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    # an id with a slash is a session like any other, and can be deleted
    slashed = {**body, "user": "team/a", "max_tokens": 2}
    assert (await client.post("/v1/chat/completions", json=slashed)).status_code == 200
    deleted = await client.delete("/sessions/team/a")
    assert deleted.json() == {"id": "team/a", "deleted": True}


async def test_streamed_reply_equals_the_plain_one(client):
    body = {
        "messages": [{"role": "user", "content": "List three fruits, comma separated."}],
        "max_tokens": 12,
        "stop": ["\n\n"],
    }
    plain = (await client.post("/v1/chat/completions", json=body)).json()
    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    async with client.stream("POST", "/v1/chat/completions", json=streamed) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finish[-1] == plain["choices"][0]["finish_reason"] and set(finish[:-1]) == {None}
    final = next(c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"])
    assert final["kv"]["session_id"] == plain["kv"]["session_id"]
    assert final["kv"]["rebuild"] == "truncated"
    # the same conversation again without a session id continues the anonymous session of
    # the first request: every prompt token but the last (re-fed for its logits) is cached
    usage = plain["usage"]
    cached = usage["prompt_tokens"] - 1
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {**usage, "prompt_tokens_details": {"cached_tokens": cached}}


async def test_a_prompt_too_long_for_a_stream_is_still_a_400(client):
    body = {"messages": [{"role": "user", "content": "word " * 9000}], "stream": True}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


async def test_logit_bias_and_penalties_change_the_reply(client):
    """OpenAI's sampling fields act (they were once accepted and ignored): a -100 bias on the
    greedy first token moves the reply off it, and a frequency penalty breaks a repetition."""

    async def reply(content: str, **fields) -> str:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 24, **fields}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["message"]["content"]

    async def first_token(text: str) -> int:
        return (await client.post("/tokenize", json={"content": text})).json()["tokens"][0]

    blue = "Repeat the word Blue ten times."
    plain = await reply(blue)
    token = await first_token(plain)
    assert await first_token(await reply(blue, logit_bias={str(token): -100})) != token
    ones = "List the numbers 1 1 1 1 1 1 1 1 1 1 1 1 again."
    assert set((await reply(ones)).split()) == {"1"}  # greedy, the model repeats itself
    assert len(set((await reply(ones, frequency_penalty=2)).split())) > 1


async def test_every_request_logs_one_structured_line(client, caplog):
    """Route, status, error code and message, session, prompt and cached tokens, time."""
    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"X-Session-Id": "logged"}
    for _ in range(2):
        assert (await client.post("/v1/chat/completions", json=body, headers=headers)).is_success
    bad = await client.post("/v1/chat/completions", json={**body, "logprobs": True})
    assert bad.status_code == 400
    lines = [json.loads(r.message) for r in caplog.records if r.name == "agent_kv.requests"]
    first, second, refused = lines
    assert first["route"] == "/v1/chat/completions" and first["status"] == 200
    assert first["session"] == second["session"] == "logged"
    assert first["cached_tokens"] == 0 < second["cached_tokens"] < second["prompt_tokens"]
    assert second["rebuild"] == "truncated"  # the same prompt again: cut back before the reply
    assert second["error"] is None and second["ms"] > 0
    assert refused["status"] == 400 and refused["error_code"] == "unsupported"
    assert "logprobs" in refused["error"]
    assert [r.levelname for r in caplog.records if r.name == "agent_kv.requests"] == [
        "INFO",
        "INFO",
        "WARNING",
    ]
