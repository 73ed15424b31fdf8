"""The recall suite: its tasks (a fact on one page, k more pages, then the answer), the
main-content observation, and the scripted-navigation runner on the bundled model.

Every recall task's trajectory also replays to score 1.0 and a wrong answer to 0.0 in
tests/test_tasks.py, which replays every bundled suite (a sample of each by default, all of
them under `slow`).
"""

import json
import re

import pytest

from agent_kv.harness.scripted_episode import (
    FORMATS,
    NOTE,
    SUITE,
    TRACE_JSON,
    Decoded,
    forced_stop,
    run_recall,
    run_recall_task,
)
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.engine.engine import Engine
from envs.browser_env import ActionError, BrowserEnv
from envs.evaluators import evaluate
from envs.observation import main_content
from envs.server import SiteServers
from envs.tasks import load_suite, load_task

TASKS = load_suite(SUITE)
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


SHOWN_QUICK = {404, 416, 425, 432}
"""The tasks the default run checks in the browser (one per site, two with the fact on their
second page, one across two sites); every other task is `slow` (~200 page loads in all)."""


@pytest.mark.browser
@pytest.mark.parametrize(
    "task",
    [pytest.param(t, marks=() if t.task_id in SHOWN_QUICK else pytest.mark.slow) for t in TASKS],
    ids=[f"task{t.task_id}" for t in TASKS],
)
def test_the_answer_is_shown_on_the_fact_page_and_on_none_after_it(env, task):
    """Scored as an answer, the text of page j (ids left out: "[120]" is no price) passes the
    task's evaluator, and the text of each of the k pages after it fails."""
    pages = [env.reset(task)["text"]]
    for action in task.reference_actions[:-1]:
        pages.append(env.step(action).observation["text"])
    fact = len(pages) - 1 - task.horizon
    shown = [evaluate(task, _ID.sub("", page), "", {}).score for page in pages[fact:]]
    assert shown == [1.0] + [0.0] * task.horizon


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
def test_the_answer_prefix_is_forced_after_stop_and_begins_the_answer(smollm):
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    chat = Conversation(engine)
    chat.add("user", "Note: Blue road bike location: Erie, PA. Where is the Blue road bike?")
    chat.prefill()
    before = chat.sequence.store.seen_tokens
    decoded = forced_stop(max_new_tokens=4, prefix="Blue road bike location:")(chat)
    forced = "stop [Blue road bike location:"
    assert chat.messages[-1] == {"role": "assistant", "content": forced}
    assert decoded.reply.startswith(forced) and len(decoded.reply) > len(forced)
    assert decoded.answer == (decoded.reply[len("stop [") :]).split("]")[0].strip()
    fed = len(smollm.tokenizer(forced, add_special_tokens=False)["input_ids"])
    assert chat.sequence.store.seen_tokens > before + fed  # the prefix, then decoded tokens


@pytest.mark.model
@pytest.mark.browser
def test_the_trace_says_how_much_of_each_note_the_layers_kept_and_pinned_notes_stay(
    tiny_llama, smollm, env, tmp_path
):
    """Task 401 (k = 1): its note, forced at step 1, against an 8-token window (4 sinks, 4
    recent tokens) that evicts it as the action after it is forced, unless the notes are
    pinned (whole replies pinned: `test_chat_and_agent.py`); the trace has the share after
    each page. What is kept is the cache's doing, not the model's: a random-weight model
    behind SmolLM2's tokenizer."""
    kept, reply_kept = {}, {}
    for pin in ("none", "notes"):
        engine = Engine(tiny_llama, smollm.tokenizer, make_policy("window", budget=8), 64)
        record = run_recall_task(
            load_task(401), engine, env, tmp_path / pin, "smollm", pin_replies=pin
        )
        assert record.pin_replies == pin and record.error is None
        trace = json.loads((tmp_path / pin / TRACE_JSON).read_text())
        first, last = trace["pages"]
        kept[pin] = (first["notes_kept"], record.notes_kept)
        reply_kept[pin] = first["reply_kept_at_answer"]
        # at the answer: the latest page whole (pinned), the first one (~400 tokens) all but gone
        assert last["kept_at_answer"] == 1.0 and first["kept_at_answer"] < 0.05
    assert kept == {"none": ({"1": 0.0}, {"1": 0.0}), "notes": ({"1": 1.0}, {"1": 1.0})}
    # unpinned, the reply keeps at most the window's 4 recent tokens; "notes" the note too
    assert reply_kept["none"] < 0.5 < reply_kept["notes"] < 1.0


