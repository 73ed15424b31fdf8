"""Append-only chat over one cache, pins by message, and the agent surviving a dead browser."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers import kept_positions

from agent_kv.errors import ConfigError
from agent_kv.harness.agent import AgentConfig, run_episode
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store.pins import flag_runs
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.chat.layout import render_placed
from agent_kv.runtime.chat.pin_rules import PinRules, protected_spans
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams
from envs.browser_env import BrowserEnv, StepResult
from envs.server import SiteServers
from envs.tasks import load_task


def test_each_turn_prefills_only_the_new_suffix(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    chat = Conversation(engine)
    chat.add("system", "You answer in one short sentence.", pin=True)
    chat.add("user", "What colour is grass?")
    chat.reply(SamplingParams(max_new_tokens=10))
    store = chat.sequence.store
    seen_after_first = store.seen_tokens
    chat.add("user", "And the sky?")
    second = chat.reply(SamplingParams(max_new_tokens=10))
    # the cache holds exactly the template rendering of the conversation so far
    rendered = smollm.tokenizer.apply_chat_template(chat.messages, tokenize=False)
    assert rendered.startswith(chat.text)
    assert rendered[len(chat.text) :] in ("<|im_end|>\n", "\n")
    fed = [t for t in second.token_ids if t not in engine.eos_ids]
    assert store.seen_tokens == seen_after_first + second.prompt_tokens + len(fed)
    assert second.prompt_tokens < 20
    assert len(chat.sequence.token_ids) == store.seen_tokens


def test_pin_rules_follow_messages(smollm):
    policy = make_policy("window", budget=40)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=16)
    latest = PinRules(latest_observations=1, observation_roles=frozenset({"user"}))
    chat = Conversation(engine, rules=latest)
    chat.add("system", "Remember the code word: heliotrope. " * 3)
    chat.add("user", "Filler text about nothing in particular. " * 8)
    chat.reply(SamplingParams(max_new_tokens=4))
    system_span, user_span = chat.spans[0], chat.spans[1]
    kept = set(kept_positions(chat.sequence.store, 0))
    assert set(range(*system_span)) <= kept and set(range(*user_span)) <= kept
    chat.add("user", "Short question?")  # the newer observation releases the filler
    chat.reply(SamplingParams(max_new_tokens=4))
    kept = set(kept_positions(chat.sequence.store, 0))
    assert set(range(*system_span)) <= kept
    assert chat.sequence.store.pins.positions()[chat.spans[3][0] : chat.spans[3][1]].all()
    # once unpinned, the filler competes for a 40-token window with newer turns and loses
    assert len(kept & set(range(*user_span))) < (user_span[1] - user_span[0]) // 2


def test_a_conversation_pins_what_the_servers_rules_pin(smollm):
    """The same rules over the same messages pin the same tokens in a `Conversation` (turn
    by turn) as in a server's turn (`protected_spans` over the whole rendering)."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    rules = PinRules(
        latest_observations=1, observation_roles=frozenset({"user"}), patterns=("#\\d+",)
    )
    chat = Conversation(engine, rules=rules)
    chat.add("system", "Track order #41.")
    chat.add("user", "Where is order #52?")
    chat.force_reply("It ships today.")
    chat.add("user", "And #63, pinned by hand?", pin=True)
    chat.add("user", "Last question.")
    chat.prefill()
    rendered = render_placed(smollm.tokenizer, chat.messages)
    assert rendered.token_ids == chat.sequence.token_ids
    expected = protected_spans(rendered, chat.messages, rules)
    assert flag_runs(chat.sequence.store.pins.positions().tolist()) == expected
    pinned = "".join(smollm.tokenizer.decode(rendered.token_ids[a:b]) for a, b in expected)
    assert "#52" in pinned and "Where is order" not in pinned  # a match in a released turn
    assert "And #63, pinned by hand?" in pinned and "Last question." in pinned


