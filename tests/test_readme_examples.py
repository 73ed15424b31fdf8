"""The examples of the README's "Four ways in" section and of the reference pages they lead to
(docs/python.md, docs/server.md), run as written: the in-process ones on SmolLM2-135M (the
model they name), the server ones against a live server (the pages' `http://127.0.0.1:8000`
replaced by its URL), the harness ones in Chromium; the README's `agent-kv` command lines,
and those of docs/cli.md, through the command's own option parser."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from helpers import kept_positions

ROOT = Path(__file__).resolve().parents[1]
README = "README.md"
SECTIONS = {README: "## Four ways in"}
"""Where a page's examples are: the README's in one section, a reference page's anywhere."""
README_URL = "http://127.0.0.1:8000"
FP32_TOKEN_BYTES = 46_080
"""KV bytes of one SmolLM2-135M token in fp32 (docs/harness.md, "Memory figures")."""
KINDS = {
    "in-process": "ChatAgentKV.local(",
    "langchain-server": "ChatAgentKV(base_url=",
    "openai": "OpenAI(base_url=",
    "harness": "BrowserEnv(",
    "conversation": "Conversation(engine",
}
"""Each example, by a string only it contains on its page."""
EXAMPLES = {
    README: {"in-process", "openai", "harness"},
    "docs/python.md": {"in-process", "langchain-server", "harness", "conversation"},
    "docs/server.md": {"openai"},
}
"""The examples each page holds, all of its ```python blocks."""
COMMAND_PAGES = (README, "docs/cli.md")
"""The pages whose ```sh blocks hold `agent-kv` command lines to parse."""
AGENT_KV = ".venv/bin/agent-kv"

pytestmark = pytest.mark.enable_socket


