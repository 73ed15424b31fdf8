"""Tool calls and structured replies: the grammar a `ReplySpec` builds, parsing, streaming
and rendering (`agent_kv.runtime.tool_calls`, `agent_kv.runtime.chat_rendering`)."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from agent_kv.errors import GrammarError
from agent_kv.runtime.chat_rendering import render_chat, template_takes_tools, tools_block
from agent_kv.runtime.grammar import GrammarCompiler
from agent_kv.runtime.sampling import SamplingParams
from agent_kv.runtime.tool_calls import (
    ReplyFormat,
    ReplySpec,
    Tool,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    parse_reply,
    render_calls,
)

WEATHER = Tool(
    "get_weather",
    "The weather in a city.",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)
SEARCH = Tool(
    "search", "Search the web.", {"type": "object", "properties": {"q": {"type": "string"}}}
)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}</tool_call>'


@pytest.fixture(scope="module")
def grammars(smollm):
    """`(compiler, eos, tokenize)` for the default model."""
    tokenizer = smollm.tokenizer
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, smollm.model.config.vocab_size, eos)
    return compiler, eos, lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def accepts(grammars, spec: ReplySpec, text: str) -> bool:
    """Whether the spec's grammar lets the tokens of `text` and then EOS through."""
    compiler, eos, tokenize = grammars
    matcher = compiler.matcher(spec.grammar())
    for token in [*tokenize(text), eos]:
        if not bool(matcher.allowed()[token]):
            return False
        matcher.advance(token)
    return matcher.done


@pytest.mark.parametrize(
    "choice, text, ok",
    [
        (ToolChoice("required"), CALL, True),
        (ToolChoice("required"), "It is sunny.", False),
        (ToolChoice("required"), CALL.replace('"days": 2', '"days": 0'), False),
        (ToolChoice("required"), CALL.replace('"days": 2', '"days": "2"'), False),
        (ToolChoice("required"), CALL.replace("get_weather", "get_wether"), False),
        (ToolChoice("required"), CALL + CALL, True),
        (ToolChoice("function", "search"), CALL, False),
        (
            ToolChoice("function", "search"),
            '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>',
            True,
        ),
        (ToolChoice("auto"), CALL, True),
        (ToolChoice("auto"), "It is sunny in Oslo.", True),
        (ToolChoice("auto"), "Let me check. " + CALL, False),
        (ToolChoice("auto"), CALL.replace('"days": 2', '"days":  2'), False),
    ],
)
def test_the_grammar_admits_exactly_valid_calls(grammars, choice, text, ok):
    spec = ReplySpec((WEATHER, SEARCH), choice)
    assert accepts(grammars, spec, text) is ok