@pytest.mark.browser
def test_a_task_that_does_not_replay_names_its_step(smollm, env, tmp_path):
    task = load_task(414).model_copy(
        update={"reference_actions": ["click [link 'Grocery']", "click [link 'Gone']", "stop [x]"]}
    )
    engine = Engine(smollm.model, smollm.tokenizer, make_policy("full"))
    with pytest.raises(ActionError, match=r"^task 414 step 2 click \[link 'Gone'\]: "):
        run_recall_task(task, engine, env, tmp_path / "broken", "smollm", FORMATS["agent"])


@pytest.mark.model
@pytest.mark.browser
@pytest.mark.parametrize(
    ("task_id", "context", "window", "fed", "history"),
    [
        (401, 2816, 512, 1000, 2900),
        pytest.param(429, None, 1024, 6000, 11000, marks=pytest.mark.slow),
    ],
    ids=["task401-2816-context", "task429"],
)
def test_past_the_context_full_kv_errs_and_a_rerotated_window_answers(
    tiny_llama, smollm, env, tmp_path, monkeypatch, task_id, context, window, fed, history
):
    """Task 429 (k = 8, ~12K tokens of forum pages) cannot run at original positions in the
    model's 8192-token context; a 1024-token window with rerotate positions runs it to an
    answer (its note is long gone). The default run: task 401 (~3.1K tokens) with the model's
    config declaring a 2816-token context, and a 512-token window. Full KV stops before the
    page that would pass the context (`fed` tokens or more in its cache); the window's history
    passes `history` tokens. Positions and the context are the cache's and the config's doing:
    a random-weight model with SmolLM2's 8192-token context, behind its tokenizer."""
    if context is not None:
        monkeypatch.setattr(tiny_llama.config, "max_position_embeddings", context)
    limit = tiny_llama.config.max_position_embeddings
    task = load_task(task_id)
    full = Engine(tiny_llama, smollm.tokenizer, make_policy("full"))
    (overflow,) = run_recall([task], full, env, tmp_path / "full", "smollm")
    assert not overflow.success and f"{limit}-token context" in overflow.error
    assert overflow.answer is None and fed < overflow.history_tokens <= limit
    spec = PolicySpec.parse("window", window, None, positions="rerotate")
    rerotated = Engine.from_spec(spec, tiny_llama, smollm.tokenizer)
    (record,) = run_recall([task], rerotated, env, tmp_path / "window", "smollm")
    assert record.error is None and record.positions == "rerotate"
    assert record.history_tokens > history > limit
    # less than full KV holds at the same history (it holds every token live)
    per_token = overflow.peak_kv_live_bytes / overflow.history_tokens
    assert record.peak_kv_live_bytes < per_token * record.history_tokens


@pytest.mark.model
@pytest.mark.browser
def test_pinning_only_the_pages_elements_lowers_the_pinned_floor(
    tiny_qwen, qwen_tokenizer, env, tmp_path
):
    """Task 404 under a 16-token window, on the default model's template (random weights):
    with `page_pins="elements"` the most tokens pinned at once (system turn, examples, the
    latest page's controls) is below the whole-page pins', lower still without the examples
    pinned, and the trace has the count after every forced reply."""
    peaks = {}
    for pins, examples in (("whole", True), ("elements", True), ("elements", False)):
        engine = Engine(tiny_qwen, qwen_tokenizer, make_policy("window", budget=16), 64)
        record = run_recall_task(
            load_task(404), engine, env, tmp_path / f"{pins}-{examples}", "tiny", page_pins=pins,
            pin_examples=examples,
        )  # fmt: skip
        assert record.error is None and (record.page_pins, record.pin_examples) == (pins, examples)
        trace = json.loads((tmp_path / f"{pins}-{examples}" / TRACE_JSON).read_text())
        counts = [page["pinned_tokens"] for page in trace["pages"][:-1]]
        assert len(counts) == 3 and record.peak_pinned_tokens >= max(counts) > 0
        peaks[pins, examples] = record.peak_pinned_tokens
    assert peaks["elements", False] < peaks["elements", True] < peaks["whole", True]
