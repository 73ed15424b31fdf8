"""`ChatAgentKV` on the default model: in-process (sync, streamed, async) and against a live
server, with usage, cache reuse across turns of a session, a chain, and errors."""

from __future__ import annotations

import json

import pydantic
import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.tools import tool

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.serving.chat_service import ChatService
from agent_kv.serving.langchain_chat import ChatAgentKV
from agent_kv.serving.langchain_messages import chat_dicts
from agent_kv.serving.langchain_server import ServerError

pytestmark = pytest.mark.model

MAX_TOKENS = 6
QUESTION = [SystemMessage("You are terse."), HumanMessage("Name a color.")]


@pytest.fixture(scope="module")
def service(smollm):
    return ChatService(Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256)))


@pytest.fixture(scope="module")
def local(service):
    return ChatAgentKV(service=service, model="smollm2-135m", max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def local_qwen(qwen_tokenizer, tiny_qwen):
    """In process on the default model's tokenizer and template (Qwen's `<tool_call>` added
    tokens), behind a tiny random Qwen2."""
    engine = Engine(tiny_qwen, qwen_tokenizer, make_policy("conf-kv", budget=256))
    return ChatAgentKV(service=ChatService(engine), model="tiny-qwen", max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def local_default(default_model):
    """In process on the real default model (`slow` tests only)."""
    loaded = default_model
    engine = Engine(loaded.model, loaded.tokenizer, make_policy("conf-kv", budget=256))
    return ChatAgentKV(service=ChatService(engine), model=loaded.name, max_tokens=MAX_TOKENS)


TOOL_BACKENDS = [
    "local",
    "remote",
    "local_qwen",
    pytest.param("local_default", marks=pytest.mark.slow),
]
"""Where tool calls are tried: SmolLM2 in process and through a server (the generic format),
the default model's tokenizer and template (a tiny random model), and the default model."""


@pytest.fixture(scope="module")
def reference(local):
    """The greedy reply to QUESTION, invoked in-process in a fresh session."""
    return local.invoke(QUESTION, session_id="reference")


@pytest.fixture(scope="module")
def remote(live_server):
    return ChatAgentKV(base_url=live_server, max_tokens=MAX_TOKENS)


def streamed(chunks) -> AIMessage:
    """The chunks of a stream added up, as LangChain aggregates them."""
    total = chunks[0]
    for chunk in chunks[1:]:
        total += chunk
    return total


def test_invoke_reports_usage_and_kv(reference, service):
    assert reference.content and isinstance(reference.content, str)
    prompt_tokens = len(service.render(chat_dicts(QUESTION)).token_ids)
    usage = reference.usage_metadata
    assert usage["input_tokens"] == prompt_tokens
    assert usage["input_token_details"] == {"cache_read": 0}
    assert 1 <= usage["output_tokens"] <= MAX_TOKENS
    assert usage["total_tokens"] == prompt_tokens + usage["output_tokens"]
    metadata = reference.response_metadata
    assert metadata["finish_reason"] in ("stop", "length")
    # cut at MAX_TOKENS exactly when the reply ran out of tokens
    assert (metadata["finish_reason"] == "length") == (usage["output_tokens"] == MAX_TOKENS)
    assert metadata["model_name"] == "smollm2-135m"
    assert metadata["kv"]["session_id"] == "reference"
    assert metadata["kv"]["policy"] == "conf-kv" and metadata["kv"]["kv_live_bytes"] > 0
    assert metadata["kv"]["kv_bytes"] == metadata["kv"]["kv_live_bytes"]  # deprecated alias
    if metadata["finish_reason"] == "length":
        assert usage["output_tokens"] == MAX_TOKENS


def test_stream_matches_invoke(local, reference):
    chunks = list(local.stream(QUESTION, session_id="stream"))
    assert len(chunks) >= 2 and chunks[-1].chunk_position == "last"
    total = streamed(chunks)
    assert total.content == reference.content
    assert total.usage_metadata == reference.usage_metadata
    assert total.response_metadata["finish_reason"] == reference.response_metadata["finish_reason"]
    assert total.response_metadata["kv"]["session_id"] == "stream"


async def test_async_invoke_and_stream_match_invoke(local, reference):
    message = await local.ainvoke(QUESTION, session_id="ainvoke")
    assert message.content == reference.content
    assert message.usage_metadata == reference.usage_metadata
    chunks = [chunk async for chunk in local.astream(QUESTION, session_id="astream")]
    assert len(chunks) >= 2
    total = streamed(chunks)
    assert total.content == reference.content
    assert total.usage_metadata == reference.usage_metadata


def test_stop_passed_to_invoke_overrides_the_field(service, reference):
    text = reference.content
    assert len(text) >= 2, "the reference reply is too short to cut"
    model = ChatAgentKV(service=service, max_tokens=MAX_TOKENS, stop=[text[1:]])
    cut = model.invoke(QUESTION, session_id="stop-field")
    assert cut.content == text[:1] and cut.response_metadata["finish_reason"] == "stop"
    whole = model.invoke(QUESTION, stop=["\N{SNOWMAN}"], session_id="stop-call")
    assert whole.content == text


def test_second_turn_of_a_session_reads_the_cache(local, service):
    model = local.bind(session_id="episode")
    first = model.invoke(QUESTION)
    second = model.invoke([*QUESTION, first, HumanMessage("Another one.")])
    assert first.usage_metadata["input_token_details"]["cache_read"] == 0
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    assert first.usage_metadata["input_tokens"] <= cached < second.usage_metadata["input_tokens"]
    assert second.response_metadata["kv"]["session_id"] == "episode"


def test_chain_on_a_freshly_loaded_model(reference):
    model = ChatAgentKV.local("smollm2-135m", budget=256, max_tokens=MAX_TOKENS)
    assert model.model_name == "smollm2-135m"
    prompt = ChatPromptTemplate.from_messages([("system", "You are terse."), ("human", "{ask}")])
    chain = prompt | model | StrOutputParser()
    assert chain.invoke({"ask": "Name a color."}) == reference.content


def test_in_process_errors_and_serialisation(local):
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        local.invoke(QUESTION, max_tokens=0)
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        list(local.stream(QUESTION, max_tokens=0))
    assert local.to_json()["type"] == "not_implemented"


def test_server_invoke_and_stream_match_in_process(remote, reference):
    message = remote.invoke(QUESTION, session_id="server-invoke")
    assert message.content == reference.content
    assert message.usage_metadata == reference.usage_metadata
    assert message.response_metadata["model_name"] == "smollm2-135m"
    assert message.response_metadata["kv"]["session_id"] == "server-invoke"
    total = streamed(list(remote.stream(QUESTION, session_id="server-stream")))
    assert total.content == reference.content
    assert total.usage_metadata == reference.usage_metadata
    kv = total.response_metadata.pop("kv")
    assert total.response_metadata == {
        "finish_reason": reference.response_metadata["finish_reason"],
        "model_name": "smollm2-135m",
    }
    assert kv["session_id"] == "server-stream" and kv["policy"] == "conf-kv"
    assert kv["kv_live_bytes"] == reference.response_metadata["kv"]["kv_live_bytes"]


async def test_server_async_and_session_reuse(remote, reference):
    first = await remote.ainvoke(QUESTION, session_id="server-episode")
    assert first.content == reference.content
    turn = [*QUESTION, first, HumanMessage("Another one.")]
    chunks = [chunk async for chunk in remote.astream(turn, session_id="server-episode")]
    second = streamed(chunks)
    cached = second.usage_metadata["input_token_details"]["cache_read"]
    assert first.usage_metadata["input_tokens"] <= cached < second.usage_metadata["input_tokens"]


async def test_server_errors_carry_the_message(remote):
    for call in (remote.invoke, lambda m, **kw: list(remote.stream(m, **kw))):
        with pytest.raises(ServerError, match="max_tokens") as err:
            call(QUESTION, max_tokens=0)
        assert err.value.status_code == 400 and "greater than or equal to 1" in err.value.message
    with pytest.raises(ServerError, match="max_tokens"):
        await remote.ainvoke(QUESTION, max_tokens=0)
    with pytest.raises(ServerError, match="max_tokens"):
        _ = [chunk async for chunk in remote.astream(QUESTION, max_tokens=0)]


@tool
def get_weather(city: str, days: int) -> str:
    """The weather forecast for a city over a number of days."""
    return f"Rain in {city} for {days} days."


class Forecast(pydantic.BaseModel):
    """A forecast."""

    city: str = pydantic.Field(max_length=30)
    sunny: bool


ASK = [HumanMessage("What is the weather in Oslo for the next 2 days?")]


def roomy(model: ChatAgentKV, **fields) -> ChatAgentKV:
    """`model` with room for a whole call (60 tokens)."""
    return model.model_copy(update={"max_tokens": 60, **fields})


@pytest.mark.parametrize("backend", TOOL_BACKENDS)
def test_bound_tools_are_called_and_the_result_reuses_the_cache(backend, request):
    model = roomy(request.getfixturevalue(backend), session_id=f"tools-{backend}")
    bound = model.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False)
    reply = bound.invoke(ASK)
    assert reply.response_metadata["finish_reason"] == "tool_calls" and reply.content == ""
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "days"}
    assert isinstance(call["args"]["days"], int) and call["id"].startswith("call_")
    result = get_weather.invoke(call)  # a ToolMessage answering the call
    assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
    follow = bound.bind(tool_choice="none").invoke([*ASK, reply, result])
    used, cached = reply.usage_metadata, follow.usage_metadata["input_token_details"]["cache_read"]
    if follow.response_metadata["kv"]["rebuild"] == "none":
        assert cached >= used["total_tokens"]
    else:  # cut back inside the reply: a random model's reply in tokens the tokenizer would
        # not write, or a newline a model wrote after its last call, which the template drops
        assert follow.response_metadata["kv"]["rebuild"] == "truncated"
        assert cached >= used["input_tokens"]


