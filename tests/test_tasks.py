"""Task files: loading, validation messages, the bundled suite, and replaying its trajectories."""

import json
from pathlib import Path

import pytest

from envs.browser_env import BrowserEnv
from envs.evaluators import evaluate
from envs.server import SiteServers
from envs.tasks import TaskError, load_suite, load_task, load_tasks, suite_names

WRONG_ANSWERS = ["N/A", "$999 in Nowhere"]
BUNDLED = [(suite, task) for suite in suite_names() for task in load_suite(suite)]
"""(suite, task) of every bundled task, replayed below."""
LONG_QUICK = {531, 546}
"""The long-horizon tasks the default run replays (one comparing facts across two sites, one
carrying a fact through comments on another site); the others, 15-60 actions each, replay
under `slow`."""
CARRIED = range(541, 561)
"""The long-horizon tasks that carry one fact through pages that never show it again
(`scripts/long_tasks/carry.py`)."""


def replayed(suite: str, task):
    """`task` as a parameter of the replay test: long-horizon tasks outside `LONG_QUICK` are
    `slow`."""
    slow = suite == "long" and task.task_id not in LONG_QUICK
    return pytest.param(
        task, marks=[pytest.mark.slow] if slow else [], id=f"{suite}-task{task.task_id}"
    )


def valid_task(task_id: int = 3) -> dict:
    return {
        "task_id": task_id,
        "sites": ["classifieds"],
        "start_url": "__CLASSIFIEDS__/",
        "intent": "Find the blue road bike's price.",
        "eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": ["120"]}},
        "reference_actions": ["stop [$120]"],
    }


def write(tmp_path: Path, content, name: str = "x.json") -> Path:
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def error_of(path: Path) -> str:
    with pytest.raises(TaskError) as caught:
        load_task(path)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_missing_field_names_file_task_and_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = valid_task()
    del task["eval"]["eval_types"]
    write(tmp_path, task)
    assert error_of(Path("x.json")) == "x.json task 3: field 'eval.eval_types' missing"


def test_wrong_types_and_unknown_fields_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = valid_task()
    task["sites"] = "classifieds"
    write(tmp_path, task)
    assert error_of(Path("x.json")).startswith("x.json task 3: field 'sites': ")
    task = valid_task()
    task["intnet"] = "typo"
    write(tmp_path, task)
    assert error_of(Path("x.json")) == "x.json task 3: unknown field 'intnet'"


