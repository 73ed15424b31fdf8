"""A sweep on Ray: the actors that run its episodes, and the Ray session they run in.

Each actor is a Ray worker process holding its own runner (the model, headless Chromium and
the sites), running `BenchSettings.episodes_per_engine` episodes at a time (one by default);
the driver hands the next job to whichever actor has a free place and writes each record as
its episode finishes (`ray.wait`), so a slow episode holds up no other record. By default a
local Ray instance is started for the sweep and shut down after it (`ray_session`); an
existing cluster is joined by address. An actor whose worker process dies (killed, out of
memory, a crash in native code) makes its episode an error record; the actor is replaced by
a fresh one and the sweep goes on. Ray itself neither restarts actors nor retries their
calls (`max_restarts=0`, `max_task_retries=0`): a crash that killed a process would most
likely kill it again, and a silent retry would hide it (a process that dies takes every
episode it was running with it: each is an error record).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError, RayTaskError
from ray.util.queue import Queue

from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.harness.sweep.job_runs import (
    STEP_POLL_S,
    RayActors,
    RunnerFactory,
    StepReport,
    error_record,
    finish_record,
    next_ready,
    run_job,
)
from agent_kv.harness.sweep.settings import BenchSettings, Job
from agent_kv.runtime.models import threads as thread_setting
from envs.tasks import Task

RAY_OBJECT_STORE_BYTES = 100 * 2**20
"""Object store of a local Ray instance (bytes): jobs and records are small JSON-like
values, so Ray's default (30% of the memory) would only reserve shared memory."""


@contextlib.contextmanager
def ray_session(address: str | None = None, num_cpus: int = 1) -> Iterator[None]:
    """Be connected to Ray inside the block.

    A connection this process already has is used as it is (and kept). Otherwise, with an
    `address` (see `runner.check_ray_address`), that cluster is joined and left at the end;
    without one, a local Ray instance is started and shut down at the end: `num_cpus`
    logical CPUs (one per actor), no dashboard, an object store of `RAY_OBJECT_STORE_BYTES`,
    the workers' output kept out of this process's stderr, Ray's own messages below ERROR
    hidden, and its session files (logs, sockets) in a temporary directory under the system
    temp dir (short enough for Unix socket paths), removed at the end.

    Raises:
        ConfigError: Ray cannot connect to `address`.
    """
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
        return run_job(self.runner, task, job, trace_dir, functools.partial(self._report, job))

    def _report(self, job: Job, step: int) -> None:
        """Queue a step for the driver; progress only, so a queue that is gone loses the
        report, never the episode."""
        try:
            self.steps.put_nowait((job, step))
        except RayError:
            pass

    def close(self) -> None:
        self.runner.close()


def _ray_error(err: Exception) -> str:
    """An error record's text for a Ray failure: its type and message on one line."""
    return f"{type(err).__name__}: {' '.join(str(err).split())}"


def _actor_class(places: int):
    """`_RunnerHost` as a Ray actor class: 1 CPU, never restarted nor retried, `places`
    calls at once (a threaded actor when more than one), and this process's torch thread
    setting (a joined cluster's workers do not inherit this process's environment)."""
    options: dict[str, Any] = {"num_cpus": 1, "max_restarts": 0, "max_task_retries": 0}
    if places > 1:
        options["max_concurrency"] = places
    host = ray.remote(**options)(_RunnerHost)
    if os.environ.get(thread_setting.ENV):
        env_vars = {thread_setting.ENV: os.environ[thread_setting.ENV]}
        host = host.options(runtime_env={"env_vars": env_vars})
    return host


