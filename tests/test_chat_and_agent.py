"""Append-only chat over one cache, pins by message, and the agent surviving a dead browser."""

from __future__ import annotations

import json

import pytest

from agent_kv.errors import ConfigError
from agent_kv.harness.agent import AgentConfig, run_episode
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.conversation import Conversation
from agent_kv.runtime.engine import Engine
from agent_kv.runtime.sampling import SamplingParams
from envs.browser_env import BrowserEnv
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


def test_pins_follow_messages(smollm):
    policy = make_policy("window", budget=40)
    engine = Engine(smollm.model, smollm.tokenizer, policy, prefill_chunk=16)
    chat = Conversation(engine)
    chat.add("system", "Remember the code word: heliotrope. " * 3, pin=True)
    chat.add("user", "Filler text about nothing in particular. " * 8, pin=True)
    chat.reply(SamplingParams(max_new_tokens=4))
    system_span, user_span = chat.spans[0], chat.spans[1]
    kept = set(chat.sequence.store.layers[0].live_positions().tolist())
    assert set(range(*system_span)) <= kept and set(range(*user_span)) <= kept
    chat.unpin_message(1)
    chat.add("user", "Short question?")
    chat.reply(SamplingParams(max_new_tokens=4))
    layer = chat.sequence.store.layers[0]
    kept = set(layer.live_positions().tolist())
    assert set(range(*system_span)) <= kept
    # once unpinned, the filler competes for a 40-token window with newer turns and loses
    assert len(kept & set(range(*user_span))) < (user_span[1] - user_span[0]) // 2
    with pytest.raises(KeyError):
        chat.unpin_message(99)


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
    assert result.tokens_seen > 0 and result.peak_kv_bytes > 0
    summary = json.loads((tmp_path / "trace" / "summary.json").read_text())
    assert summary["end_reason"] == "error"