def test_object_schemas_that_list_properties_are_closed(grammars):
    open_tool = Tool("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}})
    spec = ReplySpec((open_tool,), ToolChoice("required"))
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    assert accepts(grammars, spec, call)
    assert not accepts(grammars, spec, call.replace('"a": 1', '"a": 1, "b": 2'))
    explicit = {**open_tool.parameters, "additionalProperties": {"type": "integer"}}
    spec = ReplySpec((Tool("f", "", explicit),), ToolChoice("required"))
    assert accepts(grammars, spec, call.replace('"a": 1', '"a": 1, "b": 2'))


def test_references_inside_tool_parameters_resolve(grammars):
    address = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}}
    book = Tool(
        "book",
        "",
        {
            "$defs": {"Addr": address},
            "type": "object",
            "properties": {"to": {"$ref": "#/$defs/Addr"}, "via": {"$ref": "#/properties/to"}},
            "required": ["to"],
        },
    )
    tree = Tool(
        "tree",
        "",
        {
            "type": "object",
            "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        },
    )
    spec = ReplySpec((book, tree), ToolChoice("required"))
    book_call = '<tool_call>{"name": "book", "arguments": {"to": {"city": "Oslo"}}}</tool_call>'
    assert accepts(grammars, spec, book_call)
    assert not accepts(grammars, spec, book_call.replace('"Oslo"', "3"))
    nested = '{"kids": [{"kids": []}, {}]}'
    assert accepts(
        grammars, spec, f'<tool_call>{{"name": "tree", "arguments": {nested}}}</tool_call>'
    )


def test_schemas_are_checked_before_the_decoder_sees_them():
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nest deeper than 32"):
        ReplySpec((Tool("f", "", deep),)).grammar()
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    with pytest.raises(GrammarError, match="bytes of JSON"):
        ReplySpec(format=ReplyFormat(wide)).grammar()
    with pytest.raises(GrammarError, match="object schema"):
        ReplySpec((Tool("f", "", {"type": "string"}),)).grammar()
    with pytest.raises(GrammarError, match="not valid Unicode"):
        ReplySpec((Tool("f", "", {"description": "x\ud800"}),)).grammar()
    # data keywords are data: closing objects leaves a const alone
    from agent_kv.runtime.json_schemas import closed

    const = {"const": {"properties": {"a": 1}}}
    assert closed(const) == const
    assert closed({"properties": {}})["additionalProperties"] is False


def test_a_close_tag_inside_an_argument_string_stays_in_the_call():
    spec = ReplySpec((SEARCH,), ToolChoice("auto"))
    call = '<tool_call>{"name": "search", "arguments": {"q": "a</tool_call>b"}}</tool_call>'
    text, calls = parse_reply(call, spec)
    assert text == "" and json.loads(calls[0].arguments) == {"q": "a</tool_call>b"}
    splitter = ToolCallStream(spec)
    events = [e for i in range(0, len(call), 3) for e in splitter.feed(call[i : i + 3])]
    assert [e[0] for e in events] == ["call"] and splitter.finish() == []
    assert parse_reply("<tool_call>" + "[" * 5000, spec)[1] == []


def test_one_call_only_without_parallel_calls(grammars):
    spec = ReplySpec((WEATHER,), ToolChoice("required"), parallel=False)
    assert accepts(grammars, spec, CALL) and not accepts(grammars, spec, CALL + CALL)


def test_a_reply_format_constrains_text_and_leaves_calls_open(grammars):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    alone = ReplySpec(format=ReplyFormat(schema, "answer"))
    assert accepts(grammars, alone, '{"answer": "blue"}')
    assert not accepts(grammars, alone, "blue")
    assert not accepts(grammars, alone, '{"answer": 3}')
    with_tools = ReplySpec((WEATHER,), ToolChoice("auto"), format=ReplyFormat(schema))
    assert accepts(grammars, with_tools, CALL) and accepts(grammars, with_tools, '{"answer": "x"}')
    assert not accepts(grammars, with_tools, "plain text")
    assert ReplySpec().grammar() is None


def test_tool_choice_none_is_text_that_opens_no_call(grammars):
    none = ReplySpec((WEATHER,), ToolChoice("none"))
    assert accepts(grammars, none, "It is sunny in Paris.\nTake a hat.")
    assert not accepts(grammars, none, CALL)
    assert not accepts(grammars, none, "Calling it: " + CALL)


@pytest.mark.parametrize(
    "spec, stop, call_open",
    [
        (ReplySpec((WEATHER,), ToolChoice("none")), ["\n"], None),  # text only
        (ReplySpec((WEATHER,), ToolChoice("auto")), ["\n"], "<tool_call>"),  # text or calls
        (ReplySpec((WEATHER,), ToolChoice("required")), [], "<tool_call>"),  # calls only
        (ReplySpec((WEATHER,), ToolChoice("function", "get_weather")), [], "<tool_call>"),
        (ReplySpec(format=ReplyFormat({"type": "object"})), [], None),  # JSON only
        (ReplySpec((WEATHER,), ToolChoice("auto"), format=ReplyFormat({})), [], "<tool_call>"),
        (ReplySpec(), ["\n"], None),
    ],
)
def test_stop_strings_are_scoped_to_the_free_text_a_reply_may_be(spec, stop, call_open):
    scoped = spec.scope_stop(SamplingParams(stop=["\n"]))
    assert (scoped.stop, scoped.call_open) == (stop, call_open)


def test_constrained_generation_always_parses_and_validates(smollm):
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine import Engine
    from agent_kv.runtime.sampling import SamplingParams

    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    spec = ReplySpec((WEATHER, SEARCH), ToolChoice("required"))
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    prompt = render_chat(smollm.tokenizer, messages, spec.tools, generation_prompt=True)
    ids = smollm.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for seed in range(3):
        params = SamplingParams(
            max_new_tokens=120, temperature=1.0, seed=seed, grammar=spec.grammar()
        )
        reply = engine.generate(engine.new_sequence(), ids, params)
        assert reply.finish_reason == "stop", reply.text
        text, calls = parse_reply(reply.text, spec)
        assert text == "" and calls, reply.text
        for call in calls:
            tool = {"get_weather": WEATHER, "search": SEARCH}[call.name]
            jsonschema.validate(json.loads(call.arguments), tool.parameters)
        assert render_calls(calls) == reply.text  # renders back as generated


def test_parse_reply_keeps_text_and_refuses_broken_calls():
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    text, calls = parse_reply(CALL, spec)
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})
    ]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert parse_reply("Sunny.", spec) == ("Sunny.", [])
    cut = CALL[:30]
    assert parse_reply(cut, spec) == (cut, [])  # cut short by max_tokens: text
    unknown = CALL.replace("get_weather", "fly")
    assert parse_reply(unknown, spec) == (unknown, [])
    assert parse_reply(CALL, ReplySpec((WEATHER,), ToolChoice("none"))) == (CALL, [])


