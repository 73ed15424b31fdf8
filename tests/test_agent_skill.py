"""What depends on the default model's skill (`qwen2.5-coder-0.5b`, default weights): `make
run`'s episode (recall task 424 under CONF-KV: it evicts, holds less than full KV, and
answers); recall of its own note one page back under full KV, at a quick size (one task); the
full size (three tasks, one of them two pages back, an engine each) is `slow`. The rest of the
suite runs SmolLM2-135M, whose answers no test relies on. One model per process: this file
loads only the 0.5B.
"""

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from agent_kv.harness.agent import AgentConfig
from agent_kv.harness.scripted_episode import (
    FORMATS,
    NOTE,
    TRACE_JSON,
    format_by_k,
    run_recall,
    scripted_episode,
    success_by_k,
)
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.models.bundled_models import DEFAULT_MODEL
from agent_kv.runtime.models.model_loading import load_model
from envs.browser_env import BrowserEnv
from envs.server import SiteServers
from envs.tasks import load_task

pytestmark = [pytest.mark.model, pytest.mark.browser]

RECALLED = {
    401: "Blue road bike: $120",
    413: "Hearthly coffee grinder rating: 4.2",
    416: "Wonderbox chess set: $30.00",
}
"""The answer full KV gives to each task: calibration tasks of the recall prompt (tasks/
README.md, "The recall suite"), each from its own note, k pages back."""
TRACED = {
    401: ("Blue road bike - $120", "/category/electronics"),
    413: ("Rating: 4.2", "/category/books"),
}
"""Of the first task of a run: a text its first page shows, its last page's URL end."""


@pytest.fixture(scope="module")
def default_model():
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def env():
    with SiteServers(["classifieds", "shopping", "forum"]) as sites:
        with BrowserEnv(sites, screenshots=False) as browser:
            yield browser


def pages_seen(record) -> list[tuple[str, int]]:
    """Each page of a recall task's trace: its URL and the characters the agent saw of it
    (what a failing recall assertion shows)."""
    pages = json.loads((Path(record.trace_dir) / TRACE_JSON).read_text())["pages"]
    return [(page["url"], len(page["observation"])) for page in pages]


@pytest.mark.parametrize(
    "ids", [[413], pytest.param([401, 413, 416], marks=pytest.mark.slow)], ids=["one", "three"]
)
def test_full_kv_recalls_its_note(default_model, env, tmp_path, ids):
    tasks = [load_task(i) for i in ids]
    factory_calls = []

    def engine():
        factory_calls.append(1)
        return Engine(default_model.model, default_model.tokenizer, make_policy("full"))

    records = run_recall(tasks, engine, env, tmp_path, default_model.name, FORMATS["notes"])
    assert len(factory_calls) == len(ids)
    assert [r.answer for r in records] == [RECALLED[i] for i in ids], [
        (r.task_id, r.reply, r.history_tokens, r.reference_hits, pages_seen(r)) for r in records
    ]
    assert all(r.success and r.score == 1.0 and r.error is None for r in records)
    for record in records:
        assert 2000 < record.history_tokens < 4500
        assert record.peak_kv_allocated_bytes >= record.peak_kv_live_bytes > 0
        # full KV evicts nothing: its buffers held what its tokens take, within the store's
        # headroom (the reference: the tokens plus 5%, in whole blocks; a store grown call by
        # call holds up to a tenth more plus a block)
        assert record.full_kv_live_bytes == record.peak_kv_live_bytes
        block = 32 * record.full_kv_live_bytes // record.history_tokens
        assert record.peak_kv_allocated_bytes <= 1.1 * record.full_kv_live_bytes + block
        assert record.full_kv_allocated_bytes <= 1.05 * record.full_kv_live_bytes + block
        assert (record.policy, record.positions, record.format) == ("full", "original", "notes")
        assert record.weights == default_model.weights
    per_k = Counter(task.horizon for task in tasks)
    assert [r.k for r in records] == [task.horizon for task in tasks]
    assert success_by_k(records) == {
        k: {"tasks": n, "solved": n, "errors": 0} for k, n in per_k.items()
    }
    assert f"| 1 | {per_k[1]} | {per_k[1]} | 0 |" in format_by_k(records)
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert [json.loads(line)["task_id"] for line in lines] == ids
    task, (shown, last_url) = tasks[0], TRACED[ids[0]]
    trace = json.loads((tmp_path / f"task{task.task_id}" / TRACE_JSON).read_text())
    first, last = trace["pages"][0], trace["pages"][-1]
    start_path = task.start_url.split("__", 2)[2]  # "__SHOPPING__/product/91"
    assert first["url"].endswith(start_path) and shown in first["observation"]
    note = NOTE.match(task.reference_actions[0])["note"]
    assert re.fullmatch(rf"note \[{re.escape(note)}\]\nclick \[\d+\]", first["action"])
    assert last["url"].endswith(last_url) and "action" not in last
    assert trace["record"]["history_tokens"] == records[0].history_tokens


