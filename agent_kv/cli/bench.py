"""`agent-kv bench`: a policy sweep (`agent_kv.harness.sweep`) from the command line: its
options checked, the jobs run on Ray actors, the report written and its table printed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agent_kv.cli.common import check_agent, check_mode, check_scripted_agents, fail, writable_dir
from agent_kv.cli.options import (
    ConstrainOption,
    MaxObsTokensOption,
    MaxStepsOption,
    ModelOption,
    ModeOption,
    ObservationOption,
    PagePinsOption,
    PinExamplesOption,
    PinRepliesOption,
    PositionsOption,
    PrefillChunkOption,
    ThreadsOption,
    WeightsOption,
)
from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.harness.page_pins import check_page_pins
from agent_kv.harness.reply_pins import check_pin_replies
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, check_weight_format

if TYPE_CHECKING:
    from agent_kv.harness.sweep.settings import BenchSettings, Job
    from envs.tasks import Task

TasksOption = Annotated[
    str,
    typer.Option(help="A bundled suite, a glob of task JSON files, or ids/ranges: 1,3,5-8."),
]
SweepDirOption = Annotated[Path, typer.Option(help="Sweep directory (results, summary, traces).")]
PoliciesOption = Annotated[
    str, typer.Option(help="Comma-separated policies; full runs once, without a budget.")
]
BudgetsOption = Annotated[
    str, typer.Option(help="Comma-separated budgets (unpinned tokens per layer).")
]
WorkersOption = Annotated[
    int,
    typer.Option(
        min=1,
        help="Ray actors: worker processes, each with its own sites and model, running "
        "--episodes-per-engine episodes at a time.",
    ),
]
EpisodesPerEngineOption = Annotated[
    int,
    typer.Option(
        min=1,
        max=16,
        help="Episodes each worker runs at once on its one model (each with its own "
        "browser, all on the worker's sites): their forward calls are batched "
        "(continuous batching), so N episodes need one model in memory, not N. 1 runs "
        "one episode at a time; at most 16 (each place opens its browser, a few hundred "
        "MB, when the worker starts).",
    ),
]
RayAddressOption = Annotated[
    str | None,
    typer.Option(
        envvar="RAY_ADDRESS",
        help="Join the Ray cluster at this address (HOST:PORT, ray://HOST:PORT, or auto "
        "for the one `ray start` runs here) instead of starting a local Ray instance "
        "for the sweep.",
    ),
]
SweepInt8Option = Annotated[
    bool,
    typer.Option(
        "--int8/--no-int8", help="Mixed precision for every policy but full (the baseline)."
    ),
]
ReferenceAccuracyOption = Annotated[
    bool,
    typer.Option(
        "--reference-accuracy/--no-reference-accuracy",
        help="Also replay each task's reference actions, teacher-forced, and report how "
        "often the model's greedy action is the reference one.",
    ),
]
AgentsOption = Annotated[
    str,
    typer.Option(
        help="Comma-separated agents, each a row of its own beside its own full KV: "
        "text (actions as text) and/or tools (actions as tool calls)."
    ),
]
AgreementOption = Annotated[
    bool,
    typer.Option(
        "--agreement/--no-agreement",
        help="Compare every other policy's decisions with full KV's: free mode replays each "
        "task's full-KV episode under the policy, teacher-forced; scripted mode asks the "
        "model for its own next action at every step of the reference trajectory under both. "
        "Reports how often the policy's action equals full KV's, and the KL of its next-token "
        "distributions from full KV's.",
    ),
]
ReferenceSweepOption = Annotated[
    Path | None,
    typer.Option(
        "--reference",
        help="In scripted mode, a sweep directory whose full-KV runs (same tasks, same "
        "settings but the pins) the decisions are compared with, instead of --out's own; "
        "full KV run here reads their pages and replies, repeating them.",
    ),
]
RetryErrorsOption = Annotated[
    bool, typer.Option(help="Rerun episodes recorded with end_reason error.")
]


def bench_command(
    tasks: TasksOption,
    out: SweepDirOption,
    policies: PoliciesOption = "full,window,h2o,snapkv,conf-kv,conf-kv-l,arkv",
    budgets: BudgetsOption = "512,1024",
    workers: WorkersOption = 1,
    episodes_per_engine: EpisodesPerEngineOption = 1,
    ray_address: RayAddressOption = None,
    max_steps: MaxStepsOption = 6,
    max_obs_tokens: MaxObsTokensOption = 1200,
    prefill_chunk: PrefillChunkOption = 512,
    observation: ObservationOption = "accessibility_tree",
    int8: SweepInt8Option = False,
    reference_accuracy: ReferenceAccuracyOption = True,
    constrain: ConstrainOption = True,
    agents: AgentsOption = "text",
    mode: ModeOption = "free",
    positions: PositionsOption = "original",
    pin_replies: PinRepliesOption = "none",
    page_pins: PagePinsOption = "whole",
    pin_examples: PinExamplesOption = True,
    agreement: AgreementOption = True,
    reference: ReferenceSweepOption = None,
    retry_errors: RetryErrorsOption = False,
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
) -> None:
    """Sweep tasks x policies x budgets on Ray actors (a local Ray instance, or the cluster
    at --ray-address); write results.jsonl, summary.md and success_vs_memory.png under --out
    and print the summary table."""
    # Playwright, and the tasks (pydantic, the sites' web framework): not at start
    from agent_kv.harness.sweep.settings import BenchSettings, select_tasks
    from envs.browser_env import ChromiumNotFoundError, check_observation_mode, find_chromium
    from envs.tasks import TaskError

    try:
        thread_setting.choose(threads)  # the Ray actors get it through the environment
        task_list = select_tasks(tasks)
        bundled_models.locate(model)
        check_weight_format(weights)
        check_observation_mode(observation)
        check_page_pins(page_pins)
        if reference is not None and not (reference / "traces").is_dir():
            raise ConfigError(f"--reference {reference} holds no sweep traces")
        names, jobs = _sweep_jobs(
            task_list, policies, budgets, agents, mode, pin_replies, int8, positions, ray_address
        )
        find_chromium()
        writable_dir(out)
    except (TaskError, ChromiumNotFoundError, AgentKVError, ValueError) as err:
        fail(str(err))
    settings = BenchSettings(
        max_steps=max_steps,
        max_obs_tokens=max_obs_tokens,
        prefill_chunk=prefill_chunk,
        model=model or bundled_models.DEFAULT_MODEL,
        reference_accuracy=reference_accuracy and mode == "free",
        observation=observation,
        constrain=constrain,
        agreement=agreement and ("full" in names or reference is not None),
        mode=mode,
        positions=positions,
        episodes_per_engine=episodes_per_engine,
        weights=weights,
        pin_replies=pin_replies,
        page_pins=page_pins,
        pin_examples=pin_examples,
        reference=None if reference is None else str(reference.resolve()),
    )
    _run_sweep(task_list, jobs, out, workers, ray_address, settings, retry_errors)


def _sweep_jobs(
    task_list: list[Task],
    policies: str,
    budgets: str,
    agents: str,
    mode: str,
    pin_replies: str,
    int8: bool,
    positions: str,
    ray_address: str | None,
) -> tuple[list[str], list[Job]]:
    """The sweep's policy names and its jobs (`sweep.settings.make_jobs`) over `task_list`,
    from bench's options as given, each checked in turn (`--ray-address` too), and every
    policy setting the jobs use parsed (`PolicySpec.parse`) before anything runs.

    Raises:
        TaskError: an empty list; ConfigError: budgets that are not whole numbers, an unknown
            mode or agent, an agent other than text with `--mode scripted`, a malformed or
            unreachable `--ray-address`, or a policy setting `PolicySpec.parse` refuses;
            ValueError: an unknown policy or a budget below 1.
    """
    # the sweep's settings load the tasks (pydantic, the sites' web framework): not at start
    from agent_kv.harness.sweep.job_runs import check_ray_address
    from agent_kv.harness.sweep.settings import make_jobs, parse_list

    names = parse_list(policies, "--policies")
    try:
        sizes = [int(b) for b in parse_list(budgets, "--budgets")]
    except ValueError:
        raise ConfigError(f"--budgets must be comma-separated integers, got {budgets!r}") from None
    check_mode(mode)
    check_pin_replies(pin_replies)
    agent_list = parse_list(agents, "--agents")
    for agent in agent_list:
        check_agent(agent, "--agents")
    if mode == "scripted":
        check_scripted_agents(agent_list, "--agents")
    if ray_address is not None:
        check_ray_address(ray_address)
    jobs = make_jobs(task_list, names, sizes, int8, agent_list)  # imports torch
    for job in {(j.policy, j.budget, j.precision): j for j in jobs}.values():
        PolicySpec.parse(
            job.policy, job.budget, None, int8=job.precision == "int8", positions=positions
        )
    return names, jobs


def _run_sweep(
    task_list: list[Task],
    jobs: list[Job],
    out: Path,
    workers: int,
    ray_address: str | None,
    settings: BenchSettings,
    retry_errors: bool,
) -> None:
    """Run `jobs` on `workers` Ray actors (the cluster at `ray_address`, or a local Ray
    instance) under `settings`, write the report under `out` and print its
    table; a runner that cannot start, or an `out` that cannot be written, fails the
    command."""
    # Ray and Playwright: imported once the options are checked
    from agent_kv.harness.sweep.job_runs import RayActors
    from agent_kv.harness.sweep.report import write_report
    from agent_kv.harness.sweep.schedule import run_bench
    from agent_kv.harness.sweep.settings import AGREEMENT_PLOT, PLOT, SUMMARY
    from envs.browser_env import ChromiumNotFoundError

    actors = RayActors(workers, ray_address)
    try:  # a missing model or broken Chromium fails as the actors start, once
        run_bench(task_list, jobs, out, actors, settings, retry_errors=retry_errors)
        table = write_report(out)
    except (AgentKVError, ChromiumNotFoundError) as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot write under {out}: {err.strerror or err}")
    typer.echo(table)
    typer.echo(f"\nwrote {out / SUMMARY}, {out / PLOT}, {out / AGREEMENT_PLOT}", err=True)
