"""Policy sweeps: run web tasks under several KV policies and budgets, and report success next
to memory.

    agent-kv bench --tasks classifieds --policies full,window,conf-kv --budgets 512,1024 \
        --out runs/sweep

One *job* is a task under one policy setting (policy, budget, precision) and one agent
(`--agents`: actions as text or as tool calls, `action_formats`); `full` runs once per task
and agent, without a budget, always at full precision (it is the baseline every other row of
the same agent is compared with). Each finished job appends one JSON line to
`DIR/results.jsonl` (the episode summary of `agent.run_episode` plus `policy`, `budget`,
`precision`, `agent` and, unless disabled, the teacher-forced reference-action accuracy),
flushed at once; a rerun skips the jobs already in the file, so an interrupted sweep
resumes. A job that raises (browser death, model error,
anything) is recorded with `end_reason: "error"` and the error text, and the sweep goes on.
At the end `DIR/summary.md` holds the table of `aggregate` and `DIR/success_vs_memory.png`
plots success rate against mean peak KV memory, one labelled point per row.

**Scheduling** (`run_bench`): the episodes run on Ray actors (`RayActors`), each a worker
process holding its own runner (the model, headless Chromium and the sites), running
`BenchSettings.episodes_per_engine` episodes at a time (one by default); the driver hands
the next job to whichever actor has a free place and writes each record as its episode
finishes (`ray.wait`), so a slow episode holds up no other record. With more than one
episode per engine the runner keeps one model and runs every episode's model calls through
one `BatchScheduler` (continuous batching: their decode tokens and prefill chunks share
forward calls, `agent_kv.runtime.scheduled_engine`), each episode in a thread with its own
browser, all on the same sites. By default a local Ray instance is started for the sweep and
shut down after it (`ray_session`); an existing cluster is joined by address. An actor whose
worker process dies (killed, out of memory, a crash in native code) makes its episode an
error record; the actor is replaced by a fresh one and the sweep goes on. Ray itself neither
restarts actors nor retries their calls (`max_restarts=0`, `max_task_retries=0`): a crash
that killed a process would most likely kill it again, and a silent retry would hide it (a
process that dies takes every episode it was running with it: each is an error record). A
`Runner` passed in instead runs the episodes in the calling process, without Ray (tests,
debugging): one after another, or `episodes_per_engine` at a time in threads.

**Agreement with full KV** (`agent_kv.harness.agreement`): every job but `full` also replays
its task's full-KV episode teacher-forced beside full KV and records how often its own
greedy, constrained action equals full KV's and the KL between their next-token
distributions; jobs are handed out so that a task's full-KV episode runs before the jobs
that replay it (`_next_ready`).

**Reference-action accuracy** (`reference_replay`): the task's `reference_actions` are
replayed in the browser; at each step the agent's prompt is built exactly as the agent builds
it (pinned system message and examples, the observation the browser now shows, pinned while
latest), the reference action is resolved to the page's element ids (`click [15]`, what the
model would have to emit; for the tool agent, the call that makes it) and teacher-forced as
the reply with `Conversation.force_reply`: the
tokens are fed one at a time, exactly as decoding feeds them, so the policy evicts as it
would during the episode. A step counts as correct when every token of the action is the
argmax of the logits before it, i.e. greedy decoding (the agent's decoding) emits that action
token for token. This costs one decode-sized forward call per action token and no
generation; it is exact for greedy decoding but strict: an equivalent spelling
(`type [3] [bike]` for `type [3] [bike] [1]`) counts as a miss, and the text greedy decoding
would emit after the action is not checked. The history then holds the reference actions,
not the model's own replies, so later steps are judged on a correct trajectory: a low
figure under a policy where full KV scores well means the cache lost what mattered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import glob
import json
import logging
import math
import os
import queue
import shutil
import socket
import sys
import tempfile
import threading
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.harness.intervals import paired_difference_interval, success_interval
from agent_kv.harness.reply_pins import check_pin_replies, reply_pin
from agent_kv.kv.policy_names import base_policy, check_policy_name
from agent_kv.renamed_fields import current_names
from agent_kv.runtime import bundled_models
from agent_kv.runtime import threads as thread_setting
from agent_kv.runtime.weight_formats import DEFAULT_WEIGHTS, check_weight_format
from envs.actions import ACTION_FORMATS
from envs.tasks import Task, TaskError, load_suite, load_task, load_tasks, suite_names

RESULTS = "results.jsonl"
SUMMARY = "summary.md"
PLOT = "success_vs_memory.png"
AGREEMENT_PLOT = "agreement_vs_memory.png"
SETTINGS = "settings.json"
LEGACY_SETTINGS = {"weights": "fp32"}
"""Settings whose default changed since they were added: a sweep recorded before the setting
existed ran with these values."""
LEGACY_DEFAULT_MODEL = "smollm2-135m"
"""The default model of sweeps recorded with `model: null` (before models had names)."""


@dataclass(frozen=True)
class Job:
    """One episode of a sweep.

    Attributes:
        task_id: the task.
        policy: a name of `agent_kv.kv.policies.POLICIES`.
        budget: unpinned tokens per layer (see `kv.policy_spec.PolicySpec`), None for `full`.
        precision: "fp"; "int8" for mixed precision (`--int8`); for a policy that quantizes
            by its own rule (ARKV's), its format ("fp8").
        agent: how the agent writes actions, "text" or "tools" (`AgentConfig.agent`).
    """

    task_id: int
    policy: str
    budget: int | None
    precision: str = "fp"
    agent: str = "text"

    @property
    def key(self) -> tuple:
        """What identifies the job in results.jsonl."""
        return (self.task_id, self.policy, self.budget, self.precision, self.agent)

    @property
    def name(self) -> str:
        """A file-name-safe label, e.g. 'task3-conf-kv-512-int8' ('-tools' added for the
        tool-calling agent)."""
        parts = [f"task{self.task_id}", self.policy]
        if self.budget is not None:
            parts.append(str(self.budget))
        if self.precision != "fp":
            parts.append(self.precision)
        if self.agent != "text":
            parts.append(self.agent)
        return "-".join(parts)


SETTING_FIELDS = ("policy", "budget", "precision", "agent")
"""A job's key past its task: the setting a row of the summary aggregates."""


def record_key(record: dict[str, Any]) -> tuple:
    """The job key of a results.jsonl record (`Job.key`; a record without an agent is the
    text agent's)."""
    return (
        record["task_id"],
        record["policy"],
        record.get("budget"),
        record.get("precision", "fp"),
        record.get("agent", "text"),
    )


@dataclass(kw_only=True)
class BenchSettings:
    """Per-episode settings shared by every job of a sweep (built from named fields only).

    Attributes:
        max_steps: actions before an episode is cut off.
        max_obs_tokens: observation text cap in tokens.
        prefill_chunk: tokens per prefill forward call.
        model: a bundled model's name, a model directory or a .gguf file; None stands for
            the default bundled model (`bundled_models.DEFAULT_MODEL`), recorded by its name.
        reference_accuracy: also replay each task's reference actions (see the module
            docstring); tasks without reference actions get none.
        observation: the browser's observation mode (`envs.browser_env.OBSERVATION_MODES`).
        constrain: decode actions under each page's action grammar (`AgentConfig.constrain`).
        agreement: also replay the task's full-KV episode under each other policy and
            compare its decisions with full KV's (`agent_kv.harness.agreement`); needs `full`
            among the sweep's policies.
        mode: "free" (free navigation: the agent acts at every step, `run_episode`) or
            "scripted" (scripted navigation, free answer: the recall suite's runner,
            `agent_kv.harness.recall`).
        positions: "original" or "rerotate" (`PolicySpec`), for every policy of the sweep.
        episodes_per_engine: episodes run at once on one runner, i.e. one model in memory
            (`EpisodeRunner`): each its own thread and browser, their model calls batched by
            one `BatchScheduler`. 1 (the default) runs one episode at a time on a plain
            `Engine`. Success and memory do not depend on it; the time figures (decode
            tokens/s, seconds per step) are per episode while the model is shared, so it is
            recorded with the sweep like the other settings.
        weights: the model's weight format (`agent_kv.runtime.weight_formats`).
        pin_replies: which of the agent's replies to pin (`AgentConfig.pin_replies`).
    """

    max_steps: int = 6
    max_obs_tokens: int = 1200
    prefill_chunk: int = 512
    model: str | None = None
    reference_accuracy: bool = True
    observation: str = "accessibility_tree"
    constrain: bool = True
    agreement: bool = True
    mode: str = "free"
    positions: str = "original"
    episodes_per_engine: int = 1
    weights: str = DEFAULT_WEIGHTS
    pin_replies: str = "none"

    def __post_init__(self) -> None:
        self.model = self.model or bundled_models.DEFAULT_MODEL  # recorded by name
        check_weight_format(self.weights)
        check_pin_replies(self.pin_replies)
        if self.episodes_per_engine < 1:
            raise ValueError(f"episodes_per_engine must be >= 1, got {self.episodes_per_engine}")


class Runner(Protocol):
    """Runs the jobs of a sweep (`EpisodeRunner` is the real one): one at a time, or, with
    `BenchSettings.episodes_per_engine` N > 1, called from up to N threads at once (it must
    then be safe to call so)."""

    def start(self, sites: Iterable[str]) -> object:
        """Get ready for jobs on `sites` (start the browser, load the model), before the
        first job. Raise what would fail every job (AgentKVError, ChromiumNotFoundError):
        the sweep then stops with that error instead of recording it once per job."""

    def __call__(
        self, task: Task, job: Job, trace_dir: Path, on_step: Callable[[int], None]
    ) -> dict[str, Any]:
        """Run one job and return its record fields (an episode summary); the trace goes
        under `trace_dir`; `on_step(n)` is called as the episode finishes its agent step n
        (1, 2, ...: the sweep's progress). May raise: the sweep records the error."""

    def close(self) -> None:
        """Release what the runner started."""


RunnerFactory = Callable[[BenchSettings], Runner]
"""Builds a runner from the sweep's episode settings, inside a Ray actor."""
StepReport = Callable[[Job, int], None]
"""Told `(job, n)` as the episode of `job` finishes its agent step n."""

RAY_OBJECT_STORE_BYTES = 100 * 2**20
"""Object store of a local Ray instance (bytes): jobs and records are small JSON-like
values, so Ray's default (30% of the memory) would only reserve shared memory."""
CONNECT_TIMEOUT_S = 5.0
"""How long `check_ray_address` waits for a cluster to accept a connection (seconds)."""
STEP_POLL_S = 0.5
"""How often the driver of a Ray sweep collects the steps its actors report while no
episode finishes (seconds)."""


@dataclass(frozen=True)
class RayActors:
    """Run a sweep on Ray: `count` actors, each a Ray worker process holding the runner
    `factory(settings)` builds.

    Attributes:
        count: actors (>= 1), each asking Ray for 1 CPU and running
            `BenchSettings.episodes_per_engine` episodes at a time (a threaded actor,
            `max_concurrency`, when more than one); with the real runner each holds its own
            model, sites and browsers (one per episode at a time).
        address: the cluster to join (`check_ray_address`); None starts a local Ray
            instance for the sweep (`ray_session`).
        factory: builds an actor's runner; it is sent to the workers, so it must be
            picklable (a module-level class or function, or a `functools.partial` of one).
    """

    count: int = 1
    address: str | None = None
    factory: RunnerFactory = dataclasses.field(default_factory=lambda: EpisodeRunner)

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"RayActors.count must be >= 1, got {self.count}")


