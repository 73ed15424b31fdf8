"""The recall suite: its tasks (a fact on one page, k more pages, then the answer), the
main-content observation, and the scripted-navigation runner on the bundled model.

Every recall task's trajectory also replays to score 1.0 and a wrong answer to 0.0 in
tests/test_tasks.py, which replays every bundled suite.
"""

import json
import re

import pytest

from agent_kv.harness.recall import (
    FORMATS,
    NOTE,
    SUITE,
    TRACE_JSON,
    Decoded,
    format_by_k,
    run_recall,
    run_recall_task,
    success_by_k,
)
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.engine import Engine
from envs.browser_env import BrowserEnv
from envs.evaluators import evaluate
from envs.observation import main_content
from envs.server import SiteServers
from envs.tasks import load_suite, load_task

TASKS = load_suite(SUITE)
QUICK = [401, 402, 413]
"""k = 1, one site each of classifieds and shopping, about 2.4-3.1K tokens of history: all
three solved by full KV in the notes format (tasks/README.md, "The recall suite")."""
_ID = re.compile(r"\[\d+\] ")

PAGE = (
    "Tab 0 (current): Blue road bike | Classifieds\n"
    "URL: http://127.0.0.1:5000/listing/1\n"
    "[7] RootWebArea 'Blue road bike | Classifieds' focused: True\n"
    "\t[15] link 'Classifieds'\n"
    "\t[2] form 'Search listings'\n"
    "\t\t[3] textbox 'Search' required: False\n"
    "\t[19] navigation 'Categories'\n"
    "\t\t[22] link 'Bikes'\n"
    "\t[35] heading 'Blue road bike'\n"
    "\t[64] StaticText 'Price: $120'\n"
    "\t[46] region 'Comments (1)'\n"
    "\t\t[47] heading 'Comments (1)'\n"
    "\t\t[75] StaticText 'Riley on Mar 17, 2024: Is this still available?'\n"
    "\t\t[6] form 'Post a comment'\n"
    "\t\t\t[4] textbox 'Your name' required: False\n"
    "\t[80] link 'Next page'"
)


def test_main_content_drops_the_header_lines_menus_and_forms():
    assert main_content(PAGE) == (
        "[15] link 'Classifieds'\n"
        "[35] heading 'Blue road bike'\n"
        "[64] StaticText 'Price: $120'\n"
        "[46] region 'Comments (1)'\n"
        "\t[47] heading 'Comments (1)'\n"
        "\t[75] StaticText 'Riley on Mar 17, 2024: Is this still available?'\n"
        "[80] link 'Next page'"
    )
    error = main_content("ERROR: no element [9] on the current page\n" + PAGE)
    assert error.startswith("ERROR: no element [9] on the current page\n[15] link 'Classifieds'")


def test_the_suite_spans_the_three_sites_and_k_from_1_to_12():
    assert len(TASKS) == 36
    assert [t.task_id for t in TASKS] == list(range(401, 437))
    assert {site for task in TASKS for site in task.sites} == {"classifieds", "shopping", "forum"}
    assert sum(len(task.sites) == 2 for task in TASKS) == 7
    ks = [task.horizon for task in TASKS]
    assert sorted(set(ks)) == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    assert ks.count(1) == 6 and ks.count(2) == 6


@pytest.mark.parametrize("task", TASKS, ids=[f"task{t.task_id}" for t in TASKS])
def test_the_fact_is_noted_once_k_pages_before_the_answer(task):
    noted = [i for i, action in enumerate(task.reference_actions) if NOTE.match(action)]
    assert noted == [len(task.reference_actions) - 1 - task.horizon]
    note = NOTE.match(task.reference_actions[noted[0]])["note"]
    assert task.reference_actions[-1] == f"stop [{note}]"
    assert evaluate(task, note, "", {}).score == 1.0


def test_a_format_forces_the_note_or_only_the_action():
    reference = "note [Blue road bike: $120] click [link 'Electronics']"
    assert (
        FORMATS["notes"].reply(reference, "click [24]") == "note [Blue road bike: $120]\nclick [24]"
    )
    assert FORMATS["agent"].reply(reference, "click [24]") == "click [24]"
    assert FORMATS["notes"].reply("click [link 'Cars']", "click [9]") == "click [9]"
    assert FORMATS["main"].page_text(PAGE) == main_content(PAGE)
    assert FORMATS["agent"].page_text(PAGE) == PAGE


@pytest.fixture(scope="module")
def env():
    with SiteServers(["classifieds", "shopping", "forum"]) as sites:
        with BrowserEnv(sites, screenshots=False) as browser:
            yield browser


