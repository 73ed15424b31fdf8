"""The web agent: one browser episode as one append-only chat in one managed KV cache.

The system message (instructions and goal) and a few example turns are pinned for the whole
episode. Each observation is a turn that ends with the goal, as in VisualWebArena's prompt;
each reply is an assistant turn that the environment parses as an action (an unparsable
reply comes back as an error observation). The agent writes actions as text or as tool calls
(`AgentConfig.agent`, `agent_kv.harness.action_formats`). The latest
observation is pinned while it is the latest and released when the next one arrives, so the
policy may evict from older pages but never from the page the agent is acting on.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from playwright.sync_api import Error as PlaywrightError

from agent_kv.errors import ContextOverflowError
from agent_kv.harness.action_formats import TEXT_ACTIONS, ActionFormat, action_format
from agent_kv.harness.page_pins import ELEMENT_PATTERNS, check_page_pins
from agent_kv.harness.reply_pins import check_pin_replies, reply_pin
from agent_kv.harness.trace_view import TASK_JSON, step_cache_fields
from agent_kv.kv.kv_figures import KVFigures
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.chat.pin_rules import PinRules
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.models.weight_formats import weight_format
from agent_kv.runtime.replies.sampling import SamplingParams
from envs.actions import ActionParseError
from envs.browser_env import BrowserEnv, StepResult
from envs.evaluators import evaluate
from envs.tasks import Task

OBSERVATION_TEMPLATE = "Page:\n{observation}\nGoal: {intent}"
TRUNCATION_NOTE = "\n[observation truncated]"
AGENT_PIN_RULES = PinRules(
    roles=frozenset({"system"}),
    latest_observations=1,
    observation_roles=frozenset({"user", "tool"}),
)
"""What an episode pins: the system message (instructions, goal, tools), the messages added
with `pin` (the example turns), and the latest observation (a user or tool turn: an example
comes before every observation, so the newest of these is the page the agent acts on)."""
PAGE_PIN_RULES = {
    "whole": AGENT_PIN_RULES,
    "elements": replace(AGENT_PIN_RULES, observation_patterns=ELEMENT_PATTERNS),
}
"""The rules of each `page_pins` setting (`agent_kv.harness.page_pins`): the latest page
pinned whole, or only its tab and URL lines and interactive elements."""


@dataclass
class AgentConfig:
    """Episode settings.

    Attributes:
        max_steps: actions before the episode is cut off.
        max_obs_tokens: observation text is truncated to this many tokens.
        sampling: decoding of each action (greedy by default, 48 tokens, stops at a newline
            after the action; the tool agent drops the stop and raises the cap to a call's
            bound, `action_formats.CALL_BYTES`).
        constrain: decode each action under the page's grammar (the default: the action
            grammar, `agent_kv.harness.action_decoding`, or for the tool agent the grammar of
            its page's calls); False decodes freely.
        agent: how actions are written: "text" (`click [12]`) or "tools" (one tool call
            per action; `agent_kv.harness.action_formats`).
        page_pins: how much of the latest page to pin (`page_pins.PAGE_PINS`): "whole" or
            "elements" (its tab and URL lines and interactive elements).
        pin_examples: pin the example turns for the whole episode (the default); False
            leaves them to the policy like the history (about 650 tokens of the scripted
            runner's notes format on the default model: what a 16x budget cannot hold).
        pin_replies: which of the agent's replies to pin (`reply_pins.PIN_REPLIES`): "none", "notes"
            (the note a reply begins with, `note [fact]`, in the scripted runner's format;
            a free agent writes none) or "all" (every reply, actions and notes: short, and
            they carry what the agent gathered).
    """

    max_steps: int = 6
    max_obs_tokens: int = 1200
    sampling: SamplingParams = field(
        default_factory=lambda: SamplingParams(max_new_tokens=48, stop=["\n"])
    )
    constrain: bool = True
    agent: str = "text"
    pin_replies: str = "none"
    page_pins: str = "whole"
    pin_examples: bool = True

    def __post_init__(self) -> None:
        check_pin_replies(self.pin_replies)
        check_page_pins(self.page_pins)

    @property
    def action_format(self) -> ActionFormat:
        """The format `agent` names.

        Raises:
            ValueError: an unknown agent.
        """
        return action_format(self.agent)


@dataclass
class EpisodeResult:
    """What one episode produced; `summary()` is the JSON the CLI prints.

    `model` is the model's name and `weights` its weight format (`--weights`).

    KV memory comes in pairs, allocated first (the headline: what the process holds) and
    live beside it; the KV fields are those of `KVFigures`, the record the server reports too:

    Attributes:
        peak_kv_allocated_bytes: the most bytes the KV store's buffers held at any point of
            the episode, spare capacity included (`StoreFigures.peak_allocated_bytes`).
        peak_kv_live_bytes: the most bytes of live keys, values and scales it held
            (`StoreFigures.peak_bytes`).
        full_kv_allocated_bytes: what a full KV cache of the tokens seen would be allocated at
            full precision under the same growth rule (`KVStore.full_kv_allocated_nbytes`):
            the allocated reference `peak_kv_allocated_bytes` is compared with.
        full_kv_live_bytes: the live bytes of those tokens alone, at full precision
            (`KVStore.full_kv_nbytes`): the live-equivalent reference.
        kv_shared_bytes: bytes of the shared prefix blocks the episode's store reads at its
            end (`PrefixReads.nbytes`; held once for every session that reads them, so
            apart from the figures above; 0 without prefix sharing).
        peak_cold_kv_bytes: the most bytes the cold tier held (evicted tokens kept for
            recall, `ColdTier.peak_bytes`; 0 without one), apart from the hot figures above.
        reencoded_tokens: tokens the engine encoded again (`StoreFigures.reencoded_tokens`;
            0 without `+reencode`).
    """

    task_id: int
    agent: str
    policy: str
    policy_params: dict[str, Any]
    model: str
    weights: str
    success: bool
    score: float
    eval_details: dict[str, Any]
    answer: str | None
    end_reason: str
    error: str | None
    steps: int
    tokens_seen: int
    peak_kv_allocated_bytes: int
    peak_kv_live_bytes: int
    full_kv_allocated_bytes: int
    full_kv_live_bytes: int
    kv_shared_bytes: int
    evicted_tokens: int
    reencoded_tokens: int
    int8: dict | None
    quantized_tokens: int
    positions: str
    ttft_s: list[float]
    decode_tokens_per_s: list[float]
    step_s: list[float]
    wall_s: float
    trace_dir: str
    peak_cold_kv_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        """The result as a JSON-ready dict, with the KV reduction vs full KV added, like with
        like: `kv_reduction_vs_full` is allocated over allocated (`full_kv_allocated_bytes /
        peak_kv_allocated_bytes`), `kv_live_reduction_vs_full` live over live."""
        return asdict(self) | kv_reductions(self)


def kv_reductions(result) -> dict[str, float | None]:
    """Full KV's bytes over the policy's peak, like with like, of a result with the fields
    `full_kv_allocated_bytes`, `peak_kv_allocated_bytes`, `full_kv_live_bytes` and
    `peak_kv_live_bytes` (bytes): `kv_reduction_vs_full` (allocated over allocated) and
    `kv_live_reduction_vs_full` (live over live), each rounded to 3 places, None when the
    peak is 0."""
    ratios = {
        "kv_reduction_vs_full": (result.full_kv_allocated_bytes, result.peak_kv_allocated_bytes),
        "kv_live_reduction_vs_full": (result.full_kv_live_bytes, result.peak_kv_live_bytes),
    }
    return {key: round(full / peak, 3) if peak else None for key, (full, peak) in ratios.items()}


def truncate_tokens(tokenizer, text: str, max_tokens: int) -> str:
    """`text` cut to at most `max_tokens` tokens, with a note when it was cut."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    return tokenizer.decode(ids[:max_tokens]) + TRUNCATION_NOTE


def open_conversation(
    engine: ChatEngine,
    intent: str,
    fmt: ActionFormat = TEXT_ACTIONS,
    few_shot: Sequence[tuple[str, str]] | None = None,
    page_pins: str = "whole",
    pin_examples: bool = True,
) -> Conversation:
    """An episode's conversation in the action format `fmt`, pinned by `PAGE_PIN_RULES`
    [`page_pins`]: its system prompt with the goal and its tools, and the example turns (user
    text, assistant reply; the format's own unless given), pinned for good unless
    `pin_examples` is False; the latest page whole or its elements."""
    chat = Conversation(engine, tools=fmt.tools, rules=PAGE_PIN_RULES[page_pins])
    chat.add("system", fmt.system_prompt.format(intent=intent))
    for example, action in fmt.few_shot(engine.tokenizer) if few_shot is None else few_shot:
        chat.add("user", example, pin=pin_examples)
        chat.add("assistant", action, pin=pin_examples)
    return chat


def add_observation(
    chat: Conversation, observation: str, intent: str, config: AgentConfig, role: str = "user"
) -> str:
    """Queue a page as the latest observation turn of `role`: truncated to
    `config.max_obs_tokens`, in `OBSERVATION_TEMPLATE`; `AGENT_PIN_RULES` pin it while it is
    the latest. Returns the page text as the agent sees it."""
    text = truncate_tokens(chat.engine.tokenizer, observation, config.max_obs_tokens)
    add_shown_observation(chat, text, intent, role)
    return text


def add_shown_observation(chat: Conversation, shown: str, intent: str, role: str = "user") -> None:
    """Queue a page already as the agent sees it (truncated: `add_observation`'s return, or a
    trace's record of it) as the latest observation turn of `role`, in
    `OBSERVATION_TEMPLATE`."""
    chat.add(role, OBSERVATION_TEMPLATE.format(observation=shown, intent=intent))


def observation_role(fmt: ActionFormat, previous: int | None) -> str:
    """The role of the next observation: a user turn opens the episode, the format's role
    follows (a tool result in tools)."""
    return "user" if previous is None else fmt.observation_role


def run_episode(
    task: Task,
    engine: ChatEngine,
    env: BrowserEnv,
    trace_dir: Path,
    model_name: str,
    config: AgentConfig | None = None,
    on_step: Callable[[dict[str, Any]], None] | None = None,
) -> EpisodeResult:
    """Run `task` to its end in `env` with `engine`, writing a trace to `trace_dir`.

    The trace holds `task.json` (the task as run: goal, eval spec), `step_NNN.json`
    (observation, reply, action, blocked requests, KV stats, the step's wall time, the
    prompt's tokens and their states in the cache: `trace_view.step_cache_fields`),
    `step_NNN.png` (the screenshot the agent acted on) and, with a set-of-marks observation,
    `step_NNN.som.png` per step, `kv_steps.jsonl` (one record per forward
    call: tokens seen, KV bytes, confidence, budget, evictions) and `summary.json`.
    `on_step`, if given, receives each step's record as it is written (for progress output).

    A browser that dies (a Playwright error) or a conversation that outgrows the model's
    context (`ContextOverflowError`) ends the episode with `end_reason="error"`, score 0 and
    the error in `error`; the trace written so far stays.
    """
    config = config or AgentConfig()
    fmt = config.action_format
    trace_dir.mkdir(parents=True, exist_ok=True)
    (trace_dir / TASK_JSON).write_text(task.model_dump_json(indent=2))
    started = time.perf_counter()
    chat = open_conversation(
        engine, task.intent, fmt, page_pins=config.page_pins, pin_examples=config.pin_examples
    )
    episode = _Episode(task, env, trace_dir, config, fmt, chat, on_step)
    error = None
    try:
        episode.play()
        verdict = evaluate(task, episode.answer, env.url, env.servers, env.read_page)
        score, details = verdict.score, verdict.details
    except PlaywrightError as err:
        error = f"browser failed: {str(err).splitlines()[0]}"
        episode.end_reason, score, details = "error", 0.0, {"error": error}
    except ContextOverflowError as err:
        error = str(err)
        episode.end_reason, score, details = "error", 0.0, {"error": error}
    _write_kv_steps(trace_dir, chat.sequence.steps)
    wall_s = time.perf_counter() - started
    result = _episode_result(episode, engine, model_name, score, details, error, wall_s)
    (trace_dir / "summary.json").write_text(json.dumps(result.summary(), indent=2))
    return result


@dataclass
class _Episode:
    """An episode under way: what it runs on, and what it has done so far.

    Attributes:
        task, env, trace_dir, config, on_step: as `run_episode` takes them.
        fmt: the action format `config.agent` names.
        chat: the episode's conversation (`open_conversation`).
        answer: the answer the episode ended with (None: none yet, or none given).
        end_reason: why it ended ("max_steps" until an action ends it).
        steps: the steps taken.
        ttfts, rates, step_times: per step, the reply's time to first token (seconds), its
            decode rate (tokens per second) and the step's wall time (seconds).
        observation_index: the message index of the pinned observation (None before the
            first).
    """

    task: Task
    env: BrowserEnv
    trace_dir: Path
    config: AgentConfig
    fmt: ActionFormat
    chat: Conversation
    on_step: Callable[[dict[str, Any]], None] | None
    answer: str | None = None
    end_reason: str = "max_steps"
    steps: int = 0
    ttfts: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    observation_index: int | None = None

    def play(self) -> None:
        """Take steps from the task's first page until an action ends the episode (its
        answer and reason noted) or `config.max_steps` were taken.

        Raises:
            PlaywrightError: the browser failed.
            ContextOverflowError: the conversation outgrew the model's context.
        """
        observation = self.env.reset(self.task)
        for step in range(1, self.config.max_steps + 1):
            result = self._step(step, observation)
            if result.done:
                self.answer, self.end_reason = result.answer, result.info.get("reason", "stop")
                return
            observation = result.observation

    def _step(self, step: int, observation: dict) -> StepResult:
        """Step `step`: `observation` added as the latest (pinned) observation, the agent's
        reply decoded (under the page's grammar with `config.constrain`), its action carried
        out, the step's record written to the trace and handed to `on_step`. Returns the
        environment's answer to the action."""
        chat, config = self.chat, self.config
        step_started, first_token = time.perf_counter(), chat.sequence.store.seen_tokens
        role = observation_role(self.fmt, self.observation_index)
        text = add_observation(chat, observation["text"], self.task.intent, config, role)
        self.observation_index = len(chat.messages) - 1
        decoding = self.fmt.decoding(
            chat.engine, config.sampling, text, len(observation["tabs"]), config.constrain
        )
        reply = chat.reply(decoding.params, pin=bool(reply_pin(config.pin_replies)))
        self.ttfts.append(reply.ttft_s)
        self.rates.append(reply.decode_tokens_per_s)
        result = _act(self.env, self.fmt, reply.text, chat.engine.tokenizer)
        self.steps = step
        self.step_times.append(time.perf_counter() - step_started)
        record = _write_step(
            self.trace_dir,
            step,
            observation,
            reply.text,
            result,
            chat.sequence.store,
            decoding.record(),
            self.step_times[-1],
            step_cache_fields(chat, first_token, self.observation_index),
        )
        if self.on_step is not None:
            self.on_step(record)
        return result


def _episode_result(
    episode: _Episode,
    engine: ChatEngine,
    model_name: str,
    score: float,
    details: dict[str, Any],
    error: str | None,
    wall_s: float,
) -> EpisodeResult:
    """The result of an ended episode: its score and evaluation `details`, its `error` (None
    without one), its wall time `wall_s` (seconds), and the figures of its store as the
    episode ends (`Engine.reencode` replaces the store)."""
    store = episode.chat.sequence.store
    return EpisodeResult(
        task_id=episode.task.task_id,
        agent=episode.config.agent,
        policy=engine.policy.name,
        policy_params=engine.policy.params(),
        model=model_name,
        weights=weight_format(engine.model),
        success=score == 1.0,
        score=score,
        eval_details=details,
        answer=episode.answer,
        end_reason=episode.end_reason,
        error=error,
        steps=episode.steps,
        **KVFigures.of(store).fields_of(EpisodeResult),
        int8=None if store.int8 is None else asdict(store.int8),
        positions=store.positions_mode,
        ttft_s=[round(t, 3) for t in episode.ttfts],
        decode_tokens_per_s=[round(r, 2) for r in episode.rates],
        step_s=[round(t, 3) for t in episode.step_times],
        wall_s=round(wall_s, 2),
        trace_dir=str(episode.trace_dir),
    )


def _act(env: BrowserEnv, fmt: ActionFormat, reply: str, tokenizer) -> StepResult:
    """Carry out the reply's action (written by the model of `tokenizer`); a reply that is no
    action in the format's terms is answered with the format's error observation
    (`BrowserEnv.reject`)."""
    try:
        action = fmt.action(reply, tokenizer)
    except ActionParseError as err:
        return env.reject(str(err))
    return env.step(action)


def _write_step(
    trace_dir: Path,
    step: int,
    observation: dict,
    reply: str,
    result: StepResult,
    store,
    decoding: dict[str, Any],
    step_s: float,
    cache: dict[str, Any],
) -> dict[str, Any]:
    """Write the step's JSON record (and the screenshots acted on); return the record. Its KV
    figures are the store's (`KVFigures`: now and at its peak, allocated and live) with its
    per-layer lengths; `step_s` is the step's wall time (seconds); `cache` (the prompt's
    tokens and their states in the cache, `trace_view.step_cache_fields`) ends it."""
    stem = trace_dir / f"step_{step:03d}"
    if observation.get("screenshot"):
        stem.with_suffix(".png").write_bytes(observation["screenshot"])
    if observation.get("som_screenshot"):
        stem.with_suffix(".som.png").write_bytes(observation["som_screenshot"])
    record = {
        "step": step,
        "url": observation["url"],
        "observation": observation["text"],
        "reply": reply,
        "tabs": len(observation["tabs"]),
        **decoding,
        "action": result.info.get("action"),
        "error": result.observation.get("error"),
        "blocked_requests": observation.get("blocked_requests", []),
        "info": result.info,
        **asdict(KVFigures.of(store)),
        "kv_lengths": store.lengths(),
        "step_s": round(step_s, 3),
        **cache,
    }
    stem.with_suffix(".json").write_text(json.dumps(record, indent=2, default=str))
    return record


def _write_kv_steps(trace_dir: Path, steps) -> None:
    with (trace_dir / "kv_steps.jsonl").open("w") as handle:
        for record in steps:
            handle.write(json.dumps(asdict(record)) + "\n")
