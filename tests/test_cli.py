"""The `agent-kv` command as a user runs it: one real episode, and clean one-line errors."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from processes import CLI, free_port, read_lines_until


def run_cli(*args: str, env_extra: dict[str, str] | None = None, timeout: int = 600):
    import os

    env = {**os.environ, **(env_extra or {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.browser
@pytest.mark.model
def test_one_real_episode_runs_to_completion(tmp_path: Path):
    proc = run_cli(
        "run-episode", "--task", "1", "--max-steps", "2", "--model", "smollm2-135m",
        "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["task_id"] == 1
    assert summary["policy"] == "conf-kv"
    assert summary["policy_params"]["n_low"] == 1024
    assert isinstance(summary["success"], bool)
    assert summary["success"] == (summary["score"] == 1.0)
    assert 1 <= summary["steps"] <= 2
    assert summary["end_reason"] != "max_steps" or summary["steps"] == 2
    assert len(summary["step_s"]) == summary["steps"]
    assert summary["end_reason"] in {"stop", "max_steps", "parse_failures", "repeated_action"}
    assert summary["tokens_seen"] > 100
    assert 0 < summary["peak_kv_live_bytes"] <= summary["peak_kv_allocated_bytes"]
    assert summary["kv_shared_bytes"] == 0  # run-episode shares no prefix blocks
    assert summary["peak_kv_live_bytes"] <= summary["full_kv_live_bytes"]
    assert summary["full_kv_live_bytes"] == summary["tokens_seen"] * 30 * 2 * 3 * 64 * 4
    assert len(summary["ttft_s"]) == summary["steps"]
    assert all(t > 0 for t in summary["ttft_s"])
    assert summary["wall_s"] > 0
    trace = Path(summary["trace_dir"])
    assert trace.parent == tmp_path
    for step in range(1, summary["steps"] + 1):
        record = json.loads((trace / f"step_{step:03d}.json").read_text())
        assert record["observation"].startswith("Tab 0")
        assert (trace / f"step_{step:03d}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        json.loads((trace / "summary.json").read_text())["peak_kv_allocated_bytes"]
        == summary["peak_kv_allocated_bytes"]
    )
    kv_steps = [json.loads(line) for line in (trace / "kv_steps.jsonl").read_text().splitlines()]
    assert max(r["kv_live_bytes"] for r in kv_steps) <= summary["peak_kv_live_bytes"]
    assert max(r["appended_kv_live_bytes"] for r in kv_steps) == summary["peak_kv_live_bytes"]
    assert max(r["kv_allocated_bytes"] for r in kv_steps) == summary["peak_kv_allocated_bytes"]
    assert all(r["kv_live_bytes"] <= r["appended_kv_live_bytes"] for r in kv_steps)
    assert kv_steps[-1]["seen_tokens"] == summary["tokens_seen"]


def test_episode_with_int8_rerotate_and_set_of_marks(tmp_path: Path):
    proc = run_cli(
        "run-episode", "--task", "1", "--max-steps", "2", "--budget", "256", "--int8",
        "--fp-window", "64", "--positions", "rerotate", "--observation", "som",
        "--model", "smollm2-135m", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    trace = Path(summary["trace_dir"])
    som = (trace / "step_001.som.png").read_bytes()
    assert som[:8] == b"\x89PNG\r\n\x1a\n" and som != (trace / "step_001.png").read_bytes()
    assert summary["int8"] == {"fp_window": 64, "group": 32}
    assert summary["positions"] == "rerotate"
    # the first observation, released when the second arrives, leaves the FP window as INT8
    assert summary["steps"] == 2 and summary["quantized_tokens"] > 0
    assert summary["peak_kv_live_bytes"] < summary["full_kv_live_bytes"]


@pytest.mark.browser
@pytest.mark.model
def test_scripted_episode_evicts_and_holds_less_than_full_kv(tmp_path: Path):
    proc = run_cli(
        "run-episode", "--task", "413", "--mode", "scripted", "--budget", "160",
        "--model", "smollm2-135m", "--weights", "fp32", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "page 1 of 2 enters the cache" in proc.stderr
    assert "page 2 of 2 enters the cache" in proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["task_id"] == 413 and summary["k"] == 1 and summary["format"] == "notes"
    assert summary["policy"] == "conf-kv" and summary["policy_params"]["n_low"] == 160
    assert summary["end_reason"] == "stop" and summary["steps"] == 1 and summary["error"] is None
    assert summary["success"] == (summary["score"] == 1.0)
    assert summary["reply"].startswith("stop [")
    # the first page, released when the second arrives, is past the budget: evicted
    assert summary["evicted_tokens"] > 0
    full_live = summary["full_kv_live_bytes"]
    seen, left = divmod(full_live, 30 * 2 * 3 * 64 * 4)  # every token seen, the answer's too
    assert left == 0 and summary["history_tokens"] < seen <= summary["history_tokens"] + 32
    assert summary["peak_kv_live_bytes"] < full_live <= summary["full_kv_allocated_bytes"]
    assert summary["peak_kv_allocated_bytes"] < summary["full_kv_allocated_bytes"]
    assert summary["kv_reduction_vs_full"] == round(
        summary["full_kv_allocated_bytes"] / summary["peak_kv_allocated_bytes"], 3
    )
    assert summary["kv_live_reduction_vs_full"] == round(
        full_live / summary["peak_kv_live_bytes"], 3
    )
    trace = json.loads((Path(summary["trace_dir"]) / "recall.json").read_text())
    assert [page["url"].split("/", 3)[-1] for page in trace["pages"]] == [
        "product/91", "category/books",
    ]  # fmt: skip
    assert trace["record"]["evicted_tokens"] == summary["evicted_tokens"]


def assert_one_line_error(proc, *needles: str) -> None:
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for needle in needles:
        assert needle in lines[0]


def test_unknown_task_id(tmp_path):
    assert_one_line_error(
        run_cli("run-episode", "--task", "999", "--out", str(tmp_path)), "999", "bundled ids"
    )


def test_malformed_task_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"task_id": 5, "sites": ["classifieds"]')
    assert_one_line_error(run_cli("run-episode", "--task", str(bad)), "bad.json")
    missing_field = tmp_path / "missing.json"
    missing_field.write_text(
        json.dumps({"task_id": 5, "sites": ["classifieds"], "start_url": "__CLASSIFIEDS__"})
    )
    assert_one_line_error(
        run_cli("run-episode", "--task", str(missing_field)), "missing.json", "task 5"
    )


def test_scripted_mode_needs_reference_actions(tmp_path):
    task = json.loads(Path("tasks/classifieds/1.json").read_text()) | {"reference_actions": []}
    unscripted = tmp_path / "unscripted.json"
    unscripted.write_text(json.dumps(task))
    proc = run_cli("run-episode", "--task", str(unscripted), "--mode", "scripted")
    assert_one_line_error(proc, "--mode scripted replays", "task 1 has none")


def test_missing_chromium(tmp_path):
    proc = run_cli(
        "run-episode", "--task", "1", env_extra={"AGENT_KV_CHROMIUM": str(tmp_path / "none")}
    )
    assert_one_line_error(proc, "apt-get install chromium")


def test_missing_model(tmp_path):
    proc = run_cli("run-episode", "--task", "1", "--model", str(tmp_path / "nope.gguf"))
    assert_one_line_error(proc, "model not found")


def test_bad_policy_settings_fail_before_any_model_call(tmp_path):
    assert_one_line_error(
        run_cli("run-episode", "--task", "1", "--policy", "lru"), "unknown policy"
    )
    assert_one_line_error(run_cli("run-episode", "--task", "1", "--budget", "-3"), "budget")
    assert_one_line_error(run_cli("run-episode", "--task", "1", "--budget", "1"), "too small")
    assert_one_line_error(
        run_cli("run-episode", "--task", "1", "--policy", "full", "--tau", "0.5"),
        "no parameter 'tau'",
    )
    assert_one_line_error(
        run_cli("run-episode", "--task", "1", "--observation", "pixels"),
        "unknown observation mode 'pixels'",
    )


@pytest.mark.browser
def test_chromium_that_does_not_start(tmp_path):
    proc = run_cli(
        "run-episode",
        "--task",
        "1",
        "--out",
        str(tmp_path),
        env_extra={"AGENT_KV_CHROMIUM": "/bin/true"},
    )
    assert_one_line_error(proc, "failed to start", "apt-get install chromium")


def test_unusable_model_directory(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = run_cli(
        "run-episode", "--task", "1", "--model", str(tmp_path), "--out", str(tmp_path / "o")
    )
    assert_one_line_error(proc, "cannot load a model from")


def test_usage_errors_are_one_line(tmp_path):
    assert_one_line_error(run_cli("run-episode", "--task", "1", "--max-steps", "0"), "--max-steps")
    assert_one_line_error(run_cli("run-episode", "--task", "1", "--budget", "abc"), "--budget")
    assert_one_line_error(
        run_cli("run-episode", "--task", "1", "--positions", "sideways"), "--positions"
    )
    assert_one_line_error(run_cli("serve", "--session-bytes", "lots"), "cannot read 'lots'")
    assert_one_line_error(run_cli("run-episode"), "Missing option '--task'")
    afile = tmp_path / "afile"
    afile.write_text("")
    assert_one_line_error(run_cli("run-episode", "--task", "1", "--out", str(afile)), "cannot use")


TORCH_PROBE = (
    "import sys; from agent_kv.cli import main; code = main(); "
    "print('torch imported:', 'torch' in sys.modules, 'exit:', code)"
)
"""`python -c TORCH_PROBE ARGS...` runs the command line on ARGS in-process, then says
whether torch was imported."""


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--help"], "run-episode"),
        (["run-episode", "--help"], "--threads"),
        (["serve", "--help"], "--threads"),
        (["run-episode", "--task", "1", "--bogus"], "No such option"),
        (["run-episode", "--task", "1", "--policy", "lru"], "unknown policy 'lru'"),
        (["run-episode", "--task", "1", "--budget", "-3"], "--budget"),
        (["run-episode", "--task", "1", "--threads", "0"], "--threads"),
        (["bench", "--tasks", "1", "--out", "unused", "--policies", "lru"], "unknown policy"),
        (["run-episode", "--task", "1", "--agent", "voice"], "--agent takes text, tools"),
        (["bench", "--tasks", "1", "--out", "unused", "--agents", "text,voice"], "--agents takes"),
        (
            ["bench", "--tasks", "recall", "--out", "unused", "--mode", "scripted"]
            + ["--agents", "tools"],
            "takes --agents text only",
        ),
        (["run-episode", "--task", "401", "--mode", "replay"], "--mode must be free or scripted"),
        (
            ["run-episode", "--task", "401", "--mode", "scripted", "--agent", "tools"],
            "takes --agent text only",
        ),
        (
            ["run-episode", "--task", "401", "--mode", "scripted", "--pin-replies", "some"],
            "pin_replies must be one of none, notes, all, got 'some'",
        ),
        (
            ["bench", "--tasks", "541", "--out", "unused", "--pin-replies", "notes,all"],
            "pin_replies must be one of none, notes, all",
        ),
        (
            ["run-episode", "--task", "401", "--mode", "scripted", "--page-pins", "text"],
            "page_pins must be one of whole, elements, got 'text'",
        ),
        (
            ["bench", "--tasks", "541", "--out", "unused", "--reference", "/nonexistent"],
            "--reference /nonexistent holds no sweep traces",
        ),
        (["serve", "--policy", "h2o2"], "unknown policy 'h2o2'"),
        (["serve", "--policy", "window+reencode"], "runs on a plain engine only"),
        (["run-episode", "--task", "1", "--policy", "full+reencode"], "nothing to re-encode"),
        (["serve", "--session-bytes", "60XB"], "60XB"),
        (["serve", "--ray-address", "10.0.0.1:6379"], "--ray-address needs --replicas"),
        (["serve", "--router", "hash"], "--router needs --replicas"),
        (["serve", "--replicas", "2", "--ray-address", "h:1"], "needs --spill-dir"),
        (["serve", "--replicas", "0"], "--replicas"),
        (["sites", "--sites", "bank"], "unknown site 'bank'"),
        (["run-episode", "--task", "1", "--model", "nope"], "qwen2.5-coder-0.5b"),
        (["serve", "--model", "nope"], "neither a bundled model"),
        (["models", "install", "nope"], "unknown bundled model 'nope'"),
    ],
)
def test_help_and_usage_errors_do_not_import_torch(args, needle):
    proc = subprocess.run(
        [sys.executable, "-c", TORCH_PROBE, *args], capture_output=True, text=True, timeout=120
    )
    *_, last = proc.stdout.strip().splitlines()
    assert last.startswith("torch imported: False exit: "), proc.stdout + proc.stderr
    assert needle in proc.stdout + proc.stderr
    assert last.endswith("exit: 0" if "--help" in args else "exit: 2")


@pytest.mark.enable_socket
def test_serve_refuses_a_port_in_use_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        proc = run_cli("serve", "--port", str(port), timeout=120)
        took = time.monotonic() - started
    # the one line: the model never started loading (its first words are "loading model")
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}: Address already in use")
    assert took < 30  # seconds: Python and the CLI start; loading and compiling take minutes


@pytest.mark.parametrize(
    "host, needle",
    [
        ("no-such-host.invalid", "cannot listen on no-such-host.invalid:8000: "),
        ("192.0.2.1", "cannot listen on 192.0.2.1:8000: "),  # no interface of this machine
    ],
)
def test_serve_refuses_a_host_it_cannot_listen_on(host, needle):
    assert_one_line_error(run_cli("serve", "--host", host, "--port", "8000", timeout=120), needle)


def test_eval_refuses_recall_on_a_policy_that_evicts_nothing_before_writing(tmp_path):
    proc = run_cli("eval", "needle", "--policies", "full+recall", "--out", str(tmp_path / "o"))
    assert_one_line_error(proc, "policy 'full' evicts nothing: there is nothing to recall")
    assert not (tmp_path / "o").exists()


def test_agent_kv_threads_is_checked_before_the_model():
    proc = run_cli("run-episode", "--task", "1", env_extra={"AGENT_KV_THREADS": "lots"})
    assert_one_line_error(proc, "AGENT_KV_THREADS must be a whole number")


@pytest.mark.model
@pytest.mark.enable_socket
def test_serve_says_when_it_loads_and_when_it_is_ready():
    port = free_port()
    proc = subprocess.Popen(
        [*CLI, "serve", "--port", str(port), "--threads", "1", "--no-compile"]
        + ["--model", "smollm2-135m"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = read_lines_until(proc.stderr, lambda line: "ready on" in line, timeout=300)
        assert lines[0] == "loading model smollm2-135m (gguf weights)..."
        assert lines[-1] == f"ready on http://127.0.0.1:{port}"
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=30)
        assert health.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.mark.enable_socket
def test_sites_serves_until_stopped():
    proc = subprocess.Popen(
        [*CLI, "sites", "--sites", "classifieds,forum"], stdout=subprocess.PIPE, text=True
    )
    try:
        lines = read_lines_until(proc.stdout, lambda line: line.startswith("forum"), timeout=120)
        assert [line.split()[0] for line in lines] == ["classifieds", "forum"]
        classifieds, forum = (line.split()[1] for line in lines)
        assert classifieds.startswith("http://127.0.0.1:") and "log in" not in lines[0]
        assert f"{forum}/login as agent / agent-kv-test" in lines[1]
        page = httpx.get(classifieds, timeout=30)
        assert page.status_code == 200 and "<html" in page.text.lower()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0  # SIGTERM stops the servers as Ctrl-C does
