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
from agent_kv.runtime.engine import Engine
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.tool_calls import ToolCall, render_calls
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


def test_one_tool_per_action_kind():
    assert [tool.name for tool in ACTION_TOOLS] == list(ACTION_GRAMMAR)


@pytest.mark.parametrize("action", ACTIONS)
def test_an_action_and_its_call_translate_both_ways(action):
    call = action_call(parse_action(action))
    assert call_action(call) == str(parse_action(action))
    assert TOOL_ACTIONS.action(render_calls([call])) == str(parse_action(action))
    assert TOOL_ACTIONS.reply(action) == render_calls([call])


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
        ("click [12]", "no complete call"),
        ("", "no complete call"),
        (render_calls([action_call(parse_action("go_back"))] * 2), "2 calls"),
        ('<tool_call>{"name": "go_back", "arguments": {"x": 1}}</tool_call>', "go_back takes"),
        ('<tool_call>{"name": "stop", "arguments": {"answer": null}}</tool_call>', "answer"),
        ('<tool_call>{"name": "click", "arguments": {"element_id": "12"}}</tool_call>', "12"),
        ('<tool_call>{"name": "click", "arguments": {"element_id": true}}</tool_call>', "true"),
        ('<tool_call>{"name": "scroll", "arguments": {"direction": "left"}}</tool_call>', "left"),
        (
            '<tool_call>{"name": "type", "arguments": {"element_id": 3, "text": "x", '
            '"press_enter": null}}</tool_call>',
            "press_enter",
        ),
    ],
)
def test_a_tool_reply_that_is_no_action_is_refused_with_how_to_call(reply, needle):
    with pytest.raises(ActionParseError, match=needle) as err:
        TOOL_ACTIONS.action(reply)
    assert str(err.value).endswith(CALL_HELP)


def test_the_text_format_passes_replies_through_and_both_formats_are_known():
    assert TEXT_ACTIONS.action("click [12]") == TEXT_ACTIONS.reply("click [12]") == "click [12]"
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


def test_the_harness_rejects_a_tool_reply_that_is_no_action():
    env = RecordingEnv()
    _act(env, TOOL_ACTIONS, render_calls([action_call(parse_action("go_back"))] * 2))
    _act(env, TOOL_ACTIONS, render_calls([action_call(parse_action("click [4]"))]))
    _act(env, TEXT_ACTIONS, "click [[4]]")  # the environment parses text itself
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
def test_a_tool_agent_acts_on_its_page_and_reads_results_as_tool_turns(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=512))
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
    assert [TOOL_ACTIONS.action(r["reply"]) for r in records] == [t for t, _ in env.received]
    prompt = "".join(piece for r in records for piece in r["tokens"])  # steps 1-3 concatenated
    assert prompt.count("<|im_start|>tool\nPage:") == 2  # the pages after the first two calls
    assert '<tools>\n{"name": "click"' in prompt  # the tools, listed once, in the system turn
