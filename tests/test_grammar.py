"""Grammar-constrained decoding: the action grammar, the llguidance matcher, the engine."""

from __future__ import annotations

import json

import pytest
import torch

from agent_kv.errors import GrammarError, GrammarStateError
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.grammar import Grammar, GrammarCompiler
from agent_kv.runtime.replies.sampling import SamplingParams
from envs.action_grammar import (
    MAX_ELEMENT_IDS,
    TEXT_CHARS,
    ActionGrammarError,
    action_grammar,
    element_ids,
)
from envs.actions import parse_action

OBSERVATION = """Tab 0 (current): Bikes
URL: http://127.0.0.1:8001/c/bikes
[3] RootWebArea 'Bikes'
[12] link 'Blue road bike - $120'
  [40] StaticText 'Oakland'
[45] textbox 'Search'
[120] button 'Go'"""


@pytest.fixture(scope="module")
def compiler(smollm) -> GrammarCompiler:
    return Engine(smollm.model, smollm.tokenizer, make_policy("full")).grammars


def accepts(compiler: GrammarCompiler, grammar: Grammar, text: str, tokenizer) -> bool:
    """Whether `text`'s tokens are all allowed one by one and leave a complete sentence."""
    matcher = compiler.matcher(grammar)
    for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
        if not matcher.allowed()[token]:
            return False
        matcher.advance(token)
    return matcher.accepting


def test_element_ids_are_the_observation_lines_ids():
    assert element_ids(OBSERVATION) == [3, 12, 40, 45, 120]
    assert element_ids("Tab 0 (current): x\nURL: http://a/[7]\nno ids") == []


@pytest.mark.parametrize(
    "text, ok",
    [
        ("click [12]", True),
        ("click [13]", False),  # not on the page
        ("click [1]", False),  # a prefix of an id is not an id
        ("hover [40]", True),
        ("type [45] [red bike] [1]", True),
        ("type [45] [red bike]", False),  # the Enter flag is always written
        ("stop [$120]", True),
        ("stop []", True),
        ("stop", False),
        ("press [Control+a]", True),
        ("press [Hyper]", False),
        ("scroll [down]", True),
        ("tab_focus [1]", True),
        ("tab_focus [2]", False),  # two tabs open
        ("goto [http://127.0.0.1:8001/]", True),
        ("go_back", True),
        ("Let me click [12]", False),  # no prose
        ("stop [" + "x" * (TEXT_CHARS + 1) + "]", False),
    ],
)
def test_action_grammar_accepts_exactly_the_pages_actions(compiler, smollm, text, ok):
    grammar = Grammar("lark", action_grammar(element_ids(OBSERVATION), tabs=2).lark)
    assert accepts(compiler, grammar, text, smollm.tokenizer) is ok
    if ok:
        assert str(parse_action(text)) == text


def test_without_ids_only_page_free_actions_remain(compiler, smollm):
    grammar = Grammar("lark", action_grammar([], tabs=1).lark)
    assert not accepts(compiler, grammar, "click [12]", smollm.tokenizer)
    assert accepts(compiler, grammar, "scroll [up]", smollm.tokenizer)


def test_action_grammar_refuses_what_it_cannot_build():
    with pytest.raises(ActionGrammarError, match="element ids"):
        action_grammar(range(MAX_ELEMENT_IDS + 1), tabs=1)
    with pytest.raises(ActionGrammarError, match="tab"):
        action_grammar([1], tabs=0)


def test_max_bytes_bounds_every_action():
    grammar = action_grammar([7, 12345], tabs=1)
    longest_type = "type [12345] [" + "é" * TEXT_CHARS + "] [1]"
    assert len(longest_type.encode()) <= grammar.max_bytes


def test_constrain_masks_every_other_token(compiler, smollm):
    matcher = compiler.matcher(Grammar("regex", "(yes|no)"))
    logits = torch.zeros(smollm.model.config.vocab_size)
    masked = matcher.constrain(logits)
    allowed = torch.isfinite(masked)
    assert 2 <= int(allowed.sum()) < 20
    decoded = {smollm.tokenizer.decode([t]) for t in allowed.nonzero().flatten().tolist()}
    assert all("yes".startswith(d) or "no".startswith(d) for d in decoded), decoded
    assert torch.equal(logits, torch.zeros_like(logits))  # the input is not changed


