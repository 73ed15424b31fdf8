"""Tool calls and structured replies: the grammar a `ReplySpec` builds, parsing, streaming
and rendering (`agent_kv.runtime.replies.tool_calls`, `agent_kv.runtime.chat.rendering`)."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest

from agent_kv.errors import GrammarError
from agent_kv.runtime.chat.rendering import render_chat, tools_block
from agent_kv.runtime.replies.grammar import GrammarCompiler
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_call_format import (
    ToolCallFormat,
    template_takes_tools,
    tool_call_format,
)
from agent_kv.runtime.replies.tool_calls import (
    ReplyFormat,
    ReplySpec,
    Tool,
    ToolCall,
    ToolCallStream,
    ToolChoice,
    call_check,
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
GENERIC = ToolCallFormat("<tool_call>", "</tool_call>", "<tool_call>", "", "")
"""The generic format where the markers are text (SmolLM2's)."""


@pytest.fixture(scope="module", params=["smollm2", "qwen"])
def tokens(request):
    """`(tokenizer, vocab size)` of SmolLM2 (no tool template: the generic format, markers as
    text) and of the default model (Qwen's template: markers as added tokens)."""
    if request.param == "smollm2":
        smollm = request.getfixturevalue("smollm")
        return smollm.tokenizer, smollm.model.config.vocab_size
    return request.getfixturevalue("qwen_tokenizer"), request.getfixturevalue(
        "tiny_qwen"
    ).config.vocab_size


@pytest.fixture(scope="module")
def grammars(tokens):
    """`(compiler, eos, tokenize, format)` for the tokenizer."""
    tokenizer, vocab = tokens
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(tokenizer, vocab, eos)
    tokenize = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    return compiler, eos, tokenize, tool_call_format(tokenizer)


def call_text(fmt, name: str, arguments: dict | str) -> str:
    """A call in `fmt` (`arguments` as given when text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return fmt.render_call(name, text)


def accepts(grammars, spec: ReplySpec, text: str) -> bool:
    """Whether the spec's grammar lets the tokens of `text` and then EOS through."""
    compiler, eos, tokenize, fmt = grammars
    matcher = compiler.matcher(spec.grammar(fmt))
    for token in [*tokenize(text), eos]:
        if not bool(matcher.allowed()[token]):
            return False
        matcher.advance(token)
    return matcher.done


OSLO = {"city": "Oslo", "days": 2}


@pytest.mark.parametrize(
    "choice, reply, ok",
    [
        (ToolChoice("required"), lambda c: c, True),
        (ToolChoice("required"), lambda c: "It is sunny.", False),
        (ToolChoice("required"), lambda c: c.replace('"days": 2', '"days": 0'), False),
        (ToolChoice("required"), lambda c: c.replace('"days": 2', '"days": "2"'), False),
        (ToolChoice("required"), lambda c: c.replace("get_weather", "get_wether"), False),
        (ToolChoice("function", "search"), lambda c: c, False),
        (ToolChoice("auto"), lambda c: c, True),
        (ToolChoice("auto"), lambda c: "It is sunny in Oslo.", True),
        (ToolChoice("auto"), lambda c: c.replace('"days": 2', '"days":  2'), False),
    ],
)
def test_the_grammar_admits_exactly_valid_calls(grammars, choice, reply, ok):
    spec = ReplySpec((WEATHER, SEARCH), choice)
    assert accepts(grammars, spec, reply(call_text(grammars[3], "get_weather", OSLO))) is ok


def test_calls_follow_each_other_in_the_format_and_text_precedes_them_where_it_may(grammars):
    fmt = grammars[3]
    weather, search = call_text(fmt, "get_weather", OSLO), call_text(fmt, "search", {"q": "x"})
    spec = ReplySpec((WEATHER, SEARCH), ToolChoice("required"))
    assert accepts(grammars, spec, fmt.separator.join([weather, search]))
    assert accepts(grammars, ReplySpec((WEATHER, SEARCH), ToolChoice("function", "search")), search)
    auto = ReplySpec((WEATHER, SEARCH), ToolChoice("auto"))
    preface = "Let me check." + fmt.text_separator + weather
    assert accepts(grammars, auto, preface) is fmt.text_before_calls
    assert not accepts(grammars, spec, preface)
    assert not accepts(grammars, auto, "Let me check. " + fmt.marker + " no call")


def test_the_default_models_format_names_its_added_tokens(qwen_tokenizer, tiny_qwen):
    """Qwen2.5's calls: markers as the added tokens 151657/151658, newlines around the body,
    as its template renders them; the grammar forces those tokens, never their bytes."""
    fmt = tool_call_format(qwen_tokenizer)
    assert (fmt.open, fmt.close, fmt.separator, fmt.text_separator) == (
        "<tool_call>\n", "\n</tool_call>", "\n", "\n",
    )  # fmt: skip
    assert dict(fmt.added_tokens) == {"<tool_call>": 151657, "</tool_call>": 151658}
    eos = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    compiler = GrammarCompiler(qwen_tokenizer, tiny_qwen.config.vocab_size, eos)
    matcher = compiler.matcher(ReplySpec((WEATHER,), ToolChoice("required")).grammar(fmt))
    assert matcher.allowed().nonzero().flatten().tolist() == [151657]
    auto = compiler.matcher(ReplySpec((WEATHER,), ToolChoice("auto")).grammar(fmt))
    allowed = auto.allowed()
    assert allowed[151657] and allowed[qwen_tokenizer.convert_tokens_to_ids("It")]
    lt = qwen_tokenizer.convert_tokens_to_ids("<")
    auto.advance(lt)  # text may start with "<", but not spell the marker out
    for token in qwen_tokenizer("tool_call>", add_special_tokens=False)["input_ids"][:-1]:
        auto.advance(token)
    assert not auto.allowed()[qwen_tokenizer.convert_tokens_to_ids(">")]


def test_object_schemas_that_list_properties_are_closed(grammars):
    fmt = grammars[3]
    open_tool = Tool("f", "", {"type": "object", "properties": {"a": {"type": "integer"}}})
    spec = ReplySpec((open_tool,), ToolChoice("required"))
    assert accepts(grammars, spec, call_text(fmt, "f", {"a": 1}))
    assert not accepts(grammars, spec, call_text(fmt, "f", {"a": 1, "b": 2}))
    explicit = {**open_tool.parameters, "additionalProperties": {"type": "integer"}}
    spec = ReplySpec((Tool("f", "", explicit),), ToolChoice("required"))
    assert accepts(grammars, spec, call_text(fmt, "f", {"a": 1, "b": 2}))


def test_references_inside_tool_parameters_resolve(grammars):
    fmt = grammars[3]
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
    assert accepts(grammars, spec, call_text(fmt, "book", {"to": {"city": "Oslo"}}))
    assert not accepts(grammars, spec, call_text(fmt, "book", {"to": {"city": 3}}))
    assert accepts(grammars, spec, call_text(fmt, "tree", '{"kids": [{"kids": []}, {}]}'))


def test_schemas_are_checked_before_the_decoder_sees_them():
    deep: dict = {"type": "integer"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match="nest deeper than 32"):
        ReplySpec((Tool("f", "", deep),)).grammar(GENERIC)
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}
    with pytest.raises(GrammarError, match="bytes of JSON"):
        ReplySpec(format=ReplyFormat(wide)).grammar(None)
    with pytest.raises(GrammarError, match="object schema"):
        ReplySpec((Tool("f", "", {"type": "string"}),)).grammar(GENERIC)
    with pytest.raises(GrammarError, match="not valid Unicode"):
        ReplySpec((Tool("f", "", {"description": "x\ud800"}),)).grammar(GENERIC)
    # data keywords are data: closing objects leaves a const alone
    from agent_kv.runtime.replies.json_schemas import closed

    const = {"const": {"properties": {"a": 1}}}
    assert closed(const) == const
    assert closed({"properties": {}})["additionalProperties"] is False


