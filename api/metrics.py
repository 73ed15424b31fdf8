"""Prometheus metrics of the server (`GET /metrics`), in a registry of their own per app.

Per turn: requests by endpoint and status, time to first token, decode seconds per token,
prompt tokens reused from a session's cache vs prefilled, cache rebuilds, evictions and
INT8 moves. Read at scrape time from the session store: KV bytes held (allocated, what the
`--session-bytes` cap counts; live; and the shared prefix blocks, held once for every
session), sessions in memory and on disk, sessions dropped and saved to disk, and (replicas
sharing a spill dir) the saves after each turn, written and failed.
`agent_kv_kv_bytes` is a deprecated alias of `agent_kv_kv_live_bytes`, removed in the next
release.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agent_kv.serving.chat_service import ChatTurn
from agent_kv.serving.session_store import SessionStore

TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
"""Seconds: a short prompt on a GPU to a full 8K prefill on a 2-core CPU."""
DECODE_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64)
"""Seconds per generated token."""


class _SessionCollector(Collector):
    """Figures read from the session store at scrape time."""

    def __init__(self, sessions: SessionStore):
        self.sessions = sessions

    def collect(self):
        allocated = GaugeMetricFamily(
            "agent_kv_kv_allocated_bytes",
            "Allocated KV bytes (buffers with spare capacity) of all sessions in memory.",
        )
        allocated.add_metric([], self.sessions.allocated_bytes())
        yield allocated
        live_bytes = self.sessions.live_bytes()
        live = GaugeMetricFamily(
            "agent_kv_kv_live_bytes", "Live KV bytes of all sessions in memory."
        )
        live.add_metric([], live_bytes)
        yield live
        alias = GaugeMetricFamily(
            "agent_kv_kv_bytes",
            "Deprecated alias of agent_kv_kv_live_bytes, removed in the next release.",
        )
        alias.add_metric([], live_bytes)
        yield alias
        shared = GaugeMetricFamily(
            "agent_kv_kv_shared_bytes",
            "Bytes of the shared prefix blocks the sessions read, each block once "
            "(part of agent_kv_kv_allocated_bytes).",
        )
        shared.add_metric([], self.sessions.shared_bytes())
        yield shared
        in_memory = len(self.sessions.in_memory())
        count = GaugeMetricFamily(
            "agent_kv_sessions", "Sessions by where they are.", labels=["where"]
        )
        count.add_metric(["memory"], in_memory)
        count.add_metric(["disk"], len(self.sessions.ids()) - in_memory)
        yield count
        dropped = CounterMetricFamily(
            "agent_kv_sessions_dropped", "Sessions dropped by the idle TTL or the byte cap."
        )
        dropped.add_metric([], self.sessions.dropped)
        yield dropped
        spilled = CounterMetricFamily(
            "agent_kv_sessions_spilled", "Sessions saved to disk by the byte cap."
        )
        spilled.add_metric([], self.sessions.spilled)
        yield spilled
        unreadable = CounterMetricFamily(
            "agent_kv_sessions_unreadable",
            "Saved sessions whose file could not be read back (started again from their history).",
        )
        unreadable.add_metric([], self.sessions.unreadable)
        yield unreadable
        failures = CounterMetricFamily(
            "agent_kv_sessions_spill_failures",
            "Sessions that could not be saved to the spill dir (dropped instead).",
        )
        failures.add_metric([], self.sessions.spill_failures)
        yield failures
        checkpoints = self.sessions.checkpoints
        if checkpoints is not None:
            taken_over = CounterMetricFamily(
                "agent_kv_sessions_taken_over",
                "Sessions restored from the shared spill dir that this replica did not hold "
                "(moved from another replica).",
            )
            taken_over.add_metric([], self.sessions.taken_over)
            yield taken_over
            saved = CounterMetricFamily(
                "agent_kv_session_checkpoints",
                "Saves of a session to the shared spill dir after its turn, by result.",
                labels=["result"],
            )
            saved.add_metric(["written"], checkpoints.written)
            saved.add_metric(["failed"], checkpoints.failed)
            yield saved
            pending = GaugeMetricFamily(
                "agent_kv_session_checkpoints_pending",
                "Saves to the shared spill dir queued or running.",
            )
            pending.add_metric([], checkpoints.pending())
            yield pending


class ServerMetrics:
    """The metrics of one app; `observe` records a finished turn."""

    def __init__(self, sessions: SessionStore):
        self.registry = CollectorRegistry()
        self.registry.register(_SessionCollector(sessions))
        self.requests = Counter(
            "agent_kv_requests",
            "Requests by endpoint and HTTP status.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "agent_kv_ttft_seconds",
            "Time to first token of a turn (prefill of its new tokens included).",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.decode = Histogram(
            "agent_kv_decode_seconds_per_token",
            "Decode seconds per generated token after the first, one sample per turn.",
            buckets=DECODE_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "agent_kv_prompt_tokens",
            "Prompt tokens, by whether a session's cache already held them.",
            ["source"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "agent_kv_completion_tokens", "Generated tokens.", registry=self.registry
        )
        self.rebuilds = Counter(
            "agent_kv_cache_rebuilds",
            "Turns whose prompt changed earlier history: cut back or rebuilt from scratch.",
            ["kind"],
            registry=self.registry,
        )
        self.evicted = Counter(
            "agent_kv_evicted_tokens", "Tokens evicted, summed over layers.", registry=self.registry
        )
        self.quantized = Counter(
            "agent_kv_quantized_tokens",
            "Tokens moved to INT8, summed over layers.",
            registry=self.registry,
        )

        self.image_parts_dropped = Counter(
            "agent_kv_image_parts_dropped",
            "Image parts of requests dropped unread (--drop-image-parts).",
            registry=self.registry,
        )

    def observe(self, turn: ChatTurn) -> None:
        """Record a finished turn."""
        self.ttft.observe(turn.ttft_s)
        generated = len(turn.reply.token_ids)
        if generated > 1:
            self.decode.observe(turn.reply.decode_s / (generated - 1))
        self.prompt_tokens.labels("reused").inc(turn.sync.reused_tokens)
        self.prompt_tokens.labels("prefilled").inc(turn.sync.prefilled_tokens)
        self.completion_tokens.inc(generated)
        if turn.sync.rebuild != "none":
            self.rebuilds.labels(turn.sync.rebuild).inc()
        self.evicted.inc(turn.evicted_in_turn)
        self.quantized.inc(turn.quantized_in_turn)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
