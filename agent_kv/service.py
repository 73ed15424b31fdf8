"""Chat turns in managed sessions: the one code path behind every front end (the server's
`/v1/chat/completions` and `/chat`, and the in-process LangChain model).

A turn renders the messages with the model's chat template, matches the tokens against the
session's history so only what is new is prefilled (`sync_history`), pins what the rules
protect (`protection`), and decodes the reply.

Which session a turn runs in:
- a turn naming a session id runs in that session (created on first use);
- a turn without one looks for an anonymous session that this conversation continues: one
  whose last prompt is a prefix of the new prompt (a stateless client resending the whole
  conversation each turn). The longest such match is reused; otherwise a new anonymous
  session (id `auto-...`, reported back so the client can name it) is made. The newest
  `max_anonymous` anonymous sessions are kept.

Model calls run one at a time (the engine owns one model): a turn waits for the model at
most `queue_timeout_s` seconds (then `QueueTimeoutError`), and at most `max_waiting` turns
may wait at once (then `QueueFullError`).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

from agent_kv.engine import Engine, Generation, check_policy_precision
from agent_kv.errors import AgentKVError, ContextOverflowError
from agent_kv.policies import Policy
from agent_kv.protection import PinRules, protected_spans
from agent_kv.sampling import SamplingParams
from agent_kv.session import StepRecord
from agent_kv.sessions import HistorySync, SessionStore, sync_history

ANONYMOUS_PREFIX = "auto-"


class QueueFullError(AgentKVError):
    """Too many turns are already waiting for the model."""


class QueueTimeoutError(AgentKVError):
    """A turn waited longer than the service's `queue_timeout_s` for the model."""


@dataclass
class ConfidenceSummary:
    """CONF-KV's confidence `c` (methods.md §2) over the forward calls of one turn whose
    logits chose the budget (the prompt's last chunk and every decode step).

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
    def of(cls, steps: list[StepRecord]) -> ConfidenceSummary | None:
        """The summary of `steps`' gated calls; None when there is none."""
        values = [step.confidence for step in steps if step.gated]
        if not values:
            return None
        return cls(values[-1], sum(values) / len(values), min(values), len(values))


@dataclass
class KVReport:
    """What a session's KV cache holds after a turn.

    Attributes:
        policy: the policy that managed this turn.
        session_id: the session the turn ran in.
        rebuild: how the prompt met the history: "none", "truncated" or "scratch"
            (`HistorySync.rebuild`).
        kv_bytes: live KV bytes now.
        peak_kv_bytes: the most live KV bytes the session's cache has held.
        full_kv_bytes: what full KV at full precision would hold for the session's tokens.
        evicted_tokens: tokens the session's cache has evicted, summed over layers.
        quantized_tokens: tokens moved to INT8, summed over layers.
        pinned_tokens: positions pinned now.
        confidence: the turn's confidence summary (None when it ran no gated call).
    """

    policy: str
    session_id: str
    rebuild: str
    kv_bytes: int
    peak_kv_bytes: int
    full_kv_bytes: int
    evicted_tokens: int
    quantized_tokens: int
    pinned_tokens: int
    confidence: ConfidenceSummary | None


