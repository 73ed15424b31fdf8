"""The scripted-episode runner: scripted navigation through a task, one free answer.

A recall task (`tasks/recall/`) names a fact on one page and then has the agent go on through
`k = task.horizon` more pages before it answers. The runner replays the task's
`reference_actions` up to the last in the real browser env and builds the agent's
conversation exactly as a free episode does: the pinned system prompt and example turns, each
page as an observation turn in the agent's template (pinned while it is the latest, released
when the next one comes), each scripted action teacher-forced as the assistant's reply
(`Conversation.force_reply`, one decode step per token, so the policy evicts as it would while
decoding). The model's one free decision is the final reply, decoded by a `Decoder` (by
default `stop [` is forced and the answer decoded greedily up to `]`), and scored with the
task's evaluator.

    records = run_recall(load_suite("recall"), engine, env, Path("runs/recall"), "smollm2")
    print(format_by_k(records))

What the model sees and writes is set by a `RecallFormat` (`FORMATS`). The default, "notes",
keeps the note the reference trajectory writes where it finds the fact (`note [Blue road
bike: $120] click [...]`, forced as the assistant's turn) and shows example episodes that
answer from such a note: the bundled 135M model answers from its own note k pages back, while
it cannot find the fact in an earlier page's text (the "agent" format, without notes: no task
solved at any k; tasks/README.md has the calibration). Tasks whose history outgrows the
model's context need rerotate positions and a budgeted policy; under full KV they end with
`error` set and score 0.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from agent_kv.errors import ContextOverflowError
from agent_kv.harness.action_formats import FEW_SHOT
from agent_kv.harness.agent import (
    AgentConfig,
    add_observation,
    add_shown_observation,
    kv_reductions,
    open_conversation,
)
from agent_kv.harness.decisions import DecisionRecorder
from agent_kv.harness.reply_pins import reply_pin
from agent_kv.kv.kv_figures import KVFigures
from agent_kv.runtime.chat.conversation import Conversation
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.models.weight_formats import weight_format
from agent_kv.runtime.replies.sampling import SamplingParams
from envs.browser_env import ActionError, BrowserEnv
from envs.evaluators import evaluate
from envs.observation import main_content
from envs.tasks import Task

SUITE = "recall"
TRACE_JSON = "recall.json"
RESULTS = "results.jsonl"
STOP_PREFIX = "stop ["


NOTE = re.compile(r"^note \[(?P<note>[^\]]*)\]\s*")
"""A reference action may begin with the agent's note, `note [Blue road bike: $120] click
[...]` (the env's parser skips the prose before the action)."""

_GOALS = (
    "Find out who sells the Green lamp, then open the Phones and Books categories. "
    "Answer with the Green lamp's seller.",
    "Find the rating of the Grey kettle, then open the Garden category. "
    "Answer with the Grey kettle's rating.",
    "Find the price of the Red chair, then open the Furniture and Phones categories. "
    "Answer with the Red chair's price.",
)
NOTE_FEW_SHOT = (
    (
        "Page:\n[4] heading 'Green lamp'\n[6] StaticText 'Seller: '\n[7] link 'Ann Lee'\n"
        f"[12] link 'Phones'\nGoal: {_GOALS[0]}",
        "note [Green lamp seller: Ann Lee]\nclick [12]",
    ),
    (
        "Page:\n[3] heading 'Phones'\n[8] link 'Black phone - $150'\n[10] link 'Books'\n"
        f"Goal: {_GOALS[0]}",
        "click [10]",
    ),
    (
        "Page:\n[2] heading 'Books'\n[5] link 'Old atlas - $12'\n"
        f"[6] StaticText 'Seller: Bo Park'\nGoal: {_GOALS[0]}",
        "stop [Green lamp seller: Ann Lee]",
    ),
    (
        "Page:\n[6] heading 'Grey kettle'\n[8] StaticText 'Price: $22'\n"
        f"[9] StaticText 'Rating: 3.9 out of 5'\n[11] link 'Garden'\nGoal: {_GOALS[1]}",
        "note [Grey kettle rating: 3.9]\nclick [11]",
    ),
    (
        "Page:\n[2] heading 'Garden'\n[5] link 'Clay pot - $9'\n"
        f"[6] StaticText 'Rating: 4.6 out of 5'\nGoal: {_GOALS[1]}",
        "stop [Grey kettle rating: 3.9]",
    ),
    (
        "Page:\n[5] heading 'Red chair'\n[8] StaticText 'Price: $45'\n[9] link 'Furniture'\n"
        f"Goal: {_GOALS[2]}",
        "note [Red chair: $45]\nclick [9]",
    ),
    (
        "Page:\n[2] heading 'Furniture'\n[4] link 'Oak table - $90'\n"
        f"[6] link 'Blue sofa - $300'\n[7] link 'Phones'\nGoal: {_GOALS[2]}",
        "click [7]",
    ),
    (
        "Page:\n[3] heading 'Phones'\n[8] link 'Black phone - $150'\n"
        f"[9] link 'Grey phone - $95'\nGoal: {_GOALS[2]}",
        "stop [Red chair: $45]",
    ),
)
"""Example episodes of the note convention: the agent notes the fact where it finds it, goes
on one or two pages, and answers with the note (three examples: a seller, a rating, a price;
the price last and an attribute other than price first, calibrated for the default model:
tasks/README.md, "The recall suite")."""


@dataclass(frozen=True)
class RecallFormat:
    """What the agent sees and writes.

    Attributes:
        name: a label for reports.
        main_only: show `envs.observation.main_content` of each page (no tab and URL lines,
            no menus or forms) instead of the whole observation text.
        notes: teacher-force the reference actions' notes (`note [fact]` on its own line
            before the action); without, the notes are dropped and only the action is forced.
        few_shot: the pinned example turns (user text, assistant reply).
        max_obs_tokens: each page is truncated to this many tokens (the agent's default).
    """

    name: str
    main_only: bool = False
    notes: bool = False
    few_shot: tuple[tuple[str, str], ...] = tuple(FEW_SHOT)
    max_obs_tokens: int = AgentConfig.max_obs_tokens

    def page_text(self, observation_text: str) -> str:
        """The page as this format shows it (before truncation)."""
        return main_content(observation_text) if self.main_only else observation_text

    def reply(self, reference: str, concrete: str) -> str:
        """The assistant turn forced for reference action `reference` whose resolved action
        is `concrete`: the action, after the reference's note when this format keeps it."""
        note = NOTE.match(reference)
        return f"note [{note['note']}]\n{concrete}" if self.notes and note else concrete


FORMATS = {
    "agent": RecallFormat("agent"),
    "main": RecallFormat("main", main_only=True),
    "notes": RecallFormat("notes", notes=True, few_shot=NOTE_FEW_SHOT),
}
"""The formats compared in calibration (tasks/README.md, "The recall suite"): the agent's
own prompt and pages; main content only; the agent's prompt with the note convention."""
DEFAULT_FORMAT = FORMATS["notes"]


@dataclass
class Decoded:
    """The final reply.

    Attributes:
        reply: the reply's text as decoded (with a forced prefix, the prefix included).
        answer: the stop answer, or None when the reply is not a stop action.
    """

    reply: str
    answer: str | None


Decoder = Callable[[Conversation], Decoded]
"""Decodes the final reply of a conversation whose prompt is prefilled (the last observation
and the assistant header are in the cache)."""


def forced_stop(max_new_tokens: int = 32, prefix: str = "") -> Decoder:
    """A decoder that teacher-forces `stop [` and `prefix` (a task's `answer_prefix`, e.g.
    `Black wool sweater location:`) and decodes the rest of the answer greedily until `]`, a
    newline or `max_new_tokens` tokens; the answer is `prefix` and what was decoded,
    stripped."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=["]", "\n"])
    forced = STOP_PREFIX + prefix

    def decode(chat: Conversation) -> Decoded:
        chat.force_reply(forced)
        generation = chat.engine.generate(chat.sequence, [], params)
        return Decoded(forced + generation.raw_text, (prefix + generation.text).strip())

    return decode


@dataclass
class RecallRecord:
    """One recall task's outcome; `asdict` of it is a line of `results.jsonl`.

    Attributes:
        task_id: the task.
        sites: its sites.
        k: pages between the fact and the answer (`task.horizon`).
        success: score == 1.0.
        score: the evaluator's score (0.0 on an error).
        answer: the stop answer decoded (None when the reply was not a stop action, or on
            an error).
        reply: the final reply's text.
        history_tokens: tokens in the cache when the answer is decoded: system prompt,
            examples, every page and scripted action, the last page and the assistant
            header (on an error, the tokens fed before it).
        reference_hits: scripted actions that were the model's greedy choice.
        peak_kv_allocated_bytes: the most bytes the KV store's buffers held
            (`peak_allocated_bytes`).
        peak_kv_live_bytes: the most live KV bytes (`StoreFigures.peak_bytes`).
        full_kv_allocated_bytes: what a full KV cache of the tokens seen would allocate.
        full_kv_live_bytes: the live bytes of every token seen (the history and the answer
            decoded) alone, at full precision.
        kv_shared_bytes: bytes of the shared prefix blocks the store reads at the end
            (`PrefixReads.nbytes`; held once for every session, apart from the figures
            above; 0 without prefix sharing).
        peak_cold_kv_bytes: the most bytes the cold tier held (0 without one).
        evicted_tokens: tokens the policy evicted (`StoreFigures.evicted_tokens`).
        reencoded_tokens: tokens the engine encoded again (`StoreFigures.reencoded_tokens`;
            0 without `+reencode`).
        policy: the policy's name; policy_params its settings.
        pin_replies: which forced replies were pinned (`AgentConfig.pin_replies`).
        notes_kept: per step (as a string) whose forced reply begins with a note, the share
            of the note's tokens live when the answer is decoded, averaged over the layers
            (`KVStore.kept_share`; the trace has it after every page).
        positions: "original" or "rerotate".
        model: the model's name.
        weights: its weight format (`--weights`).
        format: the `RecallFormat` name.
        error: why the task could not be answered (e.g. the context overflowed), or None.
        wall_s: seconds for the task.
        trace_dir: where its trace is.
        page_pins: how much of the latest page was pinned (`AgentConfig.page_pins`).
        pin_examples: whether the example turns were pinned (`AgentConfig.pin_examples`).
        peak_pinned_tokens: the most tokens pinned at once (per layer; after each forced
            reply and at the answer): the floor under any budget, with one prefill chunk.
    """

    task_id: int
    sites: list[str]
    k: int
    success: bool
    score: float
    answer: str | None
    reply: str
    history_tokens: int
    reference_hits: int
    peak_kv_allocated_bytes: int
    peak_kv_live_bytes: int
    full_kv_allocated_bytes: int
    full_kv_live_bytes: int
    kv_shared_bytes: int
    peak_cold_kv_bytes: int
    evicted_tokens: int
    reencoded_tokens: int
    policy: str
    policy_params: dict[str, Any]
    pin_replies: str
    notes_kept: dict[str, float]
    positions: str
    model: str
    weights: str
    format: str
    error: str | None
    wall_s: float
    trace_dir: str
    page_pins: str = "whole"
    pin_examples: bool = True
    peak_pinned_tokens: int = 0


def _token_count(chat: Conversation, text: str) -> int:
    return len(chat.engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def _kept(store, span: tuple[int, int]) -> float:
    """The share of the positions `span` that `store` holds now (`KVStore.kept_share`),
    rounded for the trace."""
    return round(store.kept_share(*span), 3)


def _notes_kept(store, notes: dict[str, tuple[int, int]]) -> dict[str, float]:
    """Per step, the share of its note's tokens `store` holds now."""
    return {step: _kept(store, span) for step, span in notes.items()}


def run_recall_task(
    task: Task,
    engine: ChatEngine,
    env: BrowserEnv,
    trace_dir: Path,
    model_name: str = "",
    fmt: RecallFormat = DEFAULT_FORMAT,
    decode: Decoder | None = None,
    on_page: Callable[[int, int], None] | None = None,
    pin_replies: str = "none",
    decisions: DecisionRecorder | None = None,
    page_pins: str = "whole",
    pin_examples: bool = True,
    reference: list[dict[str, Any]] | None = None,
) -> RecallRecord:
    """Replay `task`'s scripted navigation into a fresh conversation of `engine`, decode the
    answer with `decode` (default `forced_stop` with the task's `answer_prefix`), score it,
    and write the trace `trace_dir/recall.json` (each page as shown with its forced action
    and whether it was the greedy choice, the share of each note's tokens live after each page,
    the share of each page's and reply's tokens live when the answer is decoded, the final
    prompt's length, the reply and the record). `on_page(n, pages)`, if given, is called as
    page n of the task's `pages` enters the conversation (progress). `pin_replies` says which
    forced replies are pinned, whole or their notes (`AgentConfig.pin_replies`), and
    `page_pins` how much of the latest page (`AgentConfig.page_pins`), and `pin_examples`
    whether the example turns are pinned. With `reference` (the `pages` of another run's
    trace of the same task, e.g. full KV's), the model reads that run's pages as shown and
    its forced replies, word for word, while `env` replays the task for the evaluation: two
    runs in two browser sessions show different element ids and ports, and this way the two
    caches differ only by their policies. With
    `decisions`, the model's own action is also decoded at each scripted step and written to
    `trace_dir` (`agent_kv.harness.decisions`).

    Raises:
        envs.browser_env.ActionError: a scripted action names no element of its page or
            fails on it (a broken task, not a model failure); the message names the task, the
            step and the action.
        ValueError: `reference` has not one page per page of the task.
        playwright Error: the browser failed.
    """
    if reference is not None and len(reference) != len(task.reference_actions):
        raise ValueError(
            f"task {task.task_id}: the reference run has {len(reference)} pages, the task "
            f"{len(task.reference_actions)}"
        )
    decode = decode or forced_stop(prefix=task.answer_prefix)
    started = time.perf_counter()
    trace_dir.mkdir(parents=True, exist_ok=True)
    config = AgentConfig(max_obs_tokens=fmt.max_obs_tokens)
    chat = open_conversation(
        engine, task.intent, few_shot=fmt.few_shot, page_pins=page_pins, pin_examples=pin_examples
    )
    replay = _Replay(chat, decisions=decisions, reference=reference)
    decoded, error, history = Decoded("", None), None, 0
    observation = env.reset(task)
    try:
        _replay_script(replay, task, env, observation, fmt, config, pin_replies, on_page)
        chat.prefill()
        replay.count_pinned()
        history = chat.sequence.store.seen_tokens
        notes_kept = replay.notes_kept()
        replay.mark_kept_at_answer()
        decoded = decode(chat)
    except ContextOverflowError as err:
        error, history = str(err), chat.sequence.store.seen_tokens
        notes_kept = replay.notes_kept()
    if error is None:
        verdict = evaluate(task, decoded.answer, env.url, env.servers, env.read_page)
        score = verdict.score
    else:
        score = 0.0
    store = chat.sequence.store  # as the episode ends (`Engine.reencode` replaces it)
    record = RecallRecord(
        task_id=task.task_id,
        sites=task.sites,
        k=task.horizon,
        success=score == 1.0,
        score=score,
        answer=decoded.answer,
        reply=decoded.reply,
        history_tokens=history,
        reference_hits=replay.hits,
        **KVFigures.of(store).fields_of(RecallRecord),
        policy=engine.policy.name,
        policy_params=engine.policy.params(),
        pin_replies=pin_replies,
        notes_kept=notes_kept,
        positions=store.positions_mode,
        model=model_name,
        weights=weight_format(engine.model),
        format=fmt.name,
        error=error,
        wall_s=round(time.perf_counter() - started, 2),
        trace_dir=str(trace_dir),
        page_pins=page_pins,
        pin_examples=pin_examples,
        peak_pinned_tokens=replay.peak_pinned_tokens,
    )
    if decisions is not None:
        decisions.write(trace_dir)
    trace = {"intent": task.intent, "pages": replay.pages, "record": asdict(record)}
    (trace_dir / TRACE_JSON).write_text(json.dumps(trace, indent=2, default=str))
    return record


def read_trace_pages(trace_dir: Path) -> list[dict[str, Any]]:
    """The pages of the scripted run traced in `trace_dir`, as shown (`scripted_episode`'s
    `reference` for a run that reads them).

    Raises:
        FileNotFoundError: `trace_dir` holds no scripted run's trace.
    """
    return json.loads((trace_dir / TRACE_JSON).read_text())["pages"]


@dataclass
class _Replay:
    """A recall task's replay so far (what a context overflow leaves is kept too).

    Attributes:
        chat: the conversation.
        pages: each page's trace entry, in order.
        page_messages: each page's message index in `chat`.
        notes: per step (as a string) whose forced reply begins with a note, the note's token
            positions `(start, end)`.
        hits: scripted actions that were the model's greedy choice.
        decisions: records the model's own action at each step, or None.
        reference: another run's pages of the task, read instead of the env's (None: the
            env's).
        peak_pinned_tokens: the most tokens pinned at once so far (`count_pinned`).
    """

    chat: Conversation
    pages: list[dict[str, Any]] = field(default_factory=list)
    page_messages: list[int] = field(default_factory=list)
    notes: dict[str, tuple[int, int]] = field(default_factory=dict)
    hits: int = 0
    decisions: DecisionRecorder | None = None
    reference: list[dict[str, Any]] | None = None
    peak_pinned_tokens: int = 0

    def count_pinned(self) -> int:
        """The tokens pinned now (per layer), also raising `peak_pinned_tokens`."""
        pinned = self.chat.sequence.store.pins.tokens()
        self.peak_pinned_tokens = max(self.peak_pinned_tokens, pinned)
        return pinned

    def notes_kept(self) -> dict[str, float]:
        """Per step, the share of its note's tokens the store holds now."""
        return _notes_kept(self.chat.sequence.store, self.notes)

    def mark_kept_at_answer(self) -> None:
        """Set on each page's trace entry the share of its tokens (`kept_at_answer`) and of its
        reply's, when it has one (`reply_kept_at_answer`), the store holds now."""
        store, spans = self.chat.sequence.store, self.chat.spans
        for page, message in zip(self.pages, self.page_messages, strict=True):
            page["kept_at_answer"] = _kept(store, spans[message])
            if message + 1 < len(spans):
                page["reply_kept_at_answer"] = _kept(store, spans[message + 1])


def _replay_script(
    replay: _Replay,
    task: Task,
    env: BrowserEnv,
    observation: dict[str, Any],
    fmt: RecallFormat,
    config: AgentConfig,
    pin_replies: str,
    on_page: Callable[[int, int], None] | None,
) -> None:
    """Feed `task`'s pages into `replay.chat` from `observation` (the env's first page), each
    scripted action but the last forced as the reply to its page and taken in `env`.

    Raises:
        envs.browser_env.ActionError: as `run_recall_task`.
    """
    chat = replay.chat
    script = [*task.reference_actions[:-1], None]
    for number, action in enumerate(script, start=1):
        if on_page is not None:
            on_page(number, len(script))
        if replay.reference is None:
            shown = add_observation(chat, fmt.page_text(observation["text"]), task.intent, config)
        else:
            shown = replay.reference[number - 1]["observation"]
            add_shown_observation(chat, shown, task.intent)
        replay.page_messages.append(len(chat.messages) - 1)
        page = {
            "step": number,
            "url": observation["url"],
            "tabs": len(observation["tabs"]),
            "observation": shown,
        }
        replay.pages.append(page)
        if action is None:
            break
        observation = _force_action(replay, task, env, fmt, pin_replies, number, action, page)


def _force_action(
    replay: _Replay,
    task: Task,
    env: BrowserEnv,
    fmt: RecallFormat,
    pin_replies: str,
    number: int,
    action: str,
    page: dict[str, Any],
) -> dict[str, Any]:
    """Force scripted `action` of step `number` as the reply to the latest page, note it on
    the page's trace entry `page`, take it in `env` and return the next observation.

    Raises:
        envs.browser_env.ActionError: as `run_recall_task`.
    """
    chat = replay.chat
    try:
        concrete = env.concrete_action(action)
    except ActionError as error:
        raise ActionError(f"task {task.task_id} step {number} {action}: {error}") from None
    if replay.reference is None:
        reply = fmt.reply(action, concrete)
    else:
        reply = replay.reference[number - 1]["action"]
    note = NOTE.match(reply)
    note_tokens = _token_count(chat, note[0].rstrip()) if note else 0
    if replay.decisions is not None:
        replay.decisions.decide(chat, number, page["observation"], page["tabs"], concrete)
    keep = replay.decisions is not None
    forced = chat.force_reply(
        reply, keep_distributions=keep, pin=reply_pin(pin_replies, note_tokens)
    )
    if keep:
        replay.decisions.forced(forced.distributions, note_tokens)
    replay.hits += forced.greedy
    if note:
        start = chat.spans[len(chat.messages) - 1][0]
        replay.notes[str(number)] = (start, start + note_tokens)
    page.update(
        action=reply,
        greedy=forced.greedy,
        tokens_seen=chat.sequence.store.seen_tokens,
        pinned_tokens=replay.count_pinned(),
        notes_kept=replay.notes_kept(),
    )
    observation = env.step(concrete).observation
    if observation["error"] is not None:
        raise ActionError(f"task {task.task_id} step {number} {action}: {observation['error']}")
    return observation


def run_recall(
    tasks: Iterable[Task],
    engine: ChatEngine | Callable[[], ChatEngine],
    env: BrowserEnv,
    out_dir: Path,
    model_name: str = "",
    fmt: RecallFormat = DEFAULT_FORMAT,
    decode: Decoder | None = None,
    on_record: Callable[[RecallRecord], None] | None = None,
) -> list[RecallRecord]:
    """Run recall tasks one after another, each in a fresh conversation.

    Args:
        tasks: e.g. `envs.tasks.load_suite("recall")`.
        engine: the engine (one conversation per task on it), or a zero-argument factory
            called once per task (a new policy object per task).
        env: a browser env whose servers serve every site of the tasks.
        out_dir: created; each task's trace goes to `out_dir/task<id>/`, and each record is
            appended to `out_dir/results.jsonl` as it is done.
        model_name: the model's name for the records.
        fmt: what the agent sees of each page (`FORMATS`).
        decode: how the final reply is decoded (default `forced_stop` with each task's
            `answer_prefix`).
        on_record: called with each record as it is done (progress output).

    Returns:
        One record per task, in order.

    Raises:
        What `run_recall_task` raises; OSError when `out_dir` cannot be written.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    records = []
    with (out_dir / RESULTS).open("a", encoding="utf-8") as results:
        for task in tasks:
            current = engine if isinstance(engine, ChatEngine) else engine()
            trace = out_dir / f"task{task.task_id}"
            record = run_recall_task(task, current, env, trace, model_name, fmt, decode)
            results.write(json.dumps(asdict(record)) + "\n")
            results.flush()
            records.append(record)
            if on_record is not None:
                on_record(record)
    return records


def scripted_episode(
    task: Task,
    engine: ChatEngine,
    env: BrowserEnv,
    trace_dir: Path,
    model_name: str,
    config: AgentConfig,
    on_page: Callable[[int, int], None] | None = None,
    decisions: DecisionRecorder | None = None,
    reference: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One recall task as an episode of `run-episode --mode scripted` and of a scripted
    sweep: `run_recall_task` in the default format with pages truncated to
    `config.max_obs_tokens`, the replies and the page pinned as `config.pin_replies` and
    `config.page_pins` say (the examples too unless `config.pin_examples` is False), returned
    as
    `episode_summary` of its record; with `decisions`, the model's own action at each step is
    recorded in `trace_dir` too (`agent_kv.harness.decisions`); with `reference`, another
    run's pages and replies are read (`run_recall_task`). Raises what `run_recall_task`
    raises."""
    fmt = replace(DEFAULT_FORMAT, max_obs_tokens=config.max_obs_tokens)
    record = run_recall_task(
        task, engine, env, trace_dir, model_name, fmt, on_page=on_page,
        pin_replies=config.pin_replies, decisions=decisions, page_pins=config.page_pins,
        pin_examples=config.pin_examples, reference=reference,
    )  # fmt: skip
    return episode_summary(record)


def episode_summary(record: RecallRecord) -> dict[str, Any]:
    """`record` in the terms of a free episode's summary (`EpisodeResult.summary`): its
    fields, plus `end_reason` ("stop", or "error" with `error` saying why), `steps` (1: the
    one free decision) and the KV reductions against full KV (`agent.kv_reductions`)."""
    failed = record.error is not None
    return {
        **asdict(record),
        "end_reason": "error" if failed else "stop",
        "steps": 1,
        **kv_reductions(record),
    }


def success_by_k(records: Iterable[RecallRecord]) -> dict[int, dict[str, int]]:
    """Per k (ascending): `tasks`, `solved`, and `errors` (tasks that could not run to an
    answer, e.g. past the context under full KV)."""
    table: dict[int, dict[str, int]] = {}
    for record in records:
        row = table.setdefault(record.k, {"tasks": 0, "solved": 0, "errors": 0})
        row["tasks"] += 1
        row["solved"] += record.success
        row["errors"] += record.error is not None
    return dict(sorted(table.items()))


def format_by_k(records: Iterable[RecallRecord]) -> str:
    """`success_by_k` as a markdown table, with the mean history length (tokens) of the
    tasks answered ("–" when every task of a k ended in an error)."""
    records = list(records)
    lines = [
        "| k | tasks | solved | errors | mean history tokens (answered) |",
        "|---|---|---|---|---|",
    ]
    for k, row in success_by_k(records).items():
        tokens = [r.history_tokens for r in records if r.k == k and r.error is None]
        mean = str(round(sum(tokens) / len(tokens))) if tokens else "–"
        lines.append(f"| {k} | {row['tasks']} | {row['solved']} | {row['errors']} | {mean} |")
    return "\n".join(lines)
