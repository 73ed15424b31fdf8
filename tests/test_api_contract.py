"""The request contract of both chat routes (issue 52): `null` is a field's default, the
sampling fields of vLLM and llama.cpp act, a message's `name` is rendered or refused, any field
the request does not define is OpenAI's "Unrecognized request argument", a streamed request
whose client left is a 499, and two messages that once named the wrong problem. On a tiny
random-weight model behind SmolLM2's tokenizer: the contract, not what the model writes."""

from __future__ import annotations

import copy
import json
import logging
import re
import time
from pathlib import Path

import httpx
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.rendering import NAME_PROBE, template_takes_names
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app
from api.schemas import UNSUPPORTED_FIELDS, NoOpFields
from tests.conftest import serving

DOCS = Path(__file__).parents[1] / "docs" / "server.md"
HI = [{"role": "user", "content": "Say hi to the red bicycle."}]
NULLABLE = [
    "temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream",
    "parallel_tool_calls", "max_tokens", "max_completion_tokens", "stop", "seed", "logprobs",
    "top_logprobs", "tool_choice", "tools", "response_format", "user", "stream_options",
    "logit_bias", "model", "metadata", "store", "service_tier", "modalities", "audio",
    "prediction", "reasoning_effort", "verbosity", "web_search_options", "function_call",
    "functions", "prompt_cache_key", "prompt_cache_retention", "safety_identifier", "top_k",
    "min_p", "repetition_penalty", "pin",
]  # fmt: skip
"""Every optional field of a chat completion request: OpenAI documents each of its own as
nullable."""
NAMED_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{% if message.name is defined and message.role == 'user' %} ({{ message.name }}){% endif %}"
    "{{ '\\n' + message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A chat template that renders the names of user messages only."""


def _app(smollm, model, tokenizer=None):
    engine = Engine(model, tokenizer or smollm.tokenizer, make_policy("full"))
    return create_app(ChatService(engine), "tiny")


@pytest.fixture(scope="module")
def app(smollm, tiny_llama):
    return _app(smollm, tiny_llama)


@pytest.fixture
async def client(app):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


async def _completion(client, session: str, **fields) -> dict:
    body = {"messages": HI, "max_tokens": 6, **fields}
    response = await client.post(
        "/v1/chat/completions", json=body, headers={"X-Session-Id": session}
    )
    assert response.status_code == 200, response.text
    return response.json()


def _reply(completion: dict) -> tuple:
    choice = completion["choices"][0]
    return choice["message"]["content"], choice["finish_reason"], completion["usage"]


def _error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


async def test_null_is_the_default_of_every_optional_field(client):
    plain = await _completion(client, "absent")
    nulls = await _completion(client, "nulls", **{f: None for f in NULLABLE if f != "max_tokens"})
    assert _reply(nulls) == _reply(plain)
    native = {"messages": HI, "max_tokens": 6, "temperature": None, "top_p": None, "stop": None}
    response = await client.post("/chat", json={**native, "session_id": "native-null"})
    assert response.status_code == 200, response.text
    assert response.json()["message"]["content"] == plain["choices"][0]["message"]["content"]


