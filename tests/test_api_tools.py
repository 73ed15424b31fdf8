"""Tool calls and structured output through `/v1/chat/completions` and `/chat`, on SmolLM2's
tokenizer and template (the generic tool format) and on the default model's."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 40}},
            "required": ["query"],
            "additionalProperties": False,
        },
    },
}
ASK = [
    {"role": "system", "content": "You are a weather assistant."},
    {"role": "user", "content": "What will the weather be in Oslo for the next 2 days?"},
]


@pytest.fixture(params=["smollm2", "qwen", pytest.param("default", marks=pytest.mark.slow)])
async def client(request):
    """A client of the API on a tiny random-weight model behind SmolLM2's tokenizer and
    template (the generic tool format) or behind the default model's (its `<tool_call>` added
    tokens), or (`slow`) on the real default model."""
    if request.param == "default":
        loaded = request.getfixturevalue("default_model")
        network, tokenizer = loaded.model, loaded.tokenizer
    elif request.param == "smollm2":
        network = request.getfixturevalue("brief_tiny_llama")
        tokenizer = request.getfixturevalue("smollm").tokenizer
    else:
        network = request.getfixturevalue("tiny_qwen")
        tokenizer = request.getfixturevalue("qwen_tokenizer")
    engine = Engine(network, tokenizer, make_policy("window", budget=64))
    app = create_app(ChatService(engine), request.param)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def complete(client, **body) -> dict:
    response = await client.post("/v1/chat/completions", json={"max_tokens": 80, **body})
    assert response.status_code == 200, response.text
    return response.json()


def arguments(call: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    return json.loads(call["function"]["arguments"])


async def test_required_tool_choice_returns_a_valid_call(client):
    data = await complete(client, messages=ASK, tools=[WEATHER, SEARCH], tool_choice="required")
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] is None and message["tool_calls"]
    for call in message["tool_calls"]:
        schema = {"get_weather": WEATHER, "search": SEARCH}[call["function"]["name"]]
        jsonschema.validate(arguments(call), schema["function"]["parameters"])


async def test_a_named_tool_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "search"}}
    data = await complete(
        client, messages=ASK, tools=[WEATHER, SEARCH], tool_choice=choice, parallel_tool_calls=False
    )
    calls = data["choices"][0]["message"]["tool_calls"]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "search"
    assert isinstance(arguments(calls[0])["query"], str)


async def test_tool_choice_none_answers_in_text(client):
    data = await complete(client, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=8)
    choice = data["choices"][0]
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")


async def test_json_schema_and_json_object_replies_validate(client, request):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": schema}}
    data = await complete(client, messages=ASK, response_format=fmt)
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    data = await complete(client, messages=ASK, response_format={"type": "json_object"})
    choice = data["choices"][0]
    if choice["finish_reason"] == "length":  # the real model, its reply's start evicted by the
        # 64-token window, writes one endless string: cut by max_tokens, a JSON object's start
        assert request.node.callspec.params["client"] == "default"
        assert choice["message"]["content"].startswith('{"')
    else:
        assert isinstance(json.loads(choice["message"]["content"]), dict)


async def test_a_tool_round_trip_reuses_the_cache(client):
    first = await complete(
        client, messages=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False
    )
    session = first["kv"]["session_id"]
    message = first["choices"][0]["message"]
    call = message["tool_calls"][0]
    history = ASK + [
        message,
        {"role": "tool", "tool_call_id": call["id"], "content": "Rain, 9 C, then sun."},
    ]
    second = await complete(client, messages=history, tools=[WEATHER], max_tokens=6)
    assert second["kv"]["session_id"] == session
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # the call rendered back is the text the model generated: the whole first turn is reused,
    # or, where the model split its reply into tokens the tokenizer would not (the random
    # model's `"` then `}}` for the tokenizer's `"}}`) or ended its last call with a newline
    # the template does not write, all of it up to the reply
    if second["kv"]["rebuild"] == "none":
        assert cached >= first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    else:
        assert second["kv"]["rebuild"] == "truncated"
        assert cached >= first["usage"]["prompt_tokens"]


async def test_streamed_tool_calls_arrive_as_deltas(client):
    body = {
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": "required",
        "stream": True,
        "max_tokens": 80,
    }
    events = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls and [c["index"] for c in calls] == list(range(len(calls)))
    assert all(c["function"]["name"] == "get_weather" for c in calls)
    jsonschema.validate(arguments(calls[0]), WEATHER["function"]["parameters"])
    assert not any(d.get("content") for d in deltas)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_the_tools_description_is_pinned_like_a_system_message(client):
    messages = [{"role": "user", "content": "Weather? " + "filler " * 300}]
    body = {"messages": messages, "max_tokens": 2, "tools": [WEATHER], "tool_choice": "none"}
    pinned = (await client.post("/chat", json=body)).json()["kv"]["pinned_tokens"]
    assert pinned > 60  # the tools' system message, kept although the window is 64
    body["pin"] = {"roles": [], "latest_observations": 0}
    assert (await client.post("/chat", json=body)).json()["kv"]["pinned_tokens"] == 0


async def test_tool_pins_keep_results_and_calls(client):
    call = {
        "id": "call_a",
        "type": "function",
        "function": {"name": "search", "arguments": '{"query": "bikes"}'},
    }
    messages = [
        {"role": "user", "content": "Find bikes. " + "filler " * 200},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_a", "content": "Red bike $120. " * 10},
        {"role": "user", "content": "And now? " + "filler " * 200},
    ]
    base = {"messages": messages, "max_tokens": 2, "tools": [SEARCH], "tool_choice": "none"}
    none = {"roles": [], "latest_observations": 0}
    plain = (await client.post("/chat", json={**base, "pin": none})).json()
    assert plain["kv"]["pinned_tokens"] == 0 and plain["kv"]["evicted_tokens"] > 0
    pin = {**none, "tool_names": ["search"], "tool_calls": True}
    pinned = (await client.post("/chat", json={**base, "pin": pin})).json()
    assert pinned["kv"]["pinned_tokens"] > 40  # the call and its result
    only_results = {**none, "tool_names": ["search"]}
    results = (await client.post("/chat", json={**base, "pin": only_results})).json()
    assert 0 < results["kv"]["pinned_tokens"] < pinned["kv"]["pinned_tokens"]
    other = {**none, "tool_names": ["get_weather"]}
    assert (await client.post("/chat", json={**base, "pin": other})).json()["kv"][
        "pinned_tokens"
    ] == 0


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
BAD_FUNCTION = {"name": "f", "parameters": BAD_SCHEMA}
BAD_FORMAT = {"type": "json_schema", "json_schema": {"name": "s", "schema": BAD_SCHEMA}}
NAMED_X = {"type": "function", "function": {"name": "x"}}
NAMED_W = {"type": "function", "function": {"name": "get_weather"}}
P0, P1 = "tools.0.function.parameters", "tools.1.function.parameters"


def fn(function: dict) -> dict:
    """`function` as a `tools` entry."""
    return {"type": "function", "function": function}


SURROGATE = {"name": "f", "parameters": {"type": "object", "description": "x\ud800"}}
DEEP: dict = {"type": "integer"}
for _ in range(300):
    DEEP = {"type": "object", "properties": {"a": DEEP}}
DEEP_FUNCTION = {"name": "f", "parameters": DEEP}
STRING_FUNCTION = {"name": "f", "parameters": {"type": "string"}}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": NAMED_X}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tools": [fn(BAD_FUNCTION)]}, P0),
        ({"response_format": BAD_FORMAT}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tools": [WEATHER, fn(BAD_FUNCTION)], "tool_choice": NAMED_W}, P1),
        ({"tools": [fn(SURROGATE)], "tool_choice": "none"}, P0),
        ({"tools": [fn(DEEP_FUNCTION)]}, P0),
        ({"tools": [fn(STRING_FUNCTION)]}, P0),
        ({"tools": [WEATHER], "response_format": BAD_FORMAT}, "response_format"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)  # fmt: skip
async def test_bad_tool_fields_are_400s_naming_them(client, extra, param):
    body = json.dumps({"messages": ASK, "max_tokens": 2, **extra})  # a lone surrogate escaped
    headers = {"content-type": "application/json"}
    response = await client.post("/v1/chat/completions", content=body, headers=headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


CALL = {"id": "call_a", "type": "function", "function": {"name": "search", "arguments": "{}"}}
NOT_AN_OBJECT = {"name": "search", "arguments": "[1]"}
DEEP_ARGUMENTS = {"name": "search", "arguments": "[" * 3000 + "]" * 3000}


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "tool", "tool_call_id": "call_z", "content": "r"}], "messages.0.tool_call_id"),
        (
            [
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_b", "content": "r"},
            ],
            "messages.1.tool_call_id",
        ),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "assistant", "tool_calls": [CALL, CALL]}], "messages.0.tool_calls"),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": DEEP_ARGUMENTS}]}],
            "messages.0.tool_calls.0.function.arguments",
        ),
        ([{"role": "assistant", "content": 3}], "messages.0.content"),
        (
            [{"role": "assistant", "tool_calls": [{**CALL, "function": NOT_AN_OBJECT}]}],
            "messages.0.tool_calls.0.function.arguments",
        ),
    ],
)  # fmt: skip
async def test_bad_tool_messages_are_400s_naming_them(client, messages, param):
    for path in ("/v1/chat/completions", "/chat"):
        body = {"messages": [*messages, {"role": "user", "content": "go"}], "max_tokens": 2}
        response = await client.post(path, json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
