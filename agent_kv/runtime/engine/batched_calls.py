"""What the engine's calls over several sequences or rows take and give: `PackedPart`, one
sequence's share of a packed forward call (`Engine.step`, continuous batching), and
`BatchGeneration`, the replies of a batch of prompts decoded together
(`Engine.generate_batch`)."""

from __future__ import annotations

from dataclasses import dataclass

from agent_kv.kv.policies import Policy
from agent_kv.kv.store import KVStore
from agent_kv.runtime.engine.sequence import CallRecord, SequenceState
from agent_kv.runtime.replies.decoding import Generation


@dataclass
class PackedPart:
    """One sequence's share of a packed forward call (`Engine.step`).

    Attributes:
        sequence: the sequence (its store has one row).
        tokens: its new tokens: one decode token, or a prefill chunk.
        policy: the policy that manages its store.
        gated: whether the call's confidence chooses its budget: True for a decode token and
            a prompt's last chunk, False for an earlier chunk (the no-signal budget).
    """

    sequence: SequenceState
    tokens: list[int]
    policy: Policy
    gated: bool


@dataclass
class BatchGeneration:
    """The replies of `Engine.generate_batch`.

    Attributes:
        generations: one per prompt, in order.
        store: the batch's KV store (per-row lengths, bytes and peaks).
        steps: per row, one record per forward call (each row's own sawtooth).
    """

    generations: list[Generation]
    store: KVStore
    steps: list[list[CallRecord]]
