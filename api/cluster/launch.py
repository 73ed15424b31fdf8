"""`agent-kv serve --replicas N`: the Ray Serve application, started and run until stopped.

Two deployments: `gateway` (`api.cluster.gateway.Gateway`, the HTTP ingress, no CPU of its
own) and `model` (`api.cluster.replica.ReplicaServer`, N replicas of one CPU per torch
thread each, routed by `api.cluster.session_router.SessionAffinityRouter`), and one named
actor, the `ReplicaDirectory` the replicas report to. Ray Serve restarts a replica that dies;
the sessions it held resume on the others from the shared spill dir meanwhile.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from dataclasses import dataclass, replace

from agent_kv.errors import ConfigError
from agent_kv.harness.sweep.ray_pool import ray_session
from api.body_limit import MAX_BODY_BYTES
from api.cluster.directory import ReplicaDirectory
from api.cluster.gateway import Gateway, GatewaySettings
from api.cluster.replica import ReplicaServer
from api.cluster.session_router import SessionAffinityRouter
from api.server_setup import ServerSettings

APP_NAME = "agent-kv"
NAMESPACE = "agent-kv"
DIRECTORY = "agent-kv-replica-directory"
ROUTING_STATS_PERIOD_S = 1.0
"""Seconds between Ray Serve's reads of each replica's load (`record_routing_stats`)."""
ROUTERS = {
    "least-loaded": SessionAffinityRouter,
    "hash": "ray.serve.experimental.consistent_hash_router.ConsistentHashRouter",
}
"""`--router`: the request router of the model replicas. `least-loaded` keeps each session on
its replica and sends new ones to the least loaded (`SessionAffinityRouter`); `hash` is Ray
Serve's consistent-hash router, where a session's replica follows from its id alone (load is
not weighed; several gateways agree with no state shared)."""


@dataclass(frozen=True)
class ClusterSettings:
    """Where and how many.

    Attributes:
        replicas: model replicas.
        threads: torch threads (and Ray CPUs) of each replica.
        host: the interface Ray Serve's HTTP proxy listens on.
        port: its TCP port.
        ray_address: a running cluster's address (`HOST:PORT`), or None to start a local one
            on this machine.
        router: a name in `ROUTERS`.
    """

    replicas: int
    threads: int
    host: str
    port: int
    ray_address: str | None
    router: str = "least-loaded"


def build_application(server: ServerSettings, cluster: ClusterSettings):
    """The Ray Serve application (not yet running): the gateway bound to the replicas."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    model = serve.deployment(
        ReplicaServer,
        name="model",
        num_replicas=cluster.replicas,
        ray_actor_options={"num_cpus": cluster.threads},
        max_ongoing_requests=server.max_waiting + server.max_batch,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[cluster.router],
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        ),
        health_check_period_s=2.0,
        graceful_shutdown_timeout_s=60.0,
    )
    gateway = serve.deployment(
        serve.ingress()(Gateway),
        name="gateway",
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=10_000,
    )
    checks = GatewaySettings(server.api_key, server.allowed_hosts, MAX_BODY_BYTES)
    return gateway.bind(model.bind(server, DIRECTORY, NAMESPACE), DIRECTORY, NAMESPACE, checks)


def run_cluster(server: ServerSettings, cluster: ClusterSettings) -> None:
    """Start (or join) Ray (`ray_session`), run the application until SIGINT or SIGTERM,
    then shut it down, saying `ready on http://HOST:PORT` on stderr once every replica has
    loaded its model.

    Raises:
        ConfigError: the cluster has fewer CPUs than the replicas need, or no Ray cluster
            answers at `ray_address`.
        RuntimeError: a replica failed to start (Ray Serve gave up on the deployment).
    """
    import ray
    from ray import serve

    with ray_session(cluster.ray_address, num_cpus=os.cpu_count() or 1):
        cpus = ray.cluster_resources().get("CPU", 0)
        needed = cluster.replicas * cluster.threads
        if needed > cpus:
            raise ConfigError(
                f"{cluster.replicas} replicas of {cluster.threads} thread(s) need {needed} "
                f"CPUs; the Ray cluster has {cpus:g}"
            )
        ray.remote(ReplicaDirectory).options(
            name=DIRECTORY, namespace=NAMESPACE, num_cpus=0, lifetime="detached",
            get_if_exists=True,
        ).remote()  # fmt: skip
        try:
            serve.start(http_options={"host": cluster.host, "port": cluster.port})
            settings = replace(server, shared_spill=True, threads=cluster.threads)
            print(f"starting {cluster.replicas} replicas...", file=sys.stderr)
            serve.run(build_application(settings, cluster), name=APP_NAME, route_prefix="/")
            print(f"ready on http://{cluster.host}:{cluster.port}", file=sys.stderr)
            _wait_for_signal()
        finally:
            print("shutting down the replicas...", file=sys.stderr)
            serve.shutdown()
            ray.kill(ray.get_actor(DIRECTORY, namespace=NAMESPACE))


def _wait_for_signal() -> None:
    """Block until SIGINT or SIGTERM."""
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
