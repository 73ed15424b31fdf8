"""The policy sweep: aggregation, resume, crash handling and the report, with a fake episode
runner (no browser, no model), in this process and on Ray actors of one local Ray instance
shared by this module's tests; one real sweep behind the browser and model markers."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from helpers import with_old_names
from typer.testing import CliRunner

from agent_kv.cli import app
from agent_kv.errors import ConfigError, ModelNotFoundError
from agent_kv.harness.agreement import canonical
from agent_kv.harness.decisions import read_decisions
from agent_kv.harness.sweep import episode_runner, ray_pool, schedule
from agent_kv.harness.sweep.aggregate import aggregate, row_label
from agent_kv.harness.sweep.episode_runner import EpisodeRunner
from agent_kv.harness.sweep.job_runs import (
    CONNECT_TIMEOUT_S,
    RayActors,
    check_ray_address,
    next_ready,
)
from agent_kv.harness.sweep.ray_pool import ray_session
from agent_kv.harness.sweep.report import format_table, per_task_table, recall_table, write_report
from agent_kv.harness.sweep.schedule import StepProgress, run_bench
from agent_kv.harness.sweep.settings import (
    RESULTS,
    SUMMARY,
    BenchSettings,
    Job,
    full_job,
    make_jobs,
    read_results,
    record_key,
    select_tasks,
)
from envs.tasks import TaskError, load_task

ROOT = Path(__file__).resolve().parents[1]


def _record(task_id, policy, budget, success, peak, steps=2, rates=(10.0, 20.0), **extra):
    return {
        "task_id": task_id,
        "policy": policy,
        "budget": budget,
        "precision": "fp",
        "success": success,
        "end_reason": "stop",
        "error": None,
        "steps": steps,
        "peak_kv_allocated_bytes": peak,
        "decode_tokens_per_s": list(rates),
        **extra,
    }


def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _nll(tokens: int, nll: float) -> dict:
    return {"reference_tokens": tokens, "reference_nll": nll}


HAND_WRITTEN = [
    # full: tasks 1, 2 succeed, 3, 4 fail; peaks 100, 100, 200, 200 MB
    _record(1, "full", None, True, 100e6, reference_steps=2, reference_hits=2, **_nll(3, 0.5)),
    _record(2, "full", None, True, 100e6, reference_steps=1, reference_hits=1, **_nll(1, 0.5)),
    _record(3, "full", None, False, 200e6),
    _record(4, "full", None, False, 200e6),
    # window 512: succeeds on 1 of 4; peaks 50 MB each; 3 reference steps, 1 hit
    # agreement with full: 3 of 4 steps on task 1 (KL 0.1), 1 of 2 on task 2 (KL 0.4)
    _record(
        1,
        "window",
        512,
        True,
        50e6,
        reference_steps=2,
        reference_hits=1,
        **_nll(4, 1.0),
        agreement=0.75,
        mean_kl=0.1,
        steps_compared=4,
    ),
    _record(
        2,
        "window",
        512,
        False,
        50e6,
        reference_steps=1,
        reference_hits=0,
        **_nll(2, 4.0),
        agreement=0.5,
        mean_kl=0.4,
        steps_compared=2,
    ),
    _record(3, "window", 512, False, 50e6),
    _record(4, "window", 512, False, 50e6, steps=4, rates=(30.0,)),
    # conf-kv 512 ran only tasks 1, 2 (one an error, no peak)
    {**_record(1, "conf-kv", 512, True, 25e6), "peak_cold_kv_bytes": 8e6},
    {**_record(2, "conf-kv", 512, False, None, steps=0, rates=()), "end_reason": "error"},
]


def test_aggregate_from_hand_written_results(tmp_path: Path):
    _write(tmp_path / "results.jsonl", HAND_WRITTEN)
    rows = aggregate(read_results(tmp_path / "results.jsonl"))
    by_label = {row_label(r): r for r in rows}
    assert [row_label(r) for r in rows] == ["full", "window 512", "conf-kv 512"]

    full = by_label["full"]
    assert full["episodes"] == 4 and full["success_rate"] == 0.5
    assert full["relative_success"] == 1.0 and full["reduction_vs_full"] == 1.0
    assert full["peak_kv_mb"] == pytest.approx(150.0)
    assert full["reference_accuracy"] == 1.0 and full["reference_steps"] == 3
    assert full["reference_nll"] == pytest.approx(0.5)

    window = by_label["window 512"]
    assert window["success_rate"] == 0.25
    assert window["relative_success"] == pytest.approx(0.5)  # 0.25 / 0.5 on the same 4 tasks
    assert window["peak_kv_mb"] == pytest.approx(50.0)
    assert window["reduction_vs_full"] == pytest.approx(3.0)  # mean 150 MB / mean 50 MB
    assert window["mean_steps"] == pytest.approx(2.5)
    assert window["decode_tokens_per_s"] == pytest.approx((10 + 20) * 3 / 7 + 30 / 7)
    assert window["reference_accuracy"] == pytest.approx(1 / 3)
    assert window["reference_nll"] == pytest.approx((4 * 1.0 + 2 * 4.0) / 6)  # per token

    conf = by_label["conf-kv 512"]
    assert conf["episodes"] == 2 and conf["errors"] == 1
    assert conf["success_rate"] == 0.5
    # on tasks 1 and 2, where full succeeded twice, conf-kv once
    assert conf["relative_success"] == pytest.approx(0.5)
    # only task 1 has a peak on both sides: 100 MB / 25 MB
    assert conf["reduction_vs_full"] == pytest.approx(4.0)
    assert conf["reference_accuracy"] is None
    assert conf["peak_cold_kv_mb"] == pytest.approx(4.0)  # 8 MB and 0, kept apart from hot
    assert conf["peak_kv_mb"] == pytest.approx(25.0)

    table = format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert window["agreement"] == pytest.approx(4 / 6)  # step-weighted over both episodes
    assert window["mean_kl"] == pytest.approx((4 * 0.1 + 2 * 0.4) / 6)
    assert window["agreement_steps"] == 6
    assert full["agreement"] is None and conf["agreement"] is None
    # Wilson's interval of 1 in 4: 4.6-69.9%; window minus full per task: 0, -1, 0, 0, whose
    # resampled means run from -0.75 to 0
    assert window["success_ci95"] == pytest.approx((0.0456, 0.6994), abs=1e-4)
    assert window["success_minus_full"] == pytest.approx(-0.25)
    assert window["success_minus_full_ci95"] == (-0.75, 0.0)
    assert full["success_minus_full"] is None and full["success_minus_full_ci95"] is None
    assert conf["success_minus_full_ci95"] == (-1.0, 0.0)  # tasks 1 and 2: 0 and -1
    window_cells = (
        "| window | 512 | fp | text | 4 | 0 | 25% (5-70%) | -25 (-75 to +0 points) | 0.50 | "
        "50.0 | – | 0.0 | 3.00x |"
    )
    assert window_cells + " 67% (6 steps) | 0.200 |" in table
    assert "33% (3 steps) | 2.00 |" in lines[3]


def test_each_agent_is_compared_with_its_own_full_kv():
    def tools(record: dict) -> dict:
        return {**record, "agent": "tools"}

    records = [
        _record(1, "full", None, True, 100e6),
        _record(2, "full", None, False, 100e6),
        _record(1, "h2o", 256, True, 50e6),
        tools(_record(1, "full", None, True, 120e6)),
        tools(_record(2, "full", None, True, 120e6)),
        tools(_record(1, "h2o", 256, False, 40e6)),
        tools(_record(2, "h2o", 256, True, 40e6)),
    ]
    rows = aggregate(records)
    labels = [row_label(r) for r in rows]
    assert labels == ["full", "full tools", "h2o 256", "h2o 256 tools"]
    by_label = dict(zip(labels, rows, strict=True))
    assert by_label["h2o 256"]["relative_success"] == 1.0  # task 1: both solved it
    assert by_label["h2o 256"]["reduction_vs_full"] == pytest.approx(2.0)
    # 1 of 2 against its own full KV's 2 of 2 (against the text agent's 1 of 2 it would be 1.0)
    assert by_label["h2o 256 tools"]["relative_success"] == 0.5
    assert by_label["h2o 256 tools"]["reduction_vs_full"] == pytest.approx(3.0)
    assert "| h2o | 256 | fp | tools | 2 |" in format_table(rows)
    assert record_key(records[0])[-1] == "text"  # records without an agent: text


def test_make_jobs_runs_every_agent_with_its_own_full_kv(two_tasks):
    jobs = make_jobs(two_tasks[:1], ["full", "h2o"], [256], agents=["text", "tools"])
    assert [(j.policy, j.agent) for j in jobs] == [
        ("full", "text"),
        ("full", "tools"),
        ("h2o", "text"),
        ("h2o", "tools"),
    ]
    assert jobs[1].name.endswith("full-tools") and jobs[1] == full_job(jobs[1].task_id, "tools")
    with pytest.raises(ValueError, match="unknown agent 'voice'"):
        make_jobs(two_tasks, ["full"], [], agents=["voice"])


def test_relative_success_is_none_when_full_never_succeeds():
    records = [_record(1, "full", None, False, 10e6), _record(1, "h2o", 256, True, 5e6)]
    rows = aggregate(records)
    assert rows[1]["relative_success"] is None
    assert rows[1]["reduction_vs_full"] == pytest.approx(2.0)
    assert "| n/a (full KV solved none) |" in format_table(rows)
    alone = aggregate([_record(1, "h2o", 256, True, 5e6)])
    assert "| n/a (no full KV run) |" in format_table(alone)


def test_per_task_table_links_rendered_traces(tmp_path: Path):
    trace = tmp_path / "traces" / "task1-full"
    trace.mkdir(parents=True)
    (trace / "trace.html").write_text("<html></html>")
    records = [
        {**_record(1, "full", None, True, 1e6), "trace_dir": str(trace)},
        {**_record(1, "h2o", 256, False, 1e6), "end_reason": "repeated_action"},
        {**_record(2, "h2o", 256, False, None), "end_reason": "error"},
    ]
    table = per_task_table(records, tmp_path).splitlines()
    assert table[0] == "| task | full | h2o 256 |"
    assert table[2] == "| 1 | [✓](traces/task1-full/trace.html) | ✗ repeated_action |"
    assert table[3] == "| 2 |  | error |"


def test_results_written_with_the_old_names_aggregate_alike(tmp_path: Path):
    _write(tmp_path / "results.jsonl", [with_old_names(r) for r in HAND_WRITTEN])
    assert '"peak_kv_bytes"' in (tmp_path / "results.jsonl").read_text()
    records = read_results(tmp_path / "results.jsonl")
    assert records == HAND_WRITTEN
    assert aggregate(records) == aggregate(HAND_WRITTEN)


@pytest.mark.parametrize("sweep", ["agent-sweep", "recall-qwen05"])
def test_committed_results_with_the_old_names_give_their_committed_tables(sweep: str):
    out = ROOT / "docs" / "results" / sweep
    records = read_results(out / RESULTS)
    assert records and all(r["peak_kv_allocated_bytes"] > 0 for r in records)
    assert not any("peak_kv_bytes" in r or "full_kv_bytes" in r for r in records)
    summary = (out / SUMMARY).read_text()
    assert format_table(aggregate(records)) in summary
    assert recall_table(records) in summary


def test_read_results_keeps_last_record_per_job_and_skips_a_torn_line(tmp_path: Path):
    path = tmp_path / "results.jsonl"
    _write(path, [_record(1, "full", None, False, 1e6), _record(1, "full", None, True, 1e6)])
    with path.open("a") as handle:
        handle.write('{"task_id": 2, "pol')
    records = read_results(path)
    assert len(records) == 1 and records[0]["success"] is True


class FakeRunner:
    """Returns a canned summary of `steps` agent steps (>= 1), each told to `on_step` as it
    ends, with the pid of the process that ran it, after `seconds` (spread over the steps);
    raises for the jobs named in `crash`; ends its process at once (`os._exit`, as a
    segfault or the OOM killer would) for those in `die`; logs every call.

    `settings` makes it a `runner.RunnerFactory`: `functools.partial(FakeRunner, ...)` builds
    one inside each Ray actor."""

    def __init__(
        self,
        settings: BenchSettings | None = None,
        crash: set[tuple] = frozenset(),
        die: set[tuple] = frozenset(),
        seconds: float = 0.0,
        steps: int = 2,
    ):
        self.crash, self.die, self.seconds, self.steps = crash, die, seconds, steps
        self.calls: list[Job] = []
        self.started: list[list[str]] = []

    def start(self, sites) -> None:
        self.started.append(sorted(sites))

    def __call__(self, task, job: Job, trace_dir: Path, on_step) -> dict:
        self.calls.append(job)
        if job.key in self.die:
            os._exit(1)
        if job.key in self.crash:
            raise RuntimeError("browser died")
        for step in range(1, self.steps + 1):
            time.sleep(self.seconds / self.steps)
            on_step(step)
        peak = 100e6 if job.policy == "full" else job.budget * 1e5
        success = job.task_id == 1
        return _record(
            job.task_id, "ignored", "ignored", success, peak, self.steps, pid=os.getpid()
        )

    def close(self) -> None:
        pass


class OverlappingRunner(FakeRunner):
    """A `FakeRunner` for sweeps of several episodes at once: the jobs in `meet` wait for
    each other at a barrier before they go on (a sweep that does not run them together
    fails them, BrokenBarrierError after 20 s); `hold` adds seconds to some jobs; every
    record says when its episode started and ended (`time.perf_counter()` in the process
    that ran it) and on which thread."""

    def __init__(self, settings=None, meet=frozenset(), hold=None, **kwargs):
        super().__init__(settings, **kwargs)
        self.meet, self.hold = meet, hold or {}
        self._barrier = threading.Barrier(len(meet), timeout=20) if meet else None

    def __call__(self, task, job: Job, trace_dir: Path, on_step) -> dict:
        started = time.perf_counter()
        if job.key in self.meet:
            self._barrier.wait()
        time.sleep(self.hold.get(job.key, 0.0))
        record = super().__call__(task, job, trace_dir, on_step)
        thread = threading.current_thread().name
        return {**record, "started": started, "ended": time.perf_counter(), "thread": thread}


def _spans(records: list[dict]) -> dict[tuple, tuple[float, float]]:
    """Job key -> (started, ended) of the records of `OverlappingRunner`."""
    return {record_key(r): (r["started"], r["ended"]) for r in records if "started" in r}


def _most_at_once(spans) -> int:
    """The most intervals of `spans` open at one time (one ending as another starts: not
    both)."""
    edges = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


class NoModelRunner(FakeRunner):
    """A runner whose start fails as a missing model does."""

    def start(self, sites) -> None:
        raise ModelNotFoundError("no model at /nowhere")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for this module's Ray tests, started as a sweep starts one;
    this module's classes go to the workers by value (the workers cannot import it)."""
    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    started = time.perf_counter()
    with ray_session(num_cpus=2):
        print(f"\nlocal Ray instance up in {time.perf_counter() - started:.1f} s")
        yield
    assert not ray.is_initialized()


