"""Decision agreement along a scripted trajectory (`agent_kv.harness.decisions`): the model's
own action at every step, recorded under full KV and under a policy and compared, and the
sweep's tables of it per step and per distance."""

import json
import math

import pytest
import torch

from agent_kv.harness.agent import AgentConfig
from agent_kv.harness.decisions import (
    DECISIONS_JSON,
    KL_TOKENS,
    TOP_TOKENS,
    DecisionRecorder,
    coarse_kl,
    compare_decisions,
    element_action,
    read_decisions,
)
from agent_kv.harness.scripted_episode import TRACE_JSON, scripted_episode
from agent_kv.harness.sweep.decision_table import decision_tables
from agent_kv.harness.sweep.group_table import group_table
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.engine.engine import Engine
from envs.actions import parse_action
from envs.browser_env import BrowserEnv
from envs.server import SiteServers
from envs.tasks import Fact, load_task


def read_recall_record(trace_dir):
    return json.loads((trace_dir / TRACE_JSON).read_text())["record"]


def _step(n, action, **extra):
    return {
        "step": n,
        "action": action,
        "scripted": action,
        "constrained": True,
        "tokens_seen": 100 * n,
        "since_fact_tokens": None if n == 1 else 100 * (n - 2),
        "kv_allocated_bytes": 1000 * n,
        "kv_live_bytes": 900 * n,
        "top_ids": [],
        "top_logprobs": [],
        "kl": None,
        **extra,
    }


def _write(directory, steps):
    directory.mkdir()
    (directory / DECISIONS_JSON).write_text(json.dumps(steps))


def test_the_kl_is_over_full_kvs_top_tokens_and_the_rest():
    p = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.9, 0.05, 0.03, 0.02]])
    q = torch.tensor([[0.25, 0.5, 0.125, 0.125], [0.9, 0.05, 0.03, 0.02]])
    exact = (p * (p.log() - q.log())).sum(1)
    # both tokens kept for row 1 hold 0.75 of p: the rest is one bucket, here equal to q's
    top_ids, top_logprobs = [[0, 1], [0, 1]], p[:, :2].log().tolist()
    assert coarse_kl(top_ids, top_logprobs, q.log()) == pytest.approx(float(exact.mean()), abs=1e-6)
    # coarsening never raises the KL (data processing): p, q differ inside the rest bucket
    q2 = torch.tensor([[0.5, 0.25, 0.05, 0.2]])
    full_kl = float((p[:1] * (p[:1].log() - q2.log())).sum())
    coarse = coarse_kl([[0, 1]], [p[0, :2].log().tolist()], q2.log())
    assert coarse == pytest.approx(0.0, abs=1e-9)
    assert full_kl == pytest.approx(0.125 * math.log(0.125 / 0.05) + 0.125 * math.log(0.125 / 0.2))
    assert coarse_kl([], [], q.log()) == 0.0
    # only as many rows as both have
    assert coarse_kl(top_ids, top_logprobs, q.log()[:1]) == pytest.approx(float(exact[0]), abs=1e-6)


def test_an_action_names_its_element_as_the_page_shows_it():
    page = (
        "Tab 0 (current): Shop\n[7] RootWebArea 'Shop' focused: True\n"
        "\t[21] button 'Add to cart'\n\t[3] textbox 'Search' required: False\n"
        "\t[1] StaticText 'Cart (1)'\n\t[30] button 'Add to cart'\n\t[44] link \"Ann's shop\""
    )
    assert element_action("click [30]", page) == "click [button 'Add to cart' #2]"
    assert element_action("click [21]", page) == "click [button 'Add to cart' #1]"
    assert element_action("type [3] [lamp] [1]", page) == "type [textbox 'Search' #1] [lamp] [1]"
    assert element_action("click [44]", page) == "click [link 'Ann's shop' #1]"
    # no element, or one the page does not show: as given; a tab index is no element id
    for action in ("scroll [down]", "tab_focus [1]", "stop [3 [1]]", "click [99]", "x [1"):
        assert element_action(action, page) == action
    # already written as an element: unchanged
    assert (
        element_action("click [button 'Add to cart' #2]", page) == "click [button 'Add to cart' #2]"
    )


def test_a_policy_is_compared_step_by_step_with_full_kv(tmp_path):
    _write(tmp_path / "full", [_step(1, "click [3]"), _step(2, "scroll [down]")])
    _write(tmp_path / "policy", [_step(1, "click [3]", kl=0.25), _step(2, "click [4]", kl=0.75)])
    compared = compare_decisions(tmp_path / "policy", tmp_path / "full")
    assert (compared["steps_compared"], compared["agreement"]) == (2, 0.5)
    assert compared["mean_kl"] == pytest.approx(0.5)
    steps = compared["agreement_steps"]
    assert [s["agree"] for s in steps] == [True, False]
    assert (steps[1]["full_action"], steps[1]["action"]) == ("scroll [down]", "click [4]")
    assert [s["since_fact_tokens"] for s in steps] == [None, 0]
    assert steps[1]["kv_allocated_bytes"] == steps[1]["full_kv_allocated_bytes"] == 2000


