"""A sweep's jobs and settings: the `Job` (a task under one policy setting and agent) and the
key that identifies its record, the episode settings every job shares (`BenchSettings`,
recorded with the sweep), the tasks and jobs a sweep runs, and the records of its results
file."""

from __future__ import annotations

import dataclasses
import glob
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent_kv.errors import ConfigError
from agent_kv.harness.page_pins import check_page_pins
from agent_kv.harness.reply_pins import check_pin_replies
from agent_kv.kv.policy_names import base_policy, check_policy_name
from agent_kv.renamed_fields import current_names
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, check_weight_format
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


def job_of(record: dict[str, Any]) -> Job:
    """The job a results.jsonl record belongs to."""
    return Job(*record_key(record))


def full_job(task_id: int, agent: str = "text") -> Job:
    """The full-KV job of a task and agent: the reference of the agreement of every other
    job of that agent."""
    return Job(task_id, "full", None, "fp", agent)


MODES = {
    "free": "free navigation",
    "scripted": "scripted navigation, free answer",
}
"""`BenchSettings.mode` -> the name every table of its sweep carries."""


@dataclass(kw_only=True)
class BenchSettings:
    """Per-episode settings shared by every job of a sweep (built from named fields only).

    Attributes:
        max_steps: actions before an episode is cut off.
        max_obs_tokens: observation text cap in tokens.
        prefill_chunk: tokens per prefill forward call.
        model: a bundled model's name, a model directory or a .gguf file; None stands for
            the default bundled model (`bundled_models.DEFAULT_MODEL`), recorded by its name.
        reference_accuracy: also replay each task's reference actions
            (`agent_kv.harness.sweep.episode_runner`); tasks without reference actions get none.
        observation: the browser's observation mode (`envs.browser_env.OBSERVATION_MODES`).
        constrain: decode actions under each page's action grammar (`AgentConfig.constrain`).
        agreement: compare each other policy's decisions with full KV's on the same task;
            needs `full` among the sweep's policies. Free: replay the task's full-KV episode
            under the policy (`agent_kv.harness.agreement`). Scripted: every run records the
            model's own action at each step of the reference trajectory, and each policy's
            are compared with full KV's (`agent_kv.harness.decisions`).
        mode: "free" (free navigation: the agent acts at every step, `run_episode`) or
            "scripted" (scripted navigation, free answer: the scripted-episode runner,
            `agent_kv.harness.scripted_episode`).
        positions: "original" or "rerotate" (`PolicySpec`), for every policy of the sweep.
        episodes_per_engine: episodes run at once on one runner, i.e. one model in memory
            (`EpisodeRunner`): each its own thread and browser, their model calls batched by
            one `BatchScheduler`. 1 (the default) runs one episode at a time on a plain
            `Engine`. Success and memory do not depend on it; the time figures (decode
            tokens/s, seconds per step) are per episode while the model is shared, so it is
            recorded with the sweep like the other settings.
        weights: the model's weight format (`agent_kv.runtime.models.weight_formats`).
        pin_replies: which of the agent's replies to pin (`AgentConfig.pin_replies`).
        page_pins: how much of the latest page to pin (`AgentConfig.page_pins`).
        pin_examples: pin the example turns (`AgentConfig.pin_examples`).
        reference: scripted mode: the sweep directory whose full-KV runs the decisions are
            compared with (None: this sweep's own); this sweep's full-KV runs then read
            those runs' pages and replies, repeating them.
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
    page_pins: str = "whole"
    pin_examples: bool = True
    reference: str | None = None

    def __post_init__(self) -> None:
        self.model = self.model or bundled_models.DEFAULT_MODEL  # recorded by name
        check_weight_format(self.weights)
        check_pin_replies(self.pin_replies)
        check_page_pins(self.page_pins)
        if self.episodes_per_engine < 1:
            raise ValueError(f"episodes_per_engine must be >= 1, got {self.episodes_per_engine}")


def check_settings(out: Path, settings: BenchSettings) -> None:
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


def recorded_mode(out: Path) -> str:
    """The mode of the sweep in `out` (its settings.json; "free" when none is recorded)."""
    path = out / SETTINGS
    if not path.exists():
        return "free"
    return json.loads(path.read_text(encoding="utf-8")).get("mode", "free")


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
    # torch: imported after the cheap checks, so the command line refuses a bad name at once
    from agent_kv.kv.policies import POLICIES

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
