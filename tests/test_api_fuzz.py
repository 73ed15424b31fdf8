"""No client input produces a 500: every field of both chat endpoints replaced by values of
the wrong type, size or shape, and raw bodies that are not JSON objects."""

from __future__ import annotations

import httpx
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

ODD_VALUES = [
    None,
    True,
    -1,
    0,
    2**70,
    -(2**70),
    1e308,
    0.5,
    "",
    "x" * 3000,
    "\u0000\ud7ff\U0001f600",
    [],
    [None],
    [{}],
    {},
    {"type": "text"},
    {"role": "user"},
]
BASE = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
OPENAI_FIELDS = [
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "n",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "pin",
    "top_k",
    "min_p",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "functions",
    "function_call",
    "metadata",
    "prompt_cache_retention",
    "an_unknown_field",
]
NATIVE_FIELDS = [
    "session_id", "pin", "policy", "max_tokens", "stop", "seed", "messages", "tools",
    "tool_choice", "response_format", "top_k", "min_p", "repetition_penalty", "temperature",
]  # fmt: skip
MESSAGE_VARIANTS = [
    {"role": "user"},
    {"content": "hi"},
    {"role": "user", "content": None},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": "hi", "pin": "yes"},
    {"role": "tool", "content": "hi", "tool_call_id": 3},
    {"role": "tool", "content": "hi", "tool_call_id": "call_nowhere"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": None}]},
    {"role": "assistant", "tool_calls": [{"id": "", "function": {"name": "f", "arguments": "{"}}]},
    {"role": "assistant", "content": "\ufffd" * 100},
    {"role": "user", "content": "hi", "name": "alice"},
    {"role": "user", "content": "hi", "name": None},
    {"role": "user", "content": "hi", "name": 5},
    {"role": "tool", "content": "hi", "tool_call_id": "call_nowhere", "name": "f"},
]
NESTED_VARIANTS = [
    {"pin": {"patterns": ["a" * 5000]}},
    {"pin": {"patterns": [None]}},
    {"pin": {"roles": "system"}},
    {"policy": {"name": None}},
    {"policy": {"name": "conf-kv", "params": {"n_low": -5}}},
    {"policy": {"name": "conf-kv", "budget": 2**70}},
    {"policy": {"name": "h2o", "params": {"protect_recent": 10**9}}},
    {"policy": {"name": "random", "params": {"seed": 1.5}}},
    {"policy": {"name": "h2o", "recall": {"cap_bytes": 2**70, "score": None}}},
    {"policy": {"name": "h2o", "recall": {"page_tokens": 10**9, "every": -1}}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/x"}}}]},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
    {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": 5}}},
    {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}},
        }
    },
    {"pin": {"tool_names": ["a b"], "tool_calls": "yes"}},
    {"repetition_penalty": 1e-300, "temperature": 1.0, "top_k": 1, "min_p": 1.0},
    {"repetition_penalty": 1e300, "temperature": 2.0, "top_p": 1e-9},
    {"stop": ["a", "b", "c", "d", "e"]},
    {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "r", "tool_call_id": "c1", "name": "g"},
        ]
    },
]
RAW_BODIES = [b"", b"null", b"[]", b"3", b'"text"', b"\xff\xfe\x00", b"[" * 5000, b'{"messages":']


@pytest.fixture(scope="module")
def app(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=64))
    return create_app(ChatService(engine), "smollm2-135m")


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def _bodies(fields: list[str]) -> list[dict]:
    bodies = [{**BASE, field: value} for field in fields for value in ODD_VALUES]
    bodies += [{**BASE, "messages": [variant]} for variant in MESSAGE_VARIANTS]
    return bodies


async def _check(response: httpx.Response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat"])
async def test_no_field_value_gives_a_500(client, path):
    fields = OPENAI_FIELDS if path == "/v1/chat/completions" else NATIVE_FIELDS
    bodies = _bodies(fields) + [{**BASE, **v} for v in NESTED_VARIANTS]
    statuses = set()
    for body in bodies:
        response = await client.post(path, json=body)
        await _check(response)
        statuses.add(response.status_code)
    assert 400 in statuses and 200 in statuses  # both kinds were exercised


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat"])
async def test_raw_bodies_and_odd_headers_give_4xx(client, path):
    for raw in RAW_BODIES:
        response = await client.post(
            path, content=raw, headers={"content-type": "application/json"}
        )
        await _check(response)
        assert response.status_code == 400
    form = await client.post(path, content=b"a=1", headers={"content-type": "text/plain"})
    await _check(form)
    long_id = {"X-Session-Id": "s" * 5000}
    await _check(await client.post("/v1/chat/completions", json=BASE, headers=long_id))
    for method in ("GET", "PUT", "DELETE"):
        await _check(await client.request(method, path))
    await _check(await client.delete("/sessions/" + "%2F" * 50))