def test_a_task_without_id_is_named_by_its_position(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    second = valid_task()
    del second["task_id"]
    write(tmp_path, [valid_task(1), second], "list.json")
    with pytest.raises(TaskError, match=r"^list.json entry 1: field 'task_id' missing$"):
        load_tasks("list.json")


def program_html_task(*checks: dict) -> dict:
    task = valid_task()
    task["eval"] = {"eval_types": ["program_html"], "program_html": list(checks)}
    return task


def test_program_html_is_loaded(tmp_path):
    check = {
        "url": "__CLASSIFIEDS__/listing/1",
        "locator": "document.querySelector('h1').textContent",
        "required_contents": {"exact_match": "Blue road bike"},
    }
    write(
        tmp_path,
        program_html_task(check, {"url": "last", "required_contents": {"must_include": ["x"]}}),
    )
    task = load_task(tmp_path / "x.json")
    assert task.eval.eval_types == ["program_html"]
    assert task.eval.program_html[0].url == "__CLASSIFIEDS__/listing/1"
    assert task.eval.program_html[0].required_contents.exact_match == "Blue road bike"
    assert task.eval.program_html[1].locator == ""


@pytest.mark.parametrize(
    ("check", "field", "expected"),
    [
        (
            {"url": "last", "required_contents": {}},
            "eval.program_html.0.required_contents",
            "required_contents needs at least one of",
        ),
        (
            {"url": "last", "required_contents": {"must_inclde": ["x"]}},
            "eval.program_html.0.required_contents.must_inclde",
            "",
        ),
        (
            {
                "url": "last",
                "locator": "func:get_query_text(__page__, '.x')",
                "required_contents": {"must_include": ["x"]},
            },
            "eval.program_html.0",
            "func: helper functions are not supported",
        ),
        (
            {
                "url": "func:shopping_get_latest_order_url()",
                "required_contents": {"must_include": ["x"]},
            },
            "eval.program_html.0",
            "func: helper functions are not supported",
        ),
    ],
)
def test_unsupported_program_html_checks_are_rejected(
    tmp_path, monkeypatch, check, field, expected
):
    monkeypatch.chdir(tmp_path)
    write(tmp_path, program_html_task(check))
    message = error_of(Path("x.json"))
    assert message.startswith("x.json task 3: ") and f"field '{field}'" in message, message
    assert expected in message


def test_program_html_urls_must_use_the_task_sites(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    check = {"url": "__SHOPPING__/cart", "required_contents": {"must_include": ["x"]}}
    write(tmp_path, program_html_task(check))
    assert error_of(Path("x.json")) == (
        "x.json task 3: eval.program_html.0.url: placeholder __SHOPPING__ is not one of the "
        "task's sites"
    )
    task = program_html_task()
    write(tmp_path, task)
    assert "program_html needs a non-empty eval.program_html list" in error_of(Path("x.json"))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"sites": ["gitlab"]}, "site 'gitlab' is not bundled"),
        (
            {"eval": {"eval_types": ["url_match"], "reference_url": "__SHOPPING__/cart"}},
            "placeholder __SHOPPING__ is not one of the task's sites",
        ),
        ({"start_url": "http://example.invalid/"}, "must begin with a site placeholder"),
        (
            {"eval": {"eval_types": ["string_match"], "reference_answers": {}}},
            "needs at least one of",
        ),
        (
            {"eval": {"eval_types": ["string_match"], "reference_answers": {"must_include": [""]}}},
            "must hold non-empty strings",
        ),
        ({"reference_actions": ["click [1]"]}, "must end with stop"),
        ({"reference_actions": ["frobnicate"]}, "reference_actions[0] 'frobnicate' does not parse"),
        (
            {"eval": {"eval_types": ["url_match"], "reference_url": ""}},
            "url_match needs eval.reference_url",
        ),
    ],
)
def test_inconsistent_tasks_are_rejected(tmp_path, change, expected):
    write(tmp_path, {**valid_task(), **change})
    message = error_of(tmp_path / "x.json")
    assert "x.json task 3: " in message and expected in message


def test_unreadable_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert error_of(Path("missing.json")) == "missing.json: no such task file"
    write(tmp_path, "{not json", "bad.json")
    assert error_of(Path("bad.json")).startswith("bad.json: invalid JSON at line 1")
    write(tmp_path, [valid_task(1), valid_task(1)], "dup.json")
    assert error_of(Path("dup.json")) == "dup.json task 1: duplicate task_id"
    write(tmp_path, [valid_task(1), valid_task(2)], "two.json")
    assert error_of(Path("two.json")) == "two.json: holds 2 tasks, expected one"


def test_load_task_by_path_id_and_digit_string(tmp_path):
    path = write(tmp_path, valid_task(7))
    assert load_task(path).task_id == 7
    assert load_task(str(path)).task_id == 7
    assert load_task(1) == load_task("1")
    assert load_task(1).start_urls == ["__CLASSIFIEDS__/listing/1"]


def test_unknown_id_lists_the_bundled_ids():
    with pytest.raises(TaskError, match=r"^unknown task id 999: bundled ids are 1-\d+") as caught:
        load_task(999)
    for suite in suite_names():  # each suite's ids are one range
        ids = [task.task_id for task in load_suite(suite)]
        assert f"{min(ids)}-{max(ids)}" in str(caught.value)


def test_bundled_suite_is_complete_and_mixed():
    tasks = load_suite("classifieds")
    assert [task.task_id for task in tasks] == list(range(1, len(tasks) + 1))
    assert len(tasks) >= 10
    assert {task.overall_difficulty for task in tasks} == {"easy", "medium", "hard"}
    assert any("url_match" in task.eval.eval_types for task in tasks)
    assert any(task.horizon >= 1 for task in tasks)
    assert any(len(task.start_urls) > 1 for task in tasks)
    for task in tasks:
        assert task.reference_actions[-1].startswith("stop [")
        assert "string_match" in task.eval.eval_types  # so a wrong answer must fail
    with pytest.raises(TaskError, match="unknown task suite 'nope'"):
        load_suite("nope")