def examples_text(page: str) -> str:
    """The page, or for the README its section: from the heading to the next `## ` heading."""
    text = (ROOT / page).read_text(encoding="utf-8")
    if page not in SECTIONS:
        return text
    start = text.index(f"\n{SECTIONS[page]}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else len(text)]


def blocks(page: str, language: str) -> list[str]:
    """The page's (or section's) fenced blocks of `language`."""
    pattern = rf"^```{language}\n(.*?)^```$"
    return re.findall(pattern, examples_text(page), re.DOTALL | re.MULTILINE)


def example(page: str, kind: str) -> str:
    """The one ```python block of `page` that contains `KINDS[kind]`."""
    found = [block for block in blocks(page, "python") if KINDS[kind] in block]
    assert len(found) == 1, f"{len(found)} examples of {page} contain {KINDS[kind]!r}"
    return found[0]


def run(code: str, page: str) -> dict:
    """Execute an example as a script; returns its global variables."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(code, f"{page} (example)", "exec"), namespace)
    return namespace


def against(url: str, code: str) -> str:
    """`code` pointed at the server at `url` rather than the page's."""
    assert README_URL in code
    return code.replace(README_URL, url)


def command_lines(page: str) -> list[str]:
    """The `agent-kv` command lines of the page's (or section's) ```sh blocks, a line ending
    in `\\` joined with the next."""
    lines = []
    for block in blocks(page, "sh"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.startswith(AGENT_KV + " "):
                lines.append(line)
    return lines


def parsed(line: str) -> dict:
    """The parameters `agent-kv` parses from a command line (`.venv/bin/agent-kv ...`): the
    command's own parser names every option and converts every value, without running it.

    Raises:
        typer.TyperException: a usage error (no such option, a value of the wrong type, a
            missing required option), as the command line would report it.
    """
    from typer.core import TyperGroup
    from typer.main import get_command

    from agent_kv.cli import app

    args = shlex.split(line)
    assert args[0] == AGENT_KV
    args, command, path = args[1:], get_command(app), ["agent-kv"]
    while isinstance(command, TyperGroup):
        name, *args = args
        command = command.get_command(command.context_class(command), name)
        assert command is not None, f"no command {name!r} in {line!r}"
        path.append(name)
    with command.make_context(" ".join(path), args) as context:
        return context.params


@pytest.mark.parametrize("page", sorted(EXAMPLES))
def test_each_page_holds_exactly_its_tested_examples(page):
    found = blocks(page, "python")
    assert len(found) == len(EXAMPLES[page])
    assert {kind for kind in KINDS for block in found if KINDS[kind] in block} == EXAMPLES[page]


@pytest.mark.parametrize(
    "line", [line for page in COMMAND_PAGES for line in command_lines(page)], ids=str
)
def test_command_lines_parse(line):
    params = parsed(line)
    for option in re.findall(r"(?<= )--([a-z][a-z0-9-]*)", line):
        assert option.replace("-", "_") in params, f"--{option} is no parameter"


def test_the_readme_shows_each_command_line_way_in():
    lines = command_lines(README)
    assert {shlex.split(line)[1] for line in lines} == {"run-episode", "serve", "sites"}
    serve = parsed(next(line for line in lines if " serve " in line))
    # the server the README's Python examples call is the one its command line starts
    assert f"http://{serve['host']}:{serve['port']}" == README_URL


def test_a_mistyped_command_line_does_not_parse():
    import typer

    with pytest.raises(typer.TyperException, match="No such option: --budgte"):
        parsed(f"{AGENT_KV} run-episode --task 3 --budgte 1024")
    with pytest.raises(typer.BadParameter, match="valid integer"):
        parsed(f"{AGENT_KV} serve --port eighty")


@pytest.mark.model
def test_langchain_in_process(capsys):
    variables = run(example("docs/python.md", "in-process"), "docs/python.md")
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
    code = against(live_server, example("docs/python.md", "langchain-server"))
    variables = run(code, "docs/python.md")
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
    variables = run(against(live_server, example("docs/server.md", "openai")), "docs/server.md")
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


@pytest.mark.model
def test_your_own_agent_loop_in_one_cache(capsys):
    variables = run(example("docs/python.md", "conversation"), "docs/python.md")
    chat, kv, reply = variables["chat"], variables["kv"], variables["reply"]
    system, first_page, first_reply, second_page, second_reply = chat.spans
    roles = ["system", "user", "assistant", "user", "assistant"]
    assert [message["role"] for message in chat.messages] == roles
    # the second turn prefilled the second page and the headers around it, nothing earlier
    assert second_page[1] - first_reply[1] <= reply.prompt_tokens < second_page[1] - system[1]
    assert kv.tokens_seen == second_reply[1] == chat.sequence.store.seen_tokens
    # pinned: the system message and the latest page; the first page was released
    pinned = chat.sequence.store.pins.positions()
    assert kv.pinned_tokens == (system[1] - system[0]) + (second_page[1] - second_page[0])
    assert pinned[slice(*system)].all() and pinned[slice(*second_page)].all()
    assert not pinned[slice(*first_page)].any()
    kept = set(kept_positions(chat.sequence.store))
    assert set(range(*system)) <= kept and set(range(*second_page)) <= kept
    assert kv.evicted_tokens > 0 and not set(range(*first_page)) <= kept
    assert kv.kv_allocated_bytes >= kv.kv_live_bytes > 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == str(chat.spans)
    assert lines[-1] == (
        f"{kv.kv_allocated_bytes} {kv.kv_live_bytes} {kv.evicted_tokens} {kv.pinned_tokens}"
    )


@pytest.mark.browser
def test_your_own_agent_in_the_harness(capsys):
    variables = run(example("docs/python.md", "harness"), "docs/python.md")
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


@pytest.mark.model
def test_the_readme_openai_client(live_server, capsys):
    variables = run(against(live_server, example(README, "openai")), README)
    r = variables["r"]
    kv = r.model_extra["kv"]
    assert r.choices[0].message.content.strip()
    assert kv["session_id"] == "episode-4" and kv["rebuild"] == "none"
    assert kv["pinned_tokens"] > 0 and kv["evicted_tokens"] == 0  # the page, pinned
    tokens = r.usage.prompt_tokens + r.usage.completion_tokens
    assert kv["full_kv_live_bytes"] == FP32_TOKEN_BYTES * tokens
    assert 0 < kv["peak_kv_live_bytes"] <= kv["full_kv_live_bytes"]
    assert 0 < r.usage.completion_tokens <= 16
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"{r.choices[0].message.content!r} {kv['peak_kv_live_bytes']}"


@pytest.mark.model
def test_the_readme_langchain(capsys):
    variables = run(example(README, "in-process"), README)
    reply = variables["reply"]
    kv, usage = reply.response_metadata["kv"], reply.usage_metadata
    assert reply.content.strip()
    assert kv["policy"] == "conf-kv" and kv["session_id"] == "episode-5"
    assert kv["rebuild"] == "none" and kv["evicted_tokens"] == 0  # under the budget of 1024
    tokens = usage["input_tokens"] + usage["output_tokens"]
    assert kv["full_kv_live_bytes"] == FP32_TOKEN_BYTES * tokens
    assert 0 < kv["peak_kv_live_bytes"] <= kv["full_kv_live_bytes"]
    assert kv["peak_kv_live_bytes"] <= kv["peak_kv_allocated_bytes"]
    assert 0 < usage["output_tokens"] <= 16
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"{reply.content!r} {kv['peak_kv_live_bytes']}"


@pytest.mark.browser
def test_the_readme_harness(capsys):
    variables = run(example(README, "harness"), README)
    result, verdict = variables["result"], variables["verdict"]
    assert result.done and result.answer == "$1,100"
    assert verdict.score == 1.0
    assert {name: part["score"] for name, part in verdict.details.items()} == {
        "string_match": 1.0,
        "url_match": 1.0,
    }
    assert capsys.readouterr().out.splitlines()[-1] == "$1,100 1.0"
