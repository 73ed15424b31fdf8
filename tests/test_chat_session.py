"""The chat session: a chat that stops extending what its cache holds (an earlier message
changed) is met with the history token by token and placed and pinned again, as a server's
turn over the whole chat would."""

from __future__ import annotations

from agent_kv.kv.policies import make_policy
from agent_kv.kv.store.pins import flag_runs
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.chat.history_sync import common_prefix
from agent_kv.runtime.chat.layout import render_placed
from agent_kv.runtime.chat.pin_rules import PinRules, protected_spans
from agent_kv.runtime.chat.session import ChatSession
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.sampling import SamplingParams

RULES = PinRules(latest_observations=1, observation_roles=frozenset({"user"}), patterns=("#\\d+",))


def test_a_changed_chat_is_met_with_the_history_and_pinned_again(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    tokenizer = smollm.tokenizer
    chat = ChatSession(engine.new_sequence(), rules=RULES)
    chat.add({"role": "system", "content": "Track order #41."})
    chat.add({"role": "user", "content": "Where is order #52?"})
    first = chat.take_prompt(tokenizer, engine.new_sequence)
    assert first.sync.rebuild == "none" and first.sync.reused_tokens == 0
    engine.prefill(chat.sequence, first.token_ids)
    before = list(chat.sequence.token_ids)

    chat.messages[1] = {"role": "user", "content": "Where is order #77?"}
    chat.add({"role": "assistant", "content": "Shipped."})
    chat.add({"role": "user", "content": "And #63?"})
    second = chat.take_prompt(tokenizer, engine.new_sequence)
    whole = render_placed(tokenizer, chat.messages)
    assert second.sync.rebuild == "truncated"
    assert 0 < second.sync.reused_tokens == common_prefix(before, whole.token_ids)
    assert second.token_ids == whole.token_ids[second.sync.reused_tokens :]
    logits = engine.prefill(chat.sequence, second.token_ids)

    assert chat.sequence.token_ids == whole.token_ids
    assert chat.rendered == whole.text
    expected = protected_spans(whole, chat.messages, RULES)
    assert flag_runs(chat.sequence.store.pins.positions().tolist()) == expected
    pinned = "".join(tokenizer.decode(whole.token_ids[a:b]) for a, b in expected)
    assert "#77" in pinned and "#52" not in pinned and "And #63?" in pinned
    fresh = engine.prefill(engine.new_sequence(), whole.token_ids)
    assert (logits - fresh).abs().max() < 1e-4
    assert chat.figures().tokens_seen == len(whole.token_ids)


def test_content_added_after_the_generation_prompt_is_tokenized_as_the_whole_chat(smollm):
    """An assistant message added after a prefill starts with whitespace the generation
    prompt's newline merges with in the whole chat: the chat is matched whole, not split."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    chat = Conversation(engine)
    chat.add("user", "Pick a colour.")
    chat.prefill()
    chat.add("assistant", "\n\nBlue.")
    chat.add("user", "Another one?")
    logits = chat.prefill()
    whole = render_placed(smollm.tokenizer, chat.messages)
    assert chat.sequence.token_ids == whole.token_ids
    fresh = engine.prefill(engine.new_sequence(), whole.token_ids)
    assert (logits - fresh).abs().max() < 1e-4


def test_reply_pins_and_pattern_matches_in_replies_outlive_an_edit(smollm):
    """A pattern match in a reply is pinned as in any new text, and a pinned reply stays
    pinned when an earlier message is edited and the chat is rebuilt from there."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    tokenizer = smollm.tokenizer
    chat = Conversation(engine, rules=PinRules(roles=frozenset(), latest_observations=0,
                                               patterns=("#\\d+",)))  # fmt: skip
    chat.add("system", "Track orders.")
    chat.add("user", "Where is it?")
    chat.force_reply("It is order #61.", pin=2)
    chat.add("user", "Thanks.")
    chat.reply(SamplingParams(max_new_tokens=4), pin=True)
    chat.add("user", "Bye.")
    chat.prefill()

    def pinned_text() -> list[str]:
        runs = flag_runs(chat.sequence.store.pins.positions().tolist())
        return [tokenizer.decode(chat.sequence.token_ids[a:b]) for a, b in runs]

    before = pinned_text()
    assert " #61" in before and before[0] == "It is"
    chat.messages[1] = {"role": "user", "content": "Where is my order?"}
    chat.add("user", "Really bye.")
    chat.prefill()
    assert chat.sequence.token_ids == render_placed(tokenizer, chat.messages).token_ids
    assert pinned_text() == before


PAGE = (
    "Tab 0 (current): Blue road bike | Classifieds\n"
    "URL: http://127.0.0.1:5000/listing/1\n"
    "[7] RootWebArea 'Blue road bike | Classifieds' focused: True\n"
    "\t[15] link 'Classifieds'\n"
    "\t[3] textbox 'Search' required: False\n"
    "\t[35] heading 'Blue road bike'\n"
    "\t[64] StaticText 'Price: $120'\n"
    "\t[80] button 'Next page'"
)


def test_element_pins_keep_the_latest_pages_controls_turn_by_turn_as_on_the_whole_chat(
    tiny_qwen, qwen_tokenizer
):
    """`page_pins="elements"` on the default model's template: of the latest page, only its
    tab and URL lines and its interactive elements are pinned, and the previous page's are
    released when a new one arrives, as `protected_spans` over the whole chat has them."""
    from agent_kv.harness.agent import PAGE_PIN_RULES

    rules = PAGE_PIN_RULES["elements"]
    engine = Engine(tiny_qwen, qwen_tokenizer, make_policy("full"))
    chat = ChatSession(engine.new_sequence(), rules=rules)
    chat.add({"role": "system", "content": "You are a web agent."})
    chat.add({"role": "user", "content": PAGE})
    engine.prefill(chat.sequence, chat.take_prompt(qwen_tokenizer, engine.new_sequence).token_ids)
    second = PAGE.replace("Blue road bike", "Red city bike").replace("[80] button", "[81] link")
    chat.add({"role": "assistant", "content": "click [15]"})
    chat.add({"role": "user", "content": second})
    engine.prefill(chat.sequence, chat.take_prompt(qwen_tokenizer, engine.new_sequence).token_ids)

    whole = render_placed(qwen_tokenizer, chat.messages)
    expected = protected_spans(whole, chat.messages, rules)
    assert flag_runs(chat.sequence.store.pins.positions().tolist()) == expected
    pinned = "".join(qwen_tokenizer.decode(whole.token_ids[a:b]) for a, b in expected)
    assert "You are a web agent." in pinned
    for line in ("Tab 0 (current): Red city bike", "URL: http://127.0.0.1:5000/listing/1"):
        assert line in pinned
    for element in ("[15] link 'Classifieds'", "[3] textbox 'Search'", "[81] link 'Next page'"):
        assert element in pinned
    assert "StaticText" not in pinned and "heading" not in pinned and "RootWebArea" not in pinned
    assert "Blue road bike" not in pinned and "[80] button" not in pinned  # the first page
    # the whole-page rules pin the latest page whole, and so more tokens
    whole_rules = protected_spans(whole, chat.messages, PAGE_PIN_RULES["whole"])
    pinned_whole = "".join(qwen_tokenizer.decode(whole.token_ids[a:b]) for a, b in whole_rules)
    assert "[64] StaticText 'Price: $120'" in pinned_whole
    assert sum(b - a for a, b in whole_rules) > sum(b - a for a, b in expected)
    # a fork keeps the parts pinned, and releases them with the next page
    twin = chat.fork()
    twin.add({"role": "assistant", "content": "click [81]"})
    twin.add({"role": "user", "content": "Tab 0 (current): Empty\n[2] StaticText 'Nothing'"})
    engine.prefill(twin.sequence, twin.take_prompt(qwen_tokenizer, engine.new_sequence).token_ids)
    later = render_placed(qwen_tokenizer, twin.messages)
    assert flag_runs(twin.sequence.store.pins.positions().tolist()) == protected_spans(
        later, twin.messages, rules
    )
    assert flag_runs(chat.sequence.store.pins.positions().tolist()) == expected
