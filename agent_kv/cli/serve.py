"""`agent-kv serve`: the API (`api.app`) on one port, from one server or from N replicas on
Ray Serve (`api.cluster`), its options checked before the model loads.

The port is taken before the model loads too, so a port in use (or a host that cannot be
bound) fails the command at once rather than after minutes of loading and compiling. One
server listens on it from then on and hands the socket to uvicorn (`_listen`): nothing can
take the port in between, and a client that connects while the model loads waits in the
listen backlog and is answered once the server is ready. Ray Serve's HTTP proxy binds the
port itself, so `--replicas` only checks that it can be bound and lets it go again (a
server started in between would still take it first)."""

from __future__ import annotations

import copy
import socket
import tempfile
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer
import uvicorn

from agent_kv.cli.common import fail, writable_dir
from agent_kv.cli.options import (
    BudgetBytesOption,
    BudgetOption,
    CompileOption,
    FpWindowOption,
    Int8Option,
    ModelOption,
    ParamOption,
    PolicyOption,
    PositionsOption,
    RecallOption,
    RecallParamOption,
    ThreadsOption,
    WeightsOption,
)
from agent_kv.errors import AgentKVError
from agent_kv.kv.budgets import parse_bytes
from agent_kv.kv.policy_names import split_reencode
from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting
from agent_kv.runtime.models.weight_formats import DEFAULT_WEIGHTS, check_weight_format
from api.access import loopback_hosts

API_KEY_ENV = "AGENT_KV_API_KEY"
"""Read for `serve --api-key` when the option is not given."""


class ReplicaRouter(StrEnum):
    """`serve --router`: the keys of `api.cluster.launch.ROUTERS` (imported only to serve)."""

    least_loaded = "least-loaded"
    hash = "hash"


HostOption = Annotated[str, typer.Option(help="Interface to listen on.")]
PortOption = Annotated[int, typer.Option(min=1, max=65535, help="TCP port.")]
SessionBytesOption = Annotated[
    str | None,
    typer.Option(
        help="Cap on the KV bytes of all sessions in memory (e.g. 2GB); the least recently "
        "used idle session leaves memory first."
    ),
]
SessionTtlOption = Annotated[float, typer.Option(min=1.0, help="Seconds an idle session is kept.")]
SpillDirOption = Annotated[
    Path | None,
    typer.Option(help="Save sessions over the byte cap here instead of dropping them."),
]
MaxWaitingOption = Annotated[
    int, typer.Option(min=1, help="Requests that may wait for the model (then 429).")
]
QueueTimeoutOption = Annotated[
    float, typer.Option(min=1.0, help="Seconds a request may wait for the model (then 503).")
]
MaxBatchOption = Annotated[
    int,
    typer.Option(
        min=1,
        help="Turns decoded at once as rows of one forward call (continuous batching; "
        "1: one turn at a time).",
    ),
]
ApiKeyOption = Annotated[
    str | None,
    typer.Option(
        envvar=API_KEY_ENV,
        show_envvar=True,
        help="Require `Authorization: Bearer KEY` on every route but /health (401 without).",
    ),
]
AllowedHostsOption = Annotated[
    str | None,
    typer.Option(
        help="Comma-separated Host names the server answers (400 for others; * for any). "
        "Default: the names of --host (127.0.0.1, localhost and ::1 for a loopback "
        "address; any for 0.0.0.0)."
    ),
]
DropImagePartsOption = Annotated[
    bool,
    typer.Option(
        help="Drop the image parts of messages unread (counted in /metrics and each "
        "reply's kv.image_parts_dropped) instead of refusing them with a 400: for clients "
        "that also send the page as text (browser-use with use_vision)."
    ),
]
ReplicasOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Serve N model replicas on Ray Serve behind one port, each session routed to "
        "the replica holding it and saved to --spill-dir after each turn, so another "
        "replica resumes it when one dies (default: one server, no Ray).",
    ),
]
ClusterAddressOption = Annotated[
    str | None,
    typer.Option(
        help="With --replicas: join the Ray cluster at HOST:PORT (default: start one on "
        "this machine). --spill-dir must then be on storage every node mounts."
    ),
]
RouterOption = Annotated[
    ReplicaRouter,
    typer.Option(
        help="With --replicas: least-loaded keeps each session on its replica and sends "
        "new ones to the least loaded; hash is Ray Serve's consistent-hash router (a "
        "session's replica follows from its id alone, load not weighed)."
    ),
]