def test_a_close_tag_inside_an_argument_string_stays_in_the_call(grammars):
    fmt = grammars[3]
    spec = ReplySpec((SEARCH,), ToolChoice("auto"))
    call = call_text(fmt, "search", {"q": "a</tool_call>b"})
    text, calls = parse_reply(call, spec, fmt)
    assert text == "" and json.loads(calls[0].arguments) == {"q": "a</tool_call>b"}
    splitter = ToolCallStream(spec, fmt)
    events = [e for i in range(0, len(call), 3) for e in splitter.feed(call[i : i + 3])]
    assert [e[0] for e in events] == ["call"] and splitter.finish() == []
    assert parse_reply(fmt.open + "[" * 5000, spec, fmt)[1] == []


def test_one_call_only_without_parallel_calls(grammars):
    fmt = grammars[3]
    call = call_text(fmt, "get_weather", OSLO)
    spec = ReplySpec((WEATHER,), ToolChoice("required"), parallel=False)
    two = fmt.separator.join([call, call])
    assert accepts(grammars, spec, call) and not accepts(grammars, spec, two)


def test_a_reply_format_constrains_text_and_leaves_calls_open(grammars):
    call = call_text(grammars[3], "get_weather", OSLO)
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
    assert accepts(grammars, with_tools, call) and accepts(grammars, with_tools, '{"answer": "x"}')
    assert not accepts(grammars, with_tools, "plain text")
    assert ReplySpec().grammar(None) is None


