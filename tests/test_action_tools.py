"""The browser actions as function tools: calls and action texts translate both ways, a page
narrows the tools to its ids and tabs, and an agent acting through tools gets each action
decoded under its page's call grammar and each next page back as a tool result."""

from __future__ import annotations

import json

import pytest

from agent_kv.harness.action_formats import (
    CALL_BYTES,
    CALL_HELP,
    FORMATS,
    TEXT_ACTIONS,
    TOOL_ACTIONS,
    action_format,
)
from agent_kv.harness.action_tools import ACTION_TOOLS, action_call, call_action, page_tools
from agent_kv.harness.agent import AgentConfig, _act, run_episode
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_call_format import tool_call_format
from agent_kv.runtime.replies.tool_calls import ToolCall, render_calls
from envs.action_grammar import element_ids
from envs.actions import ACTION_FORMATS, ACTION_GRAMMAR, ActionParseError, parse_action
from envs.browser_env import StepResult
from envs.tasks import load_task

ACTIONS = [
    "click [12]",
    "hover [3]",
    "type [3] [red bike] [1]",
    "type [3] [] [0]",
    "press [Control+a]",
    "scroll [down]",
    "new_tab",
    "tab_focus [1]",
    "close_tab",
    "goto [http://127.0.0.1:8080/item?id=4]",
    "go_back",
    "go_forward",
    "stop [$45]",
    "stop []",
]


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def tokenizer(request):
    """SmolLM2's tokenizer (calls in the generic format) and the default model's (Qwen's own
    format, markers as added tokens)."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm").tokenizer
    return request.getfixturevalue("qwen_tokenizer")


def calls_text(tokenizer, *actions: str) -> str:
    """The reply calling `actions` in the tokenizer's format."""
    calls = [action_call(parse_action(action)) for action in actions]
    return render_calls(calls, tool_call_format(tokenizer))


def call_of(tokenizer, name: str, arguments: str) -> str:
    """One call of `name` with `arguments` (JSON text) in the tokenizer's format."""
    return tool_call_format(tokenizer).render_call(name, arguments)


def test_one_tool_per_action_kind():
    assert [tool.name for tool in ACTION_TOOLS] == list(ACTION_GRAMMAR)


@pytest.mark.parametrize("action", ACTIONS)
def test_an_action_and_its_call_translate_both_ways(action, tokenizer):
    call = action_call(parse_action(action))
    assert call_action(call) == str(parse_action(action))
    assert TOOL_ACTIONS.action(calls_text(tokenizer, action), tokenizer) == str(
        parse_action(action)
    )
    assert TOOL_ACTIONS.reply(action, tokenizer) == calls_text(tokenizer, action)


def test_calls_that_make_no_action_are_refused():
    with pytest.raises(ValueError, match="no browser action is called 'jump'"):
        call_action(ToolCall("c", "jump", "{}"))
    with pytest.raises(ValueError, match="click takes the arguments"):
        call_action(ToolCall("c", "click", '{"element_id": 1, "force": true}'))
    with pytest.raises(ValueError, match="by reference"):
        action_call(parse_action("click [link 'Blue road bike']"))


@pytest.mark.parametrize(
    "reply, needle",
    [
        (lambda t: "click [12]", "no complete call"),
        (lambda t: "", "no complete call"),
        (lambda t: calls_text(t, "go_back", "go_back"), "2 calls"),
        (lambda t: call_of(t, "go_back", '{"x": 1}'), "go_back takes"),
        (lambda t: call_of(t, "stop", '{"answer": null}'), "answer"),
        (lambda t: call_of(t, "click", '{"element_id": "12"}'), "12"),
        (lambda t: call_of(t, "click", '{"element_id": true}'), "true"),
        (lambda t: call_of(t, "scroll", '{"direction": "left"}'), "left"),
        (
            lambda t: call_of(t, "type", '{"element_id": 3, "text": "x", "press_enter": null}'),
            "press_enter",
        ),
    ],
)
def test_a_tool_reply_that_is_no_action_is_refused_with_how_to_call(reply, needle, tokenizer):
    with pytest.raises(ActionParseError, match=needle) as err:
        TOOL_ACTIONS.action(reply(tokenizer), tokenizer)
    assert str(err.value).endswith(CALL_HELP)


def test_the_text_format_passes_replies_through_and_both_formats_are_known(tokenizer):
    action = TEXT_ACTIONS.action("click [12]", tokenizer)
    assert action == TEXT_ACTIONS.reply("click [12]", tokenizer) == "click [12]"
    assert tuple(FORMATS) == ACTION_FORMATS
    with pytest.raises(ValueError, match="unknown agent 'voice'"):
        action_format("voice")


class RecordingEnv:
    """What `_act` calls: `step` with an action, `reject` with an error."""

    def __init__(self):
        self.calls = []

    def step(self, text):
        self.calls.append(("step", text))

    def reject(self, error):
        self.calls.append(("reject", error))


def test_the_harness_rejects_a_tool_reply_that_is_no_action(tokenizer):
    env = RecordingEnv()
    _act(env, TOOL_ACTIONS, calls_text(tokenizer, "go_back", "go_back"), tokenizer)
    _act(env, TOOL_ACTIONS, calls_text(tokenizer, "click [4]"), tokenizer)
    _act(env, TEXT_ACTIONS, "click [[4]]", tokenizer)  # the environment parses text itself
    assert [kind for kind, _ in env.calls] == ["reject", "step", "step"]
    assert env.calls[0][1].endswith(CALL_HELP)
    assert env.calls[1:] == [("step", "click [4]"), ("step", "click [[4]]")]


