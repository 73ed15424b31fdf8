"""A model replica: one whole server (`api.server_setup.build_server`) in a Ray Serve replica.

Each replica loads the model and runs the same app as `agent-kv serve` does alone (its
scheduler, session store, caps, checks and errors); the gateway relays requests to it
(`relay`), and Ray Serve's router reads its load (`record_routing_stats`). Its session
store shares the spill dir with the other replicas (`SessionStore`, `shared_spill`): each
session is saved after each turn, and a session it does not hold is restored from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import asdict

import ray
from ray import serve
from starlette.concurrency import run_in_threadpool

from api.cluster.asgi_relay import run_app
from api.cluster.directory import REPORT_PERIOD_S
from api.server_setup import ServerSettings, build_server

log = logging.getLogger(__name__)


class ReplicaServer:
    """The Ray Serve deployment class of a model replica.

    Args:
        settings: the server's settings (`shared_spill` set, a `spill_dir` shared by every
            replica).
        directory: the name of the `ReplicaDirectory` actor it reports to.
        namespace: the Ray namespace of that actor.

    Raises:
        AgentKVError: the model cannot be loaded (the replica fails to start).
    """

    async def __init__(self, settings: ServerSettings, directory: str, namespace: str):
        self.app, self.service = build_server(settings)
        self._lifespan = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()  # the session sweeper; on exit, sessions saved
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.directory = ray.get_actor(directory, namespace=namespace)
        self._reporting = asyncio.get_running_loop().create_task(self._report_every())

    async def relay(self, scope: dict, body: bytes) -> AsyncIterator[dict]:
        """Run one HTTP request through this replica's app (`asgi_relay.run_app`), yielding
        the ASGI messages of its response as they come."""
        async for message in run_app(self.app, scope, body):
            yield message

    async def respond(self, scope: dict, body: bytes) -> list[dict]:
        """Run one HTTP request through this replica's app; its response's ASGI messages,
        all at once (one return over Ray rather than a stream: for replies not streamed)."""
        return [message async for message in run_app(self.app, scope, body)]

    def record_routing_stats(self) -> dict:
        """What the router weighs (`SessionAffinityRouter`): the allocated KV bytes of the
        sessions in memory and their ids."""
        sessions = self.service.sessions
        return {
            "kv_allocated_bytes": sessions.allocated_bytes(),
            "sessions": sessions.in_memory(),
        }

    def report(self) -> dict:
        """This replica as the gateway lists it: `replica` (its id), `pid`, `node` (the Ray
        node id), `sessions` (`SessionStore.describe`, as dicts), `kv_allocated_bytes` and
        `metrics` (its Prometheus text)."""
        sessions = self.service.sessions
        return {
            "replica": self.replica_id,
            "pid": os.getpid(),
            "node": self.node,
            "sessions": [asdict(summary) for summary in sessions.describe()],
            "kv_allocated_bytes": sessions.allocated_bytes(),
            "metrics": self.app.state.server.metrics.render().decode(),
        }

    async def __del__(self) -> None:
        """Stop reporting, run the saves queued and save the idle sessions (a drain)."""
        self._reporting.cancel()
        with contextlib.suppress(Exception):
            self.directory.withdraw.remote(self.replica_id)
        await self._lifespan.__aexit__(None, None, None)
        checkpoints = self.service.sessions.checkpoints
        if checkpoints is not None:
            await run_in_threadpool(checkpoints.close, 30.0)

    async def _report_every(self) -> None:
        while True:
            try:
                report = await run_in_threadpool(self.report)
                self.directory.report.remote(self.replica_id, report)
            except Exception as err:  # noqa: BLE001 - the next period tries again
                log.warning("replica %s could not report: %r", self.replica_id, err)
            await asyncio.sleep(REPORT_PERIOD_S)
