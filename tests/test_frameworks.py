"""What agent frameworks send, as they send it: their request shapes replayed against the
OpenAI-compatible route (httpx AsyncClient over ASGITransport, a tiny random-weight model:
the shape of requests and what the cache reuses, not what the model writes), then the
frameworks themselves, unmodified, against a live server (what they send reaches the model
and what it answers reaches them; the model's own choices, such as calling a tool every turn,
are its own). Each runs twice: on SmolLM2's tokenizer (no tool template: the generic format)
and on the default model's tokenizer and template (Qwen's `<tool_call>` added tokens), the
latter behind a tiny random Qwen2; the real default model runs them under `slow`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

import httpx
import pytest
from pydantic import BaseModel

from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from api.app import create_app
from tests.conftest import serving

BROWSER_USE_SYSTEM = "You are a browser agent. Rules: act on one element per step. " * 40


@pytest.fixture(params=["smollm2", "qwen"])
def service(request):
    """A service on a tiny random model behind SmolLM2's or the default model's tokenizer."""
    if request.param == "smollm2":
        network, tokenizer = (
            request.getfixturevalue("tiny_llama"),
            request.getfixturevalue("smollm").tokenizer,
        )
    else:
        network = request.getfixturevalue("tiny_qwen")
        tokenizer = request.getfixturevalue("qwen_tokenizer")
    engine = Engine(network, tokenizer, make_policy("conf-kv", budget=256))
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
        service.render([{"role": "system", "content": BROWSER_USE_SYSTEM}]).token_ids
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
    # the call renders as generated; a random model may split it into tokens the tokenizer
    # would not (`"` then `}}` where it writes `"}}`), so the cache is cut back, if at all,
    # only inside the reply
    assert second.json()["kv"]["rebuild"] in ("none", "truncated")
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first.json()["usage"]["prompt_tokens"]
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


# -- the frameworks themselves, unmodified, against a live server ----------------------------


@pytest.fixture(
    scope="module",
    params=[
        "smollm2",
        "tiny-qwen",
        pytest.param("qwen2.5-coder-0.5b", marks=pytest.mark.slow),
    ],
)
def live_model_service(request):
    """`(root URL, service, model id)` of a live server on SmolLM2, on a tiny random Qwen2
    behind the default model's tokenizer and template, or (`slow`) on the default model."""
    if request.param == "smollm2":
        url, service = request.getfixturevalue("live_service")
        yield url, service, "smollm2-135m"
        return
    if request.param == "tiny-qwen":
        network = request.getfixturevalue("tiny_qwen")
        tokenizer = request.getfixturevalue("qwen_tokenizer")
    else:
        loaded = request.getfixturevalue("default_model")
        network, tokenizer = loaded.model, loaded.tokenizer
    service = ChatService(Engine(network, tokenizer, make_policy("conf-kv", budget=256)))
    with serving(create_app(service, request.param)) as url:
        yield url, service, request.param


def _turns(caplog, session: str, count: int = 1) -> list[dict]:
    """The request log lines (`api.request_log`) of `session`'s requests, in order, once
    there are at least `count` (the live server writes a line when its response has ended,
    which the client may see a moment before; 10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(r.message) for r in caplog.records if r.name == "agent_kv.requests"]
        turns = [line for line in lines if line["session"] == session]
        if len(turns) >= count or time.monotonic() > deadline:
            return turns
        time.sleep(0.05)


def _assert_history_reused(turns: list[dict]) -> None:
    """Every turn after the first reused at least the previous turn's whole prompt, and none
    rebuilt its cache from scratch."""
    assert turns and all(turn["status"] == 200 for turn in turns), turns
    assert [turn["rebuild"] for turn in turns].count("scratch") == 0
    for before, after in zip(turns, turns[1:], strict=False):
        assert after["cached_tokens"] >= before["prompt_tokens"], (before, after)


class Answer(BaseModel):
    city: str
    sunny: bool


def weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}."


async def test_openai_agents_sdk_tools_and_structured_output(live_model_service, caplog):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    set_tracing_disabled(True)  # it would export traces to OpenAI
    url, _, served = live_model_service
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    model = OpenAIChatCompletionsModel(model=served, openai_client=client)
    session = {"X-Session-Id": "agents-sdk"}
    caller = Agent(
        name="weather",
        instructions="Answer about the weather.",
        tools=[function_tool(weather)],
        model=model,
        model_settings=ModelSettings(tool_choice="required", max_tokens=48, extra_headers=session),
        tool_use_behavior="stop_on_first_tool",
    )
    called = await Runner.run(caller, "Is it sunny in Paris?", max_turns=2)
    assert called.final_output.startswith("Sunny in ")  # the tool ran on the model's call
    answerer = Agent(
        name="answer",
        instructions="Answer about the weather.",
        model=model,
        model_settings=ModelSettings(max_tokens=48),
        output_type=Answer,
    )
    answered = await Runner.run(answerer, "Is it sunny in Paris?", max_turns=1)
    assert isinstance(answered.final_output, Answer)  # a response_format reply, validated
    assert _turns(caplog, "agents-sdk")[0]["status"] == 200


async def test_pydantic_ai_tool_turns_reuse_the_cache(live_model_service, caplog):
    """pydantic-ai sends each call back re-serialised compactly; its tool turns still extend
    the session's history (the call renders as generated)."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    url, _, served = live_model_service
    model = OpenAIChatModel(served, provider=OpenAIProvider(f"{url}/v1", api_key="unused"))
    settings = {"extra_headers": {"X-Session-Id": "pydantic-ai"}, "max_tokens": 48}
    agent = Agent(model, output_type=Answer, model_settings=settings, tools=[weather], retries=3)
    history = []
    for prompt in ("Use weather for Paris, then answer.", "And in Oslo?"):
        with contextlib.suppress(UsageLimitExceeded):  # the model may call the tool every turn
            run = await agent.run(
                prompt, message_history=history, usage_limits=UsageLimits(request_limit=6)
            )
            history = run.all_messages()
        if len(_turns(caplog, "pydantic-ai")) >= 2:  # a model that answered at once: go on
            break
    turns = _turns(caplog, "pydantic-ai", count=2)
    assert len(turns) >= 2
    _assert_history_reused(turns)