@pytest.fixture
def two_tasks():
    return [load_task(1), load_task(2)]


def test_sweep_records_a_crash_and_finishes_the_rest(tmp_path: Path, two_tasks):
    jobs = make_jobs(two_tasks, ["full", "window"], [512, 1024])
    assert len(jobs) == 2 * 3
    crashing = Job(2, "window", 512).key
    runner = FakeRunner(crash={crashing})
    written = run_bench(two_tasks, jobs, tmp_path, runner, progress=False)
    assert len(written) == 6 and len(runner.calls) == 6
    assert runner.started == [["classifieds"]]  # once, before the first job
    records = {record_key(r): r for r in read_results(tmp_path / "results.jsonl")}
    assert len(records) == 6
    crashed = records[crashing]
    assert crashed["end_reason"] == "error" and "browser died" in crashed["error"]
    assert crashed["success"] is False
    # the job's own key fields win over whatever the runner returned
    assert records[Job(1, "window", 1024).key]["policy"] == "window"
    assert records[Job(1, "window", 1024).key]["budget"] == 1024
    assert sum(r["end_reason"] == "error" for r in records.values()) == 1


def test_rerun_skips_finished_episodes(tmp_path: Path, two_tasks):
    jobs = make_jobs(two_tasks, ["full", "h2o"], [256])
    first = FakeRunner(crash={Job(1, "h2o", 256).key})
    run_bench(two_tasks, jobs[:3], tmp_path, first, progress=False)
    assert len(first.calls) == 3

    second = FakeRunner()
    written = run_bench(two_tasks, jobs, tmp_path, second, progress=False)
    assert [job.key for job in second.calls] == [Job(2, "h2o", 256).key]
    assert len(written) == 1
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4  # earlier results stay written

    third = FakeRunner()
    run_bench(two_tasks, jobs, tmp_path, third, progress=False, retry_errors=True)
    assert [job.key for job in third.calls] == [Job(1, "h2o", 256).key]
    records = read_results(tmp_path / "results.jsonl")
    assert len(records) == 4 and all(r["end_reason"] != "error" for r in records)

    idle = FakeRunner()  # every job has its record: nothing starts
    assert run_bench(two_tasks, jobs, tmp_path, idle, progress=False) == []
    assert idle.started == [] and idle.calls == []


