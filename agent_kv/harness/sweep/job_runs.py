"""What runs a sweep's episodes, and one job run into its record: the `Runner` protocol (the
episodes in this process), `RayActors` (the episodes on Ray actors, each holding a runner,
at a cluster address `check_ray_address` checks), `run_job` (a runner's fields, or the
error it raised, as the job's record) and `next_ready` (which queued job may start: a
task's full-KV episode runs before the jobs that replay it)."""

from __future__ import annotations

import socket
import traceback
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from agent_kv.errors import ConfigError
from agent_kv.harness.sweep.settings import BenchSettings, Job
from envs.tasks import Task


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

CONNECT_TIMEOUT_S = 5.0
"""How long `check_ray_address` waits for a cluster to accept a connection (seconds)."""
STEP_POLL_S = 0.5
"""How often a sweep's driver collects the steps its episodes report while none finishes,
when several run at once, in threads of this process or on Ray actors (seconds)."""


def episode_runner(settings: BenchSettings) -> Runner:
    """The real runner, `EpisodeRunner(settings)`: the default `RayActors.factory`."""
    # torch and Playwright: imported where the runner is built (in the Ray actor), so that
    # choosing where a sweep runs imports neither
    from agent_kv.harness.sweep.episode_runner import EpisodeRunner

    return EpisodeRunner(settings)


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
            instance for the sweep (`ray_pool.ray_session`).
        factory: builds an actor's runner; it is sent to the workers, so it must be
            picklable (a module-level class or function, or a `functools.partial` of one).
    """

    count: int = 1
    address: str | None = None
    factory: RunnerFactory = episode_runner

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"RayActors.count must be >= 1, got {self.count}")


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


def finish_record(job: Job, fields: dict[str, Any]) -> dict[str, Any]:
    """The record: the runner's fields with the job's key fields put first (and winning)."""
    record = {"task_id": job.task_id, "policy": job.policy, "budget": job.budget}
    record["precision"], record["agent"] = job.precision, job.agent
    record.update({k: v for k, v in fields.items() if k not in record})
    return record


def run_job(
    runner: Runner, task: Task, job: Job, trace_dir: Path, on_step: Callable[[int], None]
) -> dict[str, Any]:
    """Run one job (`on_step`: see `Runner.__call__`), turning any exception into an error
    record."""
    try:
        fields = runner(task, job, trace_dir, on_step)
    except Exception as err:  # noqa: BLE001 - a sweep records every failure and goes on
        last = traceback.format_exception_only(err)[-1].strip()
        fields = error_record(last)
    return finish_record(job, fields)


def next_ready(
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
