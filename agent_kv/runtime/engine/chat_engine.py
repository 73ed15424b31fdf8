"""What a chat needs of an engine: the interface `Conversation`, the web agent, the scripted-episode
runner and the agreement replay use, declared by both engines that offer it.

`agent_kv.runtime.engine.engine.Engine` runs the model on the caller's thread;
`agent_kv.runtime.engine.scheduled_engine.ScheduledEngine` hands every call to a shared
`BatchScheduler` (several episodes, one model). Code typed `ChatEngine` takes either.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from agent_kv.kv.policies import Policy
    from agent_kv.runtime.engine.sequence import SequenceState
    from agent_kv.runtime.replies.decoding import Generation
    from agent_kv.runtime.replies.grammar import GrammarCompiler, GrammarMatcher
    from agent_kv.runtime.replies.sampling import SamplingParams


@runtime_checkable
class ChatEngine(Protocol):
    """An engine a chat runs on.

    Attributes:
        model: the causal LM (read its config and device; only the engine calls it).
        tokenizer: its tokenizer, with a chat template.
        policy: the KV policy applied after every forward call.
        store_options: the sequences' store options, `{"int8": Int8Config | None,
            "rerotate": bool}`.
        eos_ids: token ids that end a reply.
        prefill_chunk: tokens per prefill forward call.
    """

    model: torch.nn.Module
    tokenizer: Any
    policy: Policy
    store_options: dict[str, Any]
    eos_ids: set[int]
    prefill_chunk: int

    @property
    def grammars(self) -> GrammarCompiler:
        """Builds `SamplingParams.grammar`s against the tokenizer."""
        ...

    def matcher(self, params: SamplingParams) -> GrammarMatcher | None:
        """A matcher for `params.grammar` (None without one)."""
        ...

    def new_sequence(self) -> SequenceState:
        """An empty sequence for the model with the engine's store options."""
        ...

    def prefill(
        self, sequence: SequenceState, token_ids: list[int], cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """Feed `token_ids` to `sequence` under the policy; returns the `[vocab]` float32
        logits after the last one (also `sequence.last_logits`).

        Raises:
            ValueError: `token_ids` is empty.
            ContextOverflowError: the tokens would pass the model's trained context.
            TurnCancelled: `cancel` was set before a chunk ran.
        """
        ...

    def generate(
        self,
        sequence: SequenceState,
        prompt_ids: list[int],
        params: SamplingParams,
        on_text: Callable[[str], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> Generation:
        """Prefill `prompt_ids` (none: reply from the sequence's last logits), then decode a
        reply; the cache ends holding the prompt followed by the reply's `raw_text`.

        Raises:
            ConfigError: invalid sampling parameters, or a grammar that cannot be built.
            ValueError: empty prompt on an empty sequence.
            TurnCancelled: `cancel` was set.
        """
        ...
