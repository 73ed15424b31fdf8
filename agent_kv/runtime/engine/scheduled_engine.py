"""An engine for one agent episode whose model calls all run in a shared `BatchScheduler`.

Several episodes (threads of one process) can then share one model in memory: each holds a
`ScheduledEngine` with its own policy and store options, as `Engine.from_spec` would give
it, and every prefill chunk, decode token and teacher-forced token it asks for becomes a row
of the scheduler's next packed forward call, beside the other episodes' rows (continuous
batching, `agent_kv.runtime.engine.batch_scheduler`). Only the scheduler's thread runs the model.

It offers what `Conversation`, the web agent, the scripted-episode runner, the agreement replay and
the reference replay use of an `Engine`, the interface both declare (`ChatEngine`). The
`Engine` methods that would run the model on the caller's thread (`decode`,
`generate_batch`, `score`, `step`, `warm_up`) are not offered.

Greedy replies and fed logits are those of a plain `Engine` with the same policy (the same
chunk boundaries and policy evictions), up to the float rounding that batched products may
differ in.
"""

from __future__ import annotations

import threading
from functools import cached_property

import torch

from agent_kv.errors import ConfigError
from agent_kv.kv.policies import Policy
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.kv.store import Int8Config
from agent_kv.runtime.engine.batch_scheduler import BatchScheduler
from agent_kv.runtime.engine.chat_engine import ChatEngine
from agent_kv.runtime.engine.policy_setup import check_store_options, policy_from_spec
from agent_kv.runtime.engine.sequence import SequenceState
from agent_kv.runtime.replies.decoding import Generation
from agent_kv.runtime.replies.grammar import GrammarCompiler, GrammarMatcher
from agent_kv.runtime.replies.sampling import SamplingParams

_GRAMMARS_LOCK = threading.Lock()
"""Held while a shared engine's grammar compiler is first built (0.3-1 s), so that episodes
starting together build it once."""


class ScheduledEngine(ChatEngine):
    """One episode's engine over a shared `BatchScheduler` (module docstring).

    Args:
        scheduler: runs the model; its engine gives the model, tokenizer, end-of-reply ids
            and the prefill chunk (tokens per prefill call), shared by every view on it.
        policy: this episode's KV policy (a policy object is not shared between views).
        int8: mixed-precision storage for this episode's sequences, or None.
        rerotate: StreamingLLM-style in-cache positions for this episode's sequences.

    Raises:
        ConfigError: invalid `int8` settings, a policy that manages its own precision with
            `int8`, or `rerotate` on a model without rotary embeddings.
    """

    def __init__(
        self,
        scheduler: BatchScheduler,
        policy: Policy,
        int8: Int8Config | None = None,
        *,
        rerotate: bool = False,
    ):
        check_store_options(scheduler.engine.model, policy, int8, rerotate)
        self.scheduler = scheduler
        self.policy = policy
        self.store_options = {"int8": int8, "rerotate": rerotate}

    @classmethod
    def from_spec(cls, spec: PolicySpec, scheduler: BatchScheduler) -> ScheduledEngine:
        """A view with the policy and store options of `spec`, as `Engine.from_spec` builds
        them for the scheduler's model (a byte budget becomes tokens at the model's FP cost
        per token and, with INT8, its INT8 cost).

        Raises:
            ConfigError: the budget holds no token, invalid policy or store settings, or a
                `+reencode` spec (re-encoding runs on a plain `Engine` only).
        """
        if spec.reencode:
            raise ConfigError(
                f"{spec.label}: re-encoding the kept tokens runs on a plain engine, not over "
                "the batch scheduler (run one episode per engine)"
            )
        policy = policy_from_spec(spec, scheduler.engine.model)
        return cls(scheduler, policy, spec.int8, rerotate=spec.rerotate)

    @property
    def model(self) -> torch.nn.Module:
        """The shared model: read its config and device here; never call it (only the
        scheduler's thread runs it)."""
        return self.scheduler.engine.model

    @property
    def tokenizer(self):
        """The shared tokenizer."""
        return self.scheduler.engine.tokenizer

    @property
    def eos_ids(self) -> set[int]:
        """Token ids that end a reply (the shared engine's)."""
        return self.scheduler.engine.eos_ids

    @property
    def prefill_chunk(self) -> int:
        """Tokens per prefill forward call (the shared engine's, which the scheduler chunks
        by)."""
        return self.scheduler.engine.prefill_chunk

    @cached_property
    def grammars(self) -> GrammarCompiler:
        """The shared engine's grammar compiler (`Engine.grammars`), built once for all
        views."""
        with _GRAMMARS_LOCK:
            return self.scheduler.engine.grammars

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher for `params.grammar` (None without one)."""
        return None if params.grammar is None else self.grammars.matcher(params.grammar)

    def new_sequence(self) -> SequenceState:
        """An empty sequence for the shared model with this view's store options."""
        return SequenceState.for_model(self.model, **self.store_options)

    def prefill(
        self, sequence: SequenceState, token_ids: list[int], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """`Engine.prefill` through the scheduler, under this view's policy
        (`BatchScheduler.prefill`); blocks until the tokens are in.

        Returns:
            `[vocab]` float32 logits after the last token (also `sequence.last_logits`).

        Raises:
            ValueError: `token_ids` is empty.
            ContextOverflowError: the tokens would pass the model's trained context.
            TurnCancelled: `cancel` was set before a chunk ran; the sequence holds the
                chunks fed before it.
            RuntimeError: the scheduler was closed.
        """
        return self.scheduler.prefill(sequence, token_ids, self.policy, cancel)

    def generate(
        self,
        sequence: SequenceState,
        prompt_ids: list[int],
        params: SamplingParams,
        on_text=None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """`Engine.generate` through the scheduler, under this view's policy
        (`BatchScheduler.generate`): prefill `prompt_ids` (none: reply from the sequence's
        last logits), then decode a reply; blocks until it ends. `on_text` is called from
        the scheduler's thread.

        Raises:
            ConfigError: invalid sampling parameters, or a grammar that cannot be built
                (nothing prefilled).
            ValueError: empty prompt on an empty sequence.
            ContextOverflowError: the prompt would pass the model's trained context.
            TurnCancelled: `cancel` was set; the sequence keeps every token fed before it.
            RuntimeError: the scheduler was closed.
        """
        if params.grammar is not None:
            _ = self.grammars  # built once, under the lock, before the scheduler uses it
        return self.scheduler.generate(
            sequence, prompt_ids, params, policy=self.policy, on_text=on_text, cancel=cancel
        )
