"""A model's tool-call format learnt from its chat template
(`agent_kv.runtime.replies.tool_call_format`):
Qwen's own template, a Hermes-style template of other whitespace, templates whose calls
agent_kv does not read (a 400 naming the model, before any token is decoded), the generic
format, and a grammar failure in the middle of decoding (the server's fault: a 500)."""

from __future__ import annotations

import copy

import httpx
import pytest

from agent_kv.errors import ToolFormatError
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.replies.grammar import GrammarMatcher, end_of_generation_ids
from agent_kv.runtime.replies.tool_call_format import tool_call_format
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

HERMES_TIGHT = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if tools %}{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""A Hermes-style template that writes calls with no whitespace around or between them."""
LLAMA_STYLE = HERMES_TIGHT.replace('"arguments"', '"parameters"').replace("<tool_call>", "")
"""A template that writes bare `{"name", "parameters"}` bodies (Llama 3.1's layout)."""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def with_template(tokenizer, template: str):
    """A copy of `tokenizer` with `template` as its chat template."""
    copied = copy.copy(tokenizer)
    copied.chat_template = template
    return copied


def test_a_hermes_template_of_other_whitespace_is_read_as_it_writes(smollm):
    fmt = tool_call_format(with_template(smollm.tokenizer, HERMES_TIGHT))
    assert (fmt.open, fmt.close, fmt.separator, fmt.text_separator) == (
        "<tool_call>", "</tool_call>", "", "",
    )  # fmt: skip
    assert fmt.added_tokens == () and not fmt.text_before_calls  # SmolLM2: markers are text


def test_a_template_that_drops_text_beside_calls_allows_no_text_before_them(qwen_tokenizer):
    """Hermes 3's layout: calls between newlines, the turn's text dropped when it calls."""
    dropping = HERMES_TIGHT.replace(
        "{{ m.content }}", "{% if not m.tool_calls %}{{ m.content }}{% endif %}"
    )
    fmt = tool_call_format(with_template(qwen_tokenizer, dropping))
    assert fmt.text_separator is None and not fmt.text_before_calls
    assert dict(fmt.added_tokens) == {"<tool_call>": 151657, "</tool_call>": 151658}


def test_a_template_without_tools_that_refuses_a_role_the_generic_format_needs_is_refused(
    smollm,
):
    """Gemma's template: no tool format and no system role, where the generic format lists
    the tools; refused (a 400 naming the model at the route), not a 500 mid-render."""
    no_system = (
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ToolFormatError, match="System role not supported"):
        tool_call_format(with_template(smollm.tokenizer, no_system))


def test_a_template_whose_calls_are_no_hermes_bodies_is_refused(smollm):
    with pytest.raises(ToolFormatError, match="not a Hermes body"):
        tool_call_format(with_template(smollm.tokenizer, LLAMA_STYLE))


async def test_tools_offered_to_a_model_whose_template_has_no_readable_format_are_a_400(
    smollm, tiny_llama
):
    engine = Engine(tiny_llama, with_template(smollm.tokenizer, LLAMA_STYLE), make_policy("full"))
    app = create_app(ChatService(engine), "llama-style")
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 4}
        response = await client.post("/v1/chat/completions", json={**body, "tools": [WEATHER]})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "tools" and error["type"] == "invalid_request_error"
        assert "'llama-style'" in error["message"] and "Hermes" in error["message"]
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200


async def test_a_grammar_failure_while_decoding_is_a_500_not_the_clients_error(
    smollm, tiny_llama, monkeypatch
):
    """A mask that lets through a token its matcher refuses (here: no mask at all) is the
    server's fault: a 500 `server_error`, never an `invalid_request_error` about `tools`."""
    engine = Engine(tiny_llama, smollm.tokenizer, make_policy("full"))
    app = create_app(ChatService(engine), "tiny")
    monkeypatch.setattr(GrammarMatcher, "constrain", lambda self, logits: logits)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = {
            "messages": [{"role": "user", "content": "Weather in Oslo?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "max_tokens": 8,
        }
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 500, response.text
        assert response.json()["error"]["type"] == "server_error"
        assert response.json()["error"]["param"] is None


def test_qwens_end_of_text_token_ends_a_reply_as_its_end_of_turn_does(qwen_tokenizer):
    """Qwen2.5-Coder ends a reply of tool calls with `<|endoftext|>`: an end of generation
    beside `<|im_end|>`, allowed by a grammar wherever the reply may end."""
    ids = end_of_generation_ids(qwen_tokenizer)
    assert qwen_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"]) == ids
