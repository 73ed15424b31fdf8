"""One sequence's state across every turn: its KV store, its token history, and what happened
to its memory (a server's session or an agent's conversation runs on one)."""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from agent_kv.errors import AgentKVError
from agent_kv.kv.cache import StoreCache
from agent_kv.kv.rope import Rotary
from agent_kv.kv.store import KVStore, StoreFootprint
from agent_kv.renamed_fields import current_names


@dataclass
class CallRecord:
    """One forward call (a prefill chunk or a decode token).

    Attributes:
        seen_tokens: tokens appended so far, after this call.
        appended_kv_live_bytes: live KV bytes after this call appended, before eviction (the
            sawtooth's peaks).
        kv_live_bytes: live KV bytes after this call's eviction (its troughs).
        confidence: `c` of the call's last next-token distribution.
        gated: whether `confidence` chose the budget (False for prompt chunks before the
            last, which get the policy's no-signal budget).
        budget: the policy's budget for this call (unpinned tokens per layer), None for no limit.
        evicted: tokens evicted after this call, summed over layers.
        kv_allocated_bytes: the most bytes the store's buffers held during this call, spare
            capacity included (`StoreFigures.call_allocated_bytes`: after its append or any
            quantization of its policy eviction), this row's share of a batch; the most over
            all calls is `StoreFigures.peak_allocated_bytes`. 0 in records saved before it existed.
        cold_kv_bytes: bytes of the store's cold tier after this call (`RecallTier.nbytes`,
            codes, scales and digests; 0 without one), never part of the figures above.
    """

    seen_tokens: int
    appended_kv_live_bytes: int
    kv_live_bytes: int
    confidence: float
    gated: bool
    budget: int | None
    evicted: int
    kv_allocated_bytes: int = 0
    cold_kv_bytes: int = 0

    @classmethod
    def read(cls, record: dict) -> CallRecord:
        """The step record `asdict` made `record` from (a saved session's), also from one
        written with the old field names (`agent_kv.renamed_fields`, accepted for one
        release)."""
        return cls(**current_names(record))


@dataclass
class SequenceState:
    """One sequence's state across every turn.

    Attributes:
        store: the managed KV cache.
        cache: its transformers `Cache` adapter, passed to the model.
        token_ids: every token fed to the model so far, in order.
        last_logits: `[vocab]` logits after the last fed token (None before the first call).
        steps: one `CallRecord` per forward call (the name is the saved field's, `save`).
        evicted_at_reencode: the store's evicted tokens (`StoreFigures.evicted_tokens`) when
            its kept tokens were last encoded again (`Engine.reencode`); 0 before.
    """

    store: KVStore
    cache: StoreCache
    token_ids: list[int] = field(default_factory=list)
    last_logits: torch.Tensor | None = None
    steps: list[CallRecord] = field(default_factory=list)
    evicted_at_reencode: int = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module, **store_kwargs) -> SequenceState:
        """An empty sequence shaped for `model`."""
        store = KVStore.for_model(model, **store_kwargs)
        return cls(store=store, cache=StoreCache(store))

    def restart(self, fresh: Callable[[], SequenceState]) -> None:
        """Drop this sequence's cache and history, then take over `fresh()`'s in place (a
        rebuilt cache), so holders of this object see the new one. The old cache is let go
        before the new one is made, so the two are never held together."""
        self.store = self.cache = None
        self.token_ids, self.last_logits, self.steps = [], None, []
        other = fresh()
        self.store, self.cache = other.store, other.cache
        self.token_ids, self.last_logits, self.steps = (
            other.token_ids,
            other.last_logits,
            other.steps,
        )

    def save(self, path: Path, meta: dict | None = None) -> None:
        """Write the sequence (store, tokens, last logits, per-call records) to `path` with
        `torch.save`, with `meta` (plain values, e.g. the id of the session it serves) beside it for
        `SequenceOutline.read`; the file appears whole or not at all (written aside, then
        renamed)."""
        data = {
            "store": self.store.state(trim=True),
            "token_ids": self.token_ids,
            "last_logits": self.last_logits,
            "steps": [asdict(step) for step in self.steps],
            "meta": meta or {},
        }
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        try:
            torch.save(data, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: Path, model: torch.nn.Module) -> SequenceState:
        """The sequence `save` wrote, for the same `model`; decoding resumes with the same
        next-token logits.

        Raises:
            AgentKVError: the file is missing, unreadable, damaged (a record whose checksum
                fails, a missing or malformed field: nothing of it is restored), or was saved
                for another shape of model.
        """
        _check_whole(path)
        data = _load(path)
        expected = KVStore.for_model(model)
        shape = [expected.num_layers, expected.kv_heads, expected.head_dim]
        try:
            state = data["store"]
            if state["shape"] != shape:
                raise AgentKVError(
                    f"session {path} was saved for a model with [layers, kv heads, head dim] "
                    f"{state['shape']}, not {shape}"
                )
            rotary = Rotary.from_model(model) if state["rerotate"] else None
            store = KVStore.from_state(state, rotary)
            return cls(
                store=store,
                cache=StoreCache(store),
                token_ids=[int(token) for token in data["token_ids"]],
                last_logits=data["last_logits"],
                steps=[CallRecord.read(step) for step in data["steps"]],
            )
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError) as err:
            raise AgentKVError(f"session {path} cannot be restored: {err!r}") from None