async def test_the_openapi_document_shows_the_optional_fields_nullable(client):
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    request = schemas["ChatCompletionRequest"]
    assert set(request["properties"]) - {"messages"} == set(NULLABLE)
    for field in NULLABLE:
        prop = request["properties"][field]
        branches = [prop, *prop.get("anyOf", [])]
        assert {"type": "null"} in branches or prop.get("type") == "null", field
    assert request["required"] == ["messages"] and request["additionalProperties"] is False
    temperature = request["properties"]["temperature"]
    assert temperature["default"] == 0.0 and temperature["anyOf"][0]["maximum"] == 2.0
    native = schemas["NativeChatRequest"]["properties"]
    assert {"type": "null"} in native["top_p"]["anyOf"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat", "/tokenize"])
async def test_an_unknown_field_is_an_unrecognized_argument(client, path):
    body = {"messages": HI, "temperture": 0.5}
    error = _error(await client.post(path, json=body))
    assert error["message"] == "Unrecognized request argument supplied: temperture"
    assert (error["param"], error["code"]) == ("temperture", "unrecognized_argument")
    # named before any other problem of the body, as OpenAI does
    error = _error(await client.post(path, json={**body, "messages": "nope"}))
    assert error["code"] == "unrecognized_argument"


async def test_the_no_op_fields_are_the_documented_list_and_change_nothing(client):
    docs = " ".join(DOCS.read_text().split())
    listed = re.search(r"Accepted with no effect: (.*?) \(they", docs).group(1)
    assert set(re.findall(r"`(\w+)`", listed)) == set(NoOpFields.model_fields)
    refused = re.search(r"Refused with a 400 saying unsupported: (.*?)\. The model", docs)
    assert set(UNSUPPORTED_FIELDS) <= set(re.findall(r"`(\w+)`", refused.group(1)))
    no_ops = {
        "store": True, "metadata": {"run": "7"}, "service_tier": "auto",
        "prompt_cache_key": "k", "prompt_cache_retention": "24h", "safety_identifier": "u1",
        "logprobs": False, "top_logprobs": 0, "modalities": ["text"], "verbosity": "medium",
        "function_call": "none", "functions": [],
    }  # fmt: skip
    plain = await _completion(client, "no-op plain")
    assert _reply(await _completion(client, "no-ops", **no_ops)) == _reply(plain)
    for field, value in (("logprobs", True), ("audio", {"format": "wav"}), ("functions", [{}])):
        body = {"messages": HI, "max_tokens": 1, field: value}
        error = _error(await client.post("/v1/chat/completions", json=body))
        assert (error["param"], error["code"]) == (field, "unsupported")


async def test_top_k_and_min_p_filter_and_the_repetition_penalty_acts(client):
    greedy = _reply(await _completion(client, "greedy", max_tokens=8))
    hot = {"temperature": 2.0, "seed": 5, "max_tokens": 8}
    sampled = _reply(await _completion(client, "sampled", **hot))
    assert sampled != greedy  # a random-weight model's distribution is nearly flat
    assert _reply(await _completion(client, "top-k", top_k=1, **hot)) == greedy
    assert _reply(await _completion(client, "min-p", min_p=1.0, **hot)) == greedy
    assert _reply(await _completion(client, "top-k off", top_k=-1, **hot)) == sampled
    penalized = _reply(await _completion(client, "penalty", repetition_penalty=1e4, max_tokens=8))
    assert penalized != greedy  # greedy, the model repeats a token; the penalty forbids it


@pytest.mark.parametrize(
    "field,value", [("top_k", -2), ("min_p", 1.5), ("repetition_penalty", 0), ("top_k", 0.5)]
)
async def test_sampling_fields_out_of_range_are_400s_naming_them(client, field, value):
    for path in ("/v1/chat/completions", "/chat"):
        body = {"messages": HI, "max_tokens": 1, field: value}
        error = _error(await client.post(path, json=body))
        assert error["param"] == field and error["code"] == "invalid_value"


def test_template_takes_names_probes_each_role(smollm):
    assert not any(
        template_takes_names(smollm.tokenizer, role)
        for role in ("system", "user", "assistant", "tool")
    )
    named = copy.deepcopy(smollm.tokenizer)
    named.chat_template = NAMED_TEMPLATE
    assert template_takes_names(named, "user")
    assert not template_takes_names(named, "assistant")
    assert not template_takes_names(named, "system")
    failing = copy.deepcopy(smollm.tokenizer)
    failing.chat_template = "{{ raise_exception('no') }}{{ messages[0].name }}"
    assert not template_takes_names(failing, "user")
    assert NAME_PROBE not in smollm.tokenizer.apply_chat_template(HI, tokenize=False)


async def test_a_name_the_template_cannot_render_is_refused_clearly(client):
    for path, role in (
        ("/v1/chat/completions", "user"),
        ("/chat", "system"),
        ("/tokenize", "user"),
    ):
        body = {"messages": [{"role": role, "content": "hi", "name": "alice"}]}
        error = _error(await client.post(path, json=body))
        assert (error["param"], error["code"]) == ("messages.0.name", "unsupported")
        assert "does not render the name" in error["message"]


async def test_a_tool_messages_name_must_be_its_calls(client):
    call = {"id": "call_1", "type": "function", "function": {"name": "look", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Look around."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a red bicycle", "name": "peek"},
    ]
    body = {"messages": messages, "max_tokens": 2}
    error = _error(await client.post("/v1/chat/completions", json=body))
    assert (error["param"], error["code"]) == ("messages.2.name", "invalid_value")
    assert "'peek'" in error["message"] and "'look'" in error["message"]
    messages[2]["name"] = "look"
    named = await client.post("/v1/chat/completions", json=body)
    assert named.status_code == 200, named.text
    del messages[2]["name"]
    unnamed = await client.post("/v1/chat/completions", json=body)
    assert named.json()["usage"]["prompt_tokens"] == unnamed.json()["usage"]["prompt_tokens"]


async def test_a_name_the_template_renders_reaches_the_prompt(smollm, tiny_llama):
    named = copy.deepcopy(smollm.tokenizer)
    named.chat_template = NAMED_TEMPLATE
    transport = httpx.ASGITransport(app=_app(smollm, tiny_llama, named))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        message = {"role": "user", "content": "hi", "name": "alice"}
        tokens = (await http.post("/tokenize", json={"messages": [message]})).json()["tokens"]
        assert "<|im_start|>user (alice)\nhi" in named.decode(tokens)
        body = {"messages": [message], "max_tokens": 2}
        reply = await http.post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] == len(tokens)
        body["messages"] = [{"role": "system", "content": "hi", "name": "boss"}]
        error = _error(await http.post("/v1/chat/completions", json=body))
        assert error["param"] == "messages.0.name"


