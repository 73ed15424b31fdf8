"""Which replica a request goes to: the key it routes by, and the replica that key maps to.

A session's KV cache lives in one replica's memory, so every request naming a session must
reach the replica holding it (session affinity, as vLLM production-stack's session router
and SGLang's cache-aware router keep it). This module is the policy, with no Ray in it;
`api.cluster.session_router` applies it inside Ray Serve's request routing.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import unquote

ANONYMOUS_PREFIX = "anonymous:"
"""Keys of chats that name no session: a hash of their first messages (see `affinity_key`)."""
ANONYMOUS_MESSAGES = 2
"""The leading messages an anonymous chat's key hashes (the system prompt and the goal)."""
CHAT_PATHS = frozenset({"/chat", "/v1/chat/completions"})
"""Routes whose JSON body names a session or carries a conversation."""
SESSIONS_PATH = "/sessions/"


def json_object(body: bytes) -> dict | None:
    """The request body as a JSON object, or None when it is not one (the replica answers
    that with a 400)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def affinity_key(method: str, path: str, headers: Mapping[str, str], body: dict | None) -> str:
    """The key a request routes by, "" when any replica may serve it.

    In order: the `X-Session-Id` header; for `DELETE /sessions/{id}`, the id; for a chat, the
    body's `session_id` (`/chat`) or `user` (`/v1/chat/completions`); else, for a chat that
    names no session, `ANONYMOUS_PREFIX` and a hash of its first `ANONYMOUS_MESSAGES`
    messages, so the later turns of an anonymous agent reach the replica whose session
    matched its history by prefix. A body that is not a JSON object routes anywhere.

    Args:
        method: the HTTP method.
        path: the URL path.
        headers: the request's headers, names lower-cased, values as text.
        body: the request body as a JSON object (`json_object`), or None.
    """
    header = headers.get("x-session-id")
    if header:
        return header
    if method == "DELETE" and path.startswith(SESSIONS_PATH):
        return unquote(path[len(SESSIONS_PATH) :])
    if method != "POST" or path not in CHAT_PATHS or body is None:
        return ""
    for field in ("session_id", "user"):
        value = body.get(field)
        if isinstance(value, str) and value:
            return value
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return ""
    head = json.dumps(messages[:ANONYMOUS_MESSAGES], sort_keys=True).encode()
    return ANONYMOUS_PREFIX + hashlib.sha256(head).hexdigest()[:32]


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica as the router sees it.

    Attributes:
        replica_id: its id.
        in_flight_bytes: the body bytes of the requests sent to it and not finished (the
            router's count): the prompts it has queued or is running, in a unit every
            request has before any tokenizing.
        kv_allocated_bytes: allocated KV bytes of its sessions in memory, as it last reported
            (`SessionStore.allocated_bytes`).
        sessions: ids of the sessions it holds in memory, as it last reported.
    """

    replica_id: str
    in_flight_bytes: int = 0
    kv_allocated_bytes: int = 0
    sessions: frozenset[str] = frozenset()


class Placements:
    """Which replica each session key was sent to, newest last, at most `capacity` keys.

    The router's own memory of where it placed sessions: a replica's report of the sessions
    it holds comes only every stats period, while the second turn of a new session may come
    sooner.
    """

    def __init__(self, capacity: int = 100_000):
        self.capacity = capacity
        self._replica_of: OrderedDict[str, str] = OrderedDict()

    def choose(self, key: str, replicas: list[ReplicaLoad]) -> str:
        """The id of the replica for a request routed by `key`.

        The replica this router placed `key` on, while it runs; else one that reports
        holding `key`; else the least loaded: fewest request bytes in flight, then fewest
        allocated KV bytes, then fewest sessions placed there by this router (the KV bytes
        are reported only every stats period). That is where new sessions go, and those of a
        replica that died, which the chosen one restores from the shared spill. A key of ""
        (any replica) is not remembered.

        Raises:
            ValueError: `replicas` is empty.
        """
        if not replicas:
            raise ValueError("no replica to choose from")
        running = {replica.replica_id for replica in replicas}
        if key:
            placed = self._replica_of.get(key)
            if placed in running:
                self._replica_of.move_to_end(key)
                return placed
            holders = [replica.replica_id for replica in replicas if key in replica.sessions]
            if holders:
                return self._remember(key, holders[0])
        placed = Counter(self._replica_of.values())
        least = min(
            replicas,
            key=lambda r: (
                r.in_flight_bytes,
                r.kv_allocated_bytes,
                placed[r.replica_id],
                r.replica_id,
            ),
        )
        return self._remember(key, least.replica_id) if key else least.replica_id

    def forget_replicas_except(self, running: set[str]) -> None:
        """Forget the placements on replicas no longer running."""
        for key in [key for key, replica in self._replica_of.items() if replica not in running]:
            del self._replica_of[key]

    def replica_of(self, key: str) -> str | None:
        """The replica `key` was last placed on, or None."""
        return self._replica_of.get(key)

    def _remember(self, key: str, replica_id: str) -> str:
        self._replica_of[key] = replica_id
        self._replica_of.move_to_end(key)
        while len(self._replica_of) > self.capacity:
            self._replica_of.popitem(last=False)
        return replica_id


class InFlightBytes:
    """The body bytes of the requests in flight on each replica, from two reports that may
    come in either order: a request routed (`routed`) and a request finished (`completed`).
    A request finished before its routing is reported (a short one) is remembered, at most
    `memory` of them, so that its late report adds nothing.
    """

    def __init__(self, memory: int = 10_000):
        self.memory = memory
        self._by_replica: Counter[str] = Counter()
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (replica id, bytes)
        self._finished: OrderedDict[str, None] = OrderedDict()  # finished, routing unreported

    def routed(self, request_id: str, replica_id: str, size: int) -> None:
        """Request `request_id`, of `size` body bytes, went to `replica_id`."""
        if self._finished.pop(request_id, False) is None:
            return
        self._sent[request_id] = (replica_id, size)
        self._by_replica[replica_id] += size

    def completed(self, request_id: str) -> None:
        """Request `request_id` finished (or failed)."""
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            self._by_replica[sent[0]] -= sent[1]
            return
        self._finished[request_id] = None
        while len(self._finished) > self.memory:
            self._finished.popitem(last=False)

    def __getitem__(self, replica_id: str) -> int:
        """The bytes in flight on `replica_id`."""
        return self._by_replica[replica_id]