def test_a_token_outside_the_grammar_is_an_error(compiler, smollm):
    matcher = compiler.matcher(Grammar("regex", "yes"))
    with pytest.raises(GrammarStateError, match="outside the grammar"):
        matcher.advance(smollm.tokenizer("no", add_special_tokens=False)["input_ids"][0])


@pytest.mark.parametrize(
    "grammar, reason",
    [
        (Grammar("lark", "start: missing_rule"), "missing_rule"),
        (Grammar.json_schema({"type": "bogus"}), "bogus"),
        (Grammar("regex", "(unclosed"), "regex"),
        (Grammar.json_schema({"type": "string", "pattern": "(["}), "unclosed character class"),
        (Grammar("yaml", "a: b"), "unknown grammar kind"),
        (Grammar("lark", "  "), "empty"),
    ],
)
def test_grammars_that_cannot_be_built_name_the_reason(compiler, grammar, reason):
    with pytest.raises(GrammarError, match=reason):
        compiler.matcher(grammar)


@pytest.fixture(scope="module")
def engine(smollm) -> Engine:
    return Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))


def prompt(smollm, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    rendered = smollm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    return smollm.tokenizer(rendered, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.5, 1), (1.5, 2), (1.5, 3)])
def test_constrained_replies_always_parse(engine, smollm, temperature, seed):
    """Even hot sampling from a prompt that asks for prose gives a valid action on the
    page, ending by itself (finish "stop") within the grammar's byte bound."""
    grammar = action_grammar(element_ids(OBSERVATION), tabs=1)
    params = SamplingParams(
        max_new_tokens=grammar.max_bytes + 1,
        temperature=temperature,
        seed=seed,
        grammar=Grammar("lark", grammar.lark),
    )
    ids = prompt(smollm, "Write a poem about bicycles.\n" + OBSERVATION)
    reply = engine.generate(engine.new_sequence(), ids, params)
    action = parse_action(reply.text)
    assert reply.finish_reason == "stop"
    assert str(action) == reply.text
    if action.element_id is not None:
        assert action.element_id in grammar.element_ids


def test_json_schema_replies_validate(engine, smollm):
    schema = {
        "type": "object",
        "properties": {"price": {"type": "integer"}, "city": {"enum": ["Oakland", "Berkeley"]}},
        "required": ["price", "city"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_new_tokens=64, grammar=Grammar.json_schema(schema))
    ids = prompt(smollm, "A blue road bike costs 120 dollars in Oakland. Give price and city.")
    reply = engine.generate(engine.new_sequence(), ids, params)
    data = json.loads(reply.text)
    assert set(data) == {"price", "city"}
    assert isinstance(data["price"], int) and data["city"] in ("Oakland", "Berkeley")


def test_a_bad_grammar_prefills_nothing(engine, smollm):
    sequence = engine.new_sequence()
    params = SamplingParams(grammar=Grammar("lark", "start: nope"))
    with pytest.raises(GrammarError):
        engine.generate(sequence, prompt(smollm, "hi"), params)
    assert sequence.store.seen_tokens == 0


def test_batch_rows_each_follow_the_grammar(engine, smollm):
    params = SamplingParams(
        max_new_tokens=8, temperature=1.0, seed=5, grammar=Grammar("regex", "(yes|no)")
    )
    prompts = [prompt(smollm, "Is it red?"), prompt(smollm, "Hi")]
    batch = engine.generate_batch(prompts, params)
    assert [g.text in ("yes", "no") for g in batch.generations] == [True, True]
    assert all(g.finish_reason == "stop" for g in batch.generations)
    longest = max(len(g.token_ids) for g in batch.generations)
    for row, ids in enumerate(prompts):
        alone = engine.new_sequence()  # the same reply as the prompt decoded alone
        reply = batch.generations[row].token_ids
        assert reply == engine.generate(alone, ids, params).token_ids
        assert alone.store.seen(0) == len(ids) + len(reply)  # the completing token fed
        # one decode call per token of the longest reply, a finished row fed its last token
        assert batch.store.seen(row) == len(ids) + longest
