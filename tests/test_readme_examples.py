"""The Python examples of the README's "Use it from your code" section, run as written: the
in-process one on SmolLM2-135M (the model it names), the server ones against a live server
(the README's `http://127.0.0.1:8000` replaced by its URL), the harness one in Chromium."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
SECTION = "## Use it from your code"
README_URL = "http://127.0.0.1:8000"
FP32_TOKEN_BYTES = 46_080
"""KV bytes of one SmolLM2-135M token in fp32 (README, Memory figures)."""
KINDS = {
    "in-process": "ChatAgentKV.local(",
    "langchain-server": "ChatAgentKV(base_url=",
    "openai": "OpenAI(base_url=",
    "harness": "BrowserEnv(",
}
"""Each example, by a string only it contains."""

pytestmark = pytest.mark.enable_socket


def section_blocks() -> list[str]:
    """The ```python blocks between the section's heading and the next `## ` heading."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + 1)
    section = text[start : end if end != -1 else len(text)]
    return re.findall(r"^```python\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)


def example(kind: str) -> str:
    """The one block of the section that contains `KINDS[kind]`."""
    found = [block for block in section_blocks() if KINDS[kind] in block]
    assert len(found) == 1, f"{len(found)} README examples contain {KINDS[kind]!r}"
    return found[0]


def run(code: str) -> dict:
    """Execute an example as a script; returns its global variables."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, f"{README.name} ({SECTION})", "exec"), namespace)
    return namespace


def against(url: str, code: str) -> str:
    """`code` pointed at the server at `url` rather than the README's."""
    assert README_URL in code
    return code.replace(README_URL, url)


def test_the_section_holds_exactly_the_tested_examples():
    blocks = section_blocks()
    assert len(blocks) == len(KINDS)
    assert {kind for kind in KINDS for block in blocks if KINDS[kind] in block} == set(KINDS)


@pytest.mark.model
def test_langchain_in_process(capsys):
    variables = run(example("in-process"))
    first, second, kv, usage = (variables[name] for name in ("first", "second", "kv", "usage"))
    assert second.content.strip()
    assert kv["policy"] == "conf-kv" and kv["session_id"] == "episode-1"
    assert kv["rebuild"] == "none"
    tokens = usage["input_tokens"] + usage["output_tokens"]
    assert kv["full_kv_live_bytes"] == FP32_TOKEN_BYTES * tokens
    assert 0 < kv["peak_kv_live_bytes"] <= kv["full_kv_live_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["peak_kv_allocated_bytes"]
    # the deprecated aliases, for one release: the live figures under their old names
    assert (kv["kv_bytes"], kv["peak_kv_bytes"], kv["full_kv_bytes"]) == (
        kv["kv_live_bytes"],
        kv["peak_kv_live_bytes"],
        kv["full_kv_live_bytes"],
    )
    assert kv["evicted_tokens"] == 0  # 110 tokens, under the budget of 1024
    # the system message and the pinned page
    assert 0 < kv["pinned_tokens"] < usage["input_tokens"]
    # the whole first turn, its prompt and its reply, came from the cache
    first_turn = first.usage_metadata["input_tokens"] + first.usage_metadata["output_tokens"]
    assert usage["input_token_details"]["cache_read"] == first_turn
    assert usage["output_tokens"] <= 16
    lines = capsys.readouterr().out.splitlines()
    figures = ("peak_kv_live_bytes", "full_kv_live_bytes", "evicted_tokens", "pinned_tokens")
    assert lines[-2] == " ".join(str(kv[name]) for name in figures)
    assert lines[-1] == f"{first_turn} of {usage['input_tokens']} prompt tokens"


@pytest.mark.model
def test_langchain_against_the_server(live_server, capsys):
    variables = run(against(live_server, example("langchain-server")))
    reply, streamed = variables["reply"], variables["streamed"]
    assert reply.content.strip() and streamed.content.strip()
    first_kv, kv = reply.response_metadata["kv"], streamed.response_metadata["kv"]
    assert first_kv["session_id"] == kv["session_id"] == "episode-2"
    assert 0 < first_kv["peak_kv_live_bytes"] < kv["peak_kv_live_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["full_kv_live_bytes"]
    assert kv["peak_kv_bytes"] == kv["peak_kv_live_bytes"]  # the deprecated alias
    first_turn = reply.usage_metadata["input_tokens"] + reply.usage_metadata["output_tokens"]
    usage = streamed.usage_metadata
    assert usage["input_token_details"]["cache_read"] == first_turn
    assert usage["input_tokens"] > first_turn and 0 < usage["output_tokens"] <= 16
    out = capsys.readouterr().out
    assert streamed.content in out  # the streamed text, printed as it came


@pytest.mark.model
def test_openai_client_against_the_server(live_server, capsys):
    variables = run(against(live_server, example("openai")))
    first, kv, usage = variables["r"], variables["kv"], variables["usage"]
    first_kv = first.model_extra["kv"]
    # the header named the session of the first call, `user` that of the streamed one
    assert first_kv["session_id"] == kv["session_id"] == "episode-3"
    assert first_kv["pinned_tokens"] > 0 and first_kv["evicted_tokens"] == 0
    assert 0 < first_kv["peak_kv_live_bytes"] < kv["peak_kv_live_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["full_kv_live_bytes"]
    assert kv["full_kv_bytes"] == kv["full_kv_live_bytes"]  # the deprecated alias
    first_turn = first.usage.prompt_tokens + first.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == first_turn
    assert usage.prompt_tokens > first_turn and 0 < usage.completion_tokens <= 16
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"{kv['peak_kv_live_bytes']} {first_turn} of {usage.prompt_tokens}"


@pytest.mark.browser
def test_your_own_agent_in_the_harness(capsys):
    variables = run(example("harness"))
    task, verdict = variables["task"], variables["verdict"]
    assert variables["answer"] == "$1,100"
    assert verdict.score == 1.0
    assert {name: part["score"] for name, part in verdict.details.items()} == {
        "string_match": 1.0,
        "url_match": 1.0,
    }
    lines = capsys.readouterr().out.splitlines()
    steps = [line for line in lines if re.match(r"\d+ ", line)]
    assert steps == [
        f"{number} {action} None" for number, action in enumerate(task.reference_actions, 1)
    ]
    assert lines[-1].startswith("1.0 {")