@pytest.mark.slow
async def test_pydantic_ai_fifty_tool_turns_never_rebuild_from_scratch(live_model_service, caplog):
    """The quick size above at full length: 50 requests of one pydantic-ai run."""
    from pydantic_ai import Agent
    from pydantic_ai.exceptions import UsageLimitExceeded
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    url, _, served = live_model_service
    model = OpenAIChatModel(served, provider=OpenAIProvider(f"{url}/v1", api_key="unused"))
    settings = {"extra_headers": {"X-Session-Id": "pydantic-ai-50"}, "max_tokens": 48}
    agent = Agent(model, output_type=Answer, model_settings=settings, tools=[weather], retries=3)
    with contextlib.suppress(UsageLimitExceeded):
        await agent.run(
            "Use weather for Paris, then answer.", usage_limits=UsageLimits(request_limit=50)
        )
    turns = _turns(caplog, "pydantic-ai-50", count=2)
    rebuilds = [turn["rebuild"] for turn in turns]
    print(f"{len(turns)} turns: {rebuilds.count('truncated')} truncated, 0 scratch")
    _assert_history_reused(turns)


def test_smolagents_tool_calling_agent_runs_unmodified(live_model_service, caplog):
    """smolagents' ToolCallingAgent sends `stop` with `tool_choice: "required"` on every step,
    and each call back as its own text ("Calling tools: [...]")."""
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool
    from smolagents.memory import ActionStep
    from smolagents.utils import AgentGenerationError

    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    url, _, served = live_model_service

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city.

        Args:
            city: the city.
        """
        return weather(city)

    model = OpenAIServerModel(
        model_id=served, api_base=f"{url}/v1", api_key="unused", max_tokens=48,
        client_kwargs={"default_headers": {"X-Session-Id": "smolagents"}},
    )  # fmt: skip
    agent = ToolCallingAgent(tools=[get_weather], model=model, max_steps=2, verbosity_level=0)
    agent.run("Is it sunny in Paris?")
    steps = [step for step in agent.memory.steps if isinstance(step, ActionStep)]
    assert steps and not any(isinstance(step.error, AgentGenerationError) for step in steps)
    assert steps[0].tool_calls  # the first step called a tool, as required
    _assert_history_reused(_turns(caplog, "smolagents", count=2)[:2])


def test_litellm_completion_tools_and_cache_reuse(live_model_service):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    url, _, served = live_model_service
    args = {"model": f"openai/{served}", "api_base": f"{url}/v1", "api_key": "unused"}
    args |= {"max_tokens": 48, "extra_headers": {"X-Session-Id": "litellm"}}
    messages = [{"role": "user", "content": "Is it sunny in Paris?"}]
    first = litellm.completion(
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        **args,
    )
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C."},
    ]
    second = litellm.completion(messages=messages, tools=[WEATHER_TOOL], tool_choice="none", **args)
    assert second.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_langchain_openai_tools_in_a_named_session(live_model_service, caplog):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    caplog.set_level(logging.INFO, logger="agent_kv.requests")
    url, _, served = live_model_service
    llm = ChatOpenAI(
        model=served, base_url=f"{url}/v1", api_key="unused", max_tokens=48,
        default_headers={"X-Session-Id": "langchain-openai"},
    )  # fmt: skip
    caller = llm.bind_tools([weather], tool_choice="weather", parallel_tool_calls=False)
    messages = [HumanMessage("Is it sunny in Paris?")]
    reply = caller.invoke(messages)
    (call,) = reply.tool_calls
    assert call["name"] == "weather"
    messages += [reply, ToolMessage(weather(**call["args"]), tool_call_id=call["id"])]
    assert llm.bind_tools([weather], tool_choice="none").invoke(messages).content
    turns = _turns(caplog, "langchain-openai", count=2)
    assert len(turns) == 2
    _assert_history_reused(turns)  # truncated, if at all, only inside the generated reply