def test_a_conversation_turn_renders_and_tokenizes_the_chat_once(smollm, monkeypatch):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    chat = Conversation(engine, rules=PinRules())
    chat.add("system", "Answer in one word.")
    chat.add("user", "A colour?")
    chat.reply(SamplingParams(max_new_tokens=3))  # the first turn also learns the frame
    cls = type(smollm.tokenizer)
    render, call = cls.apply_chat_template, cls.__call__
    renders, calls = [], []
    monkeypatch.setattr(
        cls, "apply_chat_template", lambda *a, **k: renders.append(1) or render(*a, **k)
    )
    monkeypatch.setattr(cls, "__call__", lambda *a, **k: calls.append(1) or call(*a, **k))
    counts = []
    for question in ("A fruit?", "A tree?"):
        renders.clear()
        calls.clear()
        chat.add("user", question)
        chat.reply(SamplingParams(max_new_tokens=3))
        counts.append((len(renders), len(calls)))
    assert counts == [(1, 1), (1, 1)]


@pytest.mark.parametrize("reencode", [False, True])
def test_pinned_replies_outlive_a_window_that_evicts_unpinned_ones(smollm, reencode):
    policy = make_policy("window", budget=24)
    engine = Engine(smollm.model, smollm.tokenizer, policy, 16, reencode=reencode)
    chat = Conversation(engine)
    chat.add("user", "Say a colour.")
    decoded = chat.reply(SamplingParams(max_new_tokens=6), pin=True)
    decoded_span = chat.spans[1]
    chat.add("user", "Note it.")
    chat.force_reply("note [Blue road bike: $120]", pin=True)
    noted_span = chat.spans[3]
    chat.add("user", "Go on.")
    chat.force_reply("click [12]")
    unpinned_span = chat.spans[5]
    for _ in range(3):
        chat.add("user", "Filler text about nothing in particular. " * 4)
        chat.reply(SamplingParams(max_new_tokens=4))
    store = chat.sequence.store
    kept = set(kept_positions(store, 0))
    # the decoded reply is pinned exactly: its tokens, not the positions past it it reserved
    fed = [t for t in decoded.token_ids if t not in engine.eos_ids]
    assert decoded_span[1] - decoded_span[0] == len(fed) > 0
    assert set(range(*decoded_span)) <= kept and set(range(*noted_span)) <= kept
    pinned = store.pins.positions()
    assert pinned[decoded_span[0] : decoded_span[1]].all()
    assert not pinned[decoded_span[1] : noted_span[0]].any()
    assert not set(range(*unpinned_span)) & kept
    assert store.pins.tokens() == (decoded_span[1] - decoded_span[0]) + (
        noted_span[1] - noted_span[0]
    )
    # re-encoding replaced the cache midway; the spans and pins followed it
    assert (chat.sequence.evicted_at_reencode > 0) == reencode
    spans = list(chat.spans)
    assert all(a[1] <= b[0] and a[0] < a[1] for a, b in itertools.pairwise(spans))
    assert spans[-1][1] == store.seen_tokens == len(chat.sequence.token_ids)


def test_bad_sampling_parameters_leave_the_queued_turn_intact(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    chat = Conversation(engine)
    chat.add("user", "Name a fruit.", pin=True)
    with pytest.raises(ConfigError, match="stop strings"):
        chat.reply(SamplingParams(stop=[""]))
    assert chat.sequence.store.seen_tokens == 0
    reply = chat.reply(SamplingParams(max_new_tokens=4))
    assert reply.prompt_tokens > 5
    assert "Name a fruit." in smollm.tokenizer.decode(chat.sequence.token_ids)


@pytest.mark.browser
def test_dead_browser_fails_the_episode_and_keeps_the_trace(smollm, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=2048))
    task = load_task(1)
    with SiteServers(task.sites) as servers, BrowserEnv(servers) as env:
        real_step = env.step

        def crash_then_step(text):
            env._browser.close()
            return real_step(text)

        env.step = crash_then_step
        result = run_episode(
            task, engine, env, tmp_path / "trace", "smollm", AgentConfig(max_steps=2)
        )
    assert result.end_reason == "error"
    assert result.error.startswith("browser failed")
    assert not result.success and result.score == 0.0
    assert result.tokens_seen > 0 and result.peak_kv_allocated_bytes > 0
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    assert summary["end_reason"] == "error"


