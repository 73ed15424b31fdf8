"""Continuous batching: the turns of many sequences decoded as rows of one forward call per
scheduler iteration, each with its own store, policy, budget, pins and sampling.

One thread owns the model. Each iteration it runs, in one engine step (`Engine.step`), the
next decode token of every running turn and the next prefill chunks of turns still
prefilling, under a per-iteration budget of prefill tokens (`prefill_tokens`, by default the
engine's `prefill_chunk`): chunks are taken in turn, round robin, so a new short prompt is not
stuck behind a long one, while they fit the budget (the first always runs). Chunks are the
engine's own `prefill_chunk` boundaries, so a sequence sees exactly the calls it would see
alone. This is chunked prefill beside decodes as Sarathi-Serve and vLLM schedule it: the
budget bounds how long one iteration, and so every running turn's next token, can take. Turns
join the batch between iterations, in arrival order, while fewer than `max_batch` are running,
and leave it when their reply ends. With a KV cap (`max_kv_bytes`) they join only while the
running turns' KV bounds fit under it: each turn's bound is the most allocated KV bytes its
sequence can reach while it runs (`KVMemory.turn_bound`: the prompt and `max_new_tokens`
under its policy), so the batch never allocates past the cap; a turn whose bound alone is over
it is refused at once (`KVCapacityError`), one that fits waits for running turns to end. An
iteration of one turn is the serial path itself
(`Engine.prefill`, compiled with `compile`), so a lone turn runs as fast as it would without
the scheduler.

Callers block in `generate`, which has `Engine.generate`'s contract: the same reply (greedy
replies are token-for-token those of serving the turns one at a time, up to the float
rounding that batched products may differ in), streamed through `on_text` from the
scheduler's thread, and `TurnCancelled` once `cancel` is set (the sequence keeps what was
fed). A sequence must not run two turns at once (the caller serialises them). `prefill` is
`Engine.prefill`'s counterpart: a turn that ends after its prompt, through the same chunks.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent_kv.errors import KVCapacityError, QueueTimeoutError, TurnCancelled
from agent_kv.kv.policies import Policy
from agent_kv.runtime.engine.batched_calls import PackedPart
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.decoding import Generation, ReplyDecoder
from agent_kv.runtime.replies.sampling import SamplingParams

WAIT_SLICE_S = 0.1
"""Seconds between a waiting caller's checks of its deadline."""


@dataclass(eq=False)  # compared by identity: turns are found in queues
class _Turn:
    """One turn in the scheduler: what is left to prefill, the token to feed next, and how
    it ends."""

    sequence: SequenceState
    policy: Policy
    pending: list[int]
    decoder: ReplyDecoder | _PrefillOnly
    prompt_tokens: int
    cancel: threading.Event | None
    on_join: Callable[[], None] | None
    deadline: float | None
    kv_bound: int = 0
    next_token: int | None = None
    done: threading.Event = field(default_factory=threading.Event)
    result: Generation | torch.Tensor | None = None
    error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        """End the turn: its reply (a prefill-only turn: its last logits), or `error`."""
        if error is None:
            self.result = self.decoder.generation(self.prompt_tokens)
        self.error = error
        self.done.set()

    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


class _PrefillOnly:
    """The decoder of a turn that only prefills (`BatchScheduler.prefill`): it chooses no token,
    so the turn ends after its prompt's last chunk, and its result is that chunk's logits."""

    def __init__(self):
        self.started = 0.0  # set as the turn joins, as a reply's decoder's is
        self.logits: torch.Tensor | None = None

    def choose(self, logits: torch.Tensor) -> None:
        self.logits = logits
        return None

    def generation(self, prompt_tokens: int) -> torch.Tensor | None:
        return self.logits


