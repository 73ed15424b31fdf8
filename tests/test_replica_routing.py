"""The parts of `serve --replicas` that need no Ray cluster: the affinity key a request
routes by, where a key is placed, the replicas' metrics merged, the directory of reports,
and a request relayed through an ASGI app."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from api.cluster.affinity import (
    ANONYMOUS_PREFIX,
    InFlightBytes,
    Placements,
    ReplicaLoad,
    affinity_key,
    json_object,
)
from api.cluster.asgi_relay import portable_scope, run_app
from api.cluster.directory import ReplicaDirectory
from api.cluster.merged_metrics import merge_metrics


def chat(body: dict) -> dict | None:
    return json_object(json.dumps(body).encode())


MESSAGES = [{"role": "system", "content": "Act."}, {"role": "user", "content": "Goal"}]


def test_the_affinity_key_is_the_session_id_wherever_the_request_names_it():
    assert affinity_key("POST", "/chat", {"x-session-id": "h"}, chat({"session_id": "b"})) == "h"
    assert affinity_key("POST", "/chat", {}, chat({"session_id": "b", "messages": []})) == "b"
    assert affinity_key("POST", "/v1/chat/completions", {}, chat({"user": "u"})) == "u"
    assert affinity_key("DELETE", "/sessions/a%20b", {}, None) == "a b"
    assert affinity_key("GET", "/v1/models", {}, None) == ""
    assert affinity_key("POST", "/tokenize", {}, chat({"messages": MESSAGES})) == ""
    assert json_object(b"{not json") is None and json_object(b"[1]") is None
    assert json_object(b"\xff") is None
    assert affinity_key("POST", "/chat", {}, None) == ""


def test_an_anonymous_chat_routes_by_its_first_messages_so_its_later_turns_follow():
    first = affinity_key("POST", "/v1/chat/completions", {}, chat({"messages": MESSAGES}))
    later = MESSAGES + [{"role": "assistant", "content": "click"}, {"role": "user", "content": "p"}]
    again = affinity_key("POST", "/v1/chat/completions", {}, chat({"messages": later}))
    other = [MESSAGES[0], {"role": "user", "content": "Another goal"}]
    assert first.startswith(ANONYMOUS_PREFIX) and first == again
    assert affinity_key("POST", "/chat", {}, chat({"messages": other})) != first


def loads(**in_flight_bytes: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(rid, n) for rid, n in in_flight_bytes.items()]


def test_a_new_session_goes_to_the_least_loaded_replica_and_stays_there():
    placements = Placements()
    assert placements.choose("s", loads(a=3, b=1)) == "b"
    assert placements.choose("s", loads(a=0, b=9)) == "b"  # sticky, however loaded
    assert placements.choose("t", loads(a=0, b=9)) == "a"
    kv = [ReplicaLoad("a", 1, kv_allocated_bytes=900), ReplicaLoad("b", 1, 100)]
    assert placements.choose("u", kv) == "b"  # the same queue: fewer KV bytes
    assert placements.choose("", loads(a=2, b=1)) == "b" and placements.replica_of("") is None


def test_new_sessions_between_two_reports_of_kv_bytes_take_turns_between_replicas():
    placements = Placements()
    assert [placements.choose(key, loads(a=0, b=0)) for key in "wxyz"] == ["a", "b", "a", "b"]


def test_a_session_a_replica_reports_goes_there_and_one_on_a_dead_replica_moves():
    placements = Placements()
    held = [ReplicaLoad("a", 5, sessions=frozenset({"s"})), ReplicaLoad("b", 0)]
    assert placements.choose("s", held) == "a"  # known from its report (a router restarted)
    placements.forget_replicas_except({"b", "c"})  # a died
    assert placements.replica_of("s") is None
    assert placements.choose("s", loads(b=4, c=2)) == "c"
    with pytest.raises(ValueError, match="no replica"):
        placements.choose("s", [])


def test_bytes_in_flight_come_off_in_whichever_order_ray_reports_a_request():
    in_flight = InFlightBytes(memory=2)
    in_flight.routed("r1", "a", 100)
    in_flight.routed("r2", "a", 30)
    in_flight.completed("r1")
    assert in_flight["a"] == 30
    in_flight.completed("r3")  # a short request reported finished first...
    in_flight.routed("r3", "b", 500)  # ...then routed: it adds nothing
    assert in_flight["b"] == 0
    for request in ("x", "y", "z"):  # finished, never reported routed: at most 2 remembered
        in_flight.completed(request)
    in_flight.routed("x", "b", 7)  # forgotten: counted as in flight
    assert in_flight["b"] == 7 and in_flight["a"] == 30


def test_placements_forget_the_oldest_keys_past_their_capacity():
    placements = Placements(capacity=2)
    for key in ("x", "y", "z"):
        placements.choose(key, loads(a=0))
    assert placements.replica_of("x") is None and placements.replica_of("z") == "a"


def replica_text(chats: int, kv_bytes: int, ttft_s: float) -> str:
    """A replica's exposition, as `ServerMetrics.render` writes one."""
    registry = CollectorRegistry()
    requests = Counter("agent_kv_requests", "Requests.", ["endpoint", "status"], registry=registry)
    requests.labels("/chat", "200").inc(chats)
    Gauge("agent_kv_kv_allocated_bytes", "KV bytes.", registry=registry).set(kv_bytes)
    ttft = Histogram("agent_kv_ttft_seconds", "TTFT.", buckets=(0.1, 1.0), registry=registry)
    ttft.observe(ttft_s)
    return generate_latest(registry).decode()