def test_a_rerun_with_other_settings_is_refused(tmp_path: Path, two_tasks):
    jobs = make_jobs(two_tasks[:1], ["full"], [])
    run_bench(two_tasks, jobs, tmp_path, FakeRunner(), settings=BenchSettings())
    assert json.loads((tmp_path / "settings.json").read_text())["max_steps"] == 6
    other = BenchSettings(max_steps=3, reference_accuracy=False)
    with pytest.raises(ConfigError, match="max_steps 6 -> 3, reference_accuracy True -> False"):
        run_bench(two_tasks, jobs, tmp_path, FakeRunner(), settings=other)


def test_report_writes_summary_and_png(tmp_path: Path):
    _write(tmp_path / "results.jsonl", HAND_WRITTEN)
    table = write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert table in summary and "| conf-kv | 512 |" in summary
    png = (tmp_path / "success_vs_memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_make_jobs_full_once_and_int8_for_the_others(two_tasks):
    jobs = make_jobs(two_tasks[:1], ["full", "conf-kv"], [512, 512, 1024], int8=True)
    assert [job.name for job in jobs] == [
        "task1-full",
        "task1-conf-kv-512-int8",
        "task1-conf-kv-1024-int8",
    ]
    with pytest.raises(ValueError, match="unknown policy"):
        make_jobs(two_tasks, ["nope"], [512])


def test_make_jobs_runs_arkv_in_its_own_format_and_base_quant_once(two_tasks):
    jobs = make_jobs(two_tasks[:1], ["arkv", "base-quant", "window"], [256], int8=True)
    assert [job.name for job in jobs] == [
        "task1-arkv-256-fp8",
        "task1-base-quant-fp8",
        "task1-window-256-int8",
    ]


def test_select_tasks_by_suite_ids_and_glob(tmp_path: Path):
    assert [t.task_id for t in select_tasks("1,3-4,3")] == [1, 3, 4]
    assert len(select_tasks("classifieds")) >= 4
    (tmp_path / "t.json").write_text(load_task(2).model_dump_json())
    assert [t.task_id for t in select_tasks(str(tmp_path / "*.json"))] == [2]
    with pytest.raises(TaskError):
        select_tasks("no-such-suite")
    with pytest.raises(TaskError, match="no file matches"):
        select_tasks(str(tmp_path / "missing*.json"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "nosuch"], "neither a suite"),
        (["--tasks", "5-3"], "runs backwards"),
        (["--tasks", "1", "--policies", "full,lru"], "unknown policy 'lru'"),
        (["--tasks", "1", "--budgets", "512,abc"], "--budgets must be"),
        (["--tasks", "1", "--budgets", "0"], "budgets must be >= 1"),
    ],
)
def test_bench_cli_bad_input_is_one_error_line(tmp_path: Path, args, message):
    result = CliRunner().invoke(app, ["bench", *args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: ") and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.browser
@pytest.mark.model
def test_real_one_task_sweep_with_reference_accuracy(tmp_path: Path, local_ray):
    task = load_task(1)
    jobs = make_jobs([task], ["full", "window"], [256])
    settings = BenchSettings(max_steps=1, model="smollm2-135m")
    run_bench([task], jobs, tmp_path, settings=settings, progress=False)
    records = read_results(tmp_path / "results.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["end_reason"] != "error", record
        assert record["peak_kv_allocated_bytes"] > 0
        assert record["reference_steps"] == len(task.reference_actions)
        assert 0 <= record["reference_hits"] <= record["reference_steps"]
        steps = sorted(Path(record["trace_dir"]).glob("step_[0-9][0-9][0-9].json"))
        assert [json.loads(p.read_text())["constrained"] for p in steps] == [True]
    full, window = sorted(records, key=lambda r: r["policy"] != "full")
    assert "agreement" not in full
    assert window["steps_compared"] == full["steps"] == 1
    assert window["agreement"] in (0.0, 1.0) and window["mean_kl"] >= 0
    assert window["agreement_steps"][0]["reference"] == canonical(
        json.loads((Path(full["trace_dir"]) / "step_001.json").read_text())["reply"]
    )
    table = write_report(tmp_path)
    assert "| window | 256 |" in table
    summary = (tmp_path / "summary.md").read_text()
    assert "## Per task" in summary and "trace.html)" in summary
    assert (tmp_path / "agreement_vs_memory.png").stat().st_size > 0
    assert (Path(full["trace_dir"]) / "trace.html").is_file()


@pytest.mark.browser
@pytest.mark.model
def test_real_scripted_sweep_records_evictions_and_reductions(tmp_path: Path, local_ray):
    task = load_task(413)
    jobs = make_jobs([task], ["full", "conf-kv"], [160])
    settings = BenchSettings(model="smollm2-135m", mode="scripted")
    run_bench([task], jobs, tmp_path, settings=settings, progress=False)
    records = read_results(tmp_path / "results.jsonl")
    full, conf_kv = sorted(records, key=lambda r: r["policy"] != "full")
    for record in records:
        assert record["end_reason"] == "stop" and record["steps"] == 1, record
        assert record["format"] == "notes" and record["k"] == 1
        assert record["kv_reduction_vs_full"] == round(
            record["full_kv_allocated_bytes"] / record["peak_kv_allocated_bytes"], 3
        )
        assert (Path(record["trace_dir"]) / "recall.json").is_file()
    assert full["evicted_tokens"] == 0 and full["kv_live_reduction_vs_full"] == 1.0
    assert conf_kv["budget"] == 160 and conf_kv["evicted_tokens"] > 0
    assert conf_kv["peak_kv_live_bytes"] < full["peak_kv_live_bytes"]
    # the same scripted pages: CONF-KV read full KV's pages and replies word for word (its own
    # browser session shows other element ids), so both histories are the same tokens
    pages = [
        [urlsplit(page["url"]).path for page in json.loads(path.read_text())["pages"]]
        for path in (Path(r["trace_dir"]) / "recall.json" for r in (full, conf_kv))
    ]
    assert pages[0] == pages[1] and len(pages[0]) == 2
    assert conf_kv["history_tokens"] == full["history_tokens"]
    # each run decided its own action at the one scripted step; CONF-KV's is compared
    assert "agreement" not in full and "agreement_error" not in conf_kv
    (step,) = conf_kv["agreement_steps"]
    assert conf_kv["steps_compared"] == 1 and conf_kv["agreement"] == float(step["agree"])
    assert step["step"] == 1 and step["kl"] >= 0 and step["since_fact_tokens"] is None
    assert step["full_action"] == read_decisions(Path(full["trace_dir"]))[0]["action"]
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Sweep summary (scripted navigation, free answer)")
    assert "## Decisions per step and per distance" in summary
    assert (tmp_path / "agreement_vs_memory.png").stat().st_size > 0


def test_full_kv_under_a_reference_sweep_repeats_its_run(
    tmp_path: Path, smollm, tiny_llama, monkeypatch
):
    """Full KV run again with `reference` reads the reference run's pages and replies (its
    own browser session shows other element ids) and repeats its answer, history and KV
    figures token for token; a reference sweep without the task's run is an error record.
    Repeating is the harness's doing, not the model's: a random-weight model behind SmolLM2's
    tokenizer."""
    tiny = dataclasses.replace(smollm, model=tiny_llama)
    monkeypatch.setattr(episode_runner, "load_model", lambda model=None, weights=None: tiny)
    task = load_task(413)
    jobs = make_jobs([task], ["full"], [])
    first, again = tmp_path / "first", tmp_path / "again"
    for out, reference in ((first, None), (again, str(first))):
        settings = BenchSettings(mode="scripted", reference_accuracy=False, reference=reference)
        runner = EpisodeRunner(settings)
        try:
            run_bench([task], jobs, out, runner, settings, progress=False)
        finally:
            runner.close()
    (ran,), (repeated,) = (read_results(out / "results.jsonl") for out in (first, again))
    assert ran["end_reason"] == repeated["end_reason"] == "stop"
    for field in ("reply", "history_tokens", "peak_kv_allocated_bytes", "peak_kv_live_bytes"):
        assert repeated[field] == ran[field], field
    recalls = [
        json.loads((out / "traces" / jobs[0].name / "recall.json").read_text())
        for out in (first, again)
    ]
    shown = [[page["observation"] for page in recall["pages"]] for recall in recalls]
    assert shown[1] == shown[0] and len(shown[0]) == 2
    # each step's decision, but the scripted action as this session's browser names it
    decided = [
        [{k: v for k, v in step.items() if k != "scripted"} for step in read_decisions(path)]
        for path in (Path(ran["trace_dir"]), Path(repeated["trace_dir"]))
    ]
    assert decided[1] == decided[0] and len(decided[0]) == 1
    empty = tmp_path / "empty"
    (empty / "traces").mkdir(parents=True)
    settings = BenchSettings(mode="scripted", reference_accuracy=False, reference=str(empty))
    runner = EpisodeRunner(settings)
    try:
        (failed,) = run_bench([task], jobs, tmp_path / "none", runner, settings, progress=False)
    finally:
        runner.close()
    assert failed["end_reason"] == "error" and "recall.json" in failed["error"]


class RecordingBar:
    """A tqdm stand-in that keeps every update and postfix."""

    def __init__(self):
        self.updates: list[int] = []
        self.postfix = ""

    def update(self, n: int) -> None:
        self.updates.append(n)

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text


def test_progress_moves_per_step_and_by_the_steps_an_episode_did_not_take():
    bar = RecordingBar()
    progress = StepProgress(bar, max_steps=6, episodes=2)
    early, failed = Job(1, "full", None), Job(2, "window", 512)
    for step in (1, 2, 3):
        progress.step(early, step)
    assert bar.updates == [1, 1, 1] and bar.postfix == "0/2 episodes; task1-full step 3"
    progress.finish({**_record(1, "full", None, True, 1e6), "steps": 3})
    assert bar.updates[-1] == 3 and bar.postfix == "1/2 episodes; task1-full: True"
    progress.step(failed, 1)
    progress.finish({**_record(2, "window", 512, False, None), "end_reason": "error"})
    assert bar.updates[-2:] == [1, 5] and bar.postfix.endswith("task2-window-512: error")
    assert sum(bar.updates) == 2 * 6  # the bar's total: episodes x max_steps


def _spy_on_progress(monkeypatch) -> list[tuple]:
    """Log `("step", job key, n, time)` and `("finish", job key, None, time)` as the sweep's
    `StepProgress` is told them, letting them through."""
    events: list[tuple] = []
    step, finish = StepProgress.step, StepProgress.finish

    def spy_step(self, job, n):
        events.append(("step", job.key, n, time.perf_counter()))
        step(self, job, n)

    def spy_finish(self, record):
        events.append(("finish", record_key(record), None, time.perf_counter()))
        finish(self, record)

    monkeypatch.setattr(StepProgress, "step", spy_step)
    monkeypatch.setattr(StepProgress, "finish", spy_finish)
    return events


def test_an_in_process_sweep_reports_every_step(tmp_path: Path, two_tasks, monkeypatch):
    events = _spy_on_progress(monkeypatch)
    jobs = make_jobs(two_tasks, ["full"], [])
    run_bench(two_tasks, jobs, tmp_path, FakeRunner(steps=3), progress=False)
    assert [e[:3] for e in events] == [
        *(("step", jobs[0].key, n) for n in (1, 2, 3)),
        ("finish", jobs[0].key, None),
        *(("step", jobs[1].key, n) for n in (1, 2, 3)),
        ("finish", jobs[1].key, None),
    ]


def test_jobs_wait_for_their_tasks_full_kv_reference():
    work = deque(
        (None, Job(t, p, b, agent=a), None)
        for t, p, b, a in [
            (1, "h2o", 64, "text"),
            (1, "h2o", 64, "tools"),
            (2, "h2o", 64, "text"),
            (1, "full", None, "text"),
        ]
    )
    references = {(1, "text")}
    assert next_ready(work, references)[1] == Job(1, "h2o", 64, agent="tools")
    assert next_ready(work, references)[1] == Job(2, "h2o", 64)
    assert next_ready(work, references)[1] == Job(1, "full", None)
    assert next_ready(work, references) is None  # task 1's full KV still runs
    references.discard((1, "text"))
    assert next_ready(work, references)[1] == Job(1, "h2o", 64)


def test_pending_jobs_run_task_by_task_with_full_kv_first(tmp_path: Path):
    jobs = [Job(t, p, 64 if p != "full" else None) for t in (7, 3, 5) for p in ("h2o", "full")]
    results = tmp_path / RESULTS
    results.write_text(json.dumps(_record(3, "h2o", 64, True, 100)) + "\n")
    pending = schedule._pending(jobs, results, retry_errors=False)
    assert [(j.task_id, j.policy) for j in pending] == [
        (7, "full"),
        (7, "h2o"),
        (3, "full"),
        (5, "full"),
        (5, "h2o"),
    ]


def test_two_ray_actors_run_every_job(tmp_path: Path, two_tasks, local_ray):
    jobs = make_jobs(two_tasks, ["full", "window"], [512])
    factory = functools.partial(FakeRunner, crash={Job(1, "window", 512).key}, seconds=0.3)
    written = run_bench(two_tasks, jobs, tmp_path, RayActors(2, factory=factory), progress=False)
    assert sorted(record_key(r) for r in written) == sorted(job.key for job in jobs)
    errors = [r for r in written if r["end_reason"] == "error"]
    assert [record_key(r) for r in errors] == [Job(1, "window", 512).key]
    assert errors[0]["error"] == "RuntimeError: browser died"  # as in-process
    pids = {r["pid"] for r in written if "pid" in r}
    assert len(pids) == 2 and os.getpid() not in pids  # both actors ran episodes


def test_ray_actors_report_steps_while_their_episodes_run(
    tmp_path: Path, two_tasks, local_ray, monkeypatch
):
    monkeypatch.setattr(ray_pool, "STEP_POLL_S", 0.05)
    events = _spy_on_progress(monkeypatch)
    jobs = make_jobs(two_tasks, ["full"], [])
    factory = functools.partial(FakeRunner, seconds=1.5, steps=3)
    run_bench(two_tasks, jobs, tmp_path, RayActors(2, factory=factory), progress=False)
    for job in jobs:
        mine = [e for e in events if e[1] == job.key]
        assert [e[0] for e in mine] == ["step", "step", "step", "finish"]
        assert [e[2] for e in mine[:3]] == [1, 2, 3]
        # step 1 reached the driver while the episode still had two 0.5 s steps to go
        assert mine[-1][-1] - mine[0][-1] > 0.5


def test_a_killed_ray_worker_is_one_error_record_and_the_sweep_finishes(
    tmp_path: Path, two_tasks, local_ray
):
    jobs = make_jobs(two_tasks, ["full", "window", "h2o"], [512, 1024])
    assert len(jobs) == 2 * 5
    run_bench(two_tasks, jobs[:2], tmp_path, FakeRunner(), progress=False)
    before = (tmp_path / "results.jsonl").read_text()
    dying = jobs[2].key  # the first job handed out by this run
    factory = functools.partial(FakeRunner, die={dying}, seconds=0.3)
    started = time.perf_counter()
    written = run_bench(two_tasks, jobs, tmp_path, RayActors(2, factory=factory), progress=False)
    print(f"\n8 episodes on 2 actors, one killed, in {time.perf_counter() - started:.1f} s")
    assert sorted(record_key(r) for r in written) == sorted(j.key for j in jobs[2:])
    died = next(r for r in written if record_key(r) == dying)
    assert died["end_reason"] == "error" and died["success"] is False
    assert died["error"].startswith("ActorDiedError: The actor died unexpectedly")
    assert "worker process has died" in died["error"]
    others = [r for r in written if record_key(r) != dying]
    assert all(r["end_reason"] == "stop" for r in others)
    # the dead actor wrote nothing; its replacement and the other actor ran the rest
    assert len({r["pid"] for r in others}) == 2
    text = (tmp_path / "results.jsonl").read_text()
    assert text.startswith(before)  # earlier records unchanged
    lines = text.splitlines()
    assert len(lines) == len(jobs)
    assert [record_key(json.loads(line)) for line in lines[:2]] == [j.key for j in jobs[:2]]


def test_a_runner_that_cannot_start_stops_the_sweep_with_its_error(
    tmp_path: Path, two_tasks, local_ray
):
    jobs = make_jobs(two_tasks, ["full"], [])
    actors = RayActors(2, factory=NoModelRunner)
    with pytest.raises(ModelNotFoundError, match="^no model at /nowhere$"):
        run_bench(two_tasks, jobs, tmp_path, actors, progress=False)
    assert read_results(tmp_path / "results.jsonl") == []


def test_more_actors_than_the_cluster_has_cpus_is_refused(tmp_path: Path, two_tasks, local_ray):
    jobs = make_jobs(two_tasks, ["full", "window"], [512])
    actors = RayActors(3, factory=FakeRunner)
    with pytest.raises(ConfigError, match="has 2 CPUs; 3 actors need 1 each"):
        run_bench(two_tasks, jobs, tmp_path, actors, progress=False)


def test_ray_address_is_checked_quickly():
    check_ray_address("auto")  # Ray looks it up itself
    with pytest.raises(ConfigError, match="must be auto, HOST:PORT or ray://HOST:PORT"):
        check_ray_address("head-node")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.perf_counter()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ConfigError, match=f"no Ray cluster answers at {address}: "):
            check_ray_address(address)
    assert time.perf_counter() - started < 2 * CONNECT_TIMEOUT_S


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--policies", "lru"], "unknown policy 'lru'"),
        (["--workers", "0"], "--workers"),
        (["--episodes-per-engine", "0"], "--episodes-per-engine"),
        (["--episodes-per-engine", "17"], "less than or equal to 16"),
        (["--ray-address", "head-node"], "--ray-address must be"),
    ],
)
def test_bench_usage_errors_import_neither_torch_nor_ray(tmp_path: Path, args, needle):
    probe = (
        "import sys; from agent_kv.cli import main; code = main(); "
        "print('heavy:', sorted({'torch', 'ray'} & set(sys.modules)), 'exit:', code)"
    )
    command = ["bench", "--tasks", "1", "--out", str(tmp_path / "o"), *args]
    proc = subprocess.run(
        [sys.executable, "-c", probe, *command], capture_output=True, text=True, timeout=120
    )
    assert proc.stdout.strip().splitlines()[-1] == "heavy: [] exit: 2", proc.stdout + proc.stderr
    assert needle in proc.stderr


