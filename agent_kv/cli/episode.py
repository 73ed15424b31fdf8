"""`agent-kv run-episode` (one web task in headless Chromium, its JSON summary printed) and
`agent-kv trace` (an episode's trace as one HTML page)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from agent_kv.cli.common import check_agent, check_mode, check_scripted_agents, fail, writable_dir
from agent_kv.cli.options import (
    AgentOption,
    BudgetBytesOption,
    BudgetOption,
    CompileOption,
    ConstrainOption,
    FpWindowOption,
    Int8Option,
    MaxObsTokensOption,
    MaxStepsOption,
    ModelOption,
    ModeOption,
    ObservationOption,
    PagePinsOption,
    ParamOption,
    PinExamplesOption,
    PinRepliesOption,
    PolicyOption,
    PositionsOption,
    PrefillChunkOption,
    RecallOption,
    RecallParamOption,
    ThreadsOption,
    WeightsOption,
)
from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.harness.page_pins import check_page_pins
from agent_kv.harness.reply_pins import check_pin_replies
from agent_kv.harness.trace_view import write_trace_html
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, check_weight_format


def run_episode_command(
    task: Annotated[str, typer.Option(help="Bundled task id, or a path to a task JSON file.")],
    mode: ModeOption = "free",
    policy: PolicyOption = "conf-kv",
    budget: BudgetOption = None,
    budget_bytes: BudgetBytesOption = None,
    tau: Annotated[float | None, typer.Option(help="conf-kv confidence threshold.")] = None,
    protect_recent: Annotated[
        int | None, typer.Option(help="Newest tokens never evicted (conf-kv's P).")
    ] = None,
    param: ParamOption = None,
    recall: RecallOption = False,
    recall_param: RecallParamOption = None,
    max_steps: MaxStepsOption = 6,
    max_obs_tokens: MaxObsTokensOption = 1200,
    prefill_chunk: PrefillChunkOption = 512,
    int8: Int8Option = False,
    fp_window: FpWindowOption = None,
    positions: PositionsOption = "original",
    observation: ObservationOption = "accessibility_tree",
    constrain: ConstrainOption = True,
    agent: AgentOption = "text",
    pin_replies: PinRepliesOption = "none",
    page_pins: PagePinsOption = "whole",
    pin_examples: PinExamplesOption = True,
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
    compile: CompileOption = None,
    out: Annotated[Path, typer.Option(help="Directory for the episode's trace.")] = Path("runs"),
) -> None:
    """Run one web task in headless Chromium and print a JSON summary."""
    # Playwright, and the tasks (pydantic, the sites' web framework): not at start
    from envs.browser_env import ChromiumNotFoundError, check_observation_mode, find_chromium
    from envs.tasks import TaskError, load_task

    try:
        thread_setting.choose(threads)
        check_agent(agent)
        check_mode(mode)
        task_obj = load_task(task)
        if mode == "scripted":
            _check_scripted(task_obj, agent)
        bundled_models.locate(model)
        check_weight_format(weights)
        check_observation_mode(observation)
        check_pin_replies(pin_replies)
        check_page_pins(page_pins)
        find_chromium()
        spec = PolicySpec.parse(
            policy, budget, budget_bytes, tau, protect_recent, int8, fp_window, positions, param,
            recall, recall_param,
        )  # fmt: skip
        writable_dir(out)
    except (TaskError, ChromiumNotFoundError, AgentKVError, ValueError) as err:
        fail(str(err))
    try:
        from agent_kv.harness.agent import AgentConfig  # torch: once the options are checked

        config = AgentConfig(
            max_steps=max_steps,
            max_obs_tokens=max_obs_tokens,
            constrain=constrain,
            agent=agent,
            pin_replies=pin_replies,
            page_pins=page_pins,
            pin_examples=pin_examples,
        )
        summary = _run(
            task_obj, mode, spec, model, weights, config, prefill_chunk, observation, out, compile
        )
    except (AgentKVError, ChromiumNotFoundError) as err:
        fail(str(err))
    typer.echo(json.dumps(summary, indent=2))


def _check_scripted(task, agent: str) -> None:
    """Raises ConfigError when `task` cannot run with `--mode scripted`: `agent` is not text
    (`common.check_scripted_agents`), or it has no reference actions to replay."""
    check_scripted_agents([agent], "--agent")
    if not task.reference_actions:
        raise ConfigError(
            f"--mode scripted replays a task's reference actions; task {task.task_id} has none"
        )


def _print_step(record: dict) -> None:
    """One progress line per agent step on stderr (stdout carries only the JSON summary)."""
    reply = record["reply"].strip().replace("\n", " ")
    reply = reply if len(reply) <= 60 else reply[:59] + "…"
    outcome = record["action"] or "unparsable"
    if record["error"]:
        outcome += f" (failed: {record['error'][:60]})"
    typer.echo(
        f"step {record['step']}: {reply!r} -> {outcome} | {record['tokens_seen']} tokens seen, "
        f"KV {record['kv_allocated_bytes'] / 1e6:.1f} MB allocated, "
        f"{record['kv_live_bytes'] / 1e6:.1f} MB live "
        f"(peak {record['peak_kv_allocated_bytes'] / 1e6:.1f} MB allocated)",
        err=True,
    )


def _print_page(number: int, pages: int) -> None:
    """One progress line per scripted page on stderr."""
    typer.echo(f"page {number} of {pages} enters the cache", err=True)


def _run(
    task, mode, spec: PolicySpec, model_path, weights, config, prefill_chunk, observation, out,
    compile,
) -> dict:  # fmt: skip
    # torch, Playwright and the sites' web framework: once the options are checked
    from agent_kv.harness.agent import run_episode
    from agent_kv.harness.scripted_episode import scripted_episode
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.models.compile_cache import use_compile_cache
    from agent_kv.runtime.models.model_loading import load_model
    from envs.browser_env import BrowserEnv
    from envs.server import SiteServers

    stamp = time.strftime("%Y%m%d-%H%M%S")
    agent = "" if config.agent == "text" else f"-{config.agent}"
    trace_dir = out / f"task{task.task_id}-{spec.label}{agent}-{stamp}"
    # The browser starts before the model loads, so either failing is the first line printed.
    with SiteServers(task.sites) as servers, BrowserEnv(servers, observation=observation) as env:
        started = time.perf_counter()
        loaded = load_model(model_path, weights)
        load_s = time.perf_counter() - started
        typer.echo(
            f"model {loaded.name} ({weights} weights) loaded in {load_s:.1f} s; task "
            f"{task.task_id}: {task.intent}",
            err=True,
        )
        compile = _compile_default(compile, loaded.model)
        if compile:
            use_compile_cache(f"{loaded.name}-{weights}")
        engine = Engine.from_spec(spec, loaded.model, loaded.tokenizer, prefill_chunk, compile)
        if mode == "scripted":
            return scripted_episode(task, engine, env, trace_dir, loaded.name, config, _print_page)
        result = run_episode(task, engine, env, trace_dir, loaded.name, config, _print_step)
    return result.summary()


def _compile_default(flag: bool | None, model) -> bool:
    """`--compile/--no-compile` as given, else on where compiling pays for an episode: on a
    GPU (capturing a CUDA graph costs one step). A server compiles by default
    (`api.server_setup`)."""
    if flag is not None:
        return flag
    return next(model.parameters()).is_cuda


def trace_command(
    trace_dir: Annotated[Path, typer.Argument(help="An episode's trace directory.")],
) -> None:
    """Write TRACE_DIR/trace.html: screenshots, observations, replies and actions per step,
    and the KV-bytes / confidence plot, in one self-contained page."""
    try:
        path = write_trace_html(trace_dir)
    except AgentKVError as err:
        fail(str(err))
    typer.echo(str(path))
