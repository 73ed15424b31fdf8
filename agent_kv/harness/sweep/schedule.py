"""The sweep's driver, `run_bench`: run the jobs not yet recorded, on Ray actors
(`ray_pool`) or in this process, and append each record to the results file as its episode
finishes, with a progress bar in agent steps (`StepProgress`).

By default the episodes run on Ray actors (`RayActors`), each a worker process holding its
own runner, running `BenchSettings.episodes_per_engine` episodes at a time (one by default).
With more than one episode per engine the runner keeps one model and runs every episode's
model calls through one `BatchScheduler` (continuous batching: their decode tokens and
prefill chunks share forward calls, `agent_kv.runtime.engine.scheduled_engine`), each episode in a
thread with its own browser, all on the same sites. A `Runner` passed in instead runs the
episodes in the calling process, without Ray (tests, debugging): one after another, or
`episodes_per_engine` at a time in threads.
"""

from __future__ import annotations

import functools
import json
import queue
import sys
from collections import deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from tqdm import tqdm

from agent_kv.harness.sweep.job_runs import (
    STEP_POLL_S,
    RayActors,
    Runner,
    StepReport,
    next_ready,
    run_job,
)
from agent_kv.harness.sweep.ray_pool import run_on_ray
from agent_kv.harness.sweep.settings import (
    RESULTS,
    BenchSettings,
    Job,
    check_settings,
    job_of,
    read_results,
    record_key,
)
from envs.tasks import Task


class StepProgress:
    """The sweep's progress bar in agent steps: every episode counts `max_steps` (the most
    it can take); the bar moves by one per step an episode reports and, when the episode's
    record is written, by the steps it did not take (it stopped early, or failed). The
    postfix names the episodes finished and the latest step or outcome.

    Args:
        bar: a tqdm bar of `episodes * max_steps` steps.
        max_steps: the sweep's `BenchSettings.max_steps`.
        episodes: the episodes the sweep runs.
    """

    def __init__(self, bar, max_steps: int, episodes: int):
        self.bar, self.max_steps, self.episodes = bar, max_steps, episodes
        self.counted: dict[tuple, int] = {}  # job key -> steps counted of its running episode
        self.finished = 0

    def step(self, job: Job, step: int) -> None:
        """`StepReport`: the episode of `job` finished its step `step`."""
        counted = self.counted.get(job.key, 0)
        self.counted[job.key] = max(counted, min(step, self.max_steps))
        self._show(f"{job.name} step {step}", self.counted[job.key] - counted)

    def finish(self, record: dict[str, Any]) -> None:
        """The record of an episode was written: count the steps it did not take."""
        job = job_of(record)
        self.finished += 1
        outcome = "error" if record.get("end_reason") == "error" else record.get("success")
        self._show(f"{job.name}: {outcome}", self.max_steps - self.counted.pop(job.key, 0))

    def _show(self, latest: str, advance: int) -> None:
        self.bar.set_postfix_str(f"{self.finished}/{self.episodes} episodes; {latest}")
        self.bar.update(advance)


def run_bench(
    tasks: list[Task],
    jobs: list[Job],
    out: Path,
    runner: Runner | RayActors | None = None,
    settings: BenchSettings | None = None,
    progress: bool = True,
    retry_errors: bool = False,
) -> list[dict[str, Any]]:
    """Run the jobs not yet in `out/results.jsonl`, appending one record per finished job.

    Nothing starts (no Ray, no model) when every job already has its record.

    Args:
        tasks: the tasks the jobs name.
        jobs: see `settings.make_jobs`.
        out: the sweep directory (created); traces go under `out/traces/<job name>` (on a
            joined cluster, on the filesystem of the node that ran the episode).
        runner: where the episodes run: `RayActors` on Ray (default `RayActors()`: one
            actor with an `EpisodeRunner`, on a local Ray instance), or a `Runner` that
            runs them in this process, without Ray (the caller closes it): one after
            another, or `settings.episodes_per_engine` at a time in threads (a job that
            replays a task's full-KV episode starts after that episode finished).
        settings: episode settings for the runners the actors build (default
            `BenchSettings()`); recorded in `out/settings.json`.
        progress: show a progress bar on stderr, in agent steps (`StepProgress`).
        retry_errors: also rerun jobs recorded with `end_reason: "error"`.

    Returns:
        The records written by this call, in completion order.

    Raises:
        OSError: `out` cannot be created or written.
        ConfigError: `out` holds a sweep run with other episode settings (its results could
            not be compared with these), or Ray cannot be reached (see `ray_pool`).
        AgentKVError, ChromiumNotFoundError: a runner cannot start (no model, no
            browser), or a Ray worker died while starting one.
    """
    settings = settings or BenchSettings()
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, settings)
    results = out / RESULTS
    by_id = {task.task_id: task for task in tasks}
    pending = _pending(jobs, results, retry_errors)
    written: list[dict[str, Any]] = []
    if not pending:
        return written
    bar = tqdm(
        total=len(pending) * settings.max_steps,
        file=sys.stderr,
        disable=not progress,
        unit="step",
        dynamic_ncols=True,
    )
    steps = StepProgress(bar, settings.max_steps, len(pending))
    work = [(by_id[job.task_id], job, out.resolve() / "traces" / job.name) for job in pending]
    with results.open("a", encoding="utf-8") as handle:

        def write(record: dict[str, Any]) -> None:
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            written.append(record)
            steps.finish(record)

        try:
            if runner is None or isinstance(runner, RayActors):
                run_on_ray(runner or RayActors(), settings, work, write, steps.step)
            else:
                runner.start({site for task, _, _ in work for site in task.sites})
                _run_in_process(runner, work, write, steps.step, settings.episodes_per_engine)
        finally:
            bar.close()
    return written