@pytest.mark.model
def test_force_reply_agrees_with_greedy_decoding(smollm):
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.chat.conversation import Conversation
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.replies.sampling import SamplingParams

    engine = Engine(smollm.model, smollm.tokenizer, make_policy("window", budget=48))
    decoded = Conversation(engine)
    decoded.add("user", "Name a colour.")
    generation = decoded.reply(SamplingParams(max_new_tokens=8))
    forced = Conversation(engine)
    forced.add("user", "Name a colour.")
    reply = forced.force_reply(generation.text)
    assert reply.greedy and len(reply.logprobs) == len(reply.hits)
    # greedy tokens are the most likely ones: each at least as likely as a uniform guess
    assert all(lp <= 0 for lp in reply.logprobs)
    wrong = Conversation(engine)
    wrong.add("user", "Name a colour.")
    wrong_reply = wrong.force_reply("zebra quantum " + generation.text)
    assert not wrong_reply.greedy
    assert min(wrong_reply.logprobs) < min(reply.logprobs)
    forced.add("user", "Another?")  # the conversation continues append-only
    forced.reply(SamplingParams(max_new_tokens=2))


def test_aggregate_reports_the_live_peak_beside_the_allocated_one():
    records = [
        _record(1, "full", None, True, 200e6, peak_kv_live_bytes=150e6),
        _record(1, "window", 512, True, 60e6, peak_kv_live_bytes=50e6),
    ]
    window = {row_label(r): r for r in aggregate(records)}["window 512"]
    assert window["peak_kv_mb"] == pytest.approx(60.0)  # allocated: the headline
    assert window["peak_kv_live_mb"] == pytest.approx(50.0)
    assert window["reduction_vs_full"] == pytest.approx(200 / 60)  # allocated over allocated