@dataclass
class SequenceOutline:
    """What a sequence holds, known without its tensors: read from a saved sequence's file
    (`read`), or taken from a sequence in memory (`describe`).

    Attributes:
        meta: the `meta` it was saved with.
        footprint: its store's footprint (bytes held and allocated, per-layer lengths and
            capacities).
        token_ids: its history.
        changed_at: the tokens seen when eviction or quantization last changed its cache
            (`Segments.changed_at`, row 0).
        pinned_tokens: positions pinned.
        intact_tokens: the length of its intact prefix (`KVStore.intact_tokens`, row 0; 0
            for a file saved before it was recorded).
    """

    meta: dict
    footprint: StoreFootprint
    token_ids: list[int]
    changed_at: int
    pinned_tokens: int
    intact_tokens: int

    @classmethod
    def describe(cls, sequence: SequenceState, meta: dict | None = None) -> SequenceOutline:
        """The outline of `sequence` (as `read` would give it once saved with `meta`)."""
        return cls(
            meta=meta or {},
            footprint=sequence.store.footprint(),
            token_ids=list(sequence.token_ids),
            changed_at=sequence.store.segments.changed_at[0],
            pinned_tokens=sequence.store.pins.tokens(),
            intact_tokens=sequence.store.intact_tokens(),
        )

    @classmethod
    def read(cls, path: Path) -> SequenceOutline:
        """The outline of the sequence file `path` (its tensors are memory-mapped, not read,
        except the pin flags).

        Raises:
            AgentKVError: the file is missing or not a saved sequence.
        """
        data = _load(path, mmap=True)
        try:
            state = data["store"]
            return cls(
                meta=dict(data.get("meta") or {}),
                footprint=StoreFootprint.of_state(state),
                token_ids=list(data["token_ids"]),
                changed_at=int(state["row_counters"][1][0]),
                pinned_tokens=int(state["pinned"][0].sum()),
                intact_tokens=int(state.get("intact_tokens", [0])[0]),
            )
        except (KeyError, TypeError, IndexError, AttributeError) as err:
            raise AgentKVError(f"{path} is not a saved session: {err!r}") from None


def _check_whole(path: Path) -> None:
    """Raise AgentKVError unless every record of the sequence file `path` (a zip archive, as
    `torch.save` writes it) matches its checksum: `torch.load` reads damaged bytes inside a
    tensor's record without noticing."""
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        raise AgentKVError(f"cannot load session {path}: {err}") from None
    if damaged is not None:
        raise AgentKVError(f"cannot load session {path}: record {damaged} is damaged")


def _load(path: Path, mmap: bool = False) -> dict:
    """`torch.load` of a sequence file (tensors only, no code), or AgentKVError saying why
    it cannot be read."""
    try:
        data = torch.load(path, weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise AgentKVError(f"cannot load session {path}: {reason}") from None
    if not isinstance(data, dict):
        raise AgentKVError(f"cannot load session {path}: not a saved session")
    return data
