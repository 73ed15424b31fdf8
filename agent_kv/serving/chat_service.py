"""Chat turns in managed sessions: the one code path behind every front end (the server's
`/v1/chat/completions` and `/chat`, and the in-process LangChain model).

A turn renders the messages with the model's chat template and tokenizes them, once
(`agent_kv.runtime.chat.layout`; only the text from the session's last generation prompt on
when the rendering extends it, `agent_kv.serving.last_prompts`); then, holding the session, a
`ChatSession` over its sequence (the session object the agent's `Conversation` runs on too)
matches the tokens against the history so only what is new is prefilled
(`agent_kv.runtime.chat.history_sync`) and pins what the rules protect
(`agent_kv.runtime.chat.pin_rules`); then the reply is decoded.

Which session a turn runs in:
- a turn naming a session id runs in that session (created on first use);
- a turn without one looks for an anonymous session that this conversation continues: one
  whose last prompt is a prefix of the new prompt (a stateless client resending the whole
  conversation each turn). The longest such match is reused; otherwise a new anonymous
  session (id `auto-...`, reported back so the client can name it) is made. The newest
  `max_anonymous` anonymous sessions are kept.

Turns run together: each is a row of the service's `BatchScheduler` (continuous batching:
every running turn's next decode token, and the next prefill chunk of one still prefilling,
in one forward call per step), each with its own session store, policy, pins and sampling.
A turn is first admitted (`admit`): at most `max_waiting` turns may be admitted and not yet
running (then `QueueFullError`, at once); only then is its prompt templated, tokenized and
checked. It then waits, at most `queue_timeout_s` seconds in all (then `QueueTimeoutError`),
for its session (turns to one session run one after another), for room under the session
store's KV cap (its session reserves the most KV it can hold during the turn,
`turn_kv_bound`, so the cap holds while every running turn grows), and for a place in the
batch (`max_batch`, and the same cap over the running turns' KV bounds: the scheduler admits
by bytes too). A turn given a `cancel` event stops at the next wait slice, prefill chunk
or decode step once it is set (`TurnCancelled`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial

from agent_kv.errors import AgentKVError, ConfigError, ContextOverflowError
from agent_kv.kv.kv_figures import KVFigures
from agent_kv.kv.policies import Policy, check_policy_precision
from agent_kv.runtime.chat.history_sync import HistorySync, plan_history_sync
from agent_kv.runtime.chat.layout import RenderedChat, placed_chat
from agent_kv.runtime.chat.pin_rules import ChatPins, PinRules
from agent_kv.runtime.chat.rendering import render_chat
from agent_kv.runtime.chat.session import ChatSession
from agent_kv.runtime.engine.batch_scheduler import BatchScheduler
from agent_kv.runtime.engine.engine import Engine, Generation
from agent_kv.runtime.engine.sequence import CallRecord, SequenceOutline
from agent_kv.runtime.replies.sampling import SamplingParams
from agent_kv.runtime.replies.tool_calls import ReplySpec, Tool, ToolCall, call_check, parse_reply
from agent_kv.serving.issued_calls import IssuedCalls
from agent_kv.serving.last_prompts import LastPrompts
from agent_kv.serving.session_store import SessionStore
from agent_kv.valid_text import check_unicode

ANONYMOUS_PREFIX = "auto-"


class QueueFullError(AgentKVError):
    """Too many turns are already waiting for the model."""


class Admission:
    """A turn's place among those admitted and not yet running (`ChatService.admit`). It is
    given up when the turn joins the batch or ends; `release` may be called more than once."""

    def __init__(self, service: ChatService):
        self._service = service
        self._held = True

    def release(self) -> None:
        """Give the place up (idempotent)."""
        with self._service._count_lock:
            if self._held:
                self._held = False
                self._service._waiting -= 1

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class ConfidenceSummary:
    """CONF-KV's confidence `c` (docs/methods.md, CONF-KV §1) over the forward calls of one
    turn whose logits chose the budget (the prompt's last chunk and every decode step).

    Attributes:
        last: `c` of the last call.
        mean: mean `c`.
        min: lowest `c`.
        steps: calls counted.
    """

    last: float
    mean: float
    min: float
    steps: int

    @classmethod
    def of(cls, steps: list[CallRecord]) -> ConfidenceSummary | None:
        """The summary of `steps`' gated calls; None when there is none."""
        values = [step.confidence for step in steps if step.gated]
        if not values:
            return None
        return cls(values[-1], sum(values) / len(values), min(values), len(values))


@dataclass
class KVReport(KVFigures):
    """What a session's KV cache holds after a turn: its figures (`KVFigures`, the record
    every front end reports) and the turn's setting.

    Attributes:
        policy: the policy that managed this turn.
        session_id: the session the turn ran in.
        rebuild: how the prompt met the history: "none", "truncated" or "scratch"
            (`HistorySync.rebuild`).
        confidence: the turn's confidence summary (None when it ran no gated call).
        kv_bytes: deprecated alias of `kv_live_bytes`, removed in the next release.
        peak_kv_bytes: deprecated alias of `peak_kv_live_bytes`, removed in the next release.
        full_kv_bytes: deprecated alias of `full_kv_live_bytes`, removed in the next release.
    """

    policy: str
    session_id: str
    rebuild: str
    confidence: ConfidenceSummary | None
    kv_bytes: int = field(init=False)
    peak_kv_bytes: int = field(init=False)
    full_kv_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.kv_bytes = self.kv_live_bytes
        self.peak_kv_bytes = self.peak_kv_live_bytes
        self.full_kv_bytes = self.full_kv_live_bytes


@dataclass
class ChatTurn:
    """A finished turn.

    Attributes:
        reply: the generated reply.
        sync: how the prompt was matched against the session's history.
        kv: the cache's figures after the turn.
        ttft_s: seconds from the turn joining the batch to the first reply token (prefill of
            the new tokens included).
        wait_s: seconds the turn waited for its session, KV room and a place in the batch.
        evicted_in_turn: tokens evicted during this turn, summed over layers.
        quantized_in_turn: tokens moved to INT8 during this turn, summed over layers.
        content: the reply's text, "" when the reply is tool calls (`parse_reply`).
        tool_calls: the tool calls the reply made (none without a `ReplySpec` offering tools).
    """

    reply: Generation
    sync: HistorySync
    kv: KVReport
    ttft_s: float
    wait_s: float
    evicted_in_turn: int
    quantized_in_turn: int
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "tool_calls" for a reply of calls, else the generation's."""
        return "tool_calls" if self.tool_calls else self.reply.finish_reason

    @property
    def prompt_tokens(self) -> int:
        """Tokens of the prompt: reused from the cache plus prefilled."""
        return self.sync.reused_tokens + self.sync.prefilled_tokens


class ChatService:
    """Runs chat turns of one engine in managed sessions.

    Args:
        engine: the model, its tokenizer and the default policy.
        sessions: where sessions live (default: an uncapped store without TTL).
        rules: the default pin rules (default: the system message and the latest tool
            message).
        max_waiting: turns allowed to wait for the model at once.
        queue_timeout_s: seconds a turn may wait for its session, KV room and the batch.
        max_anonymous: anonymous sessions kept (the newest).
        max_batch: turns running at once as rows of one forward call
            (`agent_kv.runtime.engine.batch_scheduler`); 1 serves one turn at a time.

    Raises:
        ValueError: a non-positive limit.
    """

    def __init__(
        self,
        engine: Engine,
        sessions: SessionStore | None = None,
        rules: PinRules | None = None,
        max_waiting: int = 32,
        queue_timeout_s: float = 600.0,
        max_anonymous: int = 16,
        max_batch: int = 16,
    ):
        for name, value in [
            ("max_waiting", max_waiting),
            ("queue_timeout_s", queue_timeout_s),
            ("max_anonymous", max_anonymous),
            ("max_batch", max_batch),
        ]:
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.engine = engine
        self.sessions = sessions or SessionStore(engine)
        self.rules = rules or PinRules()
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.max_anonymous = max_anonymous
        self.scheduler = BatchScheduler(engine, max_batch, max_kv_bytes=self.sessions.max_kv_bytes)
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._anonymous_lock = threading.Lock()
        self._anonymous: OrderedDict[str, int] = OrderedDict()  # id -> its last prompt length
        self._claimed: set[str] = set()  # anonymous sessions a turn has chosen and not ended
        self.issued_calls = IssuedCalls()
        self.last_prompts = LastPrompts(ANONYMOUS_PREFIX)

    def queue_full(self) -> bool:
        """Whether a turn admitted now would be refused with `QueueFullError`."""
        with self._count_lock:
            return self._waiting >= self.max_waiting

    def admit(self) -> Admission:
        """A place for one turn among those waiting for the model: cheap, done before any
        templating or tokenizing, so a flood of requests is refused before it costs work.

        Raises:
            QueueFullError: `max_waiting` turns are already admitted and not yet running.
        """
        with self._count_lock:
            if self._waiting >= self.max_waiting:
                raise QueueFullError(
                    f"{self._waiting} requests are already waiting for the model; retry later"
                )
            self._waiting += 1
        return Admission(self)

    def render(
        self, messages: list[dict], tools: Sequence[Tool] = (), session_id: str | None = None
    ) -> RenderedChat:
        """`messages` (`{"role", "content"}` dicts, see `agent_kv.runtime.chat.rendering`)
        rendered with the chat template, the `tools` offered and the generation prompt, once,
        tokenized once (only from the generation prompt on of the last prompt the rendering
        extends, of the session `session_id` or, for None, of an anonymous one:
        `last_prompts`), each message placed (`placed_chat`).

        Raises:
            ConfigError: a message whose content is not a string of valid Unicode (a lone
                UTF-16 surrogate), which no tokenizer takes, or a chat template that
                re-renders earlier messages when one is added.
        """
        for i, message in enumerate(messages):
            content = message.get("content")
            if not isinstance(content, str):
                raise ConfigError(f"messages[{i}].content must be a string")
            check_unicode(content, f"messages[{i}].content")
        tokenizer = self.engine.tokenizer
        text = render_chat(tokenizer, messages, tools, generation_prompt=True)
        previous = self.last_prompts.find(session_id, text)
        return placed_chat(tokenizer, messages, tools, text, previous)

    def check_fits(self, prompt_tokens: int, max_new_tokens: int, policy: Policy | None = None):
        """Refuse, before any compute, a turn that cannot fit the model's context: with
        original positions the prompt plus `max_new_tokens` must fit. With `rerotate`
        positions and a budgeted policy every position stays inside the context whatever the
        length, so nothing is refused here.

        Raises:
            ContextOverflowError: the turn cannot fit.
        """
        limit = self.engine.model.config.max_position_embeddings
        policy = policy or self.engine.policy
        if self.engine.store_options["rerotate"] and policy.budget(None) is not None:
            return
        if prompt_tokens + max_new_tokens > limit:
            raise ContextOverflowError(
                f"prompt of {prompt_tokens} tokens plus max_tokens={max_new_tokens} exceeds "
                f"the model's context of {limit} tokens"
            )

    def run(
        self,
        messages: list[dict],
        params: SamplingParams,
        session_id: str | None = None,
        rules: PinRules | None = None,
        policy: Policy | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        admission: Admission | None = None,
        on_start: Callable[[str], None] | None = None,
        reply: ReplySpec | None = None,
    ) -> ChatTurn:
        """Run one turn.

        Args:
            messages: the whole conversation so far, `{"role", "content"}` dicts (optionally
                `"pin": True`); a call this service generated, sent back re-serialised, is
                rendered as generated (`IssuedCalls.restore`).
            params: sampling parameters.
            session_id: the session to run in; None matches an anonymous one by prefix.
            rules: pin rules for this turn (default: the service's).
            policy: a policy for this turn only (default: the engine's).
            on_text: receives the reply's text as it grows (`Engine.generate`).
            cancel: once set, the turn stops at its next check (`TurnCancelled`).
            admission: the turn's place from `admit` (default: admitted here).
            on_start: called with the session id once the turn holds its
                session, before any prefill.
            reply: the tools offered, the tool choice and the reply format
                (`agent_kv.runtime.replies.tool_calls`): the tools are rendered into the prompt, the
                reply is decoded under `ReplySpec.grammar` (unless `params.grammar` is set)
                and split into `content` and `tool_calls`.

        Raises:
            ConfigError: invalid sampling parameters (a `logit_bias` token outside the
                vocabulary included), pin rules or message text, or a `policy` that cannot run
                on the engine's store; `GrammarError` (one) for a reply spec whose grammar
                cannot be built. Stop strings apply to the reply's free text only
                (`ReplySpec.scope_stop`).
            ContextOverflowError: the turn cannot fit the model's context.
            KVCapacityError: the turn could hold more KV than the session store's cap.
            QueueFullError, QueueTimeoutError: the model is too busy.
            TurnCancelled: `cancel` was set.
        """
        with admission or self.admit() as admitted:
            params.validate(self.engine.model.config.vocab_size)
            rules = rules or self.rules
            rules.validate()
            reply = reply or ReplySpec()
            calls = reply.call_format(self.engine.tokenizer)
            params = reply.scope_stop(params, calls)
            if params.grammar is None:
                params = replace(params, grammar=reply.grammar(calls))
            if params.grammar is not None:
                self.engine.grammars.matcher(params.grammar)  # refuse it before any compute
            messages = self.issued_calls.restore(messages)
            chat = self.render(messages, reply.tools, session_id)
            self.check_fits(len(chat.token_ids), params.max_new_tokens, policy)
            deadline = time.monotonic() + self.queue_timeout_s
            turn = self._run_turn(
                messages, reply.tools, rules, chat, params, session_id,
                policy or self.engine.policy, on_text, cancel, on_start, admitted, deadline,
            )  # fmt: skip
            check = call_check(reply, calls, self.engine.grammars)
            turn.content, turn.tool_calls = parse_reply(turn.reply.text, reply, calls, check)
            self.issued_calls.record(turn.tool_calls)
            return turn

    def _run_turn(
        self, messages, tools, rules, chat, params, session_id, policy, on_text, cancel,
        on_start, admitted, deadline,
    ) -> ChatTurn:  # fmt: skip
        """The part of `run` that holds the session and runs in the batch: the turn is a
        `ChatSession` over the session's sequence that takes the client's whole chat
        (`ChatSession.take_chat`: a stateless client resends it every turn)."""
        queued = time.perf_counter()
        prompt_ids = chat.token_ids
        anonymous = session_id is None
        if anonymous:
            session_id = self._anonymous_session(prompt_ids)
        pins = ChatPins.choose(chat, messages, rules)  # once: the reservation and the turn
        need = partial(
            self.turn_kv_bound, policy, prompt_ids, pins.pinned_tokens, params.max_new_tokens
        )
        joined, ran = [], False
        try:
            with self.sessions.use(session_id, need, policy.name, cancel, deadline) as session:
                check_policy_precision(policy, None, session.store)
                if on_start is not None:
                    on_start(session_id)
                evicted, quantized = (
                    session.store.figures.evicted_tokens,
                    session.store.figures.quantized_tokens,
                )
                steps_before = len(session.steps)
                session_chat = ChatSession(session, tools, rules)
                prompt = session_chat.take_chat(chat, self.engine.new_sequence, messages, pins)
                sync = prompt.sync
                if sync.rebuild == "scratch":
                    evicted, quantized, steps_before = 0, 0, 0

                def on_join() -> None:
                    joined.append(time.perf_counter())
                    admitted.release()

                reply = self.scheduler.generate(
                    session, prompt.token_ids, params, policy, on_text, cancel, on_join,
                    deadline,
                )  # fmt: skip
                store = session.store
                report = KVReport(
                    **asdict(session_chat.figures()),
                    policy=policy.name,
                    session_id=session_id,
                    rebuild=sync.rebuild,
                    confidence=ConfidenceSummary.of(session.steps[steps_before:]),
                )
                ran = True
            self.last_prompts.remember(session_id, chat, self.sessions.in_memory())
        finally:
            if anonymous:
                self._release_anonymous(session_id, len(prompt_ids) if ran else None)
        return ChatTurn(
            reply=reply,
            sync=sync,
            kv=report,
            ttft_s=reply.ttft_s,
            wait_s=joined[0] - queued,
            evicted_in_turn=store.figures.evicted_tokens - evicted,
            quantized_in_turn=store.figures.quantized_tokens - quantized,
        )

    def turn_kv_bound(
        self,
        policy: Policy,
        prompt_ids: list[int],
        pinned_tokens: int,
        max_new_tokens: int,
        outline: SequenceOutline,
    ) -> int:
        """The most allocated KV bytes the session `outline` describes can hold during one
        turn of `prompt_ids` (`pinned_tokens` of them pinned) and up to `max_new_tokens`, as
        the engine's `KVMemory` bounds it (`KVMemory.allocated_bound`), and never less than
        it holds now.

        The turn appends what `prepare_history` leaves to prefill (the prompt past the history
        it shares) and the reply, to layers cut back to the shared history when the client
        changed it; a cache rebuilt from scratch starts as a new session's, after the old one
        is let go (`SequenceState.restart`).
        """
        sync = plan_history_sync(
            outline.token_ids, prompt_ids, outline.changed_at, outline.intact_tokens
        )
        footprint = outline.footprint
        if sync.rebuild == "scratch":
            footprint = self.sessions.fresh.footprint
        kept = sync.reused_tokens if sync.rebuild == "truncated" else None
        appended = sync.prefilled_tokens + max_new_tokens
        bound = self.engine.kv_memory.allocated_bound(
            footprint, policy, appended, pinned_tokens, kept
        )
        return max(bound, outline.footprint.allocated_bytes)

    def _anonymous_session(self, prompt_ids: list[int]) -> str:
        """The anonymous session this prompt continues, or a new one; claimed by the turn
        (no other turn chooses it) until `_release_anonymous`."""
        with self._anonymous_lock:
            known = set(self.sessions.ids())
            for sid in [sid for sid in self._anonymous if sid not in known]:
                if sid not in self._claimed:
                    del self._anonymous[sid]  # dropped by the TTL or the byte cap
            candidates = {s: n for s, n in self._anonymous.items() if s not in self._claimed}
            match = self.sessions.longest_prefix(prompt_ids, candidates)
            if match is None:
                while len(self._anonymous) >= self.max_anonymous:
                    idle = [sid for sid in self._anonymous if sid not in self._claimed]
                    if not idle:
                        break
                    del self._anonymous[idle[0]]
                    self.sessions.drop(idle[0])
                match = f"{ANONYMOUS_PREFIX}{uuid.uuid4().hex[:16]}"
                self._anonymous[match] = 0
            self._claimed.add(match)
            return match

    def _release_anonymous(self, session_id: str, prompt_tokens: int | None) -> None:
        """The turn in anonymous session `session_id` ended, having run a prompt of
        `prompt_tokens` (None: it failed), which a later prompt must continue to reuse the
        session."""
        with self._anonymous_lock:
            self._claimed.discard(session_id)
            if prompt_tokens is not None and session_id in self._anonymous:
                self._anonymous[session_id] = prompt_tokens
                self._anonymous.move_to_end(session_id)
