"""What depends on the default model's skill (`qwen2.5-coder-0.5b`, default weights): recall
of its own note one page back under full KV, at a quick size (two tasks); the full size
(three tasks, one of them two pages back) is `slow`. The rest of the suite runs SmolLM2-135M,
whose answers no test relies on. One model per process: this file loads only the 0.5B.
"""

import json
import re
from collections import Counter

import pytest

from agent_kv.harness.recall import (
    FORMATS,
    NOTE,
    TRACE_JSON,
    format_by_k,
    run_recall,
    success_by_k,
)
from agent_kv.kv.policies import make_policy
from agent_kv.runtime.bundled_models import DEFAULT_MODEL
from agent_kv.runtime.engine import Engine
from agent_kv.runtime.model_loading import load_model
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
    with SiteServers(["classifieds", "shopping"]) as sites:
        with BrowserEnv(sites, screenshots=False) as browser:
            yield browser


@pytest.mark.parametrize(
    "ids", [[413, 401], pytest.param([401, 413, 416], marks=pytest.mark.slow)], ids=["two", "three"]
)
def test_full_kv_recalls_its_note(default_model, env, tmp_path, ids):
    tasks = [load_task(i) for i in ids]
    factory_calls = []

    def engine():
        factory_calls.append(1)
        return Engine(default_model.model, default_model.tokenizer, make_policy("full"))

    records = run_recall(tasks, engine, env, tmp_path, default_model.name, FORMATS["notes"])
    assert len(factory_calls) == len(ids)
    assert [r.answer for r in records] == [RECALLED[i] for i in ids]
    assert all(r.success and r.score == 1.0 and r.error is None for r in records)
    for record in records:
        assert 2000 < record.history_tokens < 4500
        assert record.peak_kv_bytes >= record.peak_kv_live_bytes > 0
        assert record.full_kv_bytes == record.peak_kv_bytes  # full KV evicts nothing
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