def test_tool_choice_none_is_text_that_opens_no_call(grammars):
    fmt = grammars[3]
    call = call_text(fmt, "get_weather", OSLO)
    none = ReplySpec((WEATHER,), ToolChoice("none"))
    assert accepts(grammars, none, "It is sunny in Paris.\nTake a hat.")
    assert not accepts(grammars, none, call)
    assert not accepts(grammars, none, "Calling it:" + fmt.text_separator + call)


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
    scoped = spec.scope_stop(SamplingParams(stop=["\n"]), GENERIC)
    assert (scoped.stop, scoped.call_open) == (stop, call_open)


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_constrained_generation_always_parses_validates_and_renders_back(request, model):
    """Sampled calls (temperature 1, three seeds) parse, validate against their schemas and,
    sent back, render through the chat template to the very text the model generated."""
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.engine.engine import Engine

    if model == "smollm2":
        smollm = request.getfixturevalue("smollm")
        network, tokenizer = smollm.model, smollm.tokenizer
    else:
        network, tokenizer = (
            request.getfixturevalue("tiny_qwen"),
            request.getfixturevalue("qwen_tokenizer"),
        )
    engine = Engine(network, tokenizer, make_policy("full"))
    fmt = tool_call_format(tokenizer)
    spec = ReplySpec((WEATHER, SEARCH), ToolChoice("required"))
    messages = [{"role": "user", "content": "What is the weather in Paris for 3 days?"}]
    prompt = render_chat(tokenizer, messages, spec.tools, generation_prompt=True)
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    for seed in range(3):
        params = SamplingParams(
            max_new_tokens=120, temperature=1.0, seed=seed, grammar=spec.grammar(fmt)
        )
        reply = engine.generate(engine.new_sequence(), ids, params)
        assert reply.finish_reason == "stop", reply.text
        text, calls = parse_reply(reply.text, spec, fmt)
        assert text == "" and calls, reply.text
        for call in calls:
            tool = {"get_weather": WEATHER, "search": SEARCH}[call.name]
            jsonschema.validate(json.loads(call.arguments), tool.parameters)
        assert render_calls(calls, fmt) == reply.text  # renders back as generated
        sent_back = [*messages, {"role": "assistant", "content": "", "tool_calls": calls}]
        history = render_chat(tokenizer, sent_back, spec.tools)
        assert history.startswith(prompt + reply.text + "<|im_end|>"), history[len(prompt) :]


def test_parse_reply_keeps_text_and_refuses_broken_calls(grammars):
    fmt = grammars[3]
    call = call_text(fmt, "get_weather", OSLO)
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    text, calls = parse_reply(call, spec, fmt)
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2})
    ]
    assert calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert parse_reply("Sunny.", spec, fmt) == ("Sunny.", [])
    cut = call[:30]
    assert parse_reply(cut, spec, fmt) == (cut, [])  # cut short by max_tokens: text
    unknown = call.replace("get_weather", "fly")
    assert parse_reply(unknown, spec, fmt) == (unknown, [])
    assert parse_reply(call, ReplySpec((WEATHER,), ToolChoice("none")), fmt) == (call, [])
    prefaced = "Checking." + fmt.text_separator + call
    text, calls = parse_reply(prefaced, spec, fmt)
    if fmt.text_before_calls:
        assert text == "Checking." and [c.name for c in calls] == ["get_weather"]
    else:
        assert (text, calls) == (prefaced, [])


def test_the_stream_splitter_holds_back_a_possible_call_and_emits_whole_calls(grammars):
    fmt = grammars[3]
    call = call_text(fmt, "get_weather", OSLO)
    two = fmt.separator.join([call, call])
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    splitter = ToolCallStream(spec, fmt)
    events = []
    for i in range(0, len(two), 7):
        events += splitter.feed(two[i : i + 7])
    events += splitter.finish()
    assert [e[0] for e in events] == ["call", "call"] and [e[1] for e in events] == [0, 1]
    assert events[0][2].name == "get_weather" and events[0][2].id != events[1][2].id
    text = ToolCallStream(spec, fmt)
    assert text.feed("<to") == [] and text.feed("day") == [("text", "<today")]
    assert text.feed(" is") == [("text", " is")] and text.finish() == []
    cut = ToolCallStream(spec, fmt)
    assert cut.feed(call[:40]) == [] and cut.finish() == [("text", call[:40])]


