"""The ingress of `agent-kv serve --replicas N`: one HTTP front for the model replicas.

Ray Serve's HTTP proxy hands every request to this deployment, which:
- answers `GET /sessions` (every replica's sessions, each with the `replica` holding it),
  `GET /replicas` (the replicas reporting: id, process, node, sessions, KV bytes) and
  `GET /metrics` (`api.cluster.merged_metrics`) from the replicas' reports
  (`api.cluster.directory`);
- relays every other request whole to one model replica through a Ray Serve handle, with its
  affinity key (`api.cluster.affinity`) as the request's session id, which the replicas'
  request router (`api.cluster.session_router`) routes by; the replica's response
  (`api.cluster.asgi_relay`) comes back in one return, or message by message for a
  streamed reply (`"stream": true`).

The same Host and API-key checks and body limit as one server apply here first, answered in
the same shapes. A replica lost before its response started is a 503 with a retryable error
(`replica_unavailable`, `Retry-After`): the session resumes on another replica from its last
completed turn. One lost while streaming ends the stream with an `error` event and `[DONE]`,
as a turn failing mid-stream does on one server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount
from starlette.types import Receive, Scope, Send

from api.access import AccessControl
from api.body_limit import BodyLimit
from api.cluster.affinity import affinity_key, json_object
from api.cluster.asgi_relay import portable_scope
from api.cluster.merged_metrics import merge_metrics
from api.errors import error_response
from api.response_schemas import ErrorDetail, SessionInfo, SessionList

log = logging.getLogger(__name__)

REPLICA_LOST = (
    "the replica serving this request stopped; retry: the session resumes on another "
    "replica from its last completed turn"
)


class ReplicaInfo(BaseModel):
    """One replica of `GET /replicas`."""

    id: str
    pid: int = Field(description="Its process id on its node.")
    node: str = Field(description="The Ray node it runs on.")
    sessions: int = Field(description="Sessions it knows, in memory or saved.")
    kv_allocated_bytes: int = Field(description="Allocated KV bytes of its sessions in memory.")


class ReplicaList(BaseModel):
    """`GET /replicas` response."""

    object: Literal["list"] = "list"
    data: list[ReplicaInfo]


@dataclass(frozen=True)
class GatewaySettings:
    """The checks the gateway applies before relaying (as one server would).

    Attributes:
        api_key: the key every route but /health needs, or None.
        allowed_hosts: `Host` names answered (`api.access`).
        max_body_bytes: larger bodies are a 413.
    """

    api_key: str | None
    allowed_hosts: list[str]
    max_body_bytes: int


class Gateway:
    """The Ray Serve ingress deployment class (see the module).

    Args:
        replicas: a handle to the `ReplicaServer` deployment.
        directory: the name of the `ReplicaDirectory` actor.
        namespace: its Ray namespace.
        settings: the checks to apply.
    """

    def __init__(self, replicas, directory: str, namespace: str, settings: GatewaySettings):
        import ray

        self.replicas = replicas
        self.directory = ray.get_actor(directory, namespace=namespace)
        self.settings = settings

    def __serve_build_asgi_app__(self) -> Starlette:
        """The gateway's ASGI app (Ray Serve's late-bound ingress)."""
        settings = self.settings
        return Starlette(
            routes=[Mount("", app=self.dispatch)],
            middleware=[
                Middleware(
                    AccessControl,
                    reject=error_response,
                    api_key=settings.api_key,
                    allowed_hosts=settings.allowed_hosts,
                ),
                Middleware(BodyLimit, max_bytes=settings.max_body_bytes, reject=error_response),
            ],
        )

    async def dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Answer `GET /sessions` and `GET /metrics` here; relay everything else."""
        route = (scope["method"], scope["path"])
        if route == ("GET", "/sessions"):
            response = Response(
                (await self.sessions()).model_dump_json(), media_type="application/json"
            )
        elif route == ("GET", "/replicas"):
            response = Response(
                (await self.replica_list()).model_dump_json(), media_type="application/json"
            )
        elif route == ("GET", "/metrics"):
            response = Response(
                merge_metrics(await self.metrics_texts()),
                media_type="text/plain; version=0.0.4",
            )
        else:
            await self.relay(scope, receive, send)
            return
        await response(scope, receive, send)

    async def sessions(self) -> SessionList:
        """Every session the replicas reporting know, least recently used first, each with
        the replica holding it."""
        reports = await self.directory.live.remote()
        listed = [
            SessionInfo.model_validate({**summary, "replica": replica_id})
            for replica_id, report in reports.items()
            for summary in report["sessions"]
        ]
        return SessionList(data=sorted(listed, key=lambda s: s.last_used))

    async def replica_list(self) -> ReplicaList:
        """The replicas reporting, by id."""
        reports = await self.directory.live.remote()
        return ReplicaList(
            data=[
                ReplicaInfo(
                    id=replica_id,
                    pid=report["pid"],
                    node=report["node"],
                    sessions=len(report["sessions"]),
                    kv_allocated_bytes=report["kv_allocated_bytes"],
                )
                for replica_id, report in sorted(reports.items())
            ]
        )

    async def metrics_texts(self) -> dict[str, str]:
        """Each reporting replica's Prometheus text, by replica id."""
        reports = await self.directory.live.remote()
        return {replica_id: report["metrics"] for replica_id, report in reports.items()}

    async def relay(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Send the request to its replica and its response back (see the module)."""
        body = await Request(scope, receive).body()  # bounded by `BodyLimit`
        headers = {
            name.decode("latin-1").lower(): value.decode("utf-8", "replace")
            for name, value in scope["headers"]
        }
        request = json_object(body) if scope["method"] == "POST" else None
        key = affinity_key(scope["method"], scope["path"], headers, request)
        started, streaming = False, False
        try:
            if request is not None and request.get("stream") is True:
                handle = self.replicas.options(stream=True, session_id=key)
                messages = handle.relay.remote(portable_scope(scope), body)
            else:
                handle = self.replicas.options(session_id=key)
                messages = _each(await handle.respond.remote(portable_scope(scope), body))
            async for message in messages:
                if message["type"] == "http.response.start":
                    started = True
                    streaming = _is_event_stream(message)
                await send(message)
        except (RayError, RayServeException) as err:
            log.warning("replica lost for %s %s: %r", scope["method"], scope["path"], err)
            if not started:
                response = error_response(503, REPLICA_LOST, None, "replica_unavailable")
                await response(scope, receive, send)
            else:
                await send({"type": "http.response.body", "body": _lost_event(streaming)})


async def _each(messages: list[dict]) -> AsyncIterator[dict]:
    """`messages` one by one, as a stream gives them."""
    for message in messages:
        yield message


def _is_event_stream(start: dict) -> bool:
    """Whether a response (its `http.response.start` message) is a server-sent event stream."""
    return any(
        name.lower() == b"content-type" and value.startswith(b"text/event-stream")
        for name, value in start.get("headers", ())
    )


def _lost_event(streaming: bool) -> bytes:
    """The last bytes of a response cut short by a lost replica: an `error` event for an
    event stream (as a turn failing mid-stream ends on one server), nothing otherwise."""
    if not streaming:
        return b""
    error = ErrorDetail(
        message=REPLICA_LOST, type="server_error", param=None, code="replica_unavailable"
    )
    return f"data: {json.dumps({'error': error.model_dump()})}\n\ndata: [DONE]\n\n".encode()