def parse_list(text: str, what: str) -> list[str]:
    """Comma-separated items, stripped, empty ones dropped.

    Raises:
        TaskError: no item at all (`what` names the option in the message).
    """
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise TaskError(f"{what} is empty")
    return items


def select_tasks(spec: str) -> list[Task]:
    """Tasks named by `spec`: a bundled suite name, a glob or path of task JSON files, or
    comma-separated bundled ids and ranges ("1,3,5-8"). Sorted by id, duplicates dropped.

    Raises:
        TaskError: an unknown suite or id, a glob matching no file, an invalid file.
    """
    spec = spec.strip()
    if spec in suite_names():
        return load_suite(spec)
    tasks: list[Task] = []
    if any(ch in spec for ch in "*?[") or spec.endswith(".json") or "/" in spec:
        paths = sorted(glob.glob(spec))
        if not paths:
            raise TaskError(f"--tasks {spec!r}: no file matches (suites: {suite_names()})")
        for path in paths:
            tasks.extend(load_tasks(path))
    else:
        for item in parse_list(spec, "--tasks"):
            low, _, high = item.partition("-")
            if high and low.isdigit() and high.isdigit():
                if int(low) > int(high):
                    raise TaskError(f"--tasks range {item!r} runs backwards: write {high}-{low}")
                tasks.extend(load_task(i) for i in range(int(low), int(high) + 1))
            elif item.isdigit():
                tasks.append(load_task(item))
            else:
                raise TaskError(
                    f"--tasks {item!r} is neither a suite ({', '.join(suite_names())}), "
                    "a task id, a range like 3-7, nor a JSON file"
                )
    unique = {task.task_id: task for task in tasks}
    return [unique[task_id] for task_id in sorted(unique)]


def make_jobs(
    tasks: Iterable[Task],
    policies: list[str],
    budgets: list[int],
    int8: bool = False,
    agents: Sequence[str] = ("text",),
) -> list[Job]:
    """Every task under every (policy, budget), for each agent: `full` (and `base-quant`,
    which takes no budget either) once per task with no budget; the others at each budget.
    `full` runs at full precision; with `int8` the others run in INT8 mixed precision,
    except the policies that quantize by their own rule (ARKV's), labelled with their
    default format (`fp8`).

    Raises:
        ValueError: an unknown policy or agent, or a budget below 1.
    """
    for policy in policies:
        check_policy_name(policy)
    for agent in agents:
        if agent not in ACTION_FORMATS:
            raise ValueError(f"unknown agent {agent!r}: choose from {', '.join(ACTION_FORMATS)}")
    for budget in budgets:
        if budget < 1:
            raise ValueError(f"budgets must be >= 1, got {budget}")
    from agent_kv.kv.policies import POLICIES  # torch: after the cheap checks

    jobs = []
    for task in tasks:
        for policy in dict.fromkeys(policies):
            cls = POLICIES[base_policy(policy)]
            if cls.manages_precision:
                precision = cls.quantized
            else:
                precision = "int8" if int8 and policy != "full" else "fp"
            sizes = dict.fromkeys(budgets) if cls.takes_budget else [None]
            for agent in dict.fromkeys(agents):
                jobs.extend(Job(task.task_id, policy, b, precision, agent) for b in sizes)
    return jobs


def full_job(task_id: int, agent: str = "text") -> Job:
    """The full-KV job of a task and agent: the reference of the agreement of every other
    job of that agent."""
    return Job(task_id, "full", None, "fp", agent)