@pytest.mark.browser
def test_the_answer_is_shown_on_the_fact_page_and_on_none_after_it(env):
    """Scored as an answer, the text of page j (ids left out: "[120]" is no price) passes the
    task's evaluator, and the text of each of the k pages after it fails."""
    for task in TASKS:
        pages = [env.reset(task)["text"]]
        for action in task.reference_actions[:-1]:
            pages.append(env.step(action).observation["text"])
        fact = len(pages) - 1 - task.horizon
        shown = [evaluate(task, _ID.sub("", page), "", {}).score for page in pages[fact:]]
        assert shown == [1.0] + [0.0] * task.horizon, task.task_id


@pytest.mark.browser
def test_full_kv_recalls_the_note_one_page_back(smollm, env, tmp_path):
    tasks = [load_task(i) for i in QUICK]
    factory_calls = []

    def engine():
        factory_calls.append(1)
        return Engine(smollm.model, smollm.tokenizer, make_policy("full"))

    records = run_recall(tasks, engine, env, tmp_path, "smollm", FORMATS["notes"])
    assert len(factory_calls) == 3
    assert [r.answer for r in records] == [
        "Blue road bike: $120",
        "Silver laptop: $1,100",
        "Hearthly coffee grinder: 4.2",
    ]
    assert all(r.success and r.score == 1.0 and r.error is None for r in records)
    assert [r.k for r in records] == [1, 1, 1]
    for record in records:
        assert 2000 < record.history_tokens < 3500
        assert record.peak_kv_bytes >= record.peak_kv_live_bytes > 0
        assert record.full_kv_bytes == record.peak_kv_bytes  # full KV evicts nothing
        assert (record.policy, record.positions, record.format) == ("full", "original", "notes")
    assert success_by_k(records) == {1: {"tasks": 3, "solved": 3, "errors": 0}}
    assert "| 1 | 3 | 3 | 0 |" in format_by_k(records)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == QUICK
    trace = json.loads((tmp_path / "task401" / TRACE_JSON).read_text())
    first, last = trace["pages"]
    assert (
        first["url"].endswith("/category/bikes") and "Blue road bike - $120" in first["observation"]
    )
    assert re.fullmatch(r"note \[Blue road bike: \$120\]\nclick \[\d+\]", first["action"])
    assert last["url"].endswith("/category/electronics") and "action" not in last
    assert trace["record"]["history_tokens"] == records[0].history_tokens


@pytest.mark.browser
def test_the_decoder_is_a_parameter_and_the_agent_format_drops_the_notes(smollm, env, tmp_path):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    seen = []

    def decode(chat):
        seen.append(chat.sequence.store.seen_tokens)
        return Decoded("stop [N/A]", "N/A")

    pages = []
    record = run_recall_task(
        load_task(414),
        engine,
        env,
        tmp_path / "task414",
        "smollm",
        FORMATS["agent"],
        decode,
        on_page=lambda number, total: pages.append((number, total)),
    )
    assert pages == [(1, 2), (2, 2)]
    assert (record.answer, record.reply, record.success, record.score) == (
        "N/A",
        "stop [N/A]",
        False,
        0.0,
    )
    assert seen == [record.history_tokens]
    trace = json.loads((tmp_path / "task414" / TRACE_JSON).read_text())
    assert re.fullmatch(r"click \[\d+\]", trace["pages"][0]["action"])
    assert trace["pages"][1]["observation"].startswith("Tab 0 (current): Grocery | One Stop Shop")


@pytest.mark.model
@pytest.mark.browser
def test_past_the_context_full_kv_errs_and_a_rerotated_window_answers(smollm, env, tmp_path):
    """Task 429 (k = 8, ~12K tokens of forum pages) cannot run at original positions; a
    1024-token window with rerotate positions runs it to an answer (its note is long gone)."""
    task = load_task(429)
    full = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    (overflow,) = run_recall([task], full, env, tmp_path / "full", "smollm")
    assert not overflow.success and "8192-token context" in overflow.error
    assert overflow.answer is None and 6000 < overflow.history_tokens <= 8192
    spec = PolicySpec.parse("window", 1024, None, positions="rerotate")
    window = Engine.from_spec(spec, smollm.model, smollm.tokenizer)
    (record,) = run_recall([task], window, env, tmp_path / "window", "smollm")
    assert record.error is None and record.positions == "rerotate"
    assert record.history_tokens > 11000
    assert record.peak_kv_live_bytes < overflow.peak_kv_live_bytes