def test_a_run_without_decisions_or_a_reference_is_refused(tmp_path):
    _write(tmp_path / "full", [_step(1, "click [3]")])
    (tmp_path / "none").mkdir()
    with pytest.raises(FileNotFoundError, match="no decisions in"):
        compare_decisions(tmp_path / "none", tmp_path / "full")
    _write(tmp_path / "other", [_step(2, "click [3]", kl=0.1)])
    with pytest.raises(ValueError, match="step 2 is not among full KV's steps"):
        compare_decisions(tmp_path / "other", tmp_path / "full")
    _write(tmp_path / "alone", [_step(1, "click [3]")])
    with pytest.raises(ValueError, match="no KL"):
        compare_decisions(tmp_path / "alone", tmp_path / "full")


def test_the_tables_count_agreement_per_step_and_per_distance():
    def record(policy, budget, agrees, since):
        steps = [
            {"step": n, "agree": a, "since_fact_tokens": s}
            for n, (a, s) in enumerate(zip(agrees, since, strict=True), 1)
        ]
        return {"task_id": 1, "policy": policy, "budget": budget, "agreement_steps": steps}

    records = [
        record(
            "window", 64, [True, False, True, True, True, False], [None, 0, 3000, 5000, 9000, 30000]
        ),
        record("window", 64, [True], [None]),
        {"task_id": 1, "policy": "full", "budget": None, "agreement_steps": []},
    ]
    by_step, by_distance = decision_tables(records).split("\n\n")
    assert (
        by_step.splitlines()[0] == "| policy \\ step | 1-5 | 6-10 | 11-15 | 16-20 | 21-30 | 31+ |"
    )
    assert by_step.splitlines()[2] == "| window 64 | 5/6 (83%) | 0/1 (0%) | – | – | – | – |"
    assert by_distance.splitlines()[0].endswith("| 0K-4K | 4K-8K | 8K-16K | 16K-24K | 24K+ |")
    assert by_distance.splitlines()[2].endswith(
        "| 1/2 (50%) | 1/1 (100%) | 1/1 (100%) | – | 0/1 (0%) |"
    )
    assert decision_tables([records[2]]) == ""


@pytest.fixture(scope="module")
def env():
    with SiteServers(["classifieds"]) as sites:
        with BrowserEnv(sites, screenshots=False) as browser:
            yield browser


@pytest.mark.model
@pytest.mark.browser
def test_each_step_records_the_models_own_action_and_a_policy_is_compared_with_full_kv(
    tiny_qwen, qwen_tokenizer, env, tmp_path
):
    """Recall task 404 (4 pages, its fact on page 2) on the default model's tokenizer and
    template (random weights): full KV, then full KV again and a 16-token window, each against
    the first's record. (This model's output bias puts nearly all mass on a few tokens, so its
    KL says nothing of the window: `coarse_kl` is checked on its own above.)"""
    task = load_task(404)
    task = task.model_copy(update={"facts": [Fact(text="fact", page=2, used_on=4)]})
    config = AgentConfig()
    runs = [("full", "full", None), ("again", "full", []), ("window", "window", [])]
    for name, policy, reference in runs:
        budget = None if policy == "full" else 16
        engine = Engine(tiny_qwen, qwen_tokenizer, make_policy(policy, budget=budget), 64)
        pages = None
        if reference is not None:  # full KV's decisions, pages and replies, word for word
            reference = read_decisions(tmp_path / "full")
            pages = json.loads((tmp_path / "full" / TRACE_JSON).read_text())["pages"]
        recorder = DecisionRecorder(config, 2, reference)
        summary = scripted_episode(
            task, engine, env, tmp_path / name, "tiny", config, decisions=recorder,
            reference=pages,
        )  # fmt: skip
        assert summary["error"] is None
    shown = [
        json.loads((tmp_path / n / TRACE_JSON).read_text())["pages"] for n in ("full", "again")
    ]
    assert shown[0] == shown[1]  # the same pages and replies, though the env's ids differ
    assert summary["history_tokens"] == read_recall_record(tmp_path / "full")["history_tokens"]
    steps = read_decisions(tmp_path / "full")
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(s["constrained"] and s["kl"] is None for s in steps)
    for s in steps:
        parse_action(s["action"])  # decoded under the page's grammar: it parses
        assert 1 <= len(s["top_ids"]) <= KL_TOKENS and len(s["top_ids"][0]) == TOP_TOKENS
        probs = torch.tensor(s["top_logprobs"]).exp()
        assert (probs.sum(1) <= 1.0 + 1e-4).all() and (probs.diff(dim=1) <= 1e-6).all()
    assert steps[0]["scripted"] == "type [textbox 'Search' #1] [Brown sofa] [1]"  # task 404
    assert [s["since_fact_tokens"] for s in steps][:2] == [None, 0]
    assert steps[2]["since_fact_tokens"] == steps[2]["tokens_seen"] - steps[1]["tokens_seen"] > 0
    assert steps[0]["tokens_seen"] < steps[1]["tokens_seen"] < steps[2]["tokens_seen"]
    same = compare_decisions(tmp_path / "again", tmp_path / "full")
    assert same["agreement"] == 1.0 and same["mean_kl"] == pytest.approx(0.0, abs=1e-4)
    with pytest.raises(ValueError, match="the reference run has 2 pages, the task 4"):
        engine = Engine(tiny_qwen, qwen_tokenizer, make_policy("full"), 64)
        scripted_episode(task, engine, env, tmp_path / "short", "tiny", config, reference=[{}, {}])
    window = compare_decisions(tmp_path / "window", tmp_path / "full")
    assert window["steps_compared"] == 3
    assert all(math.isfinite(s["kl"]) and s["kl"] >= 0 for s in window["agreement_steps"])
    last = window["agreement_steps"][-1]
    assert last["kv_allocated_bytes"] < last["full_kv_allocated_bytes"]