def make_run_settings() -> dict[str, int]:
    """`make run`'s task, CONF-KV budget and prefill chunk, read from the Makefile."""
    makefile = Path(__file__).parent.parent.joinpath("Makefile").read_text()
    found = {
        "task": re.search(r"^TASK\s*\?=\s*(\d+)", makefile, re.M),
        "budget": re.search(r"--budget (\d+)", makefile),
        "prefill_chunk": re.search(r"--prefill-chunk (\d+)", makefile),
    }
    return {name: int(match[1]) for name, match in found.items()}


def test_make_run_episode_evicts_holds_less_than_full_kv_and_answers(default_model, env, tmp_path):
    settings = make_run_settings()
    assert settings == {"task": 424, "budget": 160, "prefill_chunk": 128}
    spec = PolicySpec.parse("conf-kv", settings["budget"], None)
    engine = Engine.from_spec(
        spec, default_model.model, default_model.tokenizer, settings["prefill_chunk"], False
    )
    task = load_task(settings["task"])
    summary = scripted_episode(task, engine, env, tmp_path, default_model.name, AgentConfig())
    assert summary["success"] and summary["answer"] == "pixel_pilot karma: 417"
    assert summary["end_reason"] == "stop" and summary["error"] is None
    assert 3000 < summary["history_tokens"] < 3500
    # the first page (the fact) and the note are past the budget once the second page is in
    assert summary["evicted_tokens"] > 24 * 500
    per_token = 24 * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32 bytes
    seen, left = divmod(summary["full_kv_live_bytes"], per_token)
    assert left == 0 and summary["history_tokens"] < seen <= summary["history_tokens"] + 32
    assert (
        summary["peak_kv_allocated_bytes"]
        < summary["full_kv_live_bytes"]
        < summary["full_kv_allocated_bytes"]
    )
    assert summary["peak_kv_live_bytes"] <= summary["peak_kv_allocated_bytes"]


@pytest.mark.slow
def test_the_floor_answers_from_its_pinned_note(default_model, env, tmp_path):
    """Pins only with re-encoding, the agent's notes pinned, on `make run`'s task: the
    answer's key, the question and the decoded tokens stay among the newest 64, so it answers
    from the pinned note of a page long evicted (keeping no unpinned token at all, it stopped
    right after `pixel_pilot karma:`)."""
    spec = PolicySpec.parse("pins-only+reencode", None, None)
    engine = Engine.from_spec(spec, default_model.model, default_model.tokenizer, 128, False)
    task = load_task(make_run_settings()["task"])
    config = AgentConfig(pin_replies="notes")
    summary = scripted_episode(task, engine, env, tmp_path, default_model.name, config)
    assert summary["answer"] == "pixel_pilot karma: 417" and summary["success"]
    assert summary["policy_params"]["protect_recent"] == 64
    assert summary["notes_kept"] == {"1": 1.0}
    assert summary["evicted_tokens"] > 24 * 1000
