"""The tool calls a service generated, by id, so that a call a client sends back re-serialised
renders as the model wrote it.

A session's cache holds a call as the model generated it (`{"city": "Paris"}`, with the
separators of `tool_calls.JSON_LAYOUT`). Clients that parse the arguments and dump them again
(pydantic-ai writes `{"city":"Paris"}`) send back other text for the same call, and the
history rendered from it no longer matches the cache from that call on. The server issued the
call's id: a call that comes back with a known id, the same function and JSON-equal arguments
is rendered with the generated text.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import replace

from agent_kv.runtime.replies.tool_calls import ToolCall

MAX_ISSUED_CALLS = 4096
"""Calls remembered (the newest); an older one sent back renders as the client sent it."""


def canonical_json(text: str) -> str | None:
    """`text` parsed and dumped with sorted keys and no spaces (JSON values that differ in type,
    `1` and `1.0` or `true`, stay different); None for text that is not JSON."""
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except (ValueError, RecursionError):
        return None


class IssuedCalls:
    """The newest `capacity` calls generated, by id (thread-safe).

    Args:
        capacity: calls remembered.

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity: int = MAX_ISSUED_CALLS):
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._calls: OrderedDict[str, ToolCall] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, calls: list[ToolCall]) -> None:
        """Remember `calls`, as generated."""
        with self._lock:
            for call in calls:
                self._calls[call.id] = call
                self._calls.move_to_end(call.id)
            while len(self._calls) > self.capacity:
                self._calls.popitem(last=False)

    def restore(self, messages: list[dict]) -> list[dict]:
        """`messages` (`{"role", "content", "tool_calls", ...}` dicts) with every call this
        service issued, sent back with the same function and JSON-equal arguments, carrying
        the arguments text as generated; the messages themselves are not changed."""
        out = []
        for message in messages:
            calls = message.get("tool_calls") or []
            restored = [self._as_generated(call) for call in calls]
            changed = any(new is not old for new, old in zip(restored, calls, strict=True))
            out.append({**message, "tool_calls": restored} if changed else message)
        return out

    def _as_generated(self, call: ToolCall) -> ToolCall:
        with self._lock:
            issued = self._calls.get(call.id)
        if issued is None or issued.name != call.name or issued.arguments == call.arguments:
            return call
        if canonical_json(issued.arguments) != canonical_json(call.arguments):
            return call
        return replace(call, arguments=issued.arguments)
