"""What agent frameworks send, as they send it, against the OpenAI-compatible route (httpx
AsyncClient over ASGITransport, the tiny random Llama behind SmolLM2's tokenizer: the shape of
requests and what the cache reuses, not what the model writes)."""

from __future__ import annotations

import json

import httpx
import pytest

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

BROWSER_USE_SYSTEM = "You are a browser agent. Rules: act on one element per step. " * 40


@pytest.fixture
def service(smollm, tiny_llama):
    engine = Engine(tiny_llama, smollm.tokenizer, make_policy("conf-kv", budget=256))
    return ChatService(engine)


@pytest.fixture
async def client(service):
    app = create_app(service, "tiny", max_body_bytes=256 * 1024)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        yield http


def _browser_use_step(step: int) -> dict:
    """browser-use's request shape: one long system prompt, and the last user message
    rewritten every step (the page state and the step number at its start)."""
    page = " ".join(f"[{i}]<a>link {i} of step {step}</a>" for i in range(120))
    return {
        "model": "tiny",
        "messages": [
            {"role": "system", "content": BROWSER_USE_SYSTEM},
            {"role": "user", "content": f"Step {step}. Current page:\n{page}"},
        ],
        "max_tokens": 2,
        "temperature": 0,
        "frequency_penalty": 0.3,
    }


async def test_a_rewritten_last_message_keeps_the_pinned_system_prompt_cached(client, service):
    """browser-use rewrites its last user message every step: after eviction ran, the cache
    keeps the system prompt (pinned by default, evicted by no policy) and prefills only the
    rest."""
    headers = {"X-Session-Id": "browser-use"}
    system_tokens = len(
        service.prompt_ids([{"role": "system", "content": BROWSER_USE_SYSTEM}])
    )  # system turn plus the generation prompt's few tokens
    replies = []
    for step in (1, 2, 3):
        response = await client.post(
            "/v1/chat/completions", json=_browser_use_step(step), headers=headers
        )
        assert response.status_code == 200, response.text
        replies.append(response.json())
    first, *later = replies
    assert first["kv"]["evicted_tokens"] > 0 and first["kv"]["rebuild"] == "none"
    for reply in later:
        assert reply["kv"]["rebuild"] == "truncated"
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert system_tokens - 8 <= cached < reply["usage"]["prompt_tokens"]


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
        },
    },
}


async def test_a_call_sent_back_re_serialised_renders_as_generated(client):
    """pydantic-ai parses a call's arguments and dumps them compactly: the call comes back with
    its id and JSON-equal arguments, and the history still matches the cache (no rebuild)."""
    headers = {"X-Session-Id": "pydantic-ai"}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    body = {"model": "tiny", "tools": [WEATHER_TOOL], "parallel_tool_calls": False}
    body |= {"tool_choice": "required", "max_tokens": 40}
    first = await client.post(
        "/v1/chat/completions", json={**body, "messages": messages}, headers=headers
    )
    assert first.status_code == 200, first.text
    assert first.json()["choices"][0]["finish_reason"] == "tool_calls", first.text
    call = first.json()["choices"][0]["message"]["tool_calls"][0]
    arguments = call["function"]["arguments"]
    compact = json.dumps(json.loads(arguments), separators=(",", ":"))
    assert compact != arguments  # generated with ", " and ": " separators
    sent_back = {**call, "function": {**call["function"], "arguments": compact}}
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [sent_back]},
        {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 21 C."},
    ]
    second = await client.post(
        "/v1/chat/completions",
        json={**body, "tool_choice": "none", "messages": messages},
        headers=headers,
    )
    assert second.status_code == 200, second.text
    assert second.json()["kv"]["rebuild"] == "none"
    # a call whose arguments changed is history rewritten: rendered as sent, cut back
    changed = {**call, "function": {**call["function"], "arguments": '{"city":"Oslo"}'}}
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [changed]}
    third = await client.post(
        "/v1/chat/completions",
        json={**body, "tool_choice": "none", "messages": messages},
        headers=headers,
    )
    assert third.json()["kv"]["rebuild"] == "truncated"


IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


async def test_image_parts_are_a_clear_400_or_dropped_when_the_server_says_so(service):
    """browser-use's default (`use_vision=True`) sends the screenshot as an image part beside
    the page's text: a 400 that says why by default; dropped and counted with
    `drop_image_parts`."""
    content = [{"type": "text", "text": "Current page: [1]<a>Home</a>"}, IMAGE]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
    for drop in (False, True):
        app = create_app(service, "tiny", drop_image_parts=drop)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for route in ("/v1/chat/completions", "/chat"):
                response = await http.post(route, json=body)
                if not drop:
                    assert response.status_code == 400, response.text
                    error = response.json()["error"]
                    assert error["param"] == "messages.0.content.1"
                    assert "reads text only" in error["message"]
                    continue
                assert response.status_code == 200, response.text
                assert response.json()["kv"]["image_parts_dropped"] == 1
            text = (await http.get("/metrics")).text
            dropped = 2.0 if drop else 0.0
            assert f"agent_kv_image_parts_dropped_total {dropped}" in text
