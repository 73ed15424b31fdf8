"""What agent frameworks send, as they send it, against the OpenAI-compatible route (httpx
AsyncClient over ASGITransport, the tiny random Llama behind SmolLM2's tokenizer: the shape of
requests and what the cache reuses, not what the model writes)."""

from __future__ import annotations

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
