"""Messages placed in a chat from one rendering: the same spans as rendering each prefix, for
both bundled models' templates, with and without tools; one rendering and one tokenization
per `/chat` turn."""

from __future__ import annotations

import httpx
import pytest

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.chat.layout import message_char_spans, place_messages, render_placed
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models.model_loading import load_tokenizer
from agent_kv.runtime.replies.tool_calls import Tool, ToolCall
from agent_kv.serving.chat_service import ChatService
from api.app import create_app

TOOLS = (Tool("click", "Click an element.", {"type": "object", "properties": {"id": {}}}),)
CALL = ToolCall(id="call_1", name="click", arguments='{"id": 3}')
CHATS = {
    "plain": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi there"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "  spaced  "},
    ],
    "no system": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "<|im_start|>user\nyo"},  # a header inside content
    ],
    "one message": [{"role": "user", "content": "only"}],
    "tool calls": [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "page text", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "ok", "tool_calls": [CALL]},
        {"role": "tool", "content": "r1", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "next"},
    ],
}


@pytest.fixture(scope="module", params=["smollm2-135m", bundled_models.DEFAULT_MODEL])
def tokenizer(request):
    return load_tokenizer(request.param)


class Counted:
    """Counts a tokenizer's chat renderings and tokenizer calls (patched on its class), and
    keeps the texts tokenized."""

    def __init__(self, monkeypatch, tokenizer):
        self.renders = self.tokenizations = 0
        self.texts = []
        cls = type(tokenizer)
        render, call = cls.apply_chat_template, cls.__call__

        def counted_render(tok, *args, **kwargs):
            self.renders += 1
            return render(tok, *args, **kwargs)

        def counted_call(tok, *args, **kwargs):
            self.tokenizations += 1
            self.texts.append(args[0] if args else kwargs["text"])
            return call(tok, *args, **kwargs)

        monkeypatch.setattr(cls, "apply_chat_template", counted_render)
        monkeypatch.setattr(cls, "__call__", counted_call)


CASES = [
    (name, tools)
    for name, messages in CHATS.items()
    for tools in ((), TOOLS)
    if tools or not any(m.get("tool_calls") for m in messages)  # calls need their tools
]


@pytest.mark.parametrize("name,tools", CASES, ids=[f"{n}-{len(t)} tools" for n, t in CASES])
def test_one_rendering_places_messages_as_prefix_renderings_do(tokenizer, name, tools, monkeypatch):
    messages = CHATS[name]
    reference = message_char_spans(tokenizer, messages, tools)
    render_placed(tokenizer, messages, tools)  # learns the template's frame once
    counted = Counted(monkeypatch, tokenizer)
    chat = render_placed(tokenizer, messages, tools)
    assert chat.message_chars == reference
    assert (counted.renders, counted.tokenizations) == (1, 1)
    assert chat.text == render_chat(tokenizer, messages, tools, generation_prompt=True)
    for i, (start, end) in enumerate(chat.message_chars):
        assert messages[i]["content"].strip() in chat.text[start:end]


def test_a_chat_the_frame_cannot_place_falls_back_to_prefix_renderings(tokenizer):
    """Two tool results in a row: Qwen's template merges them into one turn (re-rendering the
    first when the second comes: refused as before); SmolLM2's generic format places them."""
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": "one", "tool_call_id": "call_1"},
        {"role": "tool", "content": "two", "tool_call_id": "call_1"},
    ]
    text = render_chat(tokenizer, messages, TOOLS, generation_prompt=True)
    try:
        reference = message_char_spans(tokenizer, messages, TOOLS)
    except ConfigError:
        with pytest.raises(ConfigError, match="re-renders earlier messages"):
            place_messages(tokenizer, messages, TOOLS, text)
    else:
        assert place_messages(tokenizer, messages, TOOLS, text) == reference


@pytest.mark.parametrize("session_id", ["s", None], ids=["named", "anonymous"])
async def test_a_chat_turn_renders_and_tokenizes_the_chat_once(smollm, monkeypatch, session_id):
    """One rendering and one tokenization per `/chat` turn; after the first, only the text
    from the session's last generation prompt is tokenized, and the cache reuses that whole
    prompt."""
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("conf-kv", budget=256))
    app = create_app(ChatService(engine), "smollm2-135m")
    transport = httpx.ASGITransport(app=app)
    messages = [{"role": "system", "content": "Answer in one word."}]
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
        counts, tokenized, prompts, reused = [], [], [], []
        for turn in range(3):
            messages.append({"role": "user", "content": f"Question {turn}: a colour?"})
            prompts.append(render_chat(smollm.tokenizer, messages, (), generation_prompt=True))
            counted = Counted(monkeypatch, smollm.tokenizer)
            body = {"messages": messages, "max_tokens": 4} | (
                {"session_id": session_id} if session_id else {}
            )
            response = await http.post("/chat", json=body)
            assert response.status_code == 200, response.text
            counts.append((counted.renders, counted.tokenizations))
            tokenized.append(counted.texts[-1])
            reused.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages.append(response.json()["message"])
            monkeypatch.undo()
    assert counts[1:] == [(1, 1), (1, 1)]  # the first turn also learns the template's frame
    assert counts[0][1] == 1
    assert tokenized[0] == prompts[0]
    for turn in (1, 2):  # from the previous prompt's generation prompt (its last added token)
        split = prompts[turn - 1].rindex("<|im_start|>assistant\n")
        assert tokenized[turn] == prompts[turn][split:]
        previous = smollm.tokenizer(prompts[turn - 1], add_special_tokens=False)["input_ids"]
        assert reused[turn] >= len(previous)


@pytest.mark.parametrize("reply", ["\n\nSure.", "  two", "\t tab", " ", "\n", "plain"])
def test_tokenizing_past_a_previous_prompt_gives_the_whole_chats_tokens(tokenizer, reply):
    """The split falls at the previous prompt's last added token, so whitespace that starts
    the reply after its generation prompt merges as it does in the whole chat."""
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "q"}]
    previous = render_placed(tokenizer, messages)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]
    whole = render_placed(tokenizer, messages)
    extended = render_placed(tokenizer, messages, previous=previous)
    assert extended == whole