def _pending(jobs: list[Job], results: Path, retry_errors: bool) -> list[Job]:
    """The jobs of `jobs` without a record in `results` (with `retry_errors`, also those
    recorded with `end_reason: "error"`), task by task in the order tasks first appear, each
    task's full KV before its other jobs (which replay it); how many are skipped is said on
    stderr. Task by task, a sweep stopped early has its tasks' policies run beside their full
    KV, not full KV on every task and no policy."""
    done = {
        record_key(r)
        for r in read_results(results)
        if not (retry_errors and r.get("end_reason") == "error")
    }
    first = {}
    for job in jobs:
        first.setdefault(job.task_id, len(first))
    pending = sorted(
        (job for job in jobs if job.key not in done),
        key=lambda j: (first[j.task_id], j.policy != "full"),
    )
    if len(jobs) > len(pending):
        tqdm.write(f"skipping {len(jobs) - len(pending)} episodes already in {results}", sys.stderr)
    return pending


def _run_in_process(
    runner: Runner,
    work: list[tuple[Task, Job, Path]],
    write: Callable[[dict[str, Any]], None],
    report: StepReport,
    at_once: int,
) -> None:
    """Run `work` (task, job, trace directory) on `runner` in this process, `at_once` jobs
    at a time, calling `write` with each record as its episode finishes and `report` with
    each agent step, both from this thread.

    One at a time, the jobs run in order on this thread. More run in threads of a pool:
    a job starts when a place is free and its task's full-KV episode is not still to run
    (`runner.next_ready`); the episodes' steps are queued and passed on while this thread
    waits for a finished episode (at most `STEP_POLL_S` at a time), so a job's steps all
    reach `report` before its record reaches `write`.
    """
    if at_once == 1:
        for task, job, trace_dir in work:
            write(run_job(runner, task, job, trace_dir, functools.partial(report, job)))
        return
    steps: queue.SimpleQueue[tuple[Job, int]] = queue.SimpleQueue()
    waiting = deque(work)
    references = {(job.task_id, job.agent) for _, job, _ in work if job.policy == "full"}
    running: dict[Future, Job] = {}
    with ThreadPoolExecutor(at_once, thread_name_prefix="agent-kv-episode") as pool:
        try:
            while waiting or running:
                while len(running) < at_once and (item := next_ready(waiting, references)):
                    task, job, trace_dir = item
                    on_step = functools.partial(_queue_step, steps, job)
                    running[pool.submit(run_job, runner, task, job, trace_dir, on_step)] = job
                done, _ = wait(running, timeout=STEP_POLL_S, return_when=FIRST_COMPLETED)
                while not steps.empty():
                    report(*steps.get())
                for future in done:
                    job = running.pop(future)
                    if job.policy == "full":
                        references.discard((job.task_id, job.agent))
                    write(future.result())
        finally:  # stopped early (an interrupt): no job starts after this
            for future in running:
                future.cancel()


def _queue_step(steps: queue.SimpleQueue, job: Job, step: int) -> None:
    """An episode's `on_step` in a thread: queue `(job, step)` for the thread that reports."""
    steps.put((job, step))