class _ActorPool:
    """The live actors of a Ray sweep and their free places (`idle`: an actor once per
    episode it may start now).

    Args:
        actors: where the sweep runs (the runner factory).
        settings: the episode settings each actor's runner is built with.
        steps: the queue the actors report their episodes' steps to.
        count: actors to start.
    """

    def __init__(self, actors: RayActors, settings: BenchSettings, steps, count: int):
        self._places = settings.episodes_per_engine  # episodes an actor runs at once
        self._host = _actor_class(self._places)
        self._new = functools.partial(self._host.remote, actors.factory, settings, steps)
        self.live = [self._new() for _ in range(count)]
        self.idle = [actor for _ in range(self._places) for actor in self.live]

    def start(self, sites: list[str]) -> None:
        """Start every actor's runner for `sites`.

        Raises:
            The error a runner's start raised (AgentKVError, ChromiumNotFoundError, ...);
            AgentKVError: a worker died while starting its runner.
        """
        try:
            ray.get([actor.start.remote(sites) for actor in self.live])
        except RayTaskError as err:
            raise err.cause from None
        except RayActorError as err:
            raise AgentKVError(
                f"a Ray worker died while starting its runner: {_ray_error(err)}"
            ) from None

    def result(self, ready, job: Job, actor, more_work: bool) -> dict[str, Any]:
        """The record of `job`, whose call `ready` on `actor` finished: its result, or an
        error record when the call failed. An actor whose process died is killed and left
        out, and replaced by a fresh one (its runner starts on its first job) when
        `more_work` waits; otherwise its place is free again."""
        try:
            record = ray.get(ready)
        except RayActorError as err:  # its process died (or cannot be reached)
            if actor in self.live:  # the first of its episodes to fail: replace it once
                self._replace(actor, more_work)
            return finish_record(job, error_record(_ray_error(err)))
        except RayError as err:  # the call failed in Ray (e.g. a record it cannot send)
            record = finish_record(job, error_record(_ray_error(err)))
        if actor in self.live:
            self.idle.append(actor)
        return record

    def _replace(self, actor, more_work: bool) -> None:
        ray.kill(actor)
        self.live.remove(actor)
        self.idle = [other for other in self.idle if other is not actor]
        if more_work:
            fresh = self._new()
            self.live.append(fresh)
            self.idle += [fresh] * self._places

    def close(self) -> None:
        """Close every live actor's runner."""
        ray.get([actor.close.remote() for actor in self.live])

    def kill(self) -> None:
        """End every live actor's process."""
        for actor in self.live:
            ray.kill(actor)


def run_on_ray(
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
    full-KV episode is still to run waits for it (`runner.next_ready`).

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

    Raises:
        ConfigError: Ray cannot be reached (`ray_session`), or the cluster has fewer CPUs
            than actors.
        AgentKVError, ChromiumNotFoundError: a runner cannot start (`_ActorPool.start`).
    """
    count = min(actors.count, len(work))
    with ray_session(actors.address, count):
        cpus = ray.cluster_resources().get("CPU", 0)
        if cpus < count:
            raise ConfigError(
                f"the Ray cluster has {cpus:g} CPUs; {count} actors need 1 each: "
                "ask for fewer actors (--workers)"
            )
        steps = Queue(actor_options={"num_cpus": 0})
        pool = _ActorPool(actors, settings, steps, count)
        try:
            pool.start(sorted({site for task, _, _ in work for site in task.sites}))
            _hand_out(pool, work, steps, write, report)
            pool.close()
        finally:
            pool.kill()
            steps.shutdown(force=True)


def _hand_out(
    pool: _ActorPool,
    work: list[tuple[Task, Job, Path]],
    steps,
    write: Callable[[dict[str, Any]], None],
    report: StepReport,
) -> None:
    """`run_on_ray`'s loop: hand each ready job to a free place of `pool`, pass on the
    steps queued on `steps`, and write each record as its episode finishes, until every
    job of `work` has its record."""
    waiting = deque(work)
    running: dict[ray.ObjectRef, tuple[Job, Any]] = {}
    references = {(job.task_id, job.agent) for _, job, _ in work if job.policy == "full"}
    while waiting or running:
        while pool.idle and (item := next_ready(waiting, references)) is not None:
            actor = pool.idle.pop()
            task, job, trace_dir = item
            running[actor.run.remote(task, job, trace_dir)] = (job, actor)
        done, _ = ray.wait(list(running), num_returns=1, timeout=STEP_POLL_S)
        _drain_steps(steps, report)
        if not done:
            continue
        job, actor = running.pop(done[0])
        if job.policy == "full":
            references.discard((job.task_id, job.agent))
        write(pool.result(done[0], job, actor, more_work=bool(waiting)))


def _drain_steps(steps, report: StepReport) -> None:
    """Pass the `(job, n)` steps queued on `steps` (a `ray.util.queue.Queue`) to `report`,
    in order; nothing when the queue is gone (see `run_on_ray`)."""
    try:
        size = steps.qsize()
        reports = steps.get_nowait_batch(size) if size else []
    except RayError:
        return
    for job, step in reports:
        report(job, step)