def test_the_stream_splitter_holds_back_a_possible_call_and_emits_whole_calls():
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    splitter = ToolCallStream(spec)
    events = []
    for i in range(0, len(CALL + CALL), 7):
        events += splitter.feed((CALL + CALL)[i : i + 7])
    events += splitter.finish()
    assert [e[0] for e in events] == ["call", "call"] and [e[1] for e in events] == [0, 1]
    assert events[0][2].name == "get_weather" and events[0][2].id != events[1][2].id
    text = ToolCallStream(spec)
    assert text.feed("<to") == [] and text.feed("day") == [("text", "<today")]
    assert text.feed(" is") == [("text", " is")] and text.finish() == []
    cut = ToolCallStream(spec)
    assert cut.feed(CALL[:40]) == [] and cut.finish() == [("text", CALL[:40])]


def test_spec_errors_name_the_problem():
    with pytest.raises(GrammarError, match="not in tools"):
        ReplySpec((WEATHER,), ToolChoice("function", "search")).grammar()
    with pytest.raises(GrammarError, match="offered twice"):
        ReplySpec((WEATHER, WEATHER)).grammar()
    with pytest.raises(GrammarError, match="needs at least one tool"):
        ReplySpec((), ToolChoice("required")).grammar()


def test_a_bad_schema_is_a_grammar_error(grammars):
    compiler = grammars[0]
    broken = Tool("f", "", {"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="cannot build"):
        compiler.matcher(ReplySpec((broken,), ToolChoice("required")).grammar())


def test_generic_rendering_lists_tools_in_the_system_message_and_calls_after_text(smollm):
    tokenizer = smollm.tokenizer
    assert not template_takes_tools(tokenizer)
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo", "days": 2}')
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Rain.", "tool_call_id": "call_1"},
    ]
    text = render_chat(tokenizer, messages, (WEATHER,))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n" + tools_block((WEATHER,)))
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in text
    assert "<|im_start|>tool\nRain.<|im_end|>" in text
    # no system message: one holding only the tools comes first
    alone = render_chat(tokenizer, messages[1:2], (WEATHER,))
    assert alone.startswith("<|im_start|>system\n" + tools_block((WEATHER,)) + "<|im_end|>")
    # without tools the rendering is the template's own
    plain = [{"role": "user", "content": "hi"}]
    assert render_chat(tokenizer, plain) == tokenizer.apply_chat_template(plain, tokenize=False)


def test_a_template_with_tool_support_renders_tools_its_own_way(smollm):
    tokenizer = copy.copy(smollm.tokenizer)
    tokenizer.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}"
        "CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
        "{% if m.tool_call_id %} for {{ m.tool_call_id }}{% endif %}|{% endfor %}"
    )
    assert template_takes_tools(tokenizer)
    call = ToolCall("call_1", "get_weather", '{"city": "Oslo", "days": 2}')
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Rain.", "tool_call_id": "call_1"},
    ]
    assert render_chat(tokenizer, messages, (WEATHER, SEARCH)) == (
        "TOOLS:get_weather;search;|[assistant]CALL get_weather Oslo|[tool]Rain. for call_1|"
    )
