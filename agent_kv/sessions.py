"""Sessions by id, with an idle TTL and an LRU under a global KV byte cap.

Each agent episode (a session id) keeps one managed KV cache across its requests. The
store bounds the memory of all of them together:
- a session idle for longer than `idle_ttl_s` is dropped (from memory and disk);
- while the sessions in memory hold more than `max_kv_bytes` of KV, the least recently used
  idle one leaves memory: saved to `spill_dir` when one is given (and restored on its next
  request with identical next-token logits), dropped otherwise.
A session with a request in flight is never dropped or saved. Requests to one session are
serialised by its lock; different sessions never share a cache.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from agent_kv.engine import Engine
from agent_kv.errors import AgentKVError
from agent_kv.protection import apply_pins
from agent_kv.session import Session


@dataclass
class HistorySync:
    """How a request's tokens were matched against its session's history.

    Attributes:
        reused_tokens: tokens of the request the cache already held (not prefilled again).
        prefilled_tokens: tokens fed for this request.
        rebuild: "none" (the request extends the history), "truncated" (the client changed
            earlier history: the cache was cut back to the divergence point) or "scratch"
            (the cache could not be cut back exactly, because eviction or quantization since
            the divergence point depended on what changed: rebuilt from the first token).
    """

    reused_tokens: int
    prefilled_tokens: int
    rebuild: str


def sync_history(
    engine: Engine,
    session: Session,
    token_ids: list[int],
    pins: list[tuple[int, int]] | None = None,
) -> HistorySync:
    """Bring `session` to exactly `token_ids` (a request's whole conversation, tokenized),
    prefilling only what the cache does not hold; `session.last_logits` then predicts the
    token after `token_ids`. `pins` (token spans of `token_ids`), when given, are made the
    row's pins (`apply_pins`) before anything is prefilled, so no chunk evicts them.

    The request is matched token by token against `session.token_ids`. When it diverges
    before the end of the history (or stops short of it), the cache is truncated to the
    divergence point if that is exact (`KVStore.truncate`), else rebuilt from scratch.

    Raises:
        ValueError: `token_ids` is empty.
    """
    if not token_ids:
        raise ValueError("a request needs at least one token")
    history = session.token_ids
    common = common_prefix(history, token_ids)
    if common == len(history):
        sync = HistorySync(common, len(token_ids) - common, "none")
    else:
        # diverged, or the request is a strict prefix: keep at least one token to re-feed,
        # whose logits the reply needs
        cut = min(common, len(token_ids) - 1)
        if cut > 0 and cut >= session.store.changed_at[0]:
            session.store.truncate(cut)
            del session.token_ids[cut:]
            sync = HistorySync(cut, len(token_ids) - cut, "truncated")
        else:
            session.replace_with(engine.new_session())
            sync = HistorySync(0, len(token_ids), "scratch")
    if pins is not None:
        apply_pins(session.store, pins)
    if sync.prefilled_tokens:
        engine.feed(session, token_ids[sync.reused_tokens :])
    return sync


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common


class SessionBusyError(AgentKVError):
    """The session has a request in flight."""


@dataclass
class _Entry:
    session: Session | None  # None while saved to disk
    last_used: float
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionStore:
    """Sessions of one engine, by id.

    Args:
        engine: makes new sessions (`Engine.new_session`) and owns the model they belong to.
        max_kv_bytes: cap on the KV bytes of all sessions in memory (`KVStore.nbytes`), or
            None for no cap. Sessions with a request in flight may hold it above the cap.
        idle_ttl_s: seconds a session may stay unused before it is dropped, or None.
        spill_dir: where sessions over the cap are saved; None drops them instead.
        clock: monotonic seconds (tests pass a fake one).

    Raises:
        ValueError: a non-positive cap or TTL.
    """

    def __init__(
        self,
        engine: Engine,
        max_kv_bytes: int | None = None,
        idle_ttl_s: float | None = None,
        spill_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_kv_bytes is not None and max_kv_bytes <= 0:
            raise ValueError(f"max_kv_bytes must be positive, got {max_kv_bytes}")
        if idle_ttl_s is not None and idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be positive, got {idle_ttl_s}")
        self.engine = engine
        self.max_kv_bytes = max_kv_bytes
        self.idle_ttl_s = idle_ttl_s
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.dropped = 0
        self.spilled = 0
        self._entries: dict[str, _Entry] = {}  # insertion order is not use order: see `_lru`
        self._lock = threading.Lock()

    @contextmanager
    def use(self, session_id: str) -> Iterator[Session]:
        """Hold the session `session_id` for one request: created when new, restored when it
        was saved to disk. Other requests to it wait until this one ends; afterwards the TTL
        and the byte cap are enforced."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                entry = self._entries[session_id] = _Entry(None, self.clock())
            entry.in_flight += 1
        try:
            with entry.lock:
                if entry.session is None:
                    entry.session = self._restore(session_id)
                yield entry.session
        finally:
            with self._lock:
                entry.in_flight -= 1
                entry.last_used = self.clock()
                self._enforce()

    def longest_prefix(self, token_ids: list[int], required: dict[str, int]) -> str | None:
        """The session, among the idle ones in memory named in `required`, whose history
        shares the longest prefix with `token_ids`, counting only sessions whose first
        `required[id]` tokens all match; None when there is none."""
        best, best_common = None, 0
        with self._lock:
            for sid, needed in required.items():
                entry = self._entries.get(sid)
                if entry is None or entry.session is None or entry.in_flight:
                    continue
                common = common_prefix(entry.session.token_ids, token_ids)
                if common >= needed and common > best_common:
                    best, best_common = sid, common
        return best

    def drop(self, session_id: str) -> bool:
        """Forget a session (memory and disk); False when there was none.

        Raises:
            SessionBusyError: it has a request in flight.
        """
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                return False
            if entry.in_flight:
                raise SessionBusyError(f"session {session_id!r} has a request in flight")
            self._remove(session_id)
            return True

    def sweep(self) -> None:
        """Enforce the TTL and the byte cap now (they are also enforced after each request)."""
        with self._lock:
            self._enforce()

    def ids(self) -> list[str]:
        """Sessions known, in memory or on disk."""
        with self._lock:
            return list(self._entries)

    def in_memory(self) -> list[str]:
        """Sessions whose cache is in memory."""
        with self._lock:
            return [sid for sid, e in self._entries.items() if e.session is not None]

    def kv_bytes(self) -> int:
        """KV bytes of all sessions in memory."""
        with self._lock:
            return self._kv_bytes()

    def _kv_bytes(self) -> int:
        return sum(e.session.store.nbytes() for e in self._entries.values() if e.session)

    def _enforce(self) -> None:
        now = self.clock()
        if self.idle_ttl_s is not None:
            for sid, entry in list(self._entries.items()):
                if not entry.in_flight and now - entry.last_used > self.idle_ttl_s:
                    self._remove(sid)
                    self.dropped += 1
        if self.max_kv_bytes is None:
            return
        while self._kv_bytes() > self.max_kv_bytes:
            idle = [
                (entry.last_used, sid)
                for sid, entry in self._entries.items()
                if entry.session is not None and not entry.in_flight
            ]
            if not idle:
                return  # only sessions in flight are left: they may exceed the cap
            _, sid = min(idle)
            if self.spill_dir is None:
                self._remove(sid)
                self.dropped += 1
            else:
                self._entries[sid].session.save(self._path(sid))
                self._entries[sid].session = None
                self.spilled += 1

    def _remove(self, session_id: str) -> None:
        del self._entries[session_id]
        if self.spill_dir is not None:
            self._path(session_id).unlink(missing_ok=True)

    def _restore(self, session_id: str) -> Session:
        path = None if self.spill_dir is None else self._path(session_id)
        if path is not None and path.exists():
            session = Session.load(path, self.engine.model)
            path.unlink()
            return session
        return self.engine.new_session()

    def _path(self, session_id: str) -> Path:
        digest = hashlib.sha256(session_id.encode()).hexdigest()[:32]
        return self.spill_dir / f"{digest}.pt"
