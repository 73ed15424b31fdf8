"""The real `openai` client against a live uvicorn on 127.0.0.1, streamed and not."""

from __future__ import annotations

import httpx
import openai
import pytest


@pytest.fixture(scope="module")
def base_url(live_server):
    return f"{live_server}/v1"


def test_openai_client_plain_streamed_and_errors(base_url):
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=8, user="client-test"
    )
    text = plain.choices[0].message.content
    assert text and plain.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # the same session again: the prompt is served from its cache
    again = client.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=8, user="client-test"
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= plain.usage.prompt_tokens - 1
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="smollm2-135m", messages=messages, n=2)
    assert err.value.status_code == 400 and "n=1" in err.value.message


def test_an_abandoned_stream_stops_decoding(live_service):
    url, service = live_service
    body = {
        "messages": [{"role": "user", "content": "Write a long story about a red bicycle."}],
        "max_tokens": 300,
        "stream": True,
    }
    with httpx.Client(base_url=url, timeout=120) as http:
        with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "gone"}
        ) as response:
            pieces = 0
            for line in response.iter_lines():
                pieces += '"content": "' in line and '"role"' not in line
                if pieces == 3:
                    break  # leave after three pieces of text
        # the next request waits for the model, so it runs after the abandoned turn ended
        quick = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        assert http.post("/chat", json=quick).status_code == 200
    with service.sessions.use("gone") as session:
        prompt = len(service.render(body["messages"]).token_ids)
        generated = len(session.token_ids) - prompt
    # decoding stopped soon after the client left, far short of max_tokens
    assert 3 <= generated < 100
