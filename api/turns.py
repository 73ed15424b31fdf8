"""Running a request's chat turn: its place in the queue (`admit`), the turn in a worker
thread (`run_turn`, the service's errors as API errors), cancelled when the client
disconnects (`watch_disconnect`, `run_watched`)."""

from __future__ import annotations

import asyncio
import threading

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from agent_kv.errors import (
    ConfigError,
    ContextOverflowError,
    GrammarError,
    KVCapacityError,
    QueueTimeoutError,
    TurnCancelled,
)
from agent_kv.serving.chat_service import Admission, ChatService, ChatTurn, QueueFullError
from api.errors import APIError
from api.request_log import CLIENT_CLOSED


def admit(service: ChatService) -> Admission:
    """The request's place in the queue; a 429 when it is full."""
    try:
        return service.admit()
    except QueueFullError as err:
        raise APIError(429, str(err), None, "busy") from None


async def watch_disconnect(request: Request, cancel: threading.Event) -> None:
    """Set `cancel` when the client disconnects (the body has been read, so the next ASGI
    message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


async def run_watched(
    raw: Request, admission: Admission, metrics, service, *args, **kwargs
) -> ChatTurn:
    """Run a turn (`ChatService.run`'s arguments) in a worker thread, cancelled if the client
    disconnects meanwhile."""
    cancel = threading.Event()
    watcher = asyncio.create_task(watch_disconnect(raw, cancel))
    try:
        turn = await run_in_threadpool(
            run_turn, service, *args, cancel=cancel, admission=admission, **kwargs
        )
    finally:
        watcher.cancel()
        admission.release()
    metrics.observe(turn)
    return turn


def run_turn(service: ChatService, *args, **kwargs) -> ChatTurn:
    """`service.run` with its errors as API errors."""
    try:
        return service.run(*args, **kwargs)
    except GrammarError as err:  # `reply_spec` built the grammar: only the matcher's limits
        raise APIError(400, str(err), "tools", "invalid_value") from None
    except ContextOverflowError as err:
        raise APIError(400, str(err), "messages", "context_length_exceeded") from None
    except KVCapacityError as err:
        raise APIError(400, str(err), "messages", "kv_capacity_exceeded") from None
    except ConfigError as err:  # e.g. a policy override the session's cache cannot take
        raise APIError(422, str(err), "policy", "unprocessable") from None
    except QueueFullError as err:
        raise APIError(429, str(err), None, "busy") from None
    except QueueTimeoutError as err:
        raise APIError(503, str(err), None, "timeout") from None
    except TurnCancelled as err:
        raise APIError(CLIENT_CLOSED, str(err), None, "client_closed") from None
