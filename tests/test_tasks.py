"""Task files: loading, validation messages, the bundled suite, and replaying its trajectories."""

import json
import statistics
from collections import Counter
from pathlib import Path

import pytest

from envs.browser_env import BrowserEnv
from envs.evaluators import evaluate
from envs.server import SiteServers
from envs.tasks import TaskError, load_suite, load_task, load_tasks, suite_names
from scripts.long_tasks import carry, carry_more
from scripts.long_tasks.carry import SHOWN_AGAIN
from scripts.long_tasks.kinds import KINDS, shown

WRONG_ANSWERS = ["N/A", "$999 in Nowhere"]
BUNDLED = [(suite, task) for suite in suite_names() for task in load_suite(suite)]
"""(suite, task) of every bundled task, replayed below."""
RECALL_QUICK = {401, 412, 413, 423, 424, 429, 430, 436}
"""The recall tasks the default run replays: on each site and across sites, the note one page
back and the one farthest back."""
LONG_QUICK = {531, 546, 575}
"""The long-horizon tasks the default run replays: one comparing facts across two sites, one
carrying a fact through comments on another site with distractors, one without."""


def quick_replays() -> set[int]:
    """The tasks the default run replays: the recall and long-horizon samples above and, of
    every other suite, the first task of each kind of check (its eval types) on each site or
    pair of sites. The rest (the long ones 15-60 actions each) replay under `slow`; the tasks
    the default run's episodes use are replayed by those episodes too."""
    first: dict[tuple, int] = {}
    for suite, task in BUNDLED:
        if suite not in ("recall", "long"):
            key = (suite, tuple(task.eval.eval_types), tuple(task.sites))
            first.setdefault(key, task.task_id)
    return set(first.values()) | RECALL_QUICK | LONG_QUICK


QUICK_REPLAYS = quick_replays()
CARRIED = range(541, 601)
"""The long-horizon tasks that carry one fact through pages that never show it again, fitted
to the default model (`scripts/long_tasks/carry.py`, 541-560, and `carry_more.py`,
561-600)."""


def replayed(suite: str, task):
    """`task` as a parameter of the replay test: tasks outside `QUICK_REPLAYS` are `slow`."""
    slow = task.task_id not in QUICK_REPLAYS
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
    for task in tasks:
        if task.task_id in range(541, 561):  # the first carry family: far, across two sites
            (fact,) = task.facts
            assert fact.steps >= 15 and fact.tokens >= 15_000, task.task_id
            assert len(task.sites) == 2 and "program_html" in task.eval.eval_types
        if task.task_id not in CARRIED:
            assert task.distractors is None and task.split is None, task.task_id


def test_the_fitted_suite_spans_kinds_distances_groups_and_splits():
    """The carry tasks 541-600 (tasks/README.md, "The long-horizon suite"): at least 60, each
    answering with one fact of a kind, 12K-32K tokens (median at least 16K), the fact 4K-24K
    tokens back, with and without distractors, on each site alone and across two, split in
    balanced halves by the documented rule."""
    tasks = [task for task in load_suite("long") if task.task_id in CARRIED]
    assert len(tasks) >= 60
    tokens = [task.history_tokens for task in tasks]
    assert all(12_000 <= count <= 32_000 for count in tokens)
    assert statistics.median(tokens) >= 16_000
    for task in tasks:
        (fact,) = task.facts
        assert fact.kind in KINDS and task.distractors is not None, task.task_id
        assert task.answer_prefix and "program_html" in task.eval.eval_types, task.task_id
        assert task.reference_actions[-1].startswith(f"stop [{task.answer_prefix} "), task.task_id
    distances = sorted(task.facts[0].tokens for task in tasks)
    assert 3_500 <= distances[0] <= 4_500 and 23_500 <= distances[-1] <= 26_000
    for low, high in ((0, 8_000), (8_000, 12_000), (12_000, 16_000), (16_000, 20_000)):
        assert sum(low <= d < high for d in distances) >= 4, low  # each band holds several
    assert sum(d >= 20_000 for d in distances) >= 4
    groups = {flag: [t for t in tasks if t.distractors is flag] for flag in (True, False)}
    assert len(groups[False]) >= 25 and len(groups[True]) >= 15
    assert {t.facts[0].kind for t in tasks} == set(KINDS)
    assert {t.facts[0].kind for t in groups[False]} >= {"price", "id", "date", "location"}
    sites = Counter(tuple(sorted(t.sites)) for t in tasks)
    assert {("classifieds",), ("forum",), ("shopping",)} <= set(sites)
    assert sum(count for pair, count in sites.items() if len(pair) == 2) >= 30
    splits = Counter(t.split for t in tasks)
    assert set(splits) == {"calibration", "held-out"}
    assert abs(splits["calibration"] - splits["held-out"]) <= 1
    for members in [*groups.values(), *([t for t in tasks if t.facts[0].kind == k] for k in KINDS)]:
        halves = Counter(t.split for t in members)
        assert abs(halves["calibration"] - halves["held-out"]) <= 2, halves
    for family, ids in ((carry, range(541, 561)), (carry_more, range(561, 601))):
        dumped = [t.model_dump(exclude_none=True) for t in tasks if t.task_id in ids]
        again = family.alternate_splits([{**t, "split": None} for t in dumped])
        assert [t["split"] for t in again] == [t["split"] for t in dumped]