@pytest.mark.parametrize("backend", TOOL_BACKENDS)
def test_streamed_tool_calls_come_as_tool_call_chunks(backend, request):
    model = roomy(request.getfixturevalue(backend))
    chunks = list(model.bind_tools([get_weather], tool_choice="required").stream(ASK))
    total = streamed(chunks)
    assert total.tool_call_chunks and total.tool_call_chunks[0]["name"] == "get_weather"
    assert total.tool_calls[0]["name"] == "get_weather"
    assert json.loads(total.tool_call_chunks[0]["args"]) == total.tool_calls[0]["args"]
    assert total.response_metadata["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
@pytest.mark.parametrize("backend", TOOL_BACKENDS)
def test_structured_output_parses_into_the_schema(backend, method, request):
    model = roomy(request.getfixturevalue(backend))
    structured = model.with_structured_output(Forecast, method=method)
    forecast = structured.invoke(ASK)
    assert isinstance(forecast, Forecast) and forecast.city
    raw = model.with_structured_output(Forecast, method=method, include_raw=True).invoke(ASK)
    assert raw["parsing_error"] is None and isinstance(raw["parsed"], Forecast)
    as_dict = model.with_structured_output(Forecast.model_json_schema(), method=method)
    assert set(as_dict.invoke(ASK)) == {"city", "sunny"}


def test_json_mode_gives_a_json_object(local):
    reply = roomy(local).with_structured_output(None, method="json_mode").invoke(ASK)
    assert isinstance(reply, dict)


def test_bind_tools_refuses_a_choice_it_does_not_offer(local):
    with pytest.raises(ValueError, match="not one of the tools"):
        local.bind_tools([get_weather], tool_choice="search")
    with pytest.raises(ValueError, match="exactly one tool"):
        local.bind_tools([get_weather, Forecast], tool_choice=True)


def test_pin_rules_apply_in_process(service):
    model = ChatAgentKV(service=service, max_tokens=2)
    pinned = model.invoke(QUESTION, session_id="pins-default").response_metadata["kv"]
    none = model.invoke(QUESTION, session_id="pins-none", pin={"roles": []})
    assert pinned["pinned_tokens"] > 0  # the system message, by the service's rules
    assert none.response_metadata["kv"]["pinned_tokens"] == 0