class ScriptedPages:
    """A `BrowserEnv` stand-in: numbered pages of listings, `steps` of them, then `stop`."""

    servers: dict = {}
    read_page = None

    def __init__(self, steps: int):
        self.steps, self.url = steps, "http://127.0.0.1/1"

    def _page(self, n: int) -> dict:
        lines = [f"[{i}] link 'Listing {n}-{i}: a used road bike, ${100 + i}'" for i in range(60)]
        return {"url": f"http://127.0.0.1/{n}", "text": "\n".join(lines), "tabs": [f"Page {n}"]}

    def reset(self, task) -> dict:
        return self._page(1)

    def step(self, reply: str) -> StepResult:
        n = int(self.url.rsplit("/", 1)[1]) + 1
        self.url = f"http://127.0.0.1/{n}"
        done = n > self.steps
        info = {"step": n - 1, "action": "click [1]", **({"reason": "stop"} if done else {})}
        return StepResult(self._page(n), done, info, "$120" if done else None)


def test_episode_memory_figures_are_allocated_with_live_beside_them(smollm, tmp_path):
    spec = PolicySpec.parse("conf-kv", 256, None, int8=True)
    engine = Engine.from_spec(spec, smollm.model, smollm.tokenizer)
    config = AgentConfig(max_steps=3, sampling=SamplingParams(max_new_tokens=6))
    result = run_episode(load_task(1), engine, ScriptedPages(3), tmp_path, "smollm", config)
    summary = json.loads((tmp_path / "summary.json").read_text())
    kv_steps = [json.loads(line) for line in (tmp_path / "kv_steps.jsonl").read_text().splitlines()]
    last = json.loads((tmp_path / "step_003.json").read_text())
    token = 30 * 2 * 3 * 64 * 4  # SmolLM2-135M, fp32
    assert result.steps == 3 and summary["tokens_seen"] > 1500
    # allocated: the most any forward call held; live: the most after any call's append
    assert summary["peak_kv_allocated_bytes"] == max(r["kv_allocated_bytes"] for r in kv_steps)
    assert summary["peak_kv_live_bytes"] == max(r["appended_kv_live_bytes"] for r in kv_steps)
    assert all(
        r["kv_live_bytes"] <= r["appended_kv_live_bytes"] <= r["kv_allocated_bytes"]
        for r in kv_steps
    )
    assert summary["peak_kv_live_bytes"] < summary["peak_kv_allocated_bytes"]
    assert summary["kv_shared_bytes"] == 0  # an engine without prefix sharing
    assert summary["full_kv_live_bytes"] == summary["tokens_seen"] * token
    # the tokens plus 5%, in whole 32-token blocks
    slots = summary["full_kv_allocated_bytes"] // token
    assert slots % 32 == 0 and slots - 32 < summary["tokens_seen"] * 1.05 <= slots
    # every call held at most a tenth more than its live bytes, plus one block of tokens
    assert all(
        r["kv_allocated_bytes"] <= 1.1 * r["appended_kv_live_bytes"] + 32 * token for r in kv_steps
    )
    assert summary["kv_reduction_vs_full"] == round(
        summary["full_kv_allocated_bytes"] / summary["peak_kv_allocated_bytes"], 3
    )
    assert summary["kv_live_reduction_vs_full"] == round(
        summary["full_kv_live_bytes"] / summary["peak_kv_live_bytes"], 3
    )
    # the last step's record: the store now and its peaks, the same as the summary's
    assert (last["peak_kv_allocated_bytes"], last["peak_kv_live_bytes"]) == (
        summary["peak_kv_allocated_bytes"],
        summary["peak_kv_live_bytes"],
    )
    assert last["kv_live_bytes"] <= last["kv_allocated_bytes"] <= 1.5 * last["kv_live_bytes"]