def read_results(path: Path) -> list[dict[str, Any]]:
    """The records of a results.jsonl, the last one per job key, in file order, in the
    current field names (a record written with the old ones is read too:
    `agent_kv.renamed_fields`). A truncated last line (a sweep killed mid-write) is ignored;
    a missing file is no records."""
    records: dict[tuple, dict[str, Any]] = {}
    if not path.exists():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = current_names(json.loads(line))
            records[record_key(record)] = record
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return list(records.values())


def error_record(error: str) -> dict[str, Any]:
    """The record of a job that raised instead of returning a summary."""
    return {
        "success": False,
        "score": 0.0,
        "end_reason": "error",
        "error": error,
        "steps": 0,
        "peak_kv_allocated_bytes": None,
        "decode_tokens_per_s": [],
    }


def _finish(job: Job, fields: dict[str, Any]) -> dict[str, Any]:
    """The record: the runner's fields with the job's key fields put first (and winning)."""
    record = {"task_id": job.task_id, "policy": job.policy, "budget": job.budget}
    record["precision"], record["agent"] = job.precision, job.agent
    record.update({k: v for k, v in fields.items() if k not in record})
    return record


def _run_job(
    runner: Runner, task: Task, job: Job, trace_dir: Path, on_step: Callable[[int], None]
) -> dict[str, Any]:
    """Run one job (`on_step`: see `Runner.__call__`), turning any exception into an error
    record."""
    try:
        fields = runner(task, job, trace_dir, on_step)
    except Exception as err:  # noqa: BLE001 - a sweep records every failure and goes on
        last = traceback.format_exception_only(err)[-1].strip()
        fields = error_record(last)
    return _finish(job, fields)


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
        job = _job_of(record)
        self.finished += 1
        outcome = "error" if record.get("end_reason") == "error" else record.get("success")
        self._show(f"{job.name}: {outcome}", self.max_steps - self.counted.pop(job.key, 0))

    def _show(self, latest: str, advance: int) -> None:
        self.bar.set_postfix_str(f"{self.finished}/{self.episodes} episodes; {latest}")
        self.bar.update(advance)


def _check_settings(out: Path, settings: BenchSettings) -> None:
    """Record the sweep's episode settings in `out/settings.json`, or check them against
    those recorded by an earlier run (ConfigError when they differ)."""
    path = out / SETTINGS
    current = dataclasses.asdict(settings)
    if path.exists():
        # a setting added since the sweep was recorded had its default then
        recorded = {
            **dataclasses.asdict(BenchSettings()),
            **LEGACY_SETTINGS,
            **json.loads(path.read_text("utf-8")),
        }
        if recorded["model"] is None:
            recorded["model"] = LEGACY_DEFAULT_MODEL
        changed = sorted(key for key in current if recorded.get(key) != current[key])
        if changed:
            diffs = ", ".join(f"{k} {recorded.get(k)!r} -> {current[k]!r}" for k in changed)
            raise ConfigError(
                f"{out} holds a sweep run with other settings ({diffs}); resume it with the "
                "same settings or use another --out"
            )
        return
    path.write_text(json.dumps(current, indent=2) + "\n", encoding="utf-8")


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
        jobs: see `make_jobs`.
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
            not be compared with these), or Ray cannot be reached (see `ray_session`).
        AgentKVError, ChromiumNotFoundError: a runner cannot start (no model, no
            browser), or a Ray worker died while starting one.
    """
    from tqdm import tqdm

    settings = settings or BenchSettings()
    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out, settings)
    results = out / RESULTS
    done = {
        record_key(r)
        for r in read_results(results)
        if not (retry_errors and r.get("end_reason") == "error")
    }
    by_id = {task.task_id: task for task in tasks}
    pending = sorted((job for job in jobs if job.key not in done), key=lambda j: j.policy != "full")
    written: list[dict[str, Any]] = []
    if len(jobs) > len(pending):
        tqdm.write(f"skipping {len(jobs) - len(pending)} episodes already in {results}", sys.stderr)
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
                _run_on_ray(runner or RayActors(), settings, work, write, steps.step)
            else:
                runner.start({site for task, _, _ in work for site in task.sites})
                _run_in_process(runner, work, write, steps.step, settings.episodes_per_engine)
        finally:
            bar.close()
    return written


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
    (`_next_ready`); the episodes' steps are queued and passed on while this thread waits
    for a finished episode (at most `STEP_POLL_S` at a time), so a job's steps all reach
    `report` before its record reaches `write`.
    """
    if at_once == 1:
        for task, job, trace_dir in work:
            write(_run_job(runner, task, job, trace_dir, functools.partial(report, job)))
        return
    from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

    steps: queue.SimpleQueue[tuple[Job, int]] = queue.SimpleQueue()
    waiting = deque(work)
    references = {(job.task_id, job.agent) for _, job, _ in work if job.policy == "full"}
    running: dict[Future, Job] = {}
    with ThreadPoolExecutor(at_once, thread_name_prefix="agent-kv-episode") as pool:
        try:
            while waiting or running:
                while len(running) < at_once and (item := _next_ready(waiting, references)):
                    task, job, trace_dir = item
                    on_step = functools.partial(_queue_step, steps, job)
                    running[pool.submit(_run_job, runner, task, job, trace_dir, on_step)] = job
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


def check_ray_address(address: str) -> None:
    """Check that `address` names a Ray cluster that accepts connections: `auto` (the
    cluster `ray start` runs on this machine, which Ray looks up itself), `HOST:PORT` (the
    head node's GCS, port 6379 unless set otherwise) or `ray://HOST:PORT` (Ray Client).
    Ray itself waits minutes for a GCS that does not answer; this takes at most
    `CONNECT_TIMEOUT_S`.

    Raises:
        ConfigError: a malformed address, or nothing accepts a connection there.
    """
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"--ray-address must be auto, HOST:PORT or ray://HOST:PORT, got {address!r}"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), CONNECT_TIMEOUT_S).close()
    except OSError as err:
        raise ConfigError(f"no Ray cluster answers at {address}: {err.strerror or err}") from None


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int = 1) -> Iterator[None]:
    """Be connected to Ray inside the block.

    A connection this process already has is used as it is (and kept). Otherwise, with an
    `address` (see `check_ray_address`), that cluster is joined and left at the end; without
    one, a local Ray instance is started and shut down at the end: `num_cpus` logical CPUs
    (one per actor), no dashboard, an object store of `RAY_OBJECT_STORE_BYTES`, the
    workers' output kept out of this process's stderr, Ray's own messages below ERROR
    hidden, and its session files (logs, sockets) in a temporary directory under the system
    temp dir (short enough for Unix socket paths), removed at the end.

    Raises:
        ConfigError: Ray cannot connect to `address`.
    """
    import ray

    if ray.is_initialized():
        yield
        return
    options: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "logging_level": logging.ERROR,
    }
    temp_dir = None
    if address is None:
        temp_dir = tempfile.mkdtemp(prefix="agent-kv-ray-")
        options.update(
            num_cpus=num_cpus, object_store_memory=RAY_OBJECT_STORE_BYTES, _temp_dir=temp_dir
        )
    try:
        try:
            ray.init("local" if address is None else address, **options)
        except (ConnectionError, ValueError) as err:
            raise ConfigError(f"cannot connect to Ray at {address}: {err}") from None
        try:
            yield
        finally:
            ray.shutdown()
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