def serve_command(
    host: HostOption = "127.0.0.1",
    port: PortOption = 8000,
    policy: PolicyOption = "conf-kv",
    budget: BudgetOption = None,
    budget_bytes: BudgetBytesOption = None,
    param: ParamOption = None,
    recall: RecallOption = False,
    recall_param: RecallParamOption = None,
    int8: Int8Option = False,
    fp_window: FpWindowOption = None,
    positions: PositionsOption = "original",
    model: ModelOption = None,
    weights: WeightsOption = DEFAULT_WEIGHTS,
    session_bytes: SessionBytesOption = None,
    session_ttl: SessionTtlOption = 3600.0,
    spill_dir: SpillDirOption = None,
    max_waiting: MaxWaitingOption = 32,
    queue_timeout: QueueTimeoutOption = 600.0,
    max_batch: MaxBatchOption = 16,
    threads: ThreadsOption = None,
    compile: CompileOption = None,
    api_key: ApiKeyOption = None,
    allowed_hosts: AllowedHostsOption = None,
    drop_image_parts: DropImagePartsOption = False,
    replicas: ReplicasOption = None,
    ray_address: ClusterAddressOption = None,
    router: RouterOption = ReplicaRouter.least_loaded,
) -> None:
    """Serve the API: `/v1/chat/completions` (OpenAI-compatible), `/chat` (native),
    `/tokenize`, `/v1/models`, `/health`, `/metrics`, `GET /sessions` and
    `DELETE /sessions/{id}`. Says on stderr when the model starts loading and when the server
    is ready. With `--replicas N`, the same API from N replicas on Ray Serve."""
    hosts = loopback_hosts(host)
    if allowed_hosts is not None:
        hosts = [name.strip() for name in allowed_hosts.split(",") if name.strip()]
    if api_key is not None and not api_key.strip():
        fail(f"--api-key (or {API_KEY_ENV}) is empty")
    try:
        _check_cluster_options(replicas, ray_address, router, spill_dir)
        thread_setting.choose(threads)
        bundled_models.locate(model)
        check_weight_format(weights)
        cap = None if session_bytes is None else parse_bytes(session_bytes)
        spec = _sessions_spec(
            policy, budget, budget_bytes, param, recall, recall_param, int8, fp_window, positions
        )
        listeners = _listen(host, port)
        spill_dir = _check_place(replicas, ray_address, spill_dir)
    except AgentKVError as err:
        fail(str(err))
    from api.server_setup import ServerSettings, build_server  # torch: once the options are checked

    settings = ServerSettings(
        spec=spec, model=model, weights=weights, session_bytes=cap, session_ttl_s=session_ttl,
        spill_dir=spill_dir, max_waiting=max_waiting, queue_timeout_s=queue_timeout,
        max_batch=max_batch, compile=compile, api_key=api_key, allowed_hosts=hosts,
        drop_image_parts=drop_image_parts, threads=threads,
    )  # fmt: skip
    if replicas is not None:
        for listener in listeners:  # Ray Serve's proxy binds the port itself
            listener.close()
        _serve_replicas(settings, replicas, host, port, ray_address, router)
        return
    try:
        app, _ = build_server(settings)
    except AgentKVError as err:
        fail(str(err))
    _serve(app, listeners, host, port)


def _check_cluster_options(
    replicas: int | None, ray_address: str | None, router: ReplicaRouter, spill_dir: Path | None
) -> None:
    """Fail the command (`fail`) for a cluster option without what it needs: `--ray-address`
    or `--router` without `--replicas`, `--ray-address` without `--spill-dir`."""
    if replicas is None and ray_address is not None:
        fail("--ray-address needs --replicas")
    if replicas is None and router != ReplicaRouter.least_loaded:
        fail("--router needs --replicas")
    if ray_address is not None and spill_dir is None:
        fail("--ray-address needs --spill-dir, on storage every node mounts")


