"""Saving sessions after their turns, off the turn's critical path.

A server that shares its spill directory with other replicas (`SessionStore` with
`shared_spill=True`) saves each session after each of its requests, so that another replica
can resume it from its last completed turn when this one dies. The save runs on one writer
thread, after the reply has gone out; the queue holds each session at most once (a session
asked for again while it waits is saved once, in its newest state), so it is bounded by the
number of sessions in memory. A next request to a session waits for a save of it in
progress (the session's lock), and writes a save of it still queued itself before it runs
(`SessionStore.use`), so a turn starts only once the one before it is on disk.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class SessionCheckpoints:
    """A writer thread that calls `save(session_id)` for each session asked for, in order.

    Args:
        save: writes one session's state, counting it in `written` or (logged) in `failed`;
            returns False when there was nothing to write (the session is gone).

    Attributes:
        written: sessions saved (counted by `save`).
        failed: saves that failed (counted by `save`).
    """

    def __init__(self, save: Callable[[str], bool]):
        self._save = save
        self._pending: OrderedDict[str, None] = OrderedDict()
        self._idle = threading.Condition()
        self._busy = False
        self._closed = False
        self.written = 0
        self.failed = 0
        self._thread = threading.Thread(target=self._run, name="session-checkpoints", daemon=True)
        self._thread.start()

    def request(self, session_id: str) -> None:
        """Queue a save of `session_id` (once, however often asked before it runs)."""
        with self._idle:
            if self._closed:
                return
            self._pending[session_id] = None
            self._idle.notify_all()

    def take(self, session_id: str) -> bool:
        """Remove `session_id` from the queue; whether it was queued (the caller then saves
        it itself)."""
        with self._idle:
            return self._pending.pop(session_id, False) is None

    def pending(self) -> int:
        """Saves queued or running."""
        with self._idle:
            return len(self._pending) + self._busy

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every save queued so far has run; False when `timeout_s` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._pending and not self._busy, timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Run the saves queued, then stop the thread."""
        self.flush(timeout_s)
        with self._idle:
            self._closed = True
            self._idle.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._idle:
                self._idle.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                session_id, _ = self._pending.popitem(last=False)
                self._busy = True
            try:
                self._save(session_id)
            finally:
                with self._idle:
                    self._busy = False
                    self._idle.notify_all()