@pytest.mark.model
def test_every_tool_reply_may_be_as_long_as_a_call(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    base = SamplingParams(max_new_tokens=48, stop=["\n"])
    page = "[3] link 'Bikes'"
    for constrain in (True, False):
        params = TOOL_ACTIONS.decoding(engine, base, page, 1, constrain).params
        assert params.max_new_tokens == CALL_BYTES and params.stop == []
        assert (params.grammar is not None) == constrain


def test_a_page_narrows_the_tools_to_its_ids_and_tabs():
    tools = {tool.name: tool.parameters["properties"] for tool in page_tools([15, 3, 15], 2)}
    assert tools["click"]["element_id"] == {"enum": [3, 15]}
    assert tools["type"]["element_id"] == {"enum": [3, 15]}
    assert tools["tab_focus"]["tab_index"] == {"enum": [0, 1]}
    assert tools["stop"] == ACTION_TOOLS[-1].parameters["properties"]
    bare = {tool.name for tool in page_tools([], 1)}
    assert bare == set(ACTION_GRAMMAR) - {"click", "hover", "type"}


class ListingPages:
    """A `BrowserEnv` stand-in: pages of 40 links (ids 100 + 10 * page + i), recording the
    action text each step receives; the episode ends after `steps` pages."""

    servers: dict = {}
    read_page = None

    def __init__(self, steps: int):
        self.steps, self.received, self.page = steps, [], 1
        self.url = "http://127.0.0.1/1"

    def _page(self) -> dict:
        lines = [
            f"[{100 + 10 * self.page + i}] link 'Road bike {self.page}-{i}: ${90 + i}'"
            for i in range(40)
        ]
        return {"url": self.url, "text": "\n".join(lines), "tabs": ["Bikes"]}

    def reset(self, task) -> dict:
        return self._page()

    def step(self, text: str) -> StepResult:
        self.received.append((text, self._page()["text"]))
        self.page += 1
        done = self.page > self.steps
        info = {"action": text, **({"reason": "stop"} if done else {})}
        return StepResult(self._page(), done, info, None)


@pytest.mark.model
def test_a_tool_agent_acts_on_its_page_and_reads_results_as_tool_turns(
    tiny_llama, smollm, tmp_path
):
    """The tool agent on SmolLM2's tokenizer and template, whose calls are in the generic
    format (a random-weight model: the actions' validity comes from the grammar, not the
    model)."""
    engine = Engine(tiny_llama, smollm.tokenizer, make_policy("conf-kv", budget=512))
    env = ListingPages(steps=3)
    config = AgentConfig(max_steps=3, agent="tools")
    result = run_episode(load_task(1), engine, env, tmp_path, "smollm", config)
    assert result.agent == "tools" and result.steps == 3
    for text, page in env.received:  # each a valid action, on an element of its own page
        action = parse_action(text)
        assert str(action) == text
        if action.element_id is not None:
            assert action.element_id in element_ids(page)
    records = [json.loads((tmp_path / f"step_{n:03d}.json").read_text()) for n in (1, 2, 3)]
    assert all(r["constrained"] and r["reply"].startswith("<tool_call>") for r in records)
    actions = [TOOL_ACTIONS.action(r["reply"], smollm.tokenizer) for r in records]
    assert actions == [t for t, _ in env.received]
    prompt = "".join(piece for r in records for piece in r["tokens"])  # steps 1-3 concatenated
    assert prompt.count("<|im_start|>tool\nPage:") == 2  # the pages after the first two calls
    assert '<tools>\n{"name": "click"' in prompt  # the tools, listed once, in the system turn


@pytest.mark.model
def test_a_tool_agent_on_the_default_models_tokens_calls_through_its_added_tokens(
    qwen_tokenizer, tiny_qwen, tmp_path
):
    """The tool agent on the default model's tokenizer and template (a random-weight model):
    every action is decoded as a call opened by the added token `<tool_call>`, and each next
    page comes back inside the template's own tool result (`<tool_response>`)."""
    engine = Engine(tiny_qwen, qwen_tokenizer, make_policy("conf-kv", budget=512))
    env = ListingPages(steps=3)
    config = AgentConfig(max_steps=3, agent="tools")
    result = run_episode(load_task(1), engine, env, tmp_path, "tiny-qwen", config)
    assert result.agent == "tools" and result.steps == 3
    open_id = qwen_tokenizer.convert_tokens_to_ids("<tool_call>")
    records = [json.loads((tmp_path / f"step_{n:03d}.json").read_text()) for n in (1, 2, 3)]
    for record, (text, page) in zip(records, env.received, strict=True):
        assert record["constrained"] and record["reply"].startswith("<tool_call>\n{")
        assert TOOL_ACTIONS.action(record["reply"], qwen_tokenizer) == text
        action = parse_action(text)
        if action.element_id is not None:
            assert action.element_id in element_ids(page)
        assert qwen_tokenizer(record["reply"], add_special_tokens=False)["input_ids"][0] == open_id
    prompt = "".join(piece for r in records for piece in r["tokens"])
    assert prompt.count("<tool_response>\nPage:") == 2  # the pages after the first two calls