def _sessions_spec(
    policy: str,
    budget: int | None,
    budget_bytes: str | None,
    param: list[str] | None,
    recall: bool,
    recall_param: list[str] | None,
    int8: bool,
    fp_window: int | None,
    positions: str,
) -> PolicySpec:
    """The sessions' policy settings from serve's options; a `+reencode` policy fails the
    command (`fail`): re-encoding runs on a plain engine, and the server batches.

    Raises:
        ConfigError: settings `PolicySpec.parse` refuses.
    """
    if split_reencode(policy)[1]:
        fail(
            f"{policy}: the server batches its sessions' forward calls, and re-encoding "
            "the kept tokens runs on a plain engine only (run-episode, bench)"
        )
    return PolicySpec.parse(
        policy,
        budget,
        budget_bytes,
        int8=int8,
        fp_window=fp_window,
        positions=positions,
        extra=param,
        recall=recall,
        recall_params=recall_param,
    )


def _check_place(
    replicas: int | None, ray_address: str | None, spill_dir: Path | None
) -> Path | None:
    """Check where the server runs before the model loads: the Ray cluster at `ray_address`
    answers, `spill_dir` can be written. Return the spill dir: with `replicas` and none given,
    a new temporary directory, said on stderr.

    Raises:
        ConfigError: a malformed or unreachable `ray_address`; AgentKVError: `spill_dir`
            cannot be created.
    """
    if ray_address is not None:
        # the sweep's modules load the tasks (pydantic, the sites' web framework): not at start
        from agent_kv.harness.sweep.job_runs import check_ray_address

        check_ray_address(ray_address)
    if spill_dir is not None:
        writable_dir(spill_dir)
    if replicas is not None and spill_dir is None:
        spill_dir = Path(tempfile.mkdtemp(prefix="agent-kv-sessions-"))
        typer.echo(f"sessions are saved under {spill_dir} (--spill-dir)", err=True)
    return spill_dir


def _serve_replicas(settings, replicas: int, host: str, port: int, address, router) -> None:
    """`serve --replicas N`: the application on Ray Serve until stopped (`api.cluster`).
    Ray Serve's HTTP proxy binds `host:port` itself: the command checked that it can be bound
    (`_listen`) and let it go before the replicas load, so only a server started meanwhile
    takes it first."""
    from api.cluster.launch import ClusterSettings, run_cluster  # Ray: only for replicas

    cluster = ClusterSettings(
        replicas=replicas, threads=thread_setting.configured() or thread_setting.DEFAULT,
        host=host, port=port, ray_address=address, router=router.value,
    )  # fmt: skip
    try:
        run_cluster(settings, cluster)
    except AgentKVError as err:
        fail(str(err))
    except RuntimeError as err:  # Ray Serve gave up starting a replica
        fail(f"the replicas did not start: {err}")


def _serve(app, listeners: list[socket.socket], host: str, port: int) -> None:
    """Run uvicorn on `listeners` (`_listen(host, port)`) until it is stopped (Ctrl-C,
    SIGTERM); print `ready on http://HOST:PORT` on stderr once it answers."""

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                typer.echo(f"ready on http://{host}:{port}", err=True)

    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["loggers"]["agent_kv.requests"] = {
        "handlers": ["default"],
        "level": "INFO",
        "propagate": False,
    }  # one line per request (`api.request_log`), on stderr beside uvicorn's own
    AnnouncingServer(uvicorn.Config(app, log_config=log_config)).run(sockets=listeners)


def _listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on `host:port`, one per address the host resolves to (as uvicorn
    binds them: `SO_REUSEADDR`, IPv6 sockets IPv6 only).

    Raises:
        AgentKVError: `host` does not resolve, or one of its addresses cannot be bound (the
            port in use, an address of no interface of this machine).
    """
    listeners: list[socket.socket] = []
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            listener = socket.socket(family, kind, proto)
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
            listener.listen()
    except OSError as err:
        for listener in listeners:
            listener.close()
        raise AgentKVError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    return listeners
