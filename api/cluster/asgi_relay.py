"""One HTTP request through an ASGI app in this process, its response handed on as messages.

The gateway (`api.cluster.gateway`) passes a request it received to a replica through a Ray
Serve handle: the request's ASGI scope (plain values) and its whole body. The replica runs
it through its own app (`api.app`: the same routes, checks, errors and streaming as one
server) and streams back the ASGI messages the app sends, which the gateway sends on to its
client unchanged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.types import ASGIApp, Message

log = logging.getLogger(__name__)

SCOPE_KEYS = (
    "type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path",
    "query_string", "headers", "client", "server",
)  # fmt: skip
"""The parts of an HTTP scope that travel to the replica (the rest is the gateway's own)."""
_END = object()
_running: set[asyncio.Task] = set()  # held until done (the loop keeps only weak references)


def portable_scope(scope: dict) -> dict:
    """The parts of an ASGI HTTP `scope` another process can run the request with: plain
    values only (`SCOPE_KEYS`), headers as a list of `(name, value)` byte pairs."""
    kept = {key: scope[key] for key in SCOPE_KEYS if key in scope}
    kept["headers"] = [(bytes(name), bytes(value)) for name, value in scope.get("headers", ())]
    kept["root_path"] = ""
    return kept


async def run_app(app: ASGIApp, scope: dict, body: bytes) -> AsyncIterator[Message]:
    """Run one request (`scope`, the whole `body`) through `app`, yielding the messages it
    sends (`http.response.start`, then `http.response.body` ones) as it sends them.

    When the consumer stops early (the client went away, or the gateway's call was
    cancelled), the app receives `http.disconnect`, as from a server whose client closed the
    connection: a turn in flight stops at its next check. An exception the app raises after
    its response started ends the messages (logged); one raised before is raised here.
    """
    queue: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_sent = False

    async def receive() -> Message:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await queue.put(dict(message))

    async def run() -> None:
        try:
            await app(dict(scope), receive, send)
        except Exception as err:  # noqa: BLE001 - handed to the consumer below
            await queue.put(err)
        await queue.put(_END)

    task = asyncio.get_running_loop().create_task(run())
    _running.add(task)
    task.add_done_callback(_running.discard)
    started = False
    try:
        while True:
            message = await queue.get()
            if message is _END:
                return
            if isinstance(message, Exception):
                if not started:
                    raise message
                log.warning("the app failed after its response started: %r", message)
                return
            started = started or message["type"] == "http.response.start"
            yield message
    finally:
        disconnected.set()