def test_kinds_of_facts_are_told_apart():
    page = (
        "[70] StaticText 'Location: Pittsburgh, PA'\n[71] StaticText 'Posted on Feb 28, 2024'\n"
        "[65] StaticText 'Price: $8,900'\n[41] link 'Maria Lopez'\n[47] heading 'Comments (2)'"
    )
    assert shown("location", page) == ["Pittsburgh"]
    assert shown("date", page) == ["Feb 28, 2024"]
    assert shown("price", page) == ["$8"]
    assert shown("name", page) == ["Maria Lopez"]
    assert shown("count", page) == ["(2)"]
    assert shown("id", page) == []
    assert shown("id", "[42] heading 'Order #1003'") == ["#1003"]
    assert shown("count", "'21 points' 'Karma: 417' 'quantity 2' 'Cart (3)'") == [
        "21 points",
        "Karma: 417",
        "quantity 2",
        "(3)",
    ]
    assert shown("count", "'4.5 out of 5 stars' [123] link 'Order #1003'") == []
    assert shown("name", "Signed in as Avery Agent · Samsung") == ["Avery Agent"]


def test_a_fact_outside_the_reference_pages_is_refused(tmp_path):
    task = {**valid_task(), "facts": [{"text": "$120", "page": 2, "used_on": 2}]}
    message = error_of(write(tmp_path, task))
    assert "facts[0]: needs page <= used_on <= 1" in message
    task["facts"] = [{"text": "$120", "page": 1, "used_on": 1, "tokens": 40}]
    assert load_task(write(tmp_path, task)).facts[0].steps == 0


def test_distractors_need_one_fact_of_a_kind_and_split_is_one_of_two(tmp_path):
    task = {
        **valid_task(),
        "distractors": False,
        "facts": [{"text": "$120", "page": 1, "used_on": 1}],
    }
    assert "distractors needs exactly one fact, with its kind" in error_of(write(tmp_path, task))
    task["facts"][0]["kind"] = "price"
    task["split"] = "held-out"
    loaded = load_task(write(tmp_path, task))
    assert (loaded.distractors, loaded.split, loaded.facts[0].kind) == (False, "held-out", "price")
    task["split"] = "test"
    assert "field 'split'" in error_of(write(tmp_path, task))
    task["split"], task["facts"][0]["kind"] = None, "colour"
    assert "field 'facts.0.kind'" in error_of(write(tmp_path, task))
    assert load_task(1).distractors is None and load_task(1).split is None


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
    observation, same_kind = env.reset(task), []
    for number, action in enumerate(task.reference_actions, start=1):
        for fact in task.facts:
            if fact.page == number:
                assert fact.text in observation["text"], f"fact {fact.text!r} on page {number}"
            elif task.task_id in CARRIED and fact.page < number <= fact.used_on:
                again = fact.text in observation["text"]
                assert not again or SHOWN_AGAIN.get(task.task_id) == number, f"again on {number}"
                found = shown(fact.kind, observation["text"])
                assert task.distractors or not found, f"a {fact.kind} {found} on page {number}"
                same_kind += found
        result = env.step(action)
        observation = result.observation
        assert result.observation["error"] is None, f"step {number} {action}"
        assert result.done == (number == len(task.reference_actions))
    assert result.info["reason"] == "stop"
    if task.task_id in CARRIED:  # distractors: some page after the fact shows one of its kind
        assert bool(same_kind) == task.distractors
    verdict = evaluate(task, result.answer, env.url, env.servers, env.read_page)
    assert verdict.score == 1.0, verdict.details
    for wrong in WRONG_ANSWERS:
        assert evaluate(task, wrong, env.url, env.servers, env.read_page).score == 0.0, wrong
