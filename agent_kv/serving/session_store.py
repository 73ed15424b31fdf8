"""Sessions by id, with an idle TTL and an LRU under a global KV byte cap.

Each agent episode (a session id) keeps one managed KV cache across its requests. The
store bounds the memory of all of them together, counted as allocated KV bytes (the key,
value and scale buffers with their spare capacity, `KVStore.allocated_nbytes`; live bytes are
never more):
- a session idle for longer than `idle_ttl_s` is dropped (from memory and disk);
- before a request runs, room is made for the most its session can hold during the request
  (the caller's bound, see `use`): the least recently used idle sessions leave memory until
  the sessions in memory plus that bound fit `max_kv_bytes` (the shared prefix blocks the
  sessions read counted once, `Engine.prefix_cache`), so the cap holds while the
  request runs, not only after it; a request that cannot fit even alone is refused
  (`KVCapacityError`);
- after each request, while the sessions in memory hold more than the cap, the least
  recently used idle one leaves memory.
A session leaving memory is saved to `spill_dir` when one is given (and restored on its next
request with identical next-token logits), dropped otherwise. Saved sessions found in
`spill_dir` at start (a restart) are known again: counted, listed, expired by the TTL from
the time they were saved, and restored on request; a file that cannot be read back whole
(damaged, cut short) is never half-restored: it is removed, and the session starts again from
the client's history. A session with a request in flight is never dropped or saved.
Requests to one session are serialised by its lock; different sessions never share a cache.

With `shared_spill` the spill dir is shared with other replicas of the server (each its own
process, perhaps on another machine: `api.cluster`): nothing in it is adopted at start; each
session is saved there after each of its requests, off the request's critical path
(`SessionCheckpoints`), and a session this store does not know is restored from its file
there, so that a replica takes over the sessions of one that died from their last completed
turn.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from agent_kv.errors import AgentKVError, KVCapacityError, QueueTimeoutError, TurnCancelled
from agent_kv.runtime.chat.history_sync import common_prefix
from agent_kv.runtime.engine.engine import Engine
from agent_kv.runtime.engine.sequence import SequenceOutline, SequenceState
from agent_kv.serving.session_checkpoints import SessionCheckpoints

log = logging.getLogger(__name__)


class SessionBusyError(AgentKVError):
    """The session has a request in flight."""


@dataclass
class SessionSummary:
    """One session as `SessionStore.describe` lists it.

    Attributes:
        id: the session id.
        tokens: tokens the session has fed to the model (its history).
        kv_live_bytes: live KV bytes.
        kv_allocated_bytes: allocated KV bytes (buffers with spare capacity).
        pinned_tokens: positions pinned.
        policy: the policy of the session's last request (None before its first).
        last_used: when it was last used, Unix seconds.
        where: "memory" or "disk".
        busy: whether a request is in flight.
        kv_bytes: deprecated alias of `kv_live_bytes`, removed in the next release.
    """

    id: str
    tokens: int
    kv_live_bytes: int
    kv_allocated_bytes: int
    pinned_tokens: int
    policy: str | None
    last_used: float
    where: str
    busy: bool
    kv_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.kv_bytes = self.kv_live_bytes


@dataclass
class _Entry:
    session: SequenceState | None  # None while saved to disk
    last_used: float  # the store's clock
    last_used_wall: float  # Unix seconds
    saved: SequenceOutline | None = None  # what the file on disk holds, while there
    policy: str | None = None
    in_flight: int = 0
    reserved: int = 0  # bytes reserved by the request holding it (`SessionStore.use`)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def allocated_bytes(self) -> int:
        """The allocated KV bytes of its session in memory (0 while on disk or not made)."""
        return 0 if self.session is None else self.session.store.allocated_nbytes()


class SessionStore:
    """Sessions of one engine, by id.

    Args:
        engine: makes new sessions (`Engine.new_sequence`) and owns the model they belong to.
        max_kv_bytes: cap on the allocated KV bytes of all sessions in memory
            (`KVStore.allocated_nbytes`), or None for no cap.
        idle_ttl_s: seconds a session may stay unused before it is dropped, or None.
        spill_dir: where sessions over the cap are saved; None drops them instead. Sessions
            already saved there are known again (unless `shared_spill`).
        clock: monotonic seconds (tests pass a fake one).
        shared_spill: `spill_dir` is shared with other replicas: each session is saved there
            after each request (`checkpoints`), a session unknown here is restored from it,
            and nothing in it is adopted at start.

    Raises:
        ValueError: a non-positive cap or TTL, or `shared_spill` without a `spill_dir`.
    """

    def __init__(
        self,
        engine: Engine,
        max_kv_bytes: int | None = None,
        idle_ttl_s: float | None = None,
        spill_dir: Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared_spill: bool = False,
    ):
        if shared_spill and spill_dir is None:
            raise ValueError("a shared spill needs a spill_dir")
        if max_kv_bytes is not None and max_kv_bytes <= 0:
            raise ValueError(f"max_kv_bytes must be positive, got {max_kv_bytes}")
        if idle_ttl_s is not None and idle_ttl_s <= 0:
            raise ValueError(f"idle_ttl_s must be positive, got {idle_ttl_s}")
        self.engine = engine
        self.max_kv_bytes = max_kv_bytes
        self.idle_ttl_s = idle_ttl_s
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        self.clock = clock
        self.dropped = 0
        self.spilled = 0
        self.unreadable = 0
        """Saved session files that could not be read back (each session started again, or
        the file removed at start)."""
        self.spill_failures = 0
        """Sessions that could not be saved to `spill_dir` (each dropped instead)."""
        self.taken_over = 0
        """Sessions this store did not know, restored from the shared spill (`shared_spill`):
        moved here from another replica."""
        self._entries: dict[str, _Entry] = {}  # insertion order is not use order: see `_lru`
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a request ends
        self.fresh = SequenceOutline.describe(engine.new_sequence())
        """The outline of a new session of this engine (what one allocates at first)."""
        self.shared_spill = shared_spill
        self.checkpoints = SessionCheckpoints(self.checkpoint) if shared_spill else None
        """The writer that saves each session after its requests (with `shared_spill`)."""
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
            if not shared_spill:
                self._adopt_saved()

    @contextmanager
    def use(
        self,
        session_id: str,
        need: Callable[[SequenceOutline], int] | None = None,
        policy: str | None = None,
        cancel: threading.Event | None = None,
        deadline: float | None = None,
    ) -> Iterator[SequenceState]:
        """Hold the session `session_id` for one request: created when new, restored when it
        was saved to disk. Other requests to it wait until this one ends; afterwards the TTL
        and the byte cap are enforced.

        Args:
            need: the most allocated KV bytes the session can hold during the request, given
                its outline now (history and `StoreFootprint`; see
                `ChatService.turn_kv_bound`); with a cap, idle sessions leave memory first
                until it fits beside the others, and it stays reserved for the request
                (requests running at once each count their reservation). None: its
                allocated bytes now.
            policy: the name of the policy the request runs (listed by `describe`).
            cancel: once set, a request still waiting (for the session or for room) stops.
            deadline: `time.monotonic()` until which the request may wait for the session
                and, with a cap, for requests in flight to end and leave room; None: wait for
                the session as long as it takes, and refuse at once what does not fit beside
                the requests in flight.

        Raises:
            KVCapacityError: with a cap, `need` does not fit even with every other session
                out of memory, or (without a deadline) beside the requests in flight
                (nothing is changed).
            QueueTimeoutError: the deadline passed while waiting.
            TurnCancelled: `cancel` was set while waiting.
        """
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None:
                entry = self._entries[session_id] = _Entry(None, self.clock(), time.time())
            entry.in_flight += 1
        try:
            _acquire(entry.lock, cancel, deadline)
            try:
                if self.max_kv_bytes is not None:
                    self._make_room(session_id, entry, need, cancel, deadline)
                if entry.session is None:
                    entry.session = self._restore(session_id)
                    entry.saved = None
                elif self.checkpoints is not None and self.checkpoints.take(session_id):
                    self._save_checkpoint(session_id, entry)  # the last turn first, on disk
                if policy is not None:
                    entry.policy = policy
                yield entry.session
            finally:
                entry.lock.release()
        finally:
            with self._lock:
                entry.in_flight -= 1
                entry.reserved = 0
                entry.last_used, entry.last_used_wall = self.clock(), time.time()
                if entry.session is None and entry.saved is None and not entry.in_flight:
                    del self._entries[session_id]  # refused before it ever held a cache
                elif self.checkpoints is not None and entry.session is not None:
                    self.checkpoints.request(session_id)
                self._enforce()
                self._room.notify_all()

    def checkpoint(self, session_id: str) -> bool:
        """Save the session `session_id`, in memory, to its file in `spill_dir` (written
        aside, then renamed: a reader finds the previous save or this one whole), keeping it
        in memory; waits for a request in flight to end. False when the session is not in
        memory (dropped or moved to disk since). A write that fails is logged and counted in
        `checkpoints.failed`.

        A request to a session whose save is still queued writes it before it runs: a turn
        starts only once the one before it is on disk."""
        with self._lock:
            entry = self._entries.get(session_id)
            if entry is None or entry.session is None:
                return False
            entry.in_flight += 1  # neither dropped nor moved out while it is written
        try:
            with entry.lock:
                if entry.session is None:
                    return False
                self._save_checkpoint(session_id, entry)
                return True
        finally:
            with self._lock:
                entry.in_flight -= 1
                self._room.notify_all()

    def _save_checkpoint(self, session_id: str, entry: _Entry) -> None:
        """Write the session of `entry` (in memory, its lock held) to its file; a failure is
        logged and counted (`SessionCheckpoints.failed`), never raised."""
        try:
            entry.session.save(self._path(session_id), self._meta(session_id, entry))
        except (OSError, RuntimeError) as err:  # the disk is full, gone or not writable
            log.warning("session %r could not be saved after its turn: %s", session_id, err)
            self.checkpoints.failed += 1
            return
        self.checkpoints.written += 1

    def _make_room(
        self,
        session_id: str,
        entry: _Entry,
        need: Callable[[SequenceOutline], int] | None,
        cancel: threading.Event | None,
        deadline: float | None,
    ) -> None:
        """Reserve `need(outline)` bytes for `entry` under the cap, moving idle sessions out
        of memory (least recently used first) and, with a deadline, waiting for requests in
        flight to end when their reservations leave no room; called holding the entry's
        lock."""
        if entry.session is not None:
            outline = SequenceOutline.describe(entry.session)
        else:
            outline = entry.saved if entry.saved is not None else self.fresh
        needed = outline.footprint.allocated_bytes if need is None else need(outline)
        with self._room:
            while True:
                shared = self.shared_bytes()  # (an idle session leaving may free some)
                flight = sum(
                    max(other.reserved, other.allocated_bytes())
                    for sid, other in self._entries.items()
                    if sid != session_id and other.in_flight
                )  # held, or reserved (its session perhaps not yet made), by requests in flight
                busy = shared + flight
                if busy + needed <= self.max_kv_bytes:
                    break
                if deadline is None or needed > self.max_kv_bytes:
                    raise KVCapacityError(
                        f"this request may hold up to {needed} bytes of KV cache; the cap on "
                        f"all sessions is {self.max_kv_bytes} bytes"
                        + (f", {flight} of them held by requests in flight" if flight else "")
                        + (f", {shared} by shared prefix blocks" if shared else "")
                        + ": send a shorter prompt or max_tokens, or use a budgeted policy"
                    )
                _wait_slice(self._room, cancel, deadline, "room under the KV cap")
            idle = self._idle_lru(exclude=session_id)
            sizes = {sid: self._entries[sid].session.store.allocated_nbytes() for _, sid in idle}
            held = busy + sum(sizes.values())
            while held + needed > self.max_kv_bytes:
                _, sid = idle.pop(0)
                held -= sizes[sid]
                self._evict(sid)
            entry.reserved = needed

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
        """Enforce the TTL and the byte cap now (they are also enforced after each request;
        the server calls this periodically, so idle sessions expire without traffic)."""
        with self._lock:
            self._enforce()

    def save_all(self) -> int:
        """Save every idle session in memory to `spill_dir` (a server shutting down, so a
        restart finds them); returns how many were saved. Without a spill dir, nothing."""
        if self.spill_dir is None:
            return 0
        with self._lock:
            idle = self._idle_lru()
            for _, sid in idle:
                self._evict(sid)
            return len(idle)

    def ids(self) -> list[str]:
        """Sessions known, in memory or on disk."""
        with self._lock:
            return list(self._entries)

    def in_memory(self) -> list[str]:
        """Sessions whose cache is in memory."""
        with self._lock:
            return [sid for sid, e in self._entries.items() if e.session is not None]

    def live_bytes(self) -> int:
        """Live KV bytes of all sessions in memory (the shared prefix blocks apart:
        `shared_bytes`)."""
        with self._lock:
            return sum(e.session.store.nbytes() for e in self._entries.values() if e.session)

    def allocated_bytes(self) -> int:
        """Allocated KV bytes of all sessions in memory and of the shared prefix blocks they
        read, each block once (what the cap counts)."""
        with self._lock:
            return self._allocated_bytes()

    def shared_bytes(self) -> int:
        """Bytes of the shared prefix blocks the sessions read (`Engine.prefix_cache`), each
        once; 0 without prefix sharing."""
        cache = self.engine.prefix_cache
        return 0 if cache is None else cache.nbytes()

    def describe(self) -> list[SessionSummary]:
        """Every session known, least recently used first."""
        with self._lock:
            entries = sorted(self._entries.items(), key=lambda item: item[1].last_used)
            return [self._summary(sid, entry) for sid, entry in entries]

    def _summary(self, session_id: str, entry: _Entry) -> SessionSummary:
        if entry.session is not None:
            store = entry.session.store
            tokens, pinned = len(entry.session.token_ids), store.pins.tokens()
            live, allocated, where = store.nbytes(), store.allocated_nbytes(), "memory"
        elif entry.saved is not None:
            saved = entry.saved
            tokens, pinned = len(saved.token_ids), saved.pinned_tokens
            live, allocated = saved.footprint.live_bytes, saved.footprint.allocated_bytes
            where = "disk"
        else:  # its first request is setting it up
            tokens = pinned = live = allocated = 0
            where = "memory"
        return SessionSummary(
            id=session_id,
            tokens=tokens,
            kv_live_bytes=live,
            kv_allocated_bytes=allocated,
            pinned_tokens=pinned,
            policy=entry.policy,
            last_used=entry.last_used_wall,
            where=where,
            busy=entry.in_flight > 0,
        )

    def _allocated_bytes(self) -> int:
        own = sum(e.session.store.allocated_nbytes() for e in self._entries.values() if e.session)
        return own + self.shared_bytes()

    def _idle_lru(self, exclude: str | None = None) -> list[tuple[float, str]]:
        """Idle sessions in memory, least recently used first."""
        return sorted(
            (entry.last_used, sid)
            for sid, entry in self._entries.items()
            if entry.session is not None and not entry.in_flight and sid != exclude
        )

    def _enforce(self) -> None:
        now = self.clock()
        if self.idle_ttl_s is not None:
            for sid, entry in list(self._entries.items()):
                if not entry.in_flight and now - entry.last_used > self.idle_ttl_s:
                    self._remove(sid)
                    self.dropped += 1
        if self.max_kv_bytes is None:
            return
        idle = self._idle_lru()
        while idle and self._allocated_bytes() > self.max_kv_bytes:
            _, sid = idle.pop(0)
            self._evict(sid)

    def _evict(self, session_id: str) -> None:
        """Take an idle session out of memory: saved to disk when there is a spill dir,
        dropped otherwise, or when it cannot be saved (logged, counted in `spill_failures`:
        the client's history rebuilds it)."""
        entry = self._entries[session_id]
        if self.spill_dir is None:
            self._remove(session_id)
            self.dropped += 1
            return
        meta = self._meta(session_id, entry)
        try:
            entry.session.save(self._path(session_id), meta)
        except (OSError, RuntimeError) as err:  # the disk is full, gone or not writable
            log.warning("session %r dropped: it could not be saved: %s", session_id, err)
            self.spill_failures += 1
            self._remove(session_id)
            self.dropped += 1
            return
        entry.saved = SequenceOutline.describe(entry.session, meta)
        entry.session = None
        self.spilled += 1

    @staticmethod
    def _meta(session_id: str, entry: _Entry) -> dict:
        """What a session's file holds beside its state."""
        return {"session_id": session_id, "policy": entry.policy}

    def _remove(self, session_id: str) -> None:
        del self._entries[session_id]
        if self.spill_dir is not None:
            _discard(self._path(session_id))

    def _restore(self, session_id: str) -> SequenceState:
        """The session saved to disk, loaded whole; a new one when there is no file, or when
        its file cannot be read back (damaged, cut short: refused whole, logged and counted in
        `unreadable`, removed), so the turn starts again from the client's history. With
        `shared_spill` the file stays: it is the session's save until its next one."""
        path = None if self.spill_dir is None else self._path(session_id)
        if path is not None and path.is_file():
            try:
                session = SequenceState.load(path, self.engine.model)
            except AgentKVError as err:
                log.warning("session %r starts again from its history: %s", session_id, err)
                self.unreadable += 1
                _discard(path)
                return self.engine.new_sequence()
            if self.shared_spill:
                self.taken_over += 1
            else:
                _discard(path)
            if self.engine.prefix_cache is not None:  # its shared blocks read once again
                session.store.prefix.adopt(self.engine.prefix_cache)
            return session
        return self.engine.new_sequence()

    def _adopt_saved(self) -> None:
        """Know again the sessions saved in `spill_dir` (by an earlier run): each keeps its
        id and policy from its file and its last use from the file's time. A file whose id
        cannot be read is removed (it could never be asked for)."""
        now_wall, now = time.time(), self.clock()
        for path in sorted(self.spill_dir.glob("*.pt")):
            if not path.is_file():
                log.warning("ignoring %s in the spill dir: not a file", path)
                continue
            try:
                saved = SequenceOutline.read(path)
                session_id = saved.meta["session_id"]
                if self._path(session_id) != path:
                    raise AgentKVError(f"{path} holds session {session_id!r} under another name")
            except (AgentKVError, KeyError, TypeError) as err:
                log.warning("removing unusable spill file %s: %s", path, err)
                self.unreadable += 1
                _discard(path)
                continue
            saved_at = path.stat().st_mtime
            entry = _Entry(None, now - max(now_wall - saved_at, 0.0), saved_at, saved)
            entry.policy = saved.meta.get("policy")
            self._entries[session_id] = entry
        self._enforce()

    def _path(self, session_id: str) -> Path:
        digest = hashlib.sha256(session_id.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        return self.spill_dir / f"{digest}.pt"


def _discard(path: Path) -> None:
    """Remove the spill file `path` if it is there; a path that cannot be removed (not a
    file, no permission) is logged and left."""
    try:
        path.unlink(missing_ok=True)
    except OSError as err:
        log.warning("cannot remove %s: %s", path, err)


WAIT_SLICE_S = 0.1
"""Seconds between a waiting request's checks of its `cancel` event and deadline."""


def _check_wait(cancel: threading.Event | None, deadline: float | None, what: str) -> None:
    """Raise if a request waiting for `what` was cancelled or is past its deadline."""
    if cancel is not None and cancel.is_set():
        raise TurnCancelled(f"the turn was cancelled while waiting for {what}")
    if deadline is not None and time.monotonic() >= deadline:
        raise QueueTimeoutError(f"waited too long for {what}; retry later")


def _acquire(lock: threading.Lock, cancel: threading.Event | None, deadline: float | None):
    """Take a session's lock, waiting in slices while the request may still wait."""
    while not lock.acquire(timeout=WAIT_SLICE_S):
        _check_wait(cancel, deadline, "the session (another request to it is running)")


def _wait_slice(
    room: threading.Condition, cancel: threading.Event | None, deadline: float, what: str
) -> None:
    """One slice of waiting on `room` (held), after checking the request may still wait."""
    _check_wait(cancel, deadline, what)
    room.wait(WAIT_SLICE_S)