def test_recall_sweep_reports_success_per_k_and_names_its_mode(tmp_path: Path):
    records = [
        {**_record(401, "full", None, True, 9e6), "k": 1},
        {**_record(402, "full", None, False, 9e6), "k": 4},
        {**_record(401, "h2o", 256, False, 3e6), "k": 1},
        {**_record(402, "h2o", 256, False, 3e6), "k": 4},
        {**_record(403, "h2o", 256, True, 3e6), "k": 1},
    ]
    # full KV solved task 401 (k=1) only; h2o lost it, and solved 403, which full did not run
    assert recall_table(records).splitlines() == [
        "| policy | k=1 | k=4 | of full KV's solved | first k lost |",
        "| --- | --- | --- | --- | --- |",
        "| full | 1/1 | 0/1 | 1/1 | – |",
        "| h2o 256 | 1/2 | 0/1 | 0/1 | 1 |",
    ]
    # the reduction is against a full cache of each task's own history
    histories = {401: 9e6, 402: 12e6, 403: 6e6}
    sized = [{**r, "full_kv_allocated_bytes": histories[r["task_id"]]} for r in records]
    assert recall_table(sized).splitlines()[2:] == [
        "| full | 1/1 (1.0x) | 0/1 (1.3x) | 1/1 | – |",
        "| h2o 256 | 1/2 (2.5x) | 0/1 (4.0x) | 0/1 | 1 |",
    ]
    assert recall_table([_record(1, "full", None, True, 1e6)]) == ""
    _write(tmp_path / "results.jsonl", records)
    (tmp_path / "settings.json").write_text(json.dumps({"mode": "scripted"}))
    write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert summary.startswith("# Sweep summary (scripted navigation, free answer)")
    assert "agreement vs memory" not in summary
    assert (tmp_path / "success_vs_memory.png").exists()
    assert not (tmp_path / "agreement_vs_memory.png").exists()
    assert "## Success per k" in summary and "| h2o 256 | 1/2 | 0/1 | 0/1 | 1 |" in summary


