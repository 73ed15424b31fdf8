"""Each session's last prompt, kept so that a turn extending it tokenizes only the new text."""

from __future__ import annotations

from agent_kv.runtime.chat.layout import RenderedChat
from agent_kv.serving.last_prompts import LastPrompts


def chat(text: str) -> RenderedChat:
    return RenderedChat(text, [1] * len(text), list(range(len(text))), [], [(0, len(text))])


def test_a_turn_finds_its_sessions_prompt_or_the_longest_anonymous_one_it_extends():
    prompts = LastPrompts("auto-")
    prompts.remember("named", chat("ab"), ["named"])
    prompts.remember("auto-1", chat("abc"), ["named", "auto-1"])
    prompts.remember("auto-2", chat("abcd"), ["named", "auto-1", "auto-2"])
    assert prompts.find("named", "abcdef").text == "ab"
    assert prompts.find("named", "xbcdef") is None  # the chat changed before its end
    assert prompts.find("other", "abcdef") is None
    assert prompts.find(None, "abcdef").text == "abcd"  # named sessions are not candidates
    assert prompts.find(None, "abcX").text == "abc"


def test_only_the_prompts_of_sessions_in_memory_are_kept():
    prompts = LastPrompts("auto-")
    prompts.remember("a", chat("a"), ["a"])
    prompts.remember("b", chat("b"), ["a", "b"])
    assert len(prompts) == 2
    prompts.remember("c", chat("c"), ["b", "c"])  # "a" left memory
    assert len(prompts) == 2
    assert prompts.find("a", "a") is None and prompts.find("b", "b").text == "b"