def test_the_stream_splitter_sends_text_before_calls_where_the_format_allows_it(
    qwen_tokenizer,
):
    fmt = tool_call_format(qwen_tokenizer)
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    reply = "Line one.\nChecking." + fmt.text_separator + call_text(fmt, "get_weather", OSLO)
    splitter = ToolCallStream(spec, fmt)
    events = [e for i in range(0, len(reply), 4) for e in splitter.feed(reply[i : i + 4])]
    events += splitter.finish()
    text = "".join(e[1] for e in events if e[0] == "text")
    assert text == "Line one.\nChecking." and [e[0] for e in events][-1] == "call"
    cut = ToolCallStream(spec, fmt)
    short = "Checking." + fmt.text_separator + fmt.open + '{"na'
    sent = [e for i in range(0, len(short), 3) for e in cut.feed(short[i : i + 3])]
    assert "".join(e[1] for e in [*sent, *cut.finish()]) == short  # no call: all text


def test_spec_errors_name_the_problem():
    with pytest.raises(GrammarError, match="not in tools"):
        ReplySpec((WEATHER,), ToolChoice("function", "search")).grammar(GENERIC)
    with pytest.raises(GrammarError, match="offered twice"):
        ReplySpec((WEATHER, WEATHER)).grammar(GENERIC)
    with pytest.raises(GrammarError, match="needs at least one tool"):
        ReplySpec((), ToolChoice("required")).grammar(GENERIC)
    with pytest.raises(GrammarError, match="no tool-call format"):
        ReplySpec((WEATHER,)).grammar(None)


def test_a_bad_schema_is_a_grammar_error(grammars):
    compiler, fmt = grammars[0], grammars[3]
    broken = Tool("f", "", {"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(GrammarError, match="cannot build"):
        compiler.matcher(ReplySpec((broken,), ToolChoice("required")).grammar(fmt))


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
    call_text_ = call_text(tool_call_format(tokenizer), "get_weather", OSLO)
    assert f"<|im_start|>assistant\n{call_text_}<|im_end|>" in text
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


FENCED = (
    '```json\n{\n  "name": "get_weather",\n  "arguments": {\n'
    '    "days": 2,\n    "city": "Oslo"\n  }\n}\n```'
)
"""A call written as JSON text in a code fence, its keys out of the schema's order: what the
default model writes under `auto`."""


@pytest.mark.parametrize(
    "reply, called",
    [
        (FENCED, {"city": "Oslo", "days": 2}),
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}', OSLO),
        ('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 0}}', None),  # minimum 1
        ('{"name": "get_weather", "arguments": {"city": "Oslo"}}', None),  # days required
        ('{"name": "fly", "arguments": {}}', None),
        ('```python\nprint({"name": 1})\n```', None),
        ('Sure: {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}', None),
    ],
)
def test_under_auto_a_call_written_as_json_text_is_read_when_its_arguments_pass(
    grammars, reply, called
):
    compiler, fmt = grammars[0], grammars[3]
    spec = ReplySpec((WEATHER, SEARCH), ToolChoice("auto"))
    check = call_check(spec, fmt, compiler)
    text, calls = parse_reply(reply, spec, fmt, check)
    splitter = ToolCallStream(spec, fmt, check)
    events = [e for i in range(0, len(reply), 5) for e in splitter.feed(reply[i : i + 5])]
    events += splitter.finish()
    if called is None:
        assert (text, calls) == (reply, [])
        assert "".join(e[1] for e in events) == reply and {e[0] for e in events} == {"text"}
        return
    assert text == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", called)
    ]
    assert calls[0].arguments == json.dumps(called)  # in the schema's order, as generated
    assert [e[0] for e in events] == ["call"] and events[0][2].arguments == calls[0].arguments
    for choice in (ToolChoice("required"), ToolChoice("none")):  # only `auto` reads them
        assert parse_reply(reply, ReplySpec((WEATHER,), choice), fmt, check)[1] == []


def test_a_stop_string_does_not_cut_a_call_written_as_json_text(grammars):
    """Under `auto`, a reply that is (or may become) a call written as JSON text is a call:
    no stop string cuts it, as none cuts a call opened by the marker; plain text is cut."""
    from agent_kv.runtime.replies.decoding import ReplyDecoder

    fmt = grammars[3]
    spec = ReplySpec((WEATHER,), ToolChoice("auto"))
    params = spec.scope_stop(SamplingParams(stop=["Oslo"]), fmt)
    assert params.json_calls and params.stop == ["Oslo"]
    decoder = ReplyDecoder(params, None, None, set())
    assert not decoder._stops('{"name": "get_weather", "arguments": {"city": "Oslo"')
    assert not decoder._stops('```json\n{\n  "name": "get_weather", "city": "Oslo"')
    assert decoder._stops("The weather in Oslo")
    assert (
        not ReplySpec((WEATHER,), ToolChoice("required"))
        .scope_stop(SamplingParams(), fmt)
        .json_calls
    )