class BatchScheduler:
    """Runs turns of many sequences on one engine with continuous batching (module
    docstring).

    Args:
        engine: the model, tokenizer and default policy; from now on only this scheduler
            runs its model.
        max_batch: turns running at once (decoding or prefilling); more wait, in order.
        prefill_tokens: prefill tokens per iteration (None: the engine's `prefill_chunk`); chunks
            are packed while their tokens fit, and the first chunk of an iteration always runs
            (a chunk is at most `prefill_chunk` tokens). Each decoding turn adds one token.
        max_kv_bytes: the most allocated KV bytes the running turns' sequences may reach
            together (their `KVMemory.turn_bound`s), or None for no cap.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 16,
        prefill_tokens: int | None = None,
        max_kv_bytes: int | None = None,
    ):
        prefill_tokens = engine.prefill_chunk if prefill_tokens is None else prefill_tokens
        if max_batch < 1 or prefill_tokens < 1 or (max_kv_bytes is not None and max_kv_bytes < 1):
            raise ValueError(
                f"max_batch, prefill_tokens and max_kv_bytes must be >= 1, got {max_batch}, "
                f"{prefill_tokens}, {max_kv_bytes}"
            )
        self.engine = engine
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        self.max_kv_bytes = max_kv_bytes
        self.iterations = 0
        """Forward calls run so far."""
        self.rows = 0
        """Sequences over all forward calls so far (`rows / iterations` is the mean batch)."""
        self._arrivals: deque[_Turn] = deque()
        self._running: list[_Turn] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def running(self) -> int:
        """Turns in the batch now."""
        return len(self._running)

    @property
    def waiting(self) -> int:
        """Turns waiting to join the batch."""
        return len(self._arrivals)

    @property
    def reserved_kv_bytes(self) -> int:
        """The running turns' KV bounds together (`KVMemory.turn_bound`; 0 without a cap)."""
        with self._lock:
            return sum(turn.kv_bound for turn in self._running)

    def generate(
        self,
        sequence: SequenceState,
        prompt_ids: list[int],
        params: SamplingParams,
        policy: Policy | None = None,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
        on_join: Callable[[], None] | None = None,
        deadline: float | None = None,
    ) -> Generation:
        """Prefill `prompt_ids` into `sequence`, then decode a reply, as a row of the batch;
        blocks until the reply ends. As `Engine.generate`, with:

        Args:
            policy: the policy managing `sequence` during the turn (default: the engine's).
            on_join: called (from the scheduler's thread) when the turn joins the batch.
            deadline: `time.monotonic()` by which the turn must have joined the batch.

        Raises:
            ConfigError, GrammarError, ValueError, ContextOverflowError: as `Engine.generate`,
                before the turn is queued (a rerotate overflow: when its chunk would run).
            KVCapacityError: the turn's KV bound alone is over `max_kv_bytes` (before it is
                queued).
            QueueTimeoutError: the deadline passed before the turn joined the batch.
            TurnCancelled: `cancel` was set (before it joined: nothing was fed).
            RuntimeError: the scheduler was closed.
        """
        params.validate()
        engine = self.engine
        decoder = ReplyDecoder(
            params, engine.matcher(params), engine.tokenizer, engine.eos_ids, on_text,
            prompt_ids=[*sequence.token_ids, *prompt_ids],
        )  # fmt: skip
        if not prompt_ids and sequence.last_logits is None:
            raise ValueError("nothing to generate from: the session is empty and the prompt too")
        store = sequence.store
        if prompt_ids and store.positions_mode == "original":
            store.check_context(store.seen_tokens + len(prompt_ids))
        turn = _Turn(
            sequence, policy or engine.policy, list(prompt_ids), decoder, len(prompt_ids),
            cancel, on_join, deadline,
        )  # fmt: skip
        return self._run(turn, len(prompt_ids) + params.max_new_tokens)

    def prefill(
        self,
        sequence: SequenceState,
        token_ids: list[int],
        policy: Policy | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ) -> torch.Tensor:
        """Run `token_ids` through the model into `sequence` as a row of the batch, with no
        reply: `Engine.prefill` through the scheduler. The tokens go in the engine's
        `prefill_chunk` chunks, each followed by `policy`'s eviction (only the last chunk gated
        by its confidence), exactly as `Engine.prefill` feeds them; blocks until the last chunk
        ran. One token (a teacher-forced reply token) is one chunk: a decode-sized call.

        Args:
            sequence: the sequence to extend (one row; not in another turn now).
            token_ids: the tokens, at least one.
            policy: the policy managing `sequence` (default: the engine's).
            cancel: set it to stop before the next chunk (or while waiting to join).
            deadline: `time.monotonic()` by which the turn must have joined the batch.

        Returns:
            `[vocab]` float32 logits after the last token (also `sequence.last_logits`).

        Raises:
            ValueError: `token_ids` is empty.
            ContextOverflowError: as `Engine.prefill` (original positions: before anything is
                queued; rerotate: when the chunk that passes the context would run, the
                chunks before it fed).
            KVCapacityError: the turn's KV bound alone is over `max_kv_bytes` (before it is
                queued).
            QueueTimeoutError: the deadline passed before the turn joined the batch.
            TurnCancelled: `cancel` was set; the sequence holds the chunks fed before it.
            RuntimeError: the scheduler was closed.
        """
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        store = sequence.store
        if store.positions_mode == "original":
            store.check_context(store.seen_tokens + len(token_ids))
        turn = _Turn(
            sequence, policy or self.engine.policy, list(token_ids), _PrefillOnly(),
            len(token_ids), cancel, None, deadline,
        )  # fmt: skip
        return self._run(turn, len(token_ids))

    def _run(self, turn: _Turn, appended: int) -> Generation | torch.Tensor:
        """Queue `turn`, which feeds at most `appended` tokens (with a cap: refused when its KV
        bound alone is over it), starting the scheduler's thread when none runs, and block
        until it ends; its result, or its error raised."""
        if self.max_kv_bytes is not None:
            turn.kv_bound = self.engine.kv_memory.turn_bound(
                turn.sequence.store, turn.policy, appended
            )
            if turn.kv_bound > self.max_kv_bytes:
                raise KVCapacityError(
                    f"the turn could hold {turn.kv_bound} bytes of KV, over the batch's cap "
                    f"of {self.max_kv_bytes}"
                )
        with self._lock:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            self._arrivals.append(turn)
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name="agent-kv-batch", daemon=True
                )
                self._thread.start()
        while not turn.done.wait(WAIT_SLICE_S):
            self._give_up_waiting(turn)
        if turn.error is not None:
            raise turn.error
        return turn.result

    def close(self) -> None:
        """Stop taking turns and stop the scheduler's thread after its current iteration; turns
        not finished end with `RuntimeError`."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        """The scheduler's thread: iterates while turns wait or run, then ends (the next
        `generate` starts another), so an idle scheduler holds no thread."""
        while True:
            with self._lock:
                if self._closed:
                    break
                if not self._arrivals and not self._running:
                    self._thread = None
                    return
                self._admit()
            self._run_iteration()
        closed = RuntimeError("the batch scheduler was closed")
        with self._lock:
            ended = [*self._running, *self._arrivals]
            self._running, self._thread = [], None
            self._arrivals.clear()
        for turn in ended:
            turn.finish(closed)

    def _give_up_waiting(self, turn: _Turn) -> None:
        """From the caller's thread: end a turn that has not joined the batch yet once its
        caller left or its deadline passed (the scheduler may be inside a long iteration)."""
        if turn.cancelled():
            error = TurnCancelled("the turn was cancelled while waiting for the model")
        elif turn.deadline is not None and time.monotonic() >= turn.deadline:
            error = QueueTimeoutError("waited too long for a place in the batch; retry later")
        else:
            return
        with self._lock:
            if turn in self._arrivals:
                self._arrivals.remove(turn)
                turn.finish(error)

    def _admit(self) -> None:
        """Move arrivals into the batch, in order, while there is room: fewer than `max_batch`
        running and, with a cap, the next one's KV bound fits beside the running turns' (called
        holding `_lock`)."""
        while self._arrivals and len(self._running) < self.max_batch and self._fits_kv():
            turn = self._arrivals.popleft()
            turn.decoder.started = time.perf_counter()  # its TTFT counts from here
            if turn.on_join is not None:
                turn.on_join()
            if turn.pending:  # its pinned leading blocks read shared, not computed
                del turn.pending[: self.engine.share_prefix(turn.sequence, turn.pending)]
            else:  # a reply straight from the sequence's last logits
                try:
                    self._choose(turn, turn.sequence.last_logits)
                except Exception as err:
                    turn.finish(err)
            if not turn.done.is_set():
                self._running.append(turn)

    def _fits_kv(self) -> bool:
        """Whether the next arrival's KV bound fits under the cap beside the running turns'
        (called holding `_lock`)."""
        if self.max_kv_bytes is None:
            return True
        running = sum(turn.kv_bound for turn in self._running)
        return running + self._arrivals[0].kv_bound <= self.max_kv_bytes

    def _run_iteration(self) -> None:
        """One forward call over the running turns, then each turn moves on."""
        for turn in [t for t in self._running if t.cancelled()]:
            self._running.remove(turn)
            turn.finish(TurnCancelled("the turn was cancelled: its caller went away"))
        decoding = [t for t in self._running if t.next_token is not None]
        chunk = self.engine.prefill_chunk
        prefilling, budget = [], self.prefill_tokens
        for turn in (t for t in self._running if t.pending):
            size = min(len(turn.pending), chunk)
            if prefilling and size > budget:
                break
            prefilling.append(turn)
            budget -= size
        if not decoding and not prefilling:
            return
        parts = [PackedPart(t.sequence, [t.next_token], t.policy, True) for t in decoding] + [
            PackedPart(t.sequence, t.pending[:chunk], t.policy, len(t.pending) <= chunk)
            for t in prefilling
        ]
        turns = decoding + prefilling
        try:
            results = self.engine.step(parts)
        except Exception as err:  # the model call failed: every turn in it fails
            for turn in turns:
                self._running.remove(turn)
                turn.finish(err)
            return
        self.iterations += 1
        self.rows += len(parts)
        for turn, part, result in zip(turns, parts, results, strict=True):
            try:
                if isinstance(result, Exception):
                    raise result
                if turn.pending:
                    del turn.pending[: len(part.tokens)]
                    if turn.pending:
                        continue
                    self.engine.publish_prefix(turn.sequence)
                else:
                    turn.decoder.fed()
                self._choose(turn, result)
            except Exception as err:  # this turn's own failure (an overflow, its on_text)
                turn.finish(err)
            if turn.done.is_set():
                self._running.remove(turn)
        # prefilling turns take turns: the ones that just ran go to the back
        ran = {id(t) for t in prefilling}
        self._running.sort(key=lambda t: id(t) in ran and bool(t.pending))

    @staticmethod
    def _choose(turn: _Turn, logits: torch.Tensor) -> None:
        """The turn's next token from `logits` `[vocab]`, or its end."""
        turn.next_token = turn.decoder.choose(logits)
        if turn.next_token is None:
            turn.finish()
