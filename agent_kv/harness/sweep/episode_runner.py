"""The real sweep runner, `EpisodeRunner`: the sites, the model and a headless Chromium per
episode it runs at once, and each job's episode with its two replays beside it.

**Agreement with full KV** (`agent_kv.harness.agreement`): every job but `full` also replays
its task's full-KV episode teacher-forced beside full KV and records how often its own
greedy, constrained action equals full KV's and the KL between their next-token
distributions; jobs are handed out so that a task's full-KV episode runs before the jobs
that replay it (`runner.next_ready`).

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
import functools
import math
import queue
import threading
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from agent_kv.errors import AgentKVError
from agent_kv.harness.agent import (
    AgentConfig,
    add_observation,
    observation_role,
    open_conversation,
    run_episode,
)
from agent_kv.harness.agreement import agreement_summary, read_trajectory, replay_agreement
from agent_kv.harness.decisions import DecisionRecorder, compare_decisions, read_decisions
from agent_kv.harness.reply_pins import reply_pin
from agent_kv.harness.scripted_episode import read_trace_pages, scripted_episode
from agent_kv.harness.sweep.settings import BenchSettings, Job, full_job
from agent_kv.kv.policies import make_policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.engine.batch_scheduler import BatchScheduler
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.scheduled_engine import ScheduledEngine
from agent_kv.runtime.models.model_loading import load_model
from envs.browser_env import BrowserEnv
from envs.server import SiteServers
from envs.tasks import Task


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
    fmt = config.action_format
    chat = open_conversation(
        engine, task.intent, fmt, page_pins=config.page_pins, pin_examples=config.pin_examples
    )
    matches: list[bool] = []
    logprobs: list[float] = []
    previous: int | None = None
    observation = env.reset(task)
    for reference in task.reference_actions:
        role = observation_role(fmt, previous)
        add_observation(chat, observation["text"], task.intent, config, role)
        previous = len(chat.messages) - 1
        concrete = env.concrete_action(reference)
        forced = chat.force_reply(
            fmt.reply(concrete, engine.tokenizer), pin=reply_pin(config.pin_replies)
        )
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
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="agent-kv-browser")
        return self._thread.submit(fn).result()

    def open(self, servers, observation: str):
        """The browser env, started on `servers` if none runs (call on this browser's thread).

        Raises:
            ChromiumNotFoundError: no usable Chromium.
            AgentKVError: the env was started on another thread (a runner of one episode at
                a time called from several threads: build it with the sweep's settings).
        """
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
            return ScheduledEngine.from_spec(spec, self._scheduler)
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
        env = browser.open(self._servers, self._observation)
        engine = self._engine(spec)
        model_name = self._loaded.name
        config = AgentConfig(
            max_steps=self.settings.max_steps,
            max_obs_tokens=self.settings.max_obs_tokens,
            constrain=self.settings.constrain,
            agent=job.agent,
            pin_replies=self.settings.pin_replies,
            page_pins=self.settings.page_pins,
            pin_examples=self.settings.pin_examples,
        )
        if self.settings.mode == "scripted":
            summary = self._recall(
                task, job, engine, browser, trace_dir, model_name, config, on_step
            )
            if self.settings.agreement and job.policy != "full":
                summary.update(self._decisions(task, trace_dir, config))
            return summary
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
        self,
        task: Task,
        job: Job,
        engine,
        browser: _Browser,
        trace_dir: Path,
        model: str,
        config,
        on_step,
    ):
        """A recall task's record: scripted navigation, free answer (`scripted_episode`
        under `config`, an `AgentConfig`), recording the model's own action at each step when
        the sweep compares decisions (a policy's against the full-KV run of the task beside
        `trace_dir`, whose pages and replies it then reads word for word: `run_recall_task`'s
        `reference`; none found leaves the comparison to report it). A full-KV run reads the
        pages and replies of the reference sweep's full-KV run of the task when the sweep
        names one (`BenchSettings.reference`): it then repeats that run token for token on
        unchanged code, where its own browser session would show other element ids and ports.

        Raises:
            FileNotFoundError: a full-KV run under a reference sweep without that task's run.
        """
        steps = self.settings.max_steps

        def on_page(number: int, pages: int) -> None:
            on_step(math.ceil(number * steps / pages))

        env = browser.open(self._servers, self._observation)
        decisions, pages = None, None
        full_dir = self._full_traces(trace_dir) / full_job(task.task_id, config.agent).name
        if job.policy == "full" and self.settings.reference is not None:
            pages = read_trace_pages(full_dir)
        if self.settings.agreement:
            reference = None
            if job.policy != "full":
                with contextlib.suppress(FileNotFoundError):
                    reference = read_decisions(full_dir)
                    pages = read_trace_pages(full_dir)
                reference = reference or []
            fact_page = task.facts[0].page if task.facts else None
            decisions = DecisionRecorder(config, fact_page, reference)
        try:
            return scripted_episode(
                task, engine, env, trace_dir, model, config, on_page, decisions, pages
            )
        except BaseException:
            browser.drop()
            raise

    def _full_traces(self, trace_dir: Path) -> Path:
        """Where the full-KV runs a scripted run's decisions compare with lie: the traces of
        the reference sweep (`BenchSettings.reference`), or those beside `trace_dir`."""
        if self.settings.reference is not None:
            return Path(self.settings.reference) / "traces"
        return trace_dir.parent

    def _decisions(self, task: Task, trace_dir: Path, config) -> dict[str, Any]:
        """The decision-agreement fields of `compare_decisions` for the scripted run in
        `trace_dir` against the full-KV run of the task and `config.agent` beside it, or
        `agreement_error` when there is none to compare with."""
        reference = self._full_traces(trace_dir) / full_job(task.task_id, config.agent).name
        try:
            return compare_decisions(trace_dir, reference)
        except Exception as err:  # noqa: BLE001 - recorded, the episode stands
            return {"agreement_error": traceback.format_exception_only(err)[-1].strip()}

    def _agreement(self, task: Task, engine, config, traces: Path) -> dict[str, Any]:
        """The agreement fields of `agreement_summary` for `engine` against the full-KV
        trace of the task and `config.agent` under `traces`, or `agreement_error` when there
        is none to replay. The full-KV side runs on the same model (through the scheduler
        when episodes run at once)."""
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
