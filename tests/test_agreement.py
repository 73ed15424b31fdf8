"""Agreement with full KV: a teacher-forced replay of the full-KV trajectory per policy."""

from __future__ import annotations

import json

import pytest

from agent_kv.harness.action_formats import TOOL_ACTIONS
from agent_kv.harness.agent import AgentConfig
from agent_kv.harness.agreement import (
    ReferenceStep,
    agreement_summary,
    canonical,
    read_trajectory,
    replay_agreement,
)
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine

PAGE = "Tab 0 (current): Bikes\nURL: http://127.0.0.1:8001/c/bikes\n[3] RootWebArea 'Bikes'\n"
LISTINGS = "".join(f"[{10 + i}] link 'Bike {i} - ${100 + 7 * i}'\n" for i in range(40))
TRAJECTORY = [
    ReferenceStep(PAGE + LISTINGS, 1, "click [17]"),
    ReferenceStep(PAGE + "[5] heading 'Bike 7'\n[6] StaticText 'Price: $149'\n", 1, "stop [$149]"),
]
INTENT = "What is the price of Bike 7?"


@pytest.fixture(scope="module")
def full(smollm) -> Engine:
    return Engine(smollm.model, smollm.tokenizer, make_policy("full"))


def test_full_kv_agrees_with_itself_exactly(tiny_llama, smollm):
    """Two full-KV engines agree at every step with no divergence (a random-weight model
    behind SmolLM2's tokenizer: the identity is the replay's, not the model's)."""
    own, full = (Engine(tiny_llama, smollm.tokenizer, make_policy("full")) for _ in range(2))
    steps = replay_agreement(INTENT, TRAJECTORY, own, full)
    assert [s.step for s in steps] == [1, 2]
    assert all(s.kl < 1e-6 for s in steps)
    summary = agreement_summary(steps)
    assert summary["steps_compared"] == 2
    assert summary["mean_kl"] < 1e-6


def test_an_evicting_cache_shifts_the_distributions(smollm, full):
    """A 32-token window (with its 4 sinks) drops the listing page, the system prompt
    excepted (pinned): the next-token distributions move away from full KV's."""
    window = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=32, sinks=4))
    steps = replay_agreement(INTENT, TRAJECTORY, window, full)
    assert steps[1].kl > 1e-3
    assert steps[0].tokens == len(
        smollm.tokenizer("click [17]", add_special_tokens=False)["input_ids"]
    )
    summary = agreement_summary(steps)
    assert summary["agreement"] == sum(s.agree for s in steps) / 2
    assert all(s.reference in ("click [17]", "stop [$149]") for s in steps)


def test_constrained_own_actions_are_valid_on_their_page(smollm, full):
    conf = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))
    for step in replay_agreement(INTENT, TRAJECTORY, conf, full):
        assert canonical(step.action) == step.action
        assert step.action.split(" ")[0] in ("click", "stop", "scroll", "type", "hover", "go_back")


def test_a_tool_agent_trajectory_replays_in_its_own_format(tiny_llama, smollm):
    """A trajectory of tool calls replays as calls (a random-weight model behind SmolLM2's
    tokenizer and its generic tool format: its replies are calls by the call grammar)."""
    calls = [
        ReferenceStep(s.observation, s.tabs, TOOL_ACTIONS.reply(s.action, smollm.tokenizer))
        for s in TRAJECTORY
    ]
    own, full = (Engine(tiny_llama, smollm.tokenizer, make_policy("full")) for _ in range(2))
    steps = replay_agreement(INTENT, calls, own, full, AgentConfig(agent="tools"))
    assert [s.reference for s in steps] == ["click [17]", "stop [$149]"]  # the calls' actions
    assert all(s.kl < 1e-6 for s in steps)
    assert steps[0].tokens == len(smollm.tokenizer(calls[0].action)["input_ids"])
    for step in steps:  # its own replies are calls of valid actions on their page
        assert canonical(step.action) == step.action


def test_trajectory_is_read_from_an_episode_trace(tmp_path):
    for number, step in enumerate(TRAJECTORY, 1):
        record = {"observation": step.observation, "tabs": step.tabs, "reply": step.action}
        (tmp_path / f"step_{number:03d}.json").write_text(json.dumps(record))
    (tmp_path / "step_001.png").write_bytes(b"")
    assert read_trajectory(tmp_path) == TRAJECTORY
    with pytest.raises(FileNotFoundError, match="no steps"):
        read_trajectory(tmp_path / "missing")


def test_unparsable_replies_compare_as_text():
    assert canonical("  I think I should click ") == "I think I should click"
    assert canonical("```click [12]```") == "click [12]"
    assert agreement_summary([])["agreement"] is None