class _RunnerHost:
    """The state of one Ray actor: the runner `factory(settings)` builds, and the queue
    (`ray.util.queue.Queue`) its episodes report their steps to, as `(job, n)`."""

    def __init__(self, factory: RunnerFactory, settings: BenchSettings, steps):
        self.runner = factory(settings)
        self.steps = steps

    def start(self, sites: Iterable[str]) -> None:
        self.runner.start(sites)

    def run(self, task: Task, job: Job, trace_dir: Path) -> dict[str, Any]:
        return _run_job(self.runner, task, job, trace_dir, functools.partial(self._report, job))

    def _report(self, job: Job, step: int) -> None:
        """Queue a step for the driver; progress only, so a queue that is gone loses the
        report, never the episode."""
        from ray.exceptions import RayError

        try:
            self.steps.put_nowait((job, step))
        except RayError:
            pass

    def close(self) -> None:
        self.runner.close()


def _ray_error(err: Exception) -> str:
    """An error record's text for a Ray failure: its type and message on one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _next_ready(
    queue: deque[tuple[Task, Job, Path]], references: set[tuple[int, str]]
) -> tuple[Task, Job, Path] | None:
    """Take the first queued work item whose task's full-KV episode of its agent (the
    reference its agreement replays) is not still to run: a `full` job, or one whose
    (task, agent) is not in `references`. None when every queued item waits for one."""
    for item in queue:
        job = item[1]
        if job.policy == "full" or (job.task_id, job.agent) not in references:
            queue.remove(item)
            return item
    return None


def _run_on_ray(
    actors: RayActors,
    settings: BenchSettings,
    work: list[tuple[Task, Job, Path]],
    write: Callable[[dict[str, Any]], None],
    report: StepReport,
) -> None:
    """Run `work` (task, job, trace directory) on `actors.count` Ray actors (no more than
    there are jobs), each running up to `settings.episodes_per_engine` episodes at a time (a
    threaded actor: `max_concurrency`), calling `write` with each record as its episode
    finishes and `report` with each agent step while the episodes run. A job whose task's
    full-KV episode is still to run waits for it (`_next_ready`).

    The actors put their episodes' steps on one `ray.util.queue.Queue` (an actor of its
    own, asking for no CPU); the driver waits for a finished episode at most `STEP_POLL_S`
    at a time and passes on what the queue holds after each wait, so a job's steps all
    reach `report` before its record reaches `write` (they were queued before it
    returned). Progress is best effort: a queue that is gone loses steps, never episodes.

    Every actor starts its runner first, for the sites of all the jobs, so that a missing
    model or browser stops the sweep at once. An actor whose process dies mid-sweep gets
    an error record for each episode it was running and is replaced by one fresh actor (its
    runner starts on its first job) while jobs remain. `ray.util.ActorPool` is not used: it
    hands a dead actor the next job and does not say which job a failed result belonged
    to.
    """
    import ray
    from ray.exceptions import RayActorError, RayError, RayTaskError
    from ray.util.queue import Queue

    count = min(actors.count, len(work))
    places = settings.episodes_per_engine  # episodes an actor runs at once
    env_vars = {}  # a joined cluster's workers do not inherit this process's environment
    if os.environ.get(thread_setting.ENV):
        env_vars[thread_setting.ENV] = os.environ[thread_setting.ENV]
    options: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0, "max_task_retries": 0}
    if places > 1:
        options["max_concurrency"] = places
    host = ray.remote(**options)(_RunnerHost)
    if env_vars:
        host = host.options(runtime_env={"env_vars": env_vars})
    with ray_session(actors.address, count):
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < count:
            raise ConfigError(
                f"the Ray cluster has {cpus:g} CPUs; {count} actors need 1 each: "
                "ask for fewer actors (--workers)"
            )
        steps = Queue(actor_options={"num_cpus": 0})
        live = [host.remote(actors.factory, settings, steps) for _ in range(count)]
        try:
            sites = sorted({site for task, _, _ in work for site in task.sites})
            try:
                ray.get([actor.start.remote(sites) for actor in live])
            except RayTaskError as err:
                raise err.cause from None
            except RayActorError as err:
                raise AgentKVError(
                    f"a Ray worker died while starting its runner: {_ray_error(err)}"
                ) from None
            waiting = deque(work)
            idle = [actor for _ in range(places) for actor in live]  # one per free place
            running: dict[ray.ObjectRef, tuple[Job, Any]] = {}
            references = {(job.task_id, job.agent) for _, job, _ in work if job.policy == "full"}
            while waiting or running:
                while idle and (item := _next_ready(waiting, references)) is not None:
                    actor = idle.pop()
                    task, job, trace_dir = item
                    running[actor.run.remote(task, job, trace_dir)] = (job, actor)
                done, _ = ray.wait(list(running), num_returns=1, timeout=STEP_POLL_S)
                _drain_steps(steps, report)
                if not done:
                    continue
                ready = done[0]
                job, actor = running.pop(ready)
                if job.policy == "full":
                    references.discard((job.task_id, job.agent))
                try:
                    record = ray.get(ready)
                except RayActorError as err:  # its process died (or cannot be reached)
                    record = _finish(job, error_record(_ray_error(err)))
                    if actor in live:  # the first of its episodes to fail: replace it once
                        ray.kill(actor)
                        live.remove(actor)
                        idle = [other for other in idle if other is not actor]
                        if waiting:
                            actor = host.remote(actors.factory, settings, steps)
                            live.append(actor)
                            idle += [actor] * places
                except RayError as err:  # the call failed in Ray (e.g. a record it cannot send)
                    record = _finish(job, error_record(_ray_error(err)))
                    if actor in live:
                        idle.append(actor)
                else:
                    if actor in live:
                        idle.append(actor)
                write(record)
            ray.get([actor.close.remote() for actor in live])
        finally:
            for actor in live:
                ray.kill(actor)
            steps.shutdown(force=True)


def _drain_steps(steps, report: StepReport) -> None:
    """Pass the `(job, n)` steps queued on `steps` (a `ray.util.queue.Queue`) to `report`,
    in order; nothing when the queue is gone (see `_run_on_ray`)."""
    from ray.exceptions import RayError

    try:
        size = steps.qsize()
        reports = steps.get_nowait_batch(size) if size else []
    except RayError:
        return
    for job, step in reports:
        report(job, step)


def _job_of(record: dict[str, Any]) -> Job:
    return Job(*record_key(record))


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, budget, precision, agent), `full` first, then by policy, budget
    and agent, of records in the current field names (`read_results`). Each row is compared
    with the full-KV episodes of its own agent.

    Row fields: `policy`, `budget` (None for full), `precision`, `agent`, `episodes`,
    `errors`, `success_rate` (errors count as failures) and `success_ci95` (its Wilson 95%
    interval, `intervals.success_interval`), `success_minus_full` (this row's success rate
    minus full KV's on the tasks both ran) and `success_minus_full_ci95` (its paired
    bootstrap 95% interval over those tasks, `intervals.paired_difference_interval`; None
    for full KV itself or under two common tasks), `relative_success` (this row's
    success rate over full KV's on the tasks both ran; None without a full run or when full never
    succeeded), `peak_kv_mb` (mean peak allocated KV bytes / 1e6 over episodes that report
    them), `peak_kv_live_mb` (the same for the peak live bytes), `peak_cold_kv_mb` (mean
    peak bytes of the cold tier, 0 without recall; never counted in the others),
    `reduction_vs_full` (mean peak bytes of full over mean peak bytes of this row, on the
    tasks both ran with a peak), `mean_steps`, `decode_tokens_per_s` (mean over every decode
    turn of every episode), `reference_accuracy` (reference steps whose action was the
    model's greedy choice over all reference steps replayed; None when none was) and
    `reference_steps`, `full_success_rate` (full KV's success on the tasks both ran; None
    without them), and agreement with full KV over every compared step of the row's
    episodes: `agreement` (share of steps whose own action equals full KV's), `mean_kl`
    (KL(full || policy), nats, mean over steps) and `agreement_steps` (None / 0 when no
    step was compared).
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        _, *setting = record_key(record)
        groups.setdefault(tuple(setting), []).append(record)
    rows = []
    for (policy, budget, precision, agent), group in groups.items():
        full = {r["task_id"]: r for r in groups.get(("full", None, "fp", agent), [])}
        common = [r for r in group if r["task_id"] in full]
        ours = [float(bool(r.get("success"))) for r in common]
        theirs = [float(bool(full[r["task_id"]].get("success"))) for r in common]
        is_full = policy == "full"
        full_rate = _mean(theirs)  # None without common tasks
        relative = _mean(ours) / full_rate if full_rate else None
        peaks = [
            (full[r["task_id"]]["peak_kv_allocated_bytes"], r["peak_kv_allocated_bytes"])
            for r in common
            if r.get("peak_kv_allocated_bytes")
            and full[r["task_id"]].get("peak_kv_allocated_bytes")
        ]
        reduction = None
        if peaks:
            reduction = _mean(p[0] for p in peaks) / _mean(p[1] for p in peaks)
        ref_steps = sum(r.get("reference_steps") or 0 for r in group)
        ref_hits = sum(r.get("reference_hits") or 0 for r in group)
        ref_tokens = sum(r.get("reference_tokens") or 0 for r in group)
        ref_nll = sum(
            (r.get("reference_nll") or 0) * (r.get("reference_tokens") or 0) for r in group
        )
        compared = sum(r.get("steps_compared") or 0 for r in group)
        agreed = sum((r.get("agreement") or 0) * (r.get("steps_compared") or 0) for r in group)
        kl = sum((r.get("mean_kl") or 0) * (r.get("steps_compared") or 0) for r in group)
        peak = _mean(
            r["peak_kv_allocated_bytes"] for r in group if r.get("peak_kv_allocated_bytes")
        )
        live = _mean(r["peak_kv_live_bytes"] for r in group if r.get("peak_kv_live_bytes"))
        cold = _mean(r.get("peak_cold_kv_bytes") or 0 for r in group)
        rows.append(
            {
                "policy": policy,
                "budget": budget,
                "precision": precision,
                "agent": agent,
                "episodes": len(group),
                "errors": sum(r.get("end_reason") == "error" for r in group),
                "success_rate": _mean(float(bool(r.get("success"))) for r in group),
                "success_ci95": success_interval(
                    sum(bool(r.get("success")) for r in group), len(group)
                ),
                "success_minus_full": None
                if is_full or full_rate is None
                else _mean(ours) - full_rate,
                "success_minus_full_ci95": None
                if is_full
                else paired_difference_interval(ours, theirs),
                "relative_success": relative,
                "peak_kv_mb": None if peak is None else peak / 1e6,
                "peak_kv_live_mb": None if live is None else live / 1e6,
                "peak_cold_kv_mb": None if cold is None else cold / 1e6,
                "reduction_vs_full": reduction,
                "mean_steps": _mean(r.get("steps") or 0 for r in group),
                "decode_tokens_per_s": _mean(
                    rate for r in group for rate in r.get("decode_tokens_per_s") or []
                ),
                "reference_accuracy": ref_hits / ref_steps if ref_steps else None,
                "reference_steps": ref_steps,
                "reference_nll": ref_nll / ref_tokens if ref_tokens else None,
                "full_success_rate": full_rate,
                "agreement": agreed / compared if compared else None,
                "mean_kl": kl / compared if compared else None,
                "agreement_steps": compared,
            }
        )
    from agent_kv.kv.policies import POLICIES

    order = {name: i for i, name in enumerate(POLICIES)}
    rows.sort(
        key=lambda r: (
            r["policy"] != "full",
            order.get(base_policy(r["policy"]), len(order)),
            r["policy"],
            r["budget"] or 0,
            r["precision"],
            r["agent"] != "text",
        )
    )
    return rows


def row_label(row: dict[str, Any]) -> str:
    """'conf-kv 512', 'conf-kv 512 int8', 'full', 'full tools' (the tool-calling agent)."""
    label = row["policy"] if row["budget"] is None else f"{row['policy']} {row['budget']}"
    if row["precision"] != "fp":
        label = f"{label} {row['precision']}"
    return label if row.get("agent", "text") == "text" else f"{label} {row['agent']}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def _percent_interval(interval: tuple[float, float] | None, signed: bool = False) -> str:
    """' (48-78%)' or ' (-12 to +3 points)'; '' for None."""
    if interval is None:
        return ""
    low, high = (round(100 * bound) for bound in interval)
    return f" ({low:+d} to {high:+d} points)" if signed else f" ({low}-{high}%)"


def _minus_full(row: dict[str, Any]) -> str:
    """The *minus full* cell: the difference in points with its paired interval."""
    if row.get("success_minus_full") is None:
        return "–"
    points = round(100 * row["success_minus_full"])
    return f"{points:+d}{_percent_interval(row.get('success_minus_full_ci95'), signed=True)}"


def _relative(row: dict[str, Any]) -> str:
    """The *vs full* cell: the ratio, or why there is none."""
    if row["relative_success"] is not None:
        return f"{row['relative_success']:.2f}"
    if row["full_success_rate"] == 0:
        return "n/a (full KV solved none)"
    return "n/a (no full KV run)"


def _agreement_cell(row: dict[str, Any]) -> str:
    """The *agreement* cell: the share and its step count, '–' for full KV itself."""
    if row["agreement"] is None:
        return "–"
    steps = row["agreement_steps"]
    return f"{row['agreement']:.0%} ({steps} step{'s' if steps != 1 else ''})"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `aggregate` as a markdown table."""
    header = (
        "| policy | budget | precision | agent | episodes | errors | success (95% CI) | "
        "minus full (95% CI) | vs full | "
        "peak KV (MB) | live KV (MB) | cold KV (MB) | reduction vs full | agreement | "
        "KL vs full | steps | "
        "decode tok/s | ref. action acc. | ref. NLL |"
    )
    lines = [header, "|" + "|".join([" --- "] * (header.count("|") - 1)) + "|"]
    for r in rows:
        ref = _fmt(r["reference_accuracy"], ".0%")
        if r["reference_accuracy"] is not None:
            steps = r["reference_steps"]
            ref += f" ({steps} step{'s' if steps != 1 else ''})"
        cells = [
            r["policy"],
            "–" if r["budget"] is None else str(r["budget"]),
            r["precision"],
            r["agent"],
            str(r["episodes"]),
            str(r["errors"]),
            _fmt(r["success_rate"], ".0%") + _percent_interval(r.get("success_ci95")),
            _minus_full(r),
            _relative(r),
            _fmt(r["peak_kv_mb"], ".1f"),
            _fmt(r.get("peak_kv_live_mb"), ".1f"),
            _fmt(r.get("peak_cold_kv_mb"), ".1f"),
            _fmt(r["reduction_vs_full"], ".2f", "x"),
            _agreement_cell(r),
            _fmt(r["mean_kl"], ".3f"),
            _fmt(r["mean_steps"], ".1f"),
            _fmt(r["decode_tokens_per_s"], ".1f"),
            ref,
            _fmt(r["reference_nll"], ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_vs_memory(rows: list[dict[str, Any]], path: Path, metric: str, what: str) -> None:
    """Write a PNG: `metric` (a share, 0-1, plotted in %) against mean peak allocated KV
    memory (MB), one point per row, named in the legend with its episode count (points often
    coincide: equal budgets, or no success anywhere); rows without a peak or without the
    metric are left out. The success rate is drawn with its 95% interval (`success_ci95`) as
    an error bar, and full KV's rate as a dashed line across the plot.

    Args:
        rows: `aggregate`'s rows.
        path: the PNG to write.
        metric: the row field plotted ("success_rate", "agreement").
        what: its name on the axis and in the title ("success rate").
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for row in rows:
            if row["peak_kv_mb"] is None or row[metric] is None:
                continue
            x, y = row["peak_kv_mb"], row[metric] * 100
            marker = "s" if row["policy"] == "full" else "o"
            label = f"{row_label(row)}: {x:.1f} MB, {y:.0f}% (n={row['episodes']})"
            interval = row.get("success_ci95") if metric == "success_rate" else None
            spread = None
            if interval is not None:
                spread = [[y - interval[0] * 100], [interval[1] * 100 - y]]
            points = ax.errorbar(
                [x], [y], yerr=spread, fmt=marker, ms=6, alpha=0.8, capsize=3, label=label
            )
            if row["policy"] == "full":
                ax.axhline(y, ls="--", lw=1, color=points[0].get_color(), alpha=0.6)
        if ax.containers:
            ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("mean peak KV memory, allocated (MB)")
        ax.set_ylabel(f"{what} (%)")
        ax.set_ylim(-5, 105)
        ax.set_title(f"{what[0].upper()}{what[1:]} vs KV memory")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def _outcome(record: dict[str, Any]) -> str:
    if record.get("end_reason") == "error":
        return "error"
    return "✓" if record.get("success") else f"✗ {record.get('end_reason', '')}".strip()


MODES = {
    "free": "free navigation",
    "scripted": "scripted navigation, free answer",
}
"""`BenchSettings.mode` -> the name every table of its sweep carries."""


def _recorded_mode(out: Path) -> str:
    """The mode of the sweep in `out` (its settings.json; "free" when none is recorded)."""
    path = out / SETTINGS
    if not path.exists():
        return "free"
    return json.loads(path.read_text(encoding="utf-8")).get("mode", "free")


def per_task_table(records: list[dict[str, Any]], out: Path) -> str:
    """Markdown: one row per task, one column per policy setting; each cell the episode's
    outcome (✓, ✗ and its end reason, or error), linked to its rendered trace when there is
    one (`traces/<job>/trace.html`, relative to `out`)."""
    labels: dict[tuple, str] = {}
    cells: dict[int, dict[tuple, str]] = {}
    for record in records:
        task_id, *setting = record_key(record)
        column = tuple(setting)
        labels[column] = row_label(dict(zip(SETTING_FIELDS, setting, strict=True)))
        text = _outcome(record)
        page = Path(record.get("trace_dir") or "") / "trace.html"
        if record.get("trace_dir") and page.is_file():
            link = os.path.relpath(page, out.resolve())
            text = f"[{text}]({link})"
        cells.setdefault(task_id, {})[column] = text
    columns = sorted(labels, key=lambda c: (c[0] != "full", labels[c]))
    lines = [
        "| task | " + " | ".join(labels[c] for c in columns) + " |",
        "|" + "|".join([" --- "] * (len(columns) + 1)) + "|",
    ]
    for task_id in sorted(cells):
        row = [cells[task_id].get(c, "") for c in columns]
        lines.append(f"| {task_id} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def recall_table(records: list[dict[str, Any]]) -> str:
    """Markdown: recall-suite success per policy setting (rows) and k, the pages between the
    fact and the question (columns), each cell `solved/tasks`, followed, where the records
    carry `full_kv_allocated_bytes`, by the mean KV reduction of those tasks against a full
    cache of the same history (`full_kv_allocated_bytes / peak_kv_allocated_bytes`: a full-KV
    row past the model's context stops at the overflow, so the reduction is taken against the
    history itself, not against full KV's record). Two last columns compare each row with full
    KV on the tasks full KV solved: how many of them the row solved too, and the smallest k
    among those it lost ("–" when it lost none, or when there is no full-KV row). Empty when
    no record has a `k` (a free-navigation sweep)."""
    recall = [r for r in records if r.get("k") is not None]
    if not recall:
        return ""
    ks = sorted({r["k"] for r in recall})
    rows: dict[tuple, dict[int, list[dict[str, Any]]]] = {}
    for record in recall:
        _, *setting = record_key(record)
        rows.setdefault(tuple(setting), {}).setdefault(record["k"], []).append(record)
    solved_by_full = {r["task_id"] for r in recall if r["policy"] == "full" and r.get("success")}
    lines = [
        "| policy | "
        + " | ".join(f"k={k}" for k in ks)
        + " | of full KV's solved | first k lost |",
        "|" + "|".join([" --- "] * (len(ks) + 3)) + "|",
    ]
    order = {row_label(r): i for i, r in enumerate(aggregate(recall))}
    labelled = {
        row_label(dict(zip(SETTING_FIELDS, setting, strict=True))): cells
        for setting, cells in rows.items()
    }
    for label in sorted(labelled, key=order.get):
        cells = labelled[label]
        done = [r for group in cells.values() for r in group if r["task_id"] in solved_by_full]
        lost = sorted(r["k"] for r in done if not r.get("success"))
        kept = f"{len(done) - len(lost)}/{len(done)}" if done else "–"
        lines.append(
            f"| {label} | "
            + " | ".join(_recall_cell(cells.get(k, [])) for k in ks)
            + f" | {kept} | {lost[0] if lost else '–'} |"
        )
    return "\n".join(lines)


def _recall_cell(records: list[dict[str, Any]]) -> str:
    """`solved/tasks`, and ` (N.Nx)`: the mean reduction vs a full cache of the same history
    over the records that report both byte counts (see `recall_table`)."""
    if not records:
        return ""
    cell = f"{sum(bool(r.get('success')) for r in records)}/{len(records)}"
    ratios = [
        r["full_kv_allocated_bytes"] / r["peak_kv_allocated_bytes"]
        for r in records
        if r.get("full_kv_allocated_bytes") and r.get("peak_kv_allocated_bytes")
    ]
    return f"{cell} ({_mean(ratios):.1f}x)" if ratios else cell


def write_report(out: Path) -> str:
    """Aggregate `out/results.jsonl` into `out/summary.md` (the policy table, then the
    per-task table linking each episode's rendered trace, written here where missing; for a
    scripted sweep, success per k), `out/success_vs_memory.png` and, for a free-navigation
    sweep, `out/agreement_vs_memory.png`; return the policy table.

    Raises:
        OSError: the files cannot be written.
    """
    from agent_kv.harness.trace_view import TraceError, write_trace_html

    records = read_results(out / RESULTS)
    for record in records:
        trace = Path(record.get("trace_dir") or "")
        if record.get("trace_dir") and trace.is_dir() and not (trace / "trace.html").exists():
            with contextlib.suppress(TraceError):
                write_trace_html(trace)
    rows = aggregate(records)
    table = format_table(rows)
    mode = _recorded_mode(out)
    by_k = recall_table(records)
    by_k = (
        "## Success per k\n\nk is the pages between the fact and the question. Each cell is "
        "solved/tasks, with the mean reduction of peak allocated KV against a full cache of "
        "the same history; the last columns count the tasks full KV solved that the row "
        f"solved too, and the smallest k among those it lost.\n\n{by_k}\n\n"
        if by_k
        else ""
    )
    plots = f"![success vs memory]({PLOT})"
    if mode == "free":  # a scripted sweep has no agreement to plot
        plots += f"\n![agreement vs memory]({AGREEMENT_PLOT})"
    text = (
        f"# Sweep summary ({MODES[mode]})\n\n"
        f"{len(records)} episodes from `{RESULTS}`. "
        "Success counts errors as failures; *vs full* is the success rate relative to full "
        "KV on the same tasks; *peak KV* is the mean peak of the bytes the store's buffers "
        "held (allocated), *live KV* the mean peak of the live bytes; *reduction vs full* is "
        "full KV's mean peak allocated bytes over this row's, on the same tasks; *agreement* "
        "is the share of steps of full KV's trajectory, replayed teacher-forced under the "
        "policy, whose greedy constrained action equals full KV's; *KL vs full* the mean "
        "KL(full || policy) of the next-token distributions over those actions' tokens "
        "(nats); *ref. action acc.* is the share of reference steps whose action is the "
        "model's greedy choice under the policy (teacher-forced); *ref. NLL* is the "
        "reference actions' mean negative log-likelihood per token (nats; lower is "
        "better). *success (95% CI)* carries Wilson's 95% interval over the row's episodes; "
        "*minus full (95% CI)* is the row's success rate minus full KV's on the same tasks, in "
        "percentage points, with the 95% percentile-bootstrap interval of that paired "
        "difference, tasks resampled (`agent_kv.harness.intervals`).\n\n"
        f"{table}\n\n{plots}\n\n"
        f"{by_k}## Per task\n\nEach cell links the episode's trace.\n\n"
        f"{per_task_table(records, out)}\n"
    )
    (out / SUMMARY).write_text(text, encoding="utf-8")
    plot_vs_memory(rows, out / PLOT, "success_rate", "success rate")
    if mode == "free":
        plot_vs_memory(rows, out / AGREEMENT_PLOT, "agreement", "action agreement with full KV")
    return table


# --- the real runner --------------------------------------------------------------------


def reference_replay(task: Task, engine, env, config) -> dict[str, Any]:
    """Teacher-forced reference-action accuracy of `engine` (its model and policy) on `task`
    (method: the module docstring), each action written as the agent `config.agent` writes
    it (`action_formats`: the action text, or the call that makes it), pages truncated to
    `config.max_obs_tokens`, replies pinned as `config.pin_replies` says (an `AgentConfig`).

    Returns:
        `reference_steps` (actions replayed), `reference_hits` (steps whose action was the
        greedy choice), `reference_accuracy` (hits / steps, None for no step),
        `reference_matches` (per step, bool), `reference_tokens` (action tokens forced) and
        `reference_nll` (their mean negative log-likelihood, nats per token: finer than the
        accuracy, so it separates policies even where a small model gets no action right).

    Raises:
        playwright Error: the browser failed; ContextOverflowError: the replay outgrew the
        model's context; envs.browser_env.ActionError: a reference names no element of the
        page it is replayed on.
    """
    from agent_kv.harness.agent import add_observation, observation_role, open_conversation

    fmt = config.action_format
    chat = open_conversation(engine, task.intent, fmt)
    matches: list[bool] = []
    logprobs: list[float] = []
    previous: int | None = None
    observation = env.reset(task)
    for reference in task.reference_actions:
        role = observation_role(fmt, previous)
        add_observation(chat, observation["text"], task.intent, config, previous, role)
        previous = len(chat.messages) - 1
        concrete = env.concrete_action(reference)
        forced = chat.force_reply(fmt.reply(concrete), pin=reply_pin(config.pin_replies))
        matches.append(forced.greedy)
        logprobs += forced.logprobs
        result = env.step(concrete)
        if result.done:
            break
        observation = result.observation
    hits = sum(matches)
    return {
        "reference_steps": len(matches),
        "reference_hits": hits,
        "reference_accuracy": hits / len(matches) if matches else None,
        "reference_matches": matches,
        "reference_tokens": len(logprobs),
        "reference_nll": -sum(logprobs) / len(logprobs) if logprobs else None,
    }


class _Browser:
    """One browser of an `EpisodeRunner`: a `BrowserEnv` started, used and closed on one
    thread, as Playwright's sync API requires (it is bound to the thread that started it):
    the caller's own (`own_thread` False: a runner of one episode at a time), or a thread of
    this browser's own that runs what `run` hands it, whoever calls (`own_thread` True: a
    runner called from several threads, e.g. a threaded Ray actor's pool)."""

    def __init__(self, own_thread: bool):
        self.env = None
        self._own_thread = own_thread
        self._thread = None  # a one-thread ThreadPoolExecutor, started on first use
        self._opened_on: int | None = None  # the thread that started `env`

    def run(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on this browser's thread (blocking until it returns); its result, or its
        exception raised."""
        if not self._own_thread:
            return fn()
        if self._thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._thread = ThreadPoolExecutor(1, thread_name_prefix="agent-kv-browser")
        return self._thread.submit(fn).result()

    def open(self, servers, observation: str):
        """The browser env, started on `servers` if none runs (call on this browser's thread).

        Raises:
            ChromiumNotFoundError: no usable Chromium.
            AgentKVError: the env was started on another thread (a runner of one episode at
                a time called from several threads: build it with the sweep's settings).
        """
        from envs.browser_env import BrowserEnv

        if self.env is None:
            self.env = BrowserEnv(servers, observation=observation)
            self._opened_on = threading.get_ident()
        elif self._opened_on != threading.get_ident():
            raise AgentKVError(
                "this runner's browser was started on another thread; a runner called from "
                "several threads needs settings.episodes_per_engine > 1"
            )
        return self.env

    def drop(self) -> None:
        """Close the browser env, if any, ignoring errors: it may be broken (call on this
        browser's thread; the next `open` starts a fresh one)."""
        if self.env is not None:
            try:
                self.env.close()
            except Exception:  # noqa: BLE001 - it is already broken
                pass
            self.env = None

    def close(self) -> None:
        """Drop the env on its thread, then end the thread (a later `run` starts another)."""
        self.run(self.drop)
        if self._thread is not None:
            self._thread.shutdown()
            self._thread = None


class EpisodeRunner:
    """The real `Runner`: the sites the jobs' tasks need, the model, and one headless
    Chromium per episode it runs at once, started by `start` (or the first job) and reused (a
    browser that died is restarted for its next job). On Ray each actor builds its own from
    the sweep's settings.

    With `settings.episodes_per_engine` N > 1 it may be called from up to N threads at once:
    the episodes share the sites, the loaded model and one `BatchScheduler` over it (each
    job's engine a `ScheduledEngine` with the job's policy, its agreement replay's full KV
    too), so only the scheduler's thread runs the model and the episodes' forward calls are
    batched; each episode runs on the thread of one of N browsers (`_Browser`), and a
    browser that dies fails its own episode only. With N = 1 each job gets a plain `Engine`
    and runs on the caller's thread.

    Args:
        settings: episode settings.
    """

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self._servers = None
        self._loaded = None
        self._scheduler = None
        self._sites: set[str] = set()
        self._lock = threading.Lock()  # the servers, the model, the scheduler and `_busy`
        self._busy = 0  # episodes running now
        at_once = settings.episodes_per_engine
        self._browsers = [_Browser(own_thread=at_once > 1) for _ in range(at_once)]
        self._free: queue.SimpleQueue[_Browser] = queue.SimpleQueue()
        for browser in self._browsers:
            self._free.put(browser)

    def start(self, sites: Iterable[str] = ()):
        """Start what is not running yet, serving at least `sites` (the sites already served
        stay; a new one restarts the servers and the browsers, only while no episode runs),
        with a browser for each episode that may run at once (those not running one now);
        return the loaded model.

        Raises:
            ChromiumNotFoundError, AgentKVError: no usable Chromium or model; AgentKVError
                also for a new site while episodes run.
            KeyError: a site that is not bundled.
        """
        with self._lock:
            loaded = self._serve(sites)
        free = []
        while not self._free.empty():
            free.append(self._free.get())
        try:
            for browser in free:
                browser.run(functools.partial(browser.open, self._servers, self._observation))
        finally:
            for browser in free:
                self._free.put(browser)
        return loaded

    @property
    def _observation(self) -> str:
        return self.settings.observation

    def _serve(self, sites: Iterable[str]):
        """Start the sites (at least `sites`), the model and, for more than one episode at a
        time, the scheduler, if not running; return the loaded model. Called holding
        `_lock`.

        Raises:
            AgentKVError: `sites` needs a site not served while episodes run (restarting the
                servers would break them).
        """
        from agent_kv.runtime.model_loading import load_model
        from envs.server import SiteServers

        wanted = self._sites | set(sites)
        if self._servers is not None and wanted != self._sites:
            if self._busy:
                raise AgentKVError(
                    f"site(s) {', '.join(sorted(wanted - self._sites))} not served while "
                    "episodes run on the others: start the runner with every site first"
                )
            for browser in self._browsers:
                browser.run(browser.drop)
            self._servers.close()
            self._servers = None
        if self._servers is None:
            self._servers = SiteServers(sorted(wanted))
            self._sites = wanted
        if self._loaded is None:
            self._loaded = load_model(self.settings.model, self.settings.weights)
        if self._scheduler is None and self.settings.episodes_per_engine > 1:
            from agent_kv.kv.policies import make_policy
            from agent_kv.runtime.batch_scheduler import BatchScheduler
            from agent_kv.runtime.engine import Engine

            model, tokenizer = self._loaded.model, self._loaded.tokenizer
            shared = Engine(
                model, tokenizer, make_policy("full"), self.settings.prefill_chunk,
                share_prefixes=True,
            )  # fmt: skip
            self._scheduler = BatchScheduler(shared, max_batch=self.settings.episodes_per_engine)
        return self._loaded

    def _engine(self, spec):
        """A job's engine for the policy and store options of `spec` (a `PolicySpec`): over
        the shared scheduler when episodes run at once, else a plain `Engine`."""
        if self._scheduler is not None:
            from agent_kv.runtime.scheduled_engine import ScheduledEngine

            return ScheduledEngine.from_spec(spec, self._scheduler)
        from agent_kv.runtime.engine import Engine

        loaded = self._loaded
        return Engine.from_spec(spec, loaded.model, loaded.tokenizer, self.settings.prefill_chunk)

    def __call__(
        self, task: Task, job: Job, trace_dir: Path, on_step: Callable[[int], None]
    ) -> dict[str, Any]:
        """Run the episode (and the reference replay) of `job` on a free browser's thread,
        telling `on_step` each agent step as it ends; return the record fields. Waits for a
        free browser when `episodes_per_engine` episodes run already.

        Raises:
            AgentKVError, ChromiumNotFoundError, and whatever the episode raises.
        """
        from agent_kv.kv.policy_spec import PolicySpec

        spec = PolicySpec.parse(
            job.policy,
            job.budget,
            None,
            int8=job.precision == "int8",
            positions=self.settings.positions,
        )
        browser = self._free.get()
        try:
            with self._lock:
                self._serve(task.sites)
                self._busy += 1
            try:
                episode = functools.partial(self._episode, browser, spec, task, job, trace_dir)
                return browser.run(functools.partial(episode, on_step))
            finally:
                with self._lock:
                    self._busy -= 1
        finally:
            self._free.put(browser)

    def _episode(
        self,
        browser: _Browser,
        spec,
        task: Task,
        job: Job,
        trace_dir: Path,
        on_step: Callable[[int], None],
    ) -> dict[str, Any]:
        """`__call__`'s work, on `browser`'s thread."""
        from agent_kv.harness.agent import AgentConfig, run_episode

        env = browser.open(self._servers, self._observation)
        engine = self._engine(spec)
        model_name = self._loaded.name
        config = AgentConfig(
            max_steps=self.settings.max_steps,
            max_obs_tokens=self.settings.max_obs_tokens,
            constrain=self.settings.constrain,
            agent=job.agent,
            pin_replies=self.settings.pin_replies,
        )
        if self.settings.mode == "scripted":
            return self._recall(task, engine, browser, trace_dir, model_name, config, on_step)
        try:
            summary = run_episode(
                task, engine, env, trace_dir, model_name, config, lambda r: on_step(r["step"])
            ).summary()
        except BaseException:
            browser.drop()
            raise
        if summary["end_reason"] == "error" and "browser" in (summary["error"] or ""):
            browser.drop()
        if self.settings.agreement and job.policy != "full":
            summary.update(self._agreement(task, engine, config, trace_dir.parent))
        if self.settings.reference_accuracy and task.reference_actions:
            try:
                env = browser.open(self._servers, self._observation)
                summary.update(reference_replay(task, engine, env, config))
            except Exception as err:  # noqa: BLE001 - recorded, the episode stands
                summary["reference_error"] = traceback.format_exception_only(err)[-1].strip()
                browser.drop()
        return summary

    def _recall(
        self, task: Task, engine, browser: _Browser, trace_dir: Path, model: str, config, on_step
    ):
        """A recall task's record: scripted navigation, free answer (`scripted_episode`
        under `config`, an `AgentConfig`)."""
        from agent_kv.harness.recall import scripted_episode

        steps = self.settings.max_steps

        def on_page(number: int, pages: int) -> None:
            on_step(math.ceil(number * steps / pages))

        env = browser.open(self._servers, self._observation)
        try:
            return scripted_episode(task, engine, env, trace_dir, model, config, on_page)
        except BaseException:
            browser.drop()
            raise

    def _agreement(self, task: Task, engine, config, traces: Path) -> dict[str, Any]:
        """The agreement fields of `agreement_summary` for `engine` against the full-KV
        trace of the task and `config.agent` under `traces`, or `agreement_error` when there
        is none to replay. The full-KV side runs on the same model (through the scheduler
        when episodes run at once)."""
        from agent_kv.harness.agreement import agreement_summary, read_trajectory, replay_agreement
        from agent_kv.kv.policy_spec import PolicySpec

        reference = traces / full_job(task.task_id, config.agent).name
        try:
            trajectory = read_trajectory(reference)
            full = self._engine(PolicySpec.parse("full", None, None))
            return agreement_summary(
                replay_agreement(task.intent, trajectory, engine, full, config)
            )
        except Exception as err:  # noqa: BLE001 - recorded, the episode stands
            return {"agreement_error": traceback.format_exception_only(err)[-1].strip()}

    def close(self) -> None:
        """Close the browsers (each on its own thread) and the scheduler, and stop the sites
        (the model is left to the garbage collector)."""
        for browser in self._browsers:
            browser.close()
        with self._lock:
            if self._scheduler is not None:
                self._scheduler.close()
                self._scheduler = None
            if self._servers is not None:
                self._servers.close()
                self._servers = None
                self._sites = set()
