"""Session affinity inside Ray Serve: a request router for the model replicas.

Ray Serve routes each request through a `RequestRouter` in the caller's process (here the
gateway, `api.cluster.gateway`); its `choose_replicas` ranks the replicas a request may go
to. This one sends a request with a session key (`api.cluster.affinity.affinity_key`,
passed as the request's `session_id` metadata) to the one replica holding that session, and
a new session to the least loaded replica: fewest request body bytes in flight (the router's
own count, kept by Ray Serve's `on_request_routed` and `on_request_completed` hooks), then
fewest allocated KV bytes (each replica's `record_routing_stats`, which Ray Serve collects
every `request_routing_stats_period_s`). Requests without a key go to the least loaded
replica.

The router waits, with Ray Serve's backoff, for the holder of a session when its queue is
full rather than sending the session elsewhere: another replica would start it again from
the shared spill while the holder still has it in memory.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from api.cluster.affinity import InFlightBytes, Placements, ReplicaLoad


class SessionAffinityRouter(RequestRouter):
    """Ray Serve's request router for `api.cluster.replica.ReplicaServer` (see the module).

    Kwargs (`RequestRouterConfig.request_router_kwargs`):
        max_sessions: session placements remembered (default 100,000; the oldest are
            forgotten first, then found again from the replicas' reports).
    """

    def initialize_state(self, **kwargs) -> None:
        """Set the router's state from `request_router_kwargs`.

        Raises:
            ValueError: `max_sessions` is not a positive int.
        """
        capacity = kwargs.get("max_sessions", 100_000)
        if not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"max_sessions must be a positive int, got {capacity!r}")
        self.placements = Placements(capacity)
        self.in_flight_bytes = InFlightBytes()

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        """Take the running replicas, forgetting placements on those gone."""
        super().update_replicas(replicas)
        self.placements.forget_replicas_except({r.replica_id.unique_id for r in replicas})

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """One rank holding the one replica for the request (`Placements.choose`)."""
        if not candidate_replicas:
            return []
        key = ""
        if pending_request is not None:
            key = pending_request.metadata.session_id
            pending_request.routing_context.should_backoff = True  # wait for a full holder
        loads = [self._load(replica) for replica in candidate_replicas]
        chosen = self.placements.choose(key, loads)
        return [[r for r in candidate_replicas if r.replica_id.unique_id == chosen]]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result
    ) -> None:
        """Count the request's body bytes in flight on its replica."""
        size = sum(len(arg) for arg in pending_request.args if isinstance(arg, bytes))
        request_id = pending_request.metadata.internal_request_id
        self.in_flight_bytes.routed(request_id, replica_id.unique_id, size)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        """Take a finished request's bytes off its replica (Ray Serve may report a short
        request finished before it reports it routed: `InFlightBytes`)."""
        self.in_flight_bytes.completed(internal_request_id)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        return ReplicaLoad(
            replica_id=replica.replica_id.unique_id,
            in_flight_bytes=self.in_flight_bytes[replica.replica_id.unique_id],
            kv_allocated_bytes=int(stats.get("kv_allocated_bytes", 0)),
            sessions=frozenset(stats.get("sessions", ())),
        )