def test_metrics_merged_give_each_replica_its_series_and_their_sum():
    text = merge_metrics(
        {"r1": replica_text(3, 100, 0.5), "r2": replica_text(4, 50, 0.05)}
    ).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    chat_200 = (("endpoint", "/chat"), ("status", "200"))
    assert samples[("agent_kv_requests_total", chat_200)] == 7
    by_replica = (("endpoint", "/chat"), ("replica", "r2"), ("status", "200"))
    assert samples[("agent_kv_requests_total", by_replica)] == 4
    assert samples[("agent_kv_kv_allocated_bytes", ())] == 150
    assert samples[("agent_kv_kv_allocated_bytes", (("replica", "r1"),))] == 100
    assert samples[("agent_kv_ttft_seconds_bucket", (("le", "1.0"),))] == 2
    assert samples[("agent_kv_ttft_seconds_bucket", (("le", "0.1"),))] == 1
    assert samples[("agent_kv_ttft_seconds_sum", (("replica", "r1"),))] == 0.5
    assert samples[("agent_kv_replicas", ())] == 2
    assert "_created" not in text


def test_the_directory_leaves_out_replicas_that_stopped_reporting():
    now = [0.0]
    directory = ReplicaDirectory(stale_after_s=5.0, clock=lambda: now[0])
    directory.report("a", {"sessions": []})
    now[0] = 3.0
    directory.report("b", {"sessions": ["s"]})
    assert set(directory.live()) == {"a", "b"}
    now[0] = 6.0
    assert directory.live() == {"b": {"sessions": ["s"]}}
    directory.withdraw("b")
    assert directory.live() == {}


async def echo(request):
    body = await request.json()
    return JSONResponse({"got": body, "path": request.url.path}, status_code=201)


def counting(state: dict):
    async def stream(request):
        async def chunks():
            for i in range(100):
                state["sent"] = i
                yield f"data: {i}\n\n"
                await asyncio.sleep(0.01)
            state["finished"] = True

        async def watch():
            while not await request.is_disconnected():
                await asyncio.sleep(0.005)
            state["disconnected"] = True

        asyncio.get_running_loop().create_task(watch())
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return stream


def scope_of(method: str, path: str) -> dict:
    return portable_scope({
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 8000), "state": {"not": "sent"},
    })  # fmt: skip


def test_a_relayed_request_gets_the_apps_response_message_by_message():
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])

    async def relay():
        return [m async for m in run_app(app, scope_of("POST", "/echo"), b'{"a": 1}')]

    messages = asyncio.run(relay())
    assert messages[0]["type"] == "http.response.start" and messages[0]["status"] == 201
    body = b"".join(m.get("body", b"") for m in messages[1:])
    assert json.loads(body) == {"got": {"a": 1}, "path": "/echo"}
    assert "state" not in scope_of("GET", "/")


def test_a_relayed_stream_left_early_tells_the_app_its_client_went_away():
    state: dict = {}
    app = Starlette(routes=[Route("/s", counting(state), methods=["GET"])])

    async def relay_three_events():
        events = []
        stream = run_app(app, scope_of("GET", "/s"), b"")
        async for message in stream:
            if message.get("body"):
                events.append(message["body"])
            if len(events) == 3:
                break
        await stream.aclose()
        for _ in range(200):
            if state.get("disconnected"):
                break
            await asyncio.sleep(0.01)
        return events

    events = asyncio.run(relay_three_events())
    assert events == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert state.get("disconnected") and not state.get("finished")


def test_the_commands_router_names_are_the_routers_the_cluster_knows():
    from agent_kv.cli.serve import ReplicaRouter
    from api.cluster.launch import ROUTERS

    assert {router.value for router in ReplicaRouter} == set(ROUTERS)
