"""The real `openai` client against a live uvicorn on 127.0.0.1, streamed and not."""

from __future__ import annotations

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
