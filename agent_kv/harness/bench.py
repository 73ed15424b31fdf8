"""Policy sweeps: run web tasks under several KV policies and budgets, and report success next
to memory.

    agent-kv bench --tasks classifieds --policies full,window,conf-kv --budgets 512,1024 \
        --out runs/sweep

One *job* is a task under one policy setting (policy, budget, precision); `full` runs once per
task, without a budget, always at full precision (it is the baseline every other row is
compared with). Each finished job appends one JSON line to `DIR/results.jsonl` (the episode
summary of `agent.run_episode` plus `policy`, `budget`, `precision` and, unless disabled, the
teacher-forced reference-action accuracy), flushed at once; a rerun skips the jobs already in
the file, so an interrupted sweep resumes. A job that raises (browser death, model error,
anything) is recorded with `end_reason: "error"` and the error text, and the sweep goes on.
At the end `DIR/summary.md` holds the table of `aggregate` and `DIR/success_vs_memory.png`
plots success rate against mean peak KV memory, one labelled point per row.

**Reference-action accuracy** (`reference_replay`): the task's `reference_actions` are
replayed in the browser; at each step the agent's prompt is built exactly as the agent builds
it (pinned system message and examples, the observation the browser now shows, pinned while
latest), the reference action is resolved to the page's element ids (`click [15]`, what the
model would have to emit) and teacher-forced as the reply with `Conversation.force_reply`: the
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

import dataclasses
import glob
import json
import math
import multiprocessing
import sys
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_kv.errors import ConfigError
from agent_kv.kv.policy_names import check_policy_name
from envs.tasks import Task, TaskError, load_suite, load_task, load_tasks, suite_names

RESULTS = "results.jsonl"
SUMMARY = "summary.md"
PLOT = "success_vs_memory.png"
SETTINGS = "settings.json"


@dataclass(frozen=True)
class Job:
    """One episode of a sweep.

    Attributes:
        task_id: the task.
        policy: a name of `agent_kv.kv.policies.POLICIES`.
        budget: unpinned tokens per layer (see `kv.policy_spec.PolicySpec`), None for `full`.
        precision: "fp"; "int8" for mixed precision (`--int8`); for a policy that quantizes
            by its own rule (ARKV's), its format ("fp8").
    """

    task_id: int
    policy: str
    budget: int | None
    precision: str = "fp"

    @property
    def key(self) -> tuple:
        """What identifies the job in results.jsonl."""
        return (self.task_id, self.policy, self.budget, self.precision)

    @property
    def name(self) -> str:
        """A file-name-safe label, e.g. 'task3-conf-kv-512-int8'."""
        parts = [f"task{self.task_id}", self.policy]
        if self.budget is not None:
            parts.append(str(self.budget))
        if self.precision != "fp":
            parts.append(self.precision)
        return "-".join(parts)


def record_key(record: dict[str, Any]) -> tuple:
    """The job key of a results.jsonl record."""
    return (
        record["task_id"],
        record["policy"],
        record.get("budget"),
        record.get("precision", "fp"),
    )


@dataclass
class BenchSettings:
    """Per-episode settings shared by every job of a sweep.

    Attributes:
        max_steps: actions before an episode is cut off.
        max_obs_tokens: observation text cap in tokens.
        prefill_chunk: tokens per prefill forward call.
        model: model directory or .gguf file, None for the bundled default.
        reference_accuracy: also replay each task's reference actions (see the module
            docstring); tasks without reference actions get none.
        observation: the browser's observation mode (`envs.browser_env.OBSERVATION_MODES`).
    """

    max_steps: int = 6
    max_obs_tokens: int = 1200
    prefill_chunk: int = 512
    model: str | None = None
    reference_accuracy: bool = True
    observation: str = "accessibility_tree"


Runner = Callable[[Task, Job, Path], dict[str, Any]]
"""Runs one job and returns its record fields (an episode summary); the trace goes under the
given directory. May raise: the sweep records the error."""


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
    tasks: Iterable[Task], policies: list[str], budgets: list[int], int8: bool = False
) -> list[Job]:
    """Every task under every (policy, budget): `full` (and `base-quant`, which takes no
    budget either) once per task with no budget; the others at each budget. `full` runs at
    full precision; with `int8` the others run in INT8 mixed precision, except the policies
    that quantize by their own rule (ARKV's), labelled with their default format (`fp8`).

    Raises:
        ValueError: an unknown policy, or a budget below 1.
    """
    for policy in policies:
        check_policy_name(policy)
    for budget in budgets:
        if budget < 1:
            raise ValueError(f"budgets must be >= 1, got {budget}")
    from agent_kv.kv.policies import POLICIES  # torch: after the cheap checks

    jobs = []
    for task in tasks:
        for policy in dict.fromkeys(policies):
            cls = POLICIES[policy]
            if cls.manages_precision:
                precision = cls.quantized
            else:
                precision = "int8" if int8 and policy != "full" else "fp"
            sizes = dict.fromkeys(budgets) if cls.takes_budget else [None]
            jobs.extend(Job(task.task_id, policy, b, precision) for b in sizes)
    return jobs


def read_results(path: Path) -> list[dict[str, Any]]:
    """The records of a results.jsonl, the last one per job key, in file order. A truncated
    last line (a sweep killed mid-write) is ignored; a missing file is no records."""
    records: dict[tuple, dict[str, Any]] = {}
    if not path.exists():
        return []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
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
        "peak_kv_bytes": None,
        "decode_tokens_per_s": [],
    }


def _finish(job: Job, fields: dict[str, Any]) -> dict[str, Any]:
    """The record: the runner's fields with the job's key fields put first (and winning)."""
    record = {"task_id": job.task_id, "policy": job.policy, "budget": job.budget}
    record["precision"] = job.precision
    record.update({k: v for k, v in fields.items() if k not in record})
    return record


def _run_job(runner: Runner, task: Task, job: Job, trace_dir: Path) -> dict[str, Any]:
    """Run one job, turning any exception into an error record."""
    try:
        fields = runner(task, job, trace_dir)
    except Exception as err:  # noqa: BLE001 - a sweep records every failure and goes on
        last = traceback.format_exception_only(err)[-1].strip()
        fields = error_record(last)
    return _finish(job, fields)


_WORKER_RUNNER: Runner | None = None


def _init_worker(runner: Runner) -> None:
    global _WORKER_RUNNER
    _WORKER_RUNNER = runner


def _run_in_worker(task: Task, job: Job, trace_dir: Path) -> dict[str, Any]:
    assert _WORKER_RUNNER is not None
    return _run_job(_WORKER_RUNNER, task, job, trace_dir)


def _check_settings(out: Path, settings: BenchSettings) -> None:
    """Record the sweep's episode settings in `out/settings.json`, or check them against
    those recorded by an earlier run (ConfigError when they differ)."""
    path = out / SETTINGS
    current = dataclasses.asdict(settings)
    if path.exists():
        recorded = json.loads(path.read_text(encoding="utf-8"))
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
    runner: Runner | None = None,
    workers: int = 1,
    settings: BenchSettings | None = None,
    progress: bool = True,
    retry_errors: bool = False,
) -> list[dict[str, Any]]:
    """Run the jobs not yet in `out/results.jsonl`, appending one record per finished job.

    Args:
        tasks: the tasks the jobs name.
        jobs: see `make_jobs`.
        out: the sweep directory (created); traces go under `out/traces/<job name>`.
        runner: runs one job (default: `EpisodeRunner(settings)`, a browser, the sites and
            the model, started on first use). With `workers > 1` it must be picklable: each
            worker process gets its own copy.
        workers: processes; 1 runs in this process.
        settings: episode settings for the default runner.
        progress: show a progress bar on stderr.
        retry_errors: also rerun jobs recorded with `end_reason: "error"`.

    Returns:
        The records written by this call, in completion order.

    Raises:
        OSError: `out` cannot be created or written.
        ConfigError: `out` holds a sweep run with other episode settings (its results could
            not be compared with these).
    """
    from tqdm import tqdm

    out.mkdir(parents=True, exist_ok=True)
    _check_settings(out, settings or BenchSettings())
    results = out / RESULTS
    done = {
        record_key(r)
        for r in read_results(results)
        if not (retry_errors and r.get("end_reason") == "error")
    }
    by_id = {task.task_id: task for task in tasks}
    pending = [job for job in jobs if job.key not in done]
    own_runner = runner is None
    if runner is None:
        runner = EpisodeRunner(settings or BenchSettings())
    written: list[dict[str, Any]] = []
    bar = tqdm(
        total=len(pending),
        file=sys.stderr,
        disable=not progress,
        unit="episode",
        dynamic_ncols=True,
    )
    if len(jobs) > len(pending):
        bar.write(f"skipping {len(jobs) - len(pending)} episodes already in {results}", sys.stderr)
    with results.open("a", encoding="utf-8") as handle:

        def write(record: dict[str, Any]) -> None:
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            written.append(record)
            outcome = "error" if record.get("end_reason") == "error" else record.get("success")
            bar.set_postfix_str(f"{_job_of(record).name}: {outcome}")
            bar.update(1)

        try:
            if workers <= 1:
                for job in pending:
                    write(_run_job(runner, by_id[job.task_id], job, out / "traces" / job.name))
            else:
                with ProcessPoolExecutor(
                    max_workers=workers,
                    mp_context=multiprocessing.get_context("spawn"),  # no forked torch/browser
                    initializer=_init_worker,
                    initargs=(runner,),
                ) as pool:
                    futures = {
                        pool.submit(
                            _run_in_worker, by_id[job.task_id], job, out / "traces" / job.name
                        ): job
                        for job in pending
                    }
                    for future in as_completed(futures):
                        job = futures[future]
                        try:
                            record = future.result()
                        except BrokenProcessPool as err:
                            record = _finish(job, error_record(f"worker process died: {err}"))
                        write(record)
        finally:
            bar.close()
            if own_runner:
                runner.close()
    return written


def _job_of(record: dict[str, Any]) -> Job:
    return Job(*record_key(record))


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return sum(values) / len(values) if values else None


def aggregate(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (policy, budget, precision), `full` first, then by policy and budget.

    Row fields: `policy`, `budget` (None for full), `precision`, `episodes`, `errors`,
    `success_rate` (errors count as failures), `relative_success` (this row's success rate
    over full KV's on the tasks both ran; None without a full run or when full never
    succeeded), `peak_kv_mb` (mean peak KV bytes / 1e6 over episodes that report them),
    `reduction_vs_full` (mean peak bytes of full over mean peak bytes of this row, on the
    tasks both ran with a peak), `mean_steps`, `decode_tokens_per_s` (mean over every decode
    turn of every episode), `reference_accuracy` (reference steps whose action was the
    model's greedy choice over all reference steps replayed; None when none was) and
    `reference_steps`.
    """
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in records:
        task_id, policy, budget, precision = record_key(record)
        groups.setdefault((policy, budget, precision), []).append(record)
    full = {r["task_id"]: r for r in groups.get(("full", None, "fp"), [])}
    rows = []
    for (policy, budget, precision), group in groups.items():
        common = [r for r in group if r["task_id"] in full]
        relative = None
        if common:
            base = _mean(float(bool(full[r["task_id"]].get("success"))) for r in common)
            if base:
                relative = _mean(float(bool(r.get("success"))) for r in common) / base
        peaks = [
            (full[r["task_id"]]["peak_kv_bytes"], r["peak_kv_bytes"])
            for r in common
            if r.get("peak_kv_bytes") and full[r["task_id"]].get("peak_kv_bytes")
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
        peak = _mean(r["peak_kv_bytes"] for r in group if r.get("peak_kv_bytes"))
        rows.append(
            {
                "policy": policy,
                "budget": budget,
                "precision": precision,
                "episodes": len(group),
                "errors": sum(r.get("end_reason") == "error" for r in group),
                "success_rate": _mean(float(bool(r.get("success"))) for r in group),
                "relative_success": relative,
                "peak_kv_mb": None if peak is None else peak / 1e6,
                "reduction_vs_full": reduction,
                "mean_steps": _mean(r.get("steps") or 0 for r in group),
                "decode_tokens_per_s": _mean(
                    rate for r in group for rate in r.get("decode_tokens_per_s") or []
                ),
                "reference_accuracy": ref_hits / ref_steps if ref_steps else None,
                "reference_steps": ref_steps,
                "reference_nll": ref_nll / ref_tokens if ref_tokens else None,
            }
        )
    from agent_kv.kv.policies import POLICIES

    order = {name: i for i, name in enumerate(POLICIES)}
    rows.sort(
        key=lambda r: (
            r["policy"] != "full",
            order.get(r["policy"], len(order)),
            r["policy"],
            r["budget"] or 0,
            r["precision"],
        )
    )
    return rows


def row_label(row: dict[str, Any]) -> str:
    """'conf-kv 512', 'conf-kv 512 int8', 'full'."""
    label = row["policy"] if row["budget"] is None else f"{row['policy']} {row['budget']}"
    return label if row["precision"] == "fp" else f"{label} {row['precision']}"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    return f"{value:{spec}}{suffix}"


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of `aggregate` as a markdown table."""
    header = (
        "| policy | budget | precision | episodes | errors | success | vs full | "
        "peak KV (MB) | reduction vs full | steps | decode tok/s | ref. action acc. | "
        "ref. NLL |"
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
            str(r["episodes"]),
            str(r["errors"]),
            _fmt(r["success_rate"], ".0%"),
            _fmt(r["relative_success"], ".2f"),
            _fmt(r["peak_kv_mb"], ".1f"),
            _fmt(r["reduction_vs_full"], ".2f", "x"),
            _fmt(r["mean_steps"], ".1f"),
            _fmt(r["decode_tokens_per_s"], ".1f"),
            ref,
            _fmt(r["reference_nll"], ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_success_vs_memory(rows: list[dict[str, Any]], path: Path) -> None:
    """Write a PNG: success rate against mean peak KV memory (MB), one point per row, named
    in the legend (points often coincide: equal budgets, or no success anywhere); rows
    without a peak are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    try:
        for row in rows:
            if row["peak_kv_mb"] is None:
                continue
            x, y = row["peak_kv_mb"], row["success_rate"] * 100
            marker = "s" if row["policy"] == "full" else "o"
            label = f"{row_label(row)}: {x:.1f} MB, {y:.0f}%"
            ax.scatter([x], [y], marker=marker, s=40, alpha=0.8, label=label)
        ax.legend(fontsize=8, loc="best")
        ax.set_xlabel("mean peak KV memory (MB)")
        ax.set_ylabel("success rate (%)")
        ax.set_ylim(-5, 105)
        ax.set_title("Task success vs KV memory")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)


def write_report(out: Path) -> str:
    """Aggregate `out/results.jsonl` into `out/summary.md` and `out/success_vs_memory.png`;
    return the markdown table.

    Raises:
        OSError: the files cannot be written.
    """
    rows = aggregate(read_results(out / RESULTS))
    table = format_table(rows)
    text = (
        "# Sweep summary\n\n"
        f"{len(read_results(out / RESULTS))} episodes from `{RESULTS}`. "
        "Success counts errors as failures; *vs full* is the success rate relative to full "
        "KV on the same tasks; *reduction vs full* is full KV's mean peak KV bytes over this "
        "row's, on the same tasks; *ref. action acc.* is the share of reference steps whose "
        "action is the model's greedy choice under the policy (teacher-forced); *ref. NLL* is "
        "the reference actions' mean negative log-likelihood per token (nats; lower is "
        "better).\n\n"
        f"{table}\n\n![success vs memory]({PLOT})\n"
    )
    (out / SUMMARY).write_text(text, encoding="utf-8")
    plot_success_vs_memory(rows, out / PLOT)
    return table


# --- the real runner --------------------------------------------------------------------


def reference_replay(task: Task, engine, env, max_obs_tokens: int = 1200) -> dict[str, Any]:
    """Teacher-forced reference-action accuracy of `engine` (its model and policy) on `task`
    (method: the module docstring).

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
    from agent_kv.harness.agent import (
        FEW_SHOT,
        OBSERVATION_TEMPLATE,
        SYSTEM_PROMPT,
        truncate_tokens,
    )
    from agent_kv.runtime.conversation import Conversation

    chat = Conversation(engine)
    chat.add("system", SYSTEM_PROMPT.format(intent=task.intent), pin=True)
    for example, action in FEW_SHOT:
        chat.add("user", example, pin=True)
        chat.add("assistant", action, pin=True)
    matches: list[bool] = []
    logprobs: list[float] = []
    previous: int | None = None
    observation = env.reset(task)
    for reference in task.reference_actions:
        text = truncate_tokens(engine.tokenizer, observation["text"], max_obs_tokens)
        if previous is not None:
            chat.unpin_message(previous)
        chat.add(
            "user", OBSERVATION_TEMPLATE.format(observation=text, intent=task.intent), pin=True
        )
        previous = len(chat.messages) - 1
        concrete = env.concrete_action(reference)
        forced = chat.force_reply(concrete)
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


class EpisodeRunner:
    """The default `Runner`: the sites the jobs' tasks need, one headless Chromium and the
    model, started on the first job and reused (a browser that died is restarted for the next
    job).

    Args:
        settings: episode settings.
    """

    def __init__(self, settings: BenchSettings):
        self.settings = settings
        self._servers = None
        self._env = None
        self._loaded = None
        self._sites: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {"settings": self.settings}  # workers start their own browser and model

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["settings"])

    def start(self, sites: Iterable[str] = ()):
        """Start what is not running yet, serving at least `sites` (the sites already served
        stay; a new one restarts the servers and the browser); return (browser env, loaded
        model).

        Raises:
            ChromiumNotFoundError, AgentKVError: no usable Chromium or model.
            KeyError: a site that is not bundled.
        """
        from agent_kv.runtime.model_loading import load_model
        from envs.browser_env import BrowserEnv
        from envs.server import SiteServers

        wanted = self._sites | set(sites)
        if self._servers is not None and wanted != self._sites:
            self._drop_browser()
            self._servers.close()
            self._servers = None
        if self._servers is None:
            self._servers = SiteServers(sorted(wanted))
            self._sites = wanted
        if self._env is None:
            self._env = BrowserEnv(self._servers, observation=self.settings.observation)
        if self._loaded is None:
            self._loaded = load_model(self.settings.model)
        return self._env, self._loaded

    def _drop_browser(self) -> None:
        if self._env is not None:
            try:
                self._env.close()
            except Exception:  # noqa: BLE001 - it is already broken
                pass
            self._env = None

    def __call__(self, task: Task, job: Job, trace_dir: Path) -> dict[str, Any]:
        """Run the episode (and the reference replay) of `job`; return the record fields.

        Raises:
            AgentKVError, ChromiumNotFoundError, and whatever the episode raises.
        """
        from agent_kv.harness.agent import AgentConfig, run_episode
        from agent_kv.kv.policy_spec import PolicySpec
        from agent_kv.runtime.engine import Engine

        spec = PolicySpec.parse(job.policy, job.budget, None, int8=job.precision == "int8")
        env, loaded = self.start(task.sites)
        engine = Engine.from_spec(spec, loaded.model, loaded.tokenizer, self.settings.prefill_chunk)
        config = AgentConfig(
            max_steps=self.settings.max_steps, max_obs_tokens=self.settings.max_obs_tokens
        )
        try:
            summary = run_episode(task, engine, env, trace_dir, loaded.name, config).summary()
        except BaseException:
            self._drop_browser()
            raise
        if summary["end_reason"] == "error" and "browser" in (summary["error"] or ""):
            self._drop_browser()
        if self.settings.reference_accuracy and task.reference_actions:
            try:
                env, _ = self.start(task.sites)
                summary.update(reference_replay(task, engine, env, self.settings.max_obs_tokens))
            except Exception as err:  # noqa: BLE001 - recorded, the episode stands
                summary["reference_error"] = traceback.format_exception_only(err)[-1].strip()
                self._drop_browser()
        return summary

    def close(self) -> None:
        """Close the browser and stop the sites (the model is left to the garbage collector)."""
        self._drop_browser()
        if self._servers is not None:
            self._servers.close()
            self._servers = None
            self._sites = set()
