"""Building one server from its settings: model, engine, session store, chat service, app.

`agent-kv serve` builds one in its own process; each replica of `agent-kv serve --replicas N`
(`api.cluster`) builds the same in its Ray actor, from the same settings.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agent_kv.kv.policy_spec import PolicySpec
from agent_kv.runtime.models import bundled_models
from agent_kv.runtime.models import threads as thread_setting

if TYPE_CHECKING:
    from fastapi import FastAPI

    from agent_kv.serving.chat_service import ChatService


@dataclass(frozen=True)
class ServerSettings:
    """What `agent-kv serve` was asked for (validated by the CLI).

    Attributes:
        spec: the default policy and its store options.
        model: a bundled model name, or None for the default.
        weights: the weight format (`agent_kv.runtime.models.weight_formats`).
        session_bytes: cap on the allocated KV bytes of all sessions in memory, or None.
        session_ttl_s: seconds an idle session is kept.
        spill_dir: where sessions leave memory to, or None (dropped instead).
        shared_spill: `spill_dir` is shared by replicas (`SessionStore`, `shared_spill`).
        max_waiting: turns that may wait for the model (then 429).
        queue_timeout_s: seconds a turn may wait (then 503).
        max_batch: turns decoded at once (continuous batching).
        threads: torch CPU threads, or None for `$AGENT_KV_THREADS` or the default.
        compile: compile the decode step.
        api_key: the key every route but /health needs, or None.
        allowed_hosts: `Host` names answered (`api.access`).
        drop_image_parts: drop image parts unread instead of refusing them.
    """

    spec: PolicySpec
    model: str | None
    weights: str
    session_bytes: int | None
    session_ttl_s: float
    spill_dir: Path | None
    max_waiting: int
    queue_timeout_s: float
    max_batch: int
    compile: bool | None
    api_key: str | None
    allowed_hosts: list[str]
    drop_image_parts: bool
    threads: int | None = None
    shared_spill: bool = False


def build_server(settings: ServerSettings) -> tuple[FastAPI, ChatService]:
    """Load the model and build the app serving it, saying on stderr when the model starts
    loading and when the decode step compiles (its compiled kernels kept on disk for the next
    start: `agent_kv.runtime.models.compile_cache`).

    Raises:
        AgentKVError: the model cannot be loaded or the policy cannot run on it.
    """
    from agent_kv.runtime.engine.engine import Engine
    from agent_kv.runtime.models.compile_cache import use_compile_cache
    from agent_kv.runtime.models.model_loading import load_model
    from agent_kv.serving.chat_service import ChatService
    from agent_kv.serving.session_store import SessionStore
    from api.app import create_app

    thread_setting.choose(settings.threads)
    name = settings.model or bundled_models.DEFAULT_MODEL
    print(f"loading model {name} ({settings.weights} weights)...", file=sys.stderr)
    loaded = load_model(settings.model, settings.weights)
    compile = True if settings.compile is None else settings.compile  # paid once per server
    engine = Engine.from_spec(
        settings.spec, loaded.model, loaded.tokenizer, compile=compile, share_prefixes=True
    )
    if compile:
        cache = use_compile_cache(f"{loaded.name}-{settings.weights}")
        print(
            f"compiling the decode step (cached in {cache}; --no-compile skips it)...",
            file=sys.stderr,
        )
        engine.warm_up()
    sessions = SessionStore(
        engine,
        settings.session_bytes,
        settings.session_ttl_s,
        settings.spill_dir,
        shared_spill=settings.shared_spill,
    )
    service = ChatService(
        engine,
        sessions,
        max_waiting=settings.max_waiting,
        queue_timeout_s=settings.queue_timeout_s,
        max_batch=settings.max_batch,
    )
    app = create_app(
        service,
        loaded.name,
        api_key=settings.api_key,
        allowed_hosts=settings.allowed_hosts,
        drop_image_parts=settings.drop_image_parts,
    )
    return app, service
