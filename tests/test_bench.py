"""The policy sweep: aggregation, resume, crash handling and the report, with a fake episode
runner (no browser, no model); one real sweep behind the browser and model markers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agent_kv.cli import app
from agent_kv.errors import ConfigError
from agent_kv.harness import bench
from agent_kv.harness.bench import Job
from envs.tasks import TaskError, load_task


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
        "peak_kv_bytes": peak,
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
    _record(1, "window", 512, True, 50e6, reference_steps=2, reference_hits=1, **_nll(4, 1.0)),
    _record(2, "window", 512, False, 50e6, reference_steps=1, reference_hits=0, **_nll(2, 4.0)),
    _record(3, "window", 512, False, 50e6),
    _record(4, "window", 512, False, 50e6, steps=4, rates=(30.0,)),
    # conf-kv 512 ran only tasks 1, 2 (one an error, no peak)
    _record(1, "conf-kv", 512, True, 25e6),
    {**_record(2, "conf-kv", 512, False, None, steps=0, rates=()), "end_reason": "error"},
]


def test_aggregate_from_hand_written_results(tmp_path: Path):
    _write(tmp_path / "results.jsonl", HAND_WRITTEN)
    rows = bench.aggregate(bench.read_results(tmp_path / "results.jsonl"))
    by_label = {bench.row_label(r): r for r in rows}
    assert [bench.row_label(r) for r in rows] == ["full", "window 512", "conf-kv 512"]

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

    table = bench.format_table(rows)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert "| window | 512 | fp | 4 | 0 | 25% | 0.50 | 50.0 | 3.00x | 2.5 |" in table
    assert "33% (3 steps) | 2.00 |" in lines[3]


def test_relative_success_is_none_when_full_never_succeeds():
    records = [_record(1, "full", None, False, 10e6), _record(1, "h2o", 256, True, 5e6)]
    rows = bench.aggregate(records)
    assert rows[1]["relative_success"] is None
    assert rows[1]["reduction_vs_full"] == pytest.approx(2.0)


def test_read_results_keeps_last_record_per_job_and_skips_a_torn_line(tmp_path: Path):
    path = tmp_path / "results.jsonl"
    _write(path, [_record(1, "full", None, False, 1e6), _record(1, "full", None, True, 1e6)])
    with path.open("a") as handle:
        handle.write('{"task_id": 2, "pol')
    records = bench.read_results(path)
    assert len(records) == 1 and records[0]["success"] is True


class FakeRunner:
    """Returns a canned summary; raises for the jobs named in `crash`; logs every call."""

    def __init__(self, crash: set[tuple] = frozenset()):
        self.crash = crash
        self.calls: list[Job] = []

    def __call__(self, task, job: Job, trace_dir: Path) -> dict:
        self.calls.append(job)
        if job.key in self.crash:
            raise RuntimeError("browser died")
        peak = 100e6 if job.policy == "full" else job.budget * 1e5
        return _record(job.task_id, "ignored", "ignored", job.task_id == 1, peak)

    def close(self) -> None:
        pass


@pytest.fixture
def two_tasks():
    return [load_task(1), load_task(2)]


def test_sweep_records_a_crash_and_finishes_the_rest(tmp_path: Path, two_tasks):
    jobs = bench.make_jobs(two_tasks, ["full", "window"], [512, 1024])
    assert len(jobs) == 2 * 3
    crashing = Job(2, "window", 512).key
    runner = FakeRunner(crash={crashing})
    written = bench.run_bench(two_tasks, jobs, tmp_path, runner, progress=False)
    assert len(written) == 6 and len(runner.calls) == 6
    records = {bench.record_key(r): r for r in bench.read_results(tmp_path / "results.jsonl")}
    assert len(records) == 6
    crashed = records[crashing]
    assert crashed["end_reason"] == "error" and "browser died" in crashed["error"]
    assert crashed["success"] is False
    # the job's own key fields win over whatever the runner returned
    assert records[Job(1, "window", 1024).key]["policy"] == "window"
    assert records[Job(1, "window", 1024).key]["budget"] == 1024
    assert sum(r["end_reason"] == "error" for r in records.values()) == 1


def test_rerun_skips_finished_episodes(tmp_path: Path, two_tasks):
    jobs = bench.make_jobs(two_tasks, ["full", "h2o"], [256])
    first = FakeRunner(crash={Job(1, "h2o", 256).key})
    bench.run_bench(two_tasks, jobs[:3], tmp_path, first, progress=False)
    assert len(first.calls) == 3

    second = FakeRunner()
    written = bench.run_bench(two_tasks, jobs, tmp_path, second, progress=False)
    assert [job.key for job in second.calls] == [Job(2, "h2o", 256).key]
    assert len(written) == 1
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4  # earlier results stay written

    third = FakeRunner()
    bench.run_bench(two_tasks, jobs, tmp_path, third, progress=False, retry_errors=True)
    assert [job.key for job in third.calls] == [Job(1, "h2o", 256).key]
    records = bench.read_results(tmp_path / "results.jsonl")
    assert len(records) == 4 and all(r["end_reason"] != "error" for r in records)


def test_a_rerun_with_other_settings_is_refused(tmp_path: Path, two_tasks):
    jobs = bench.make_jobs(two_tasks[:1], ["full"], [])
    bench.run_bench(two_tasks, jobs, tmp_path, FakeRunner(), settings=bench.BenchSettings())
    assert json.loads((tmp_path / "settings.json").read_text())["max_steps"] == 6
    other = bench.BenchSettings(max_steps=3, reference_accuracy=False)
    with pytest.raises(ConfigError, match="max_steps 6 -> 3, reference_accuracy True -> False"):
        bench.run_bench(two_tasks, jobs, tmp_path, FakeRunner(), settings=other)


def test_report_writes_summary_and_png(tmp_path: Path):
    _write(tmp_path / "results.jsonl", HAND_WRITTEN)
    table = bench.write_report(tmp_path)
    summary = (tmp_path / "summary.md").read_text()
    assert table in summary and "| conf-kv | 512 |" in summary
    png = (tmp_path / "success_vs_memory.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_make_jobs_full_once_and_int8_for_the_others(two_tasks):
    jobs = bench.make_jobs(two_tasks[:1], ["full", "conf-kv"], [512, 512, 1024], int8=True)
    assert [job.name for job in jobs] == [
        "task1-full",
        "task1-conf-kv-512-int8",
        "task1-conf-kv-1024-int8",
    ]
    with pytest.raises(ValueError, match="unknown policy"):
        bench.make_jobs(two_tasks, ["nope"], [512])


def test_make_jobs_runs_arkv_in_its_own_format_and_base_quant_once(two_tasks):
    jobs = bench.make_jobs(two_tasks[:1], ["arkv", "base-quant", "window"], [256], int8=True)
    assert [job.name for job in jobs] == [
        "task1-arkv-256-fp8",
        "task1-base-quant-fp8",
        "task1-window-256-int8",
    ]


def test_select_tasks_by_suite_ids_and_glob(tmp_path: Path):
    assert [t.task_id for t in bench.select_tasks("1,3-4,3")] == [1, 3, 4]
    assert len(bench.select_tasks("classifieds")) >= 4
    (tmp_path / "t.json").write_text(load_task(2).model_dump_json())
    assert [t.task_id for t in bench.select_tasks(str(tmp_path / "*.json"))] == [2]
    with pytest.raises(TaskError):
        bench.select_tasks("no-such-suite")
    with pytest.raises(TaskError, match="no file matches"):
        bench.select_tasks(str(tmp_path / "missing*.json"))


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
def test_real_one_task_sweep_with_reference_accuracy(tmp_path: Path):
    task = load_task(1)
    jobs = bench.make_jobs([task], ["full", "window"], [256])
    settings = bench.BenchSettings(max_steps=1)
    bench.run_bench([task], jobs, tmp_path, settings=settings, progress=False)
    records = bench.read_results(tmp_path / "results.jsonl")
    assert len(records) == 2
    for record in records:
        assert record["end_reason"] != "error", record
        assert record["peak_kv_bytes"] > 0
        assert record["reference_steps"] == len(task.reference_actions)
        assert 0 <= record["reference_hits"] <= record["reference_steps"]
    table = bench.write_report(tmp_path)
    assert "| window | 256 |" in table


def test_two_worker_processes_run_every_job(tmp_path: Path, two_tasks):
    jobs = bench.make_jobs(two_tasks, ["full", "window"], [512])
    runner = FakeRunner(crash={Job(1, "window", 512).key})
    written = bench.run_bench(two_tasks, jobs, tmp_path, runner, workers=2, progress=False)
    assert sorted(bench.record_key(r) for r in written) == sorted(job.key for job in jobs)
    errors = [r for r in written if r["end_reason"] == "error"]
    assert [bench.record_key(r) for r in errors] == [Job(1, "window", 512).key]


@pytest.mark.model
def test_force_reply_agrees_with_greedy_decoding(smollm):
    from agent_kv.kv.policies import make_policy
    from agent_kv.runtime.conversation import Conversation
    from agent_kv.runtime.engine import Engine
    from agent_kv.runtime.sampling import SamplingParams

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