async def test_more_than_four_stop_strings_says_the_limit(client):
    body = {"messages": HI, "max_tokens": 1, "stop": ["a", "b", "c", "d", "e"]}
    error = _error(await client.post("/v1/chat/completions", json=body))
    assert error["param"] == "stop"
    assert error["message"] == "stop: at most 4 stop strings (OpenAI's limit), got 5"


async def test_tokenize_renders_tools_as_a_chat_completion_does(client):
    tool = {
        "type": "function",
        "function": {
            "name": "find_bicycle",
            "description": "Where a bicycle is.",
            "parameters": {"type": "object", "properties": {"colour": {"type": "string"}}},
        },
    }
    response = await client.post("/tokenize", json={"messages": HI, "tools": [tool]})
    assert response.status_code == 200, response.text
    tokens = response.json()["tokens"]
    plain = (await client.post("/tokenize", json={"messages": HI})).json()["tokens"]
    assert len(tokens) > len(plain)
    completion = await _completion(client, "tools", tools=[tool], tool_choice="none")
    assert completion["usage"]["prompt_tokens"] == len(tokens)
    twice = await client.post("/tokenize", json={"messages": HI, "tools": [tool, tool]})
    assert _error(twice)["param"] == "tools"


def test_a_stream_the_client_leaves_is_a_499_in_the_log_and_metrics(smollm, tiny_llama, caplog):
    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    body = {"messages": HI, "max_tokens": 4000, "stream": True}
    app = _app(smollm, tiny_llama)
    with serving(app) as url, httpx.Client(base_url=url, timeout=60) as http:
        headers = {"X-Session-Id": "gone"}
        with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            for _ in range(5):  # a few chunks, then the client goes away
                next(lines)
        closed = 'agent_kv_requests_total{endpoint="/v1/chat/completions",status="499"} 1.0'
        deadline = time.monotonic() + 30
        while closed not in (metrics := http.get("/metrics").text):
            assert time.monotonic() < deadline, metrics
            time.sleep(0.1)
    assert 'endpoint="/v1/chat/completions",status="200"' not in metrics
    lines = [json.loads(r.message) for r in caplog.records if r.name == "agent_kv.requests"]
    (left,) = [line for line in lines if line["route"] == "/v1/chat/completions"]
    assert (left["status"], left["session"], left["error_code"]) == (499, "gone", "client_closed")
