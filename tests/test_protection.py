"""Protection rules: token spans pinned by role, flag, latest observation and regex."""

from __future__ import annotations

import pytest
from helpers import random_tokens

from agent_kv.errors import ConfigError
from agent_kv.kv.store import KVStore
from agent_kv.runtime.chat.layout import render_placed
from agent_kv.runtime.chat.pin_rules import PinRules, apply_pins, protected_spans

URL = "http://127.0.0.1:8000/item/42"
MESSAGES = [
    {"role": "system", "content": "You are a web agent. Answer with one action."},
    {"role": "user", "content": "Goal: buy the cheapest blue bike.", "pin": True},
    {"role": "tool", "content": "Observation one: a list of forty bikes."},
    {"role": "assistant", "content": "click [12]"},
    {"role": "tool", "content": "Observation two: the bike page, 120 dollars."},
    {"role": "user", "content": f"The page you are on is {URL} now."},
]


def pinned_text(tokenizer, spans) -> str:
    ids = render_placed(tokenizer, MESSAGES).token_ids
    return "|".join(tokenizer.decode(ids[start:end]) for start, end in spans)


def spans_of(tokenizer, messages, rules):
    return protected_spans(render_placed(tokenizer, messages), messages, rules)


def test_roles_flags_latest_observation_and_patterns(smollm):
    rules = PinRules(patterns=(r"http://\S+",))
    spans = spans_of(smollm.tokenizer, MESSAGES, rules)
    pinned = pinned_text(smollm.tokenizer, spans)
    assert "You are a web agent" in pinned  # role system
    assert "Goal: buy the cheapest blue bike" in pinned  # "pin": true
    assert "Observation two" in pinned and "Observation one" not in pinned  # latest only
    assert URL in pinned and "The page you are on" not in pinned  # the match alone
    assert "click [12]" not in pinned
    assert spans == sorted(spans) and all(a < b for a, b in spans)
    # two observations kept, and no rules at all
    two = PinRules(latest_observations=2)
    assert "Observation one" in pinned_text(
        smollm.tokenizer, spans_of(smollm.tokenizer, MESSAGES, two)
    )
    every_tool = PinRules(roles=frozenset({"system", "tool"}), latest_observations=0)
    assert "Observation one" in pinned_text(
        smollm.tokenizer, spans_of(smollm.tokenizer, MESSAGES, every_tool)
    )
    none = PinRules(roles=frozenset(), latest_observations=0)
    plain = [{k: v for k, v in m.items() if k != "pin"} for m in MESSAGES]
    assert spans_of(smollm.tokenizer, plain, none) == []


def test_bad_rules_are_configuration_errors(smollm):
    with pytest.raises(ConfigError, match="not valid RE2 syntax"):
        spans_of(smollm.tokenizer, MESSAGES, PinRules(patterns=("(unclosed",)))
    with pytest.raises(ConfigError, match="latest_observations"):
        PinRules(latest_observations=-1).validate()


def test_apply_pins_sets_exactly_the_spans():
    store = KVStore(1, 1, 4)
    random_tokens(store, 20)
    store.pins.pin(0, 20)
    apply_pins(store, [(2, 4), (10, 12)])
    assert store.pins.mask(0).nonzero().squeeze(1).tolist() == [2, 3, 10, 11]


def test_observation_patterns_count_with_the_patterns_and_must_compile():
    with pytest.raises(ConfigError, match="at most 16 pin patterns, got 17"):
        PinRules(patterns=("a",) * 9, observation_patterns=("b",) * 8).validate()
    with pytest.raises(ConfigError, match="not valid RE2 syntax"):
        PinRules(observation_patterns=("(unclosed",)).validate()
    rules = PinRules.from_fields(observation_patterns=[r"\[\d+\] link[^\n]*"])
    assert rules.observation_patterns == (r"\[\d+\] link[^\n]*",)
    assert rules.pinned_messages(MESSAGES) == [0, 1]  # no observation whole