@dataclass
class ChatTurn:
    """A finished turn.

    Attributes:
        reply: the generated reply.
        sync: how the prompt was matched against the session's history.
        kv: the cache's figures after the turn.
        ttft_s: seconds from the model being free for this turn to the first reply token
            (prefill of the new tokens included).
        wait_s: seconds the turn waited for the model.
        evicted_in_turn: tokens evicted during this turn, summed over layers.
        quantized_in_turn: tokens moved to INT8 during this turn, summed over layers.
    """

    reply: Generation
    sync: HistorySync
    kv: KVReport
    ttft_s: float
    wait_s: float
    evicted_in_turn: int
    quantized_in_turn: int

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
        queue_timeout_s: seconds a turn may wait for the model.
        max_anonymous: anonymous sessions kept (the newest).

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
    ):
        for name, value in [
            ("max_waiting", max_waiting),
            ("queue_timeout_s", queue_timeout_s),
            ("max_anonymous", max_anonymous),
        ]:
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.engine = engine
        self.sessions = sessions or SessionStore(engine)
        self.rules = rules or PinRules()
        self.max_waiting = max_waiting
        self.queue_timeout_s = queue_timeout_s
        self.max_anonymous = max_anonymous
        self._model_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._waiting = 0
        self._anonymous: OrderedDict[str, int] = OrderedDict()  # id -> its last prompt length

    def queue_full(self) -> bool:
        """Whether a turn started now would be refused with `QueueFullError`."""
        with self._count_lock:
            return self._waiting >= self.max_waiting

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The tokens of `messages` (`{"role", "content"}` dicts) rendered with the chat
        template and the generation prompt."""
        prompt = self.engine.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return self.engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]

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
    ) -> ChatTurn:
        """Run one turn.

        Args:
            messages: the whole conversation so far, `{"role", "content"}` dicts (optionally
                `"pin": True`).
            params: sampling parameters.
            session_id: the session to run in; None matches an anonymous one by prefix.
            rules: pin rules for this turn (default: the service's).
            policy: a policy for this turn only (default: the engine's).
            on_text: receives the reply's text as it grows (`Engine.generate`).

        Raises:
            ConfigError: invalid sampling parameters or pin rules, or a `policy` that
                cannot run on the engine's store.
            ContextOverflowError: the turn cannot fit the model's context.
            QueueFullError, QueueTimeoutError: the model is too busy.
        """
        params.validate()
        rules = rules or self.rules
        rules.validate()
        if policy is not None:
            check_policy_precision(policy, self.engine.store_options["int8"])
        prompt_ids = self.prompt_ids(messages)
        self.check_fits(len(prompt_ids), params.max_new_tokens, policy)
        queued = time.perf_counter()
        with self._model(policy):
            started = time.perf_counter()
            if session_id is None:
                session_id = self._anonymous_session(prompt_ids)
            with self.sessions.use(session_id) as session:
                check_policy_precision(self.engine.policy, None, session.store)
                evicted, quantized = session.store.evicted_tokens, session.store.quantized_tokens
                store_before, steps_before = session.store, len(session.steps)
                pins = protected_spans(self.engine.tokenizer, messages, rules)
                sync = sync_history(self.engine, session, prompt_ids, pins)
                if session.store is not store_before:  # rebuilt from scratch
                    evicted, quantized, steps_before = 0, 0, 0
                prefilled = time.perf_counter()
                reply = self.engine.generate(session, [], params, on_text)
                store = session.store
                report = KVReport(
                    policy=self.engine.policy.name,
                    session_id=session_id,
                    rebuild=sync.rebuild,
                    kv_bytes=store.nbytes(),
                    peak_kv_bytes=store.peak_bytes,
                    full_kv_bytes=store.full_kv_nbytes(),
                    evicted_tokens=store.evicted_tokens,
                    quantized_tokens=store.quantized_tokens,
                    pinned_tokens=store.pinned_tokens(),
                    confidence=ConfidenceSummary.of(session.steps[steps_before:]),
                )
            if session_id in self._anonymous:
                self._anonymous[session_id] = len(prompt_ids)
                self._anonymous.move_to_end(session_id)
        return ChatTurn(
            reply=reply,
            sync=sync,
            kv=report,
            ttft_s=prefilled - started + reply.ttft_s,
            wait_s=started - queued,
            evicted_in_turn=store.evicted_tokens - evicted,
            quantized_in_turn=store.quantized_tokens - quantized,
        )

    @contextmanager
    def _model(self, policy: Policy | None):
        """Hold the model for one turn, with `policy` in place of the engine's own."""
        with self._count_lock:
            if self._waiting >= self.max_waiting:
                raise QueueFullError(
                    f"{self._waiting} requests are already waiting for the model; retry later"
                )
            self._waiting += 1
        try:
            acquired = self._model_lock.acquire(timeout=self.queue_timeout_s)
        finally:
            with self._count_lock:
                self._waiting -= 1
        if not acquired:
            raise QueueTimeoutError(
                f"waited {self.queue_timeout_s:g} s for the model without getting it; retry later"
            )
        default = self.engine.policy
        self.engine.policy = policy or default
        try:
            yield
        finally:
            self.engine.policy = default
            self._model_lock.release()

    def _anonymous_session(self, prompt_ids: list[int]) -> str:
        """The anonymous session this prompt continues, or a new one (called with the model
        held, so no other turn is using an anonymous session)."""
        known = set(self.sessions.ids())
        for sid in [sid for sid in self._anonymous if sid not in known]:
            del self._anonymous[sid]  # dropped by the TTL or the byte cap
        match = self.sessions.longest_prefix(prompt_ids, dict(self._anonymous))
        if match is not None:
            return match
        while len(self._anonymous) >= self.max_anonymous:
            oldest, _ = self._anonymous.popitem(last=False)
            self.sessions.drop(oldest)
        session_id = f"{ANONYMOUS_PREFIX}{uuid.uuid4().hex[:16]}"
        self._anonymous[session_id] = len(prompt_ids)
        return session_id
