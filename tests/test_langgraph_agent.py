"""A LangGraph agent on agent_kv: a two-node graph (the model, LangGraph's `ToolNode`) with two
tools runs two user turns (three under `slow`), each a tool call, its result and an answer, in
one named session on a live server (conf-kv, budget 256). Each model call's prompt reads more of
itself from the session's KV cache than the call before, and with pin rules naming the tools
every tool result stays in the cache after the policy has evicted around it; without them
an earlier result is evicted."""

from __future__ import annotations

import pytest
from helpers import kept_positions
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from agent_kv.runtime.chat.pin_rules import PinRules, protected_spans
from agent_kv.runtime.replies.tool_calls import ReplySpec
from agent_kv.serving.langchain_chat import ChatAgentKV
from agent_kv.serving.langchain_messages import chat_dicts

pytestmark = pytest.mark.model

NOTES = "My notes so far: the shop opens at nine, parking is free, and returns take a week. "


@tool
def lookup_price(item: str) -> str:
    """The catalog price of an item in the shop."""
    return f"Catalog entry for {item}: price 120 dollars, color red, model year 2024, sku 4471."


@tool
def check_stock(item: str) -> str:
    """How many of an item the shop has in stock, and where."""
    return f"Stock for {item}: 3 units in aisle 7, 12 more in the back room, restock Friday."


TOOLS = [lookup_price, check_stock]
QUESTIONS = [
    NOTES * 3 + "What does the red bike cost?",
    NOTES * 3 + "Is the helmet in stock?",
    NOTES * 3 + "What does the bell cost?",
]
KEEP_RESULTS = {"tool_names": [t.name for t in TOOLS], "tool_calls": True}


def agent_graph(model: ChatAgentKV):
    """The model calls a tool for each user message (`tool_choice` required), then answers
    from the result in text; the tools stay offered to both calls, so the rendered prompt
    only grows."""
    act = model.bind_tools(TOOLS, tool_choice="required", parallel_tool_calls=False)
    answer = model.bind_tools(TOOLS, tool_choice="none")

    def agent(state: MessagesState) -> dict:
        chosen = act if isinstance(state["messages"][-1], HumanMessage) else answer
        return {"messages": [chosen.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("agent", agent)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "agent")
    graph.add_conditional_edges("agent", tools_condition)
    graph.add_edge("tools", "agent")
    return graph.compile(checkpointer=InMemorySaver())


def run_episode(url: str, session_id: str, pin: dict | None, questions: list[str]) -> list:
    """The turns in one thread and one session; the whole conversation."""
    model = ChatAgentKV(base_url=url, session_id=session_id, max_tokens=40, pin=pin)
    graph, config = agent_graph(model), {"configurable": {"thread_id": session_id}}
    for question in questions:
        state = graph.invoke({"messages": [HumanMessage(question)]}, config)
    return state["messages"]


def result_positions(service, messages: list) -> set[int]:
    """Token positions of the tool results in the session's rendering of `messages`."""
    tools = ReplySpec.from_openai(tools=[convert_to_openai_tool(t) for t in TOOLS]).tools
    only_results = PinRules(
        roles=frozenset(), latest_observations=0, tool_names=frozenset(t.name for t in TOOLS)
    )
    dicts = chat_dicts(messages)
    spans = protected_spans(service.render(dicts, tools), dicts, only_results)
    return {position for start, end in spans for position in range(start, end)}


def live(service, session_id: str) -> list[set[int]]:
    """Per layer, the positions the session's cache holds."""
    with service.sessions.use(session_id) as session:
        store = session.store
        return [set(kept_positions(store, i)) for i in range(store.num_layers)]


@pytest.mark.parametrize("turns", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_langgraph_agent_reuses_its_cache_and_keeps_its_tool_results(live_service, turns):
    url, service = live_service
    questions = QUESTIONS[:turns]
    messages = run_episode(url, f"graph-pinned-{turns}", KEEP_RESULTS, questions)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    calls = [call["name"] for m in replies for call in m.tool_calls]
    assert len(replies) == 2 * turns and len(calls) == turns
    assert set(calls) <= {t.name for t in TOOLS}
    cached = [m.usage_metadata["input_token_details"]["cache_read"] for m in replies]
    print("cached_tokens per model call:", cached)
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:], strict=False))
    kv = replies[-1].response_metadata["kv"]
    assert kv["evicted_tokens"] > 0
    results = result_positions(service, messages)
    assert len(results) > 30 * turns
    assert all(results <= layer for layer in live(service, f"graph-pinned-{turns}"))

    # the default rules pin only the latest tool result: an earlier one is evicted
    unpinned = run_episode(url, f"graph-unpinned-{turns}", None, questions)
    earlier = result_positions(service, unpinned)
    assert any(not earlier <= layer for layer in live(service, f"graph-unpinned-{turns}"))