def test_success_per_group_has_wilson_intervals_and_paired_differences_from_full_kv():
    """Tasks 541 (held-out, with distractors), 542 (calibration, with), 561 (calibration,
    without), 562 (held-out, without); recall task 401 has no group and is left out."""

    def record(task, policy, success):
        budget = None if policy == "full" else 192
        return {"task_id": task, "policy": policy, "budget": budget, "success": success}

    records = [
        record(541, "full", True),
        record(542, "full", False),
        record(561, "full", True),
        record(562, "full", True),
        record(401, "full", True),
        record(541, "window", True),
        record(542, "window", True),
        record(561, "window", False),
    ]
    head, rule, full, window = group_table(records).splitlines()
    assert head == ("| policy | held-out | calibration | without distractors | with distractors |")
    assert full == (
        "| full | 2/2 (100%; 34-100%) | 1/2 (50%; 9-91%) | 2/2 (100%; 34-100%) | 1/2 (50%; 9-91%) |"
    )
    cells = window.split(" | ")
    assert cells[1] == "1/1 (100%; 21-100%); +0 vs full"  # one shared task: no interval
    assert cells[2] == "1/2 (50%; 9-91%); +0 (-100 to +100) vs full"  # 542 gained, 561 lost
    assert cells[3] == "0/1 (0%; 0-79%); -100 vs full"
    assert cells[4] == "2/2 (100%; 34-100%); +50 (+0 to +100) vs full |"
    assert group_table([record(401, "full", True)]) == ""


def test_a_sweeps_records_are_kept_and_put_back(tmp_path):
    from scripts.long_tasks.sweep_records import copy_records

    sweep = tmp_path / "runs"
    (sweep / "traces" / "task541-full").mkdir(parents=True)
    (sweep / "traces" / "task541-conf-kv+reencode-192").mkdir()
    (sweep / "results.jsonl").write_text('{"task_id": 541}\n')
    (sweep / "settings.json").write_text('{"mode": "scripted"}\n')
    (sweep / "traces" / "task541-full" / DECISIONS_JSON).write_text("[]")
    (sweep / "traces" / "task541-full" / "recall.json").write_text("{}")
    policy = sweep / "traces" / "task541-conf-kv+reencode-192"
    (policy / DECISIONS_JSON).write_text("[1]")
    (policy / "recall.json").write_text("{}")
    kept = tmp_path / "kept"
    assert copy_records(sweep, kept) == 2
    assert (kept / "results.jsonl").read_text() == '{"task_id": 541}\n'
    assert (kept / "traces" / "task541-full" / DECISIONS_JSON).read_text() == "[]"
    assert (kept / "traces" / "task541-full" / "recall.json").read_text() == "{}"  # full KV's
    assert (kept / "traces" / policy.name / DECISIONS_JSON).read_text() == "[1]"
    assert not (kept / "traces" / policy.name / "recall.json").exists()
    back = tmp_path / "back"
    assert copy_records(kept, back) == 2 and (back / "settings.json").is_file()
    assert (back / "traces" / "task541-full" / "recall.json").is_file()
    with pytest.raises(FileNotFoundError, match="holds no results.jsonl"):
        copy_records(tmp_path / "nothing", tmp_path / "x")