def test_the_long_horizon_suite_is_long_by_its_work():
    tasks = load_suite("long")
    assert len(tasks) >= 30
    tokens = sorted(task.history_tokens for task in tasks)
    assert all(12_000 <= count <= 32_000 for count in tokens)
    assert tokens[len(tokens) // 2] >= 16_000  # the median (upper one for an even count)
    for task in tasks:
        assert 15 <= len(task.reference_actions) <= 60, task.task_id
        assert task.facts and all(fact.tokens is not None for fact in task.facts), task.task_id
        assert task.horizon == max(fact.steps for fact in task.facts)
    assert {site for task in tasks for site in task.sites} == {"classifieds", "forum", "shopping"}
    assert sum(len(task.sites) == 2 and len(task.start_urls) == 2 for task in tasks) >= 8
    assert sum("program_html" in task.eval.eval_types for task in tasks) >= 6  # write actions
    assert max(fact.tokens for task in tasks for fact in task.facts) >= 16_000
    carried = [task for task in tasks if task.task_id in CARRIED]
    assert len(carried) == 20
    for task in carried:
        (fact,) = task.facts
        assert fact.steps >= 15 and fact.tokens >= 15_000, task.task_id
        assert len(task.sites) == 2 and "program_html" in task.eval.eval_types


def test_a_fact_outside_the_reference_pages_is_refused(tmp_path):
    task = {**valid_task(), "facts": [{"text": "$120", "page": 2, "used_on": 2}]}
    message = error_of(write(tmp_path, task))
    assert "facts[0]: needs page <= used_on <= 1" in message
    task["facts"] = [{"text": "$120", "page": 1, "used_on": 1, "tokens": 40}]
    assert load_task(write(tmp_path, task)).facts[0].steps == 0


def test_an_answer_prefix_must_begin_the_reference_answer(tmp_path):
    task = {**valid_task(), "answer_prefix": "Blue road bike price:"}
    assert "the last reference action must be stop [...] beginning with it" in error_of(
        write(tmp_path, task)
    )
    task["reference_actions"] = ["stop [Blue road bike price: $120]"]
    assert load_task(write(tmp_path, task)).answer_prefix == "Blue road bike price:"


def test_task_1_is_a_one_step_answer_on_the_start_page():
    task = load_task(1)
    assert task.reference_actions == ["stop [$120]"]
    assert task.start_url == "__CLASSIFIEDS__/listing/1"


@pytest.fixture(scope="module")
def env():
    names = sorted({site for _, task in BUNDLED for site in task.sites})
    with SiteServers(names) as sites, BrowserEnv(sites, screenshots=False) as browser:
        yield browser


@pytest.mark.browser
@pytest.mark.parametrize("task", [replayed(suite, task) for suite, task in BUNDLED])
def test_reference_actions_solve_the_task_and_a_wrong_answer_fails(env, task):
    observation = env.reset(task)
    for number, action in enumerate(task.reference_actions, start=1):
        for fact in task.facts:
            if fact.page == number:
                assert fact.text in observation["text"], f"fact {fact.text!r} on page {number}"
            elif task.task_id in CARRIED and fact.page < number <= fact.used_on:
                assert fact.text not in observation["text"], f"{fact.text!r} again on {number}"
        result = env.step(action)
        observation = result.observation
        assert result.observation["error"] is None, f"step {number} {action}"
        assert result.done == (number == len(task.reference_actions))
    assert result.info["reason"] == "stop"
    verdict = evaluate(task, result.answer, env.url, env.servers, env.read_page)
    assert verdict.score == 1.0, verdict.details
    for wrong in WRONG_ANSWERS:
        assert evaluate(task, wrong, env.url, env.servers, env.read_page).score == 0.0, wrong