def test_episodes_per_engine_runs_jobs_at_once_in_process(tmp_path: Path, two_tasks, monkeypatch):
    """Three jobs at a time on one runner: the two full-KV episodes overlap (they meet at a
    barrier), a task's replaying jobs start only once its own full-KV episode ended (task
    2's while task 1's still runs), a crash is its own error record, and every step is
    reported before its episode's record."""
    monkeypatch.setattr(schedule, "STEP_POLL_S", 0.05)
    events = _spy_on_progress(monkeypatch)
    jobs = make_jobs(two_tasks, ["full", "window"], [512, 1024])
    full1, full2 = full_job(1).key, full_job(2).key
    crashing = Job(2, "window", 512).key
    runner = OverlappingRunner(
        meet={full1, full2}, hold={full1: 1.0}, crash={crashing}, seconds=0.1, steps=2
    )
    settings = BenchSettings(episodes_per_engine=3)
    written = run_bench(two_tasks, jobs, tmp_path, runner, settings, progress=False)
    assert sorted(record_key(r) for r in written) == sorted(job.key for job in jobs)
    records = {record_key(r): r for r in read_results(tmp_path / "results.jsonl")}
    assert len(records) == 6
    assert records[crashing]["end_reason"] == "error"
    assert "browser died" in records[crashing]["error"]
    assert [k for k, r in records.items() if r["end_reason"] == "error"] == [crashing]
    spans = _spans(written)
    for job in jobs:
        if job.policy != "full" and job.key != crashing:
            full = full_job(job.task_id).key
            assert spans[job.key][0] >= spans[full][1], job  # after its reference ended
    assert spans[Job(2, "window", 1024).key][0] < spans[full1][1]  # not after task 1's
    assert 2 <= _most_at_once(spans.values()) <= 3
    assert len({r["thread"] for r in written if "thread" in r}) >= 2
    assert json.loads((tmp_path / "settings.json").read_text())["episodes_per_engine"] == 3
    for job in jobs:  # each episode's steps, then its record
        mine = [e[0] for e in events if e[1] == job.key]
        steps = 0 if job.key == crashing else 2
        assert mine == ["step"] * steps + ["finish"], job


def test_a_sweep_recorded_before_episodes_per_engine_resumes(tmp_path: Path, two_tasks):
    """A settings.json without a setting added since takes it at its default; another value
    is refused like any other changed setting."""
    jobs = make_jobs(two_tasks[:1], ["full"], [])
    recorded = dataclasses.asdict(BenchSettings())
    del recorded["episodes_per_engine"]
    (tmp_path / "settings.json").write_text(json.dumps(recorded))
    run_bench(two_tasks, jobs, tmp_path, FakeRunner(), progress=False)
    assert len(read_results(tmp_path / "results.jsonl")) == 1
    other = BenchSettings(episodes_per_engine=2)
    with pytest.raises(ConfigError, match="episodes_per_engine 1 -> 2"):
        run_bench(two_tasks, jobs, tmp_path, FakeRunner(), settings=other)


def test_a_ray_actor_runs_episodes_per_engine_at_once(tmp_path: Path, two_tasks, local_ray):
    """One actor, two episodes at a time (a threaded actor): the two full-KV episodes meet
    in it, and each replaying job starts after its task's full-KV episode ended."""
    jobs = make_jobs(two_tasks, ["full", "window"], [512])
    full1, full2 = full_job(1).key, full_job(2).key
    factory = functools.partial(OverlappingRunner, meet={full1, full2}, seconds=0.2)
    settings = BenchSettings(episodes_per_engine=2)
    actors = RayActors(1, factory=factory)
    written = run_bench(two_tasks, jobs, tmp_path, actors, settings, progress=False)
    assert sorted(record_key(r) for r in written) == sorted(job.key for job in jobs)
    assert all(r["end_reason"] == "stop" for r in written), written
    assert len({r["pid"] for r in written}) == 1 and os.getpid() not in {r["pid"] for r in written}
    spans = _spans(written)
    for task_id in (1, 2):
        assert spans[Job(task_id, "window", 512).key][0] >= spans[full_job(task_id).key][1]
    assert _most_at_once(spans.values()) == 2


def test_a_killed_ray_worker_fails_every_episode_it_ran_and_is_replaced_once(
    tmp_path: Path, two_tasks, local_ray
):
    """An actor running two episodes dies during them: both are error records, one fresh
    actor takes its place and runs the rest."""
    jobs = make_jobs(two_tasks, ["full", "window"], [512, 1024])
    full1, full2 = full_job(1).key, full_job(2).key
    factory = functools.partial(
        OverlappingRunner, meet={full1, full2}, die={full1}, hold={full2: 3.0}, seconds=0.1
    )
    settings = BenchSettings(episodes_per_engine=2)
    actors = RayActors(1, factory=factory)
    written = run_bench(two_tasks, jobs, tmp_path, actors, settings, progress=False)
    assert sorted(record_key(r) for r in written) == sorted(job.key for job in jobs)
    errors = {record_key(r): r for r in written if r["end_reason"] == "error"}
    assert set(errors) == {full1, full2}
    assert all(r["error"].startswith("ActorDiedError") for r in errors.values())
    others = [r for r in written if r["end_reason"] != "error"]
    assert len(others) == 4 and len({r["pid"] for r in others}) == 1  # one replacement


@pytest.mark.browser
@pytest.mark.model
def test_real_sweep_runs_two_episodes_at_once_on_one_model(tmp_path: Path, smollm, monkeypatch):
    """Two episodes at a time on one loaded model, each with its own Chromium (two tasks'
    full KV, then a window replaying the first's beside the second): every record complete
    (the window's with its agreement replay: its engine and full KV's both scheduled), and
    only the scheduler's thread ran the model. Short observations and no reference replay
    (`force_reply` through the scheduler: `test_scheduled_engine.py`) keep it quick."""
    monkeypatch.setattr(episode_runner, "load_model", lambda model=None, weights=None: smollm)
    threads_seen: set[str] = set()
    hook = smollm.model.register_forward_pre_hook(
        lambda module, args: threads_seen.add(threading.current_thread().name)
    )
    tasks = [load_task(1), load_task(2)]
    jobs = [*make_jobs(tasks, ["full"], []), Job(1, "window", 64)]
    settings = BenchSettings(
        max_steps=1, max_obs_tokens=200, reference_accuracy=False, episodes_per_engine=2
    )
    runner = EpisodeRunner(settings)
    try:
        written = run_bench(tasks, jobs, tmp_path, runner, settings, progress=False)
        scheduler = runner._scheduler
    finally:
        runner.close()
        hook.remove()
    assert sorted(record_key(r) for r in written) == sorted(job.key for job in jobs)
    for record in written:
        assert record["end_reason"] != "error", record
        assert record["peak_kv_allocated_bytes"] > 0 and record["steps"] == 1
    window = next(r for r in written if r["policy"] == "window")
    assert window["steps_compared"] == 1 and "agreement_error" not in window
    assert threads_seen == {"agent-kv-batch"}
    assert scheduler.rows > scheduler.iterations  # the two episodes shared forward calls
