"""The HTTP API in process: server-sent events, the OpenAPI document, the dashboard and serving.

No Kafka: a Coordinator that is never started, fixtures in tests/component/conftest.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.api.fleet import FleetFeed
from controlplane.api.server import ApiServer, serve
from controlplane.coordinator.service import (
    RESYNC,
    SUBSCRIBER_QUEUE,
    Coordinator,
)
from controlplane.wire.protocol import (
    AckState,
    Command,
)
from tests.component.conftest import Clock, ack, command, feed, heartbeat, sse_events
from tests.fleet import wait_for

# --------------------------------------------------------------------------- SSE


async def test_events_of_a_finished_rollout_are_its_status_then_end(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    r = await client.get("/api/v1/rollouts/r-old/events")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e for e, _ in events] == ["status", "end"]
    assert json.loads(events[0][1])["phase"] == "succeeded"
    assert json.loads(events[1][1]) == {
        "rollout_id": "r-old",
        "phase": "succeeded",
        "reason": None,
        "exit_code": 0,
    }


async def test_events_follow_a_rollout_until_it_is_terminal(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    new = fleet_of_two["new"]
    stream = asyncio.create_task(client.get("/api/v1/rollouts/r-new/events"))
    await wait_for(lambda: coordinator.subscribers == 1)  # its first status is out
    for _ in range(3):  # news that changes nothing: an unchanged status is not sent again
        feed(coordinator, heartbeat("w1", 9.1))
        await wait_for(lambda: coordinator.backlog == 0)
    feed(coordinator, ack(new, "w2", AckState.SUCCEEDED, 9.5))
    r = await asyncio.wait_for(stream, 10)
    events = sse_events(r.text)
    assert [e for e, _ in events] == ["status", "status", "end"]
    assert [json.loads(d)["phase"] for _, d in events[:2]] == ["progressing", "failed"]
    assert json.loads(events[2][1])["exit_code"] == 1


async def test_events_end_at_the_deadline_with_no_new_record(
    coordinator: Coordinator,
    clock: Clock,
    client: httpx.AsyncClient,
    fleet_of_two: dict[str, Command],
) -> None:
    stream = asyncio.create_task(client.get("/api/v1/rollouts/r-new/events"))
    await wait_for(lambda: coordinator.subscribers == 1)
    # w2 silent since 9 s: lost, but waited for (it may come back) until the progress deadline.
    clock.advance(30)
    status = (await client.get("/api/v1/rollouts/r-new")).json()
    assert status["phase"] == "progressing" and status["counts"]["lost"] == 1
    clock.advance(600)  # past the progress deadline (its last progress: in flight at 9 s)
    events = sse_events((await asyncio.wait_for(stream, 10)).text)
    final = json.loads(events[-2][1])
    assert (final["phase"], final["reason"]) == ("failed", "WORKERS_FAILED")  # w1 rejected
    assert final["counts"]["lost"] == 1 and events[-1][0] == "end"


async def test_a_client_too_slow_for_the_change_feed_gets_a_resync(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    new = fleet_of_two["new"]
    stream = asyncio.create_task(client.get("/api/v1/rollouts/r-new/events"))
    await wait_for(lambda: coordinator.subscribers == 1)
    for i in range(SUBSCRIBER_QUEUE * 3):  # faster than it reads: its queue stays bounded
        feed(coordinator, heartbeat("w1", 9.1 + i / 1000))
        assert coordinator.backlog <= SUBSCRIBER_QUEUE
    feed(coordinator, ack(new, "w2", AckState.SUCCEEDED, 9.5))
    events = sse_events((await asyncio.wait_for(stream, 10)).text)
    names = [e for e, _ in events]
    assert names[0] == "status" and "resync" in names and names[-1] == "end"
    after = names[names.index("resync") + 1]
    assert after == "status"  # the full status again, even if unchanged


async def test_the_change_feed_drops_to_one_resync_when_a_subscriber_falls_behind(
    coordinator: Coordinator,
) -> None:
    changes = coordinator.changes(60.0, maxsize=2)
    first = asyncio.create_task(anext(changes))
    await wait_for(lambda: coordinator.subscribers == 1)
    for _ in range(5):
        feed(coordinator, heartbeat("w1", 1.0))
    assert coordinator.backlog == 1
    assert await asyncio.wait_for(first, 10) == {RESYNC}
    await changes.aclose()
    assert coordinator.subscribers == 0


async def test_events_wait_for_a_rollout_just_published(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    assert (await client.get("/api/v1/rollouts/r-later/events")).status_code == 404
    stream = asyncio.create_task(
        client.get("/api/v1/rollouts/r-later/events", params={"wait_s": 10})
    )
    await wait_for(lambda: coordinator.subscribers == 1)  # it is waiting
    later = command("r-later", workers=["w1"], issued=9.5)
    feed(coordinator, later, ack(later, "w1", AckState.SUCCEEDED, 9.8))
    r = await asyncio.wait_for(stream, 10)
    assert r.status_code == 200 and sse_events(r.text)[-1][0] == "end"


async def test_events_end_when_the_coordinator_stops(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    stream = asyncio.create_task(client.get("/api/v1/rollouts/r-new/events"))
    await wait_for(lambda: coordinator.subscribers == 1)  # its first status is out
    await coordinator.stop()
    events = sse_events((await asyncio.wait_for(stream, 10)).text)
    assert [e for e, _ in events] == ["status"]


# --------------------------------------------------------------------------- docs, dashboard, serving


async def test_openapi_documents_every_endpoint_with_a_summary(client: httpx.AsyncClient) -> None:
    doc = (await client.get("/openapi.json")).json()
    operations = [op for path in doc["paths"].values() for op in path.values()]
    assert len(operations) == 30 and all(op.get("summary") for op in operations)
    post = doc["paths"]["/api/v1/rollouts"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/RolloutRequest"
    )
    assert {"ReloadWeightsRequest", "UpdateConfigRequest", "Selector"} <= doc["components"][
        "schemas"
    ].keys()
    assert "HTTPValidationError" not in json.dumps(doc["paths"])
    assert (await client.get("/docs")).status_code == 200


async def test_dashboard_is_one_page_without_external_resources(client: httpx.AsyncClient) -> None:
    r = await client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert '"/api/v1"' in r.text and "${API}/events`" in r.text  # the fleet event stream
    # No polling: the stream says what changed. The one timer is the clock that keeps the
    # relative times current, and it asks the server nothing.
    assert r.text.count("setInterval") == 1 and "setInterval(tickRelativeTimes, 1000)" in r.text
    clock = r.text.split("function tickRelativeTimes()", 1)[1].split("\n}\n", 1)[0]
    assert "request(" not in clock and "fetch(" not in clock and "EventSource" not in clock
    assert "http://" not in r.text and "https://" not in r.text
    assert 'rel="icon" href="/favicon.svg"' in r.text
    assert (await client.get("/favicon.svg")).status_code == 200


async def test_server_binds_port_zero_serves_and_stops(
    coordinator: Coordinator, app: FastAPI
) -> None:
    async with ApiServer(coordinator, "127.0.0.1", 0, app=app) as server:
        assert server.port > 0
        async with httpx.AsyncClient(base_url=server.url) as c:
            assert (await c.get("/healthz")).json()["ready"] is True
    with pytest.raises(httpx.ConnectError):
        async with httpx.AsyncClient(base_url=server.url) as c:
            await c.get("/healthz")


async def test_serve_runs_until_cancelled_and_ends_open_streams(
    coordinator: Coordinator, app: FastAPI, fleet_of_two: dict[str, Command]
) -> None:
    async with ApiServer(coordinator, port=0, app=app) as probe:
        port = probe.port  # a port known to be free a moment ago
    task = asyncio.create_task(serve(coordinator, "127.0.0.1", port, app=create_app(coordinator)))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
        for _ in range(200):
            try:
                await c.get("/healthz")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.02)
        async with c.stream("GET", "/api/v1/rollouts/r-new/events") as stream:
            lines = stream.aiter_lines()
            while await anext(lines) != "event: status":
                pass
            task.cancel()
            rest = [line async for line in lines]  # the stream ends: the server is draining
        assert "event: end" not in rest
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)


# --------------------------------------------------------------------------- a client that stops reading

#: Events this big fill a socket's buffers in a few sends.
BLOB: dict[str, object] = {"blob": "x" * 200_000}


@contextlib.contextmanager
def stalled_reader(port: int, path: str) -> Iterator[socket.socket]:
    """A client that asks for ``path`` and never reads a byte of the answer (a small receive
    buffer: the server's sends block soon)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: coordinator\r\n\r\n".encode())
        yield sock
    finally:
        sock.close()


async def test_a_rollout_stream_whose_client_stopped_reading_is_dropped(
    coordinator: Coordinator,
) -> None:
    workers = [f"w{i}" for i in range(300)]
    big = command("r-big", workers=workers, issued=1.0, overrides=BLOB)
    feed(coordinator, big)
    app = create_app(coordinator, sse_tick_s=0.05, sse_send_timeout_s=0.5)
    async with ApiServer(coordinator, "127.0.0.1", 0, app=app) as server:
        with stalled_reader(server.port, "/api/v1/rollouts/r-big/events"):
            await wait_for(lambda: coordinator.subscribers == 1, timeout=10)
            # A change at a time, each sent as a status event of 200 KB, until the sends block:
            # the stream is dropped (the bug: it waits on its send forever, subscribed).
            for i, worker in enumerate(workers):
                if coordinator.subscribers == 0:
                    break
                feed(coordinator, ack(big, worker, AckState.RUNNING, 2.0 + i / 1000))
                await wait_for(
                    lambda: coordinator.backlog == 0 or coordinator.subscribers == 0, timeout=10
                )
            assert coordinator.subscribers == 0
            # The server goes on serving others.
            async with httpx.AsyncClient(base_url=server.url) as c:
                assert (await c.get("/api/v1/rollouts/r-big/summary")).status_code == 200


async def test_a_fleet_stream_whose_client_stopped_reading_is_dropped_and_judging_stops(
    coordinator: Coordinator,
) -> None:
    feed(coordinator, heartbeat("w1", 0.0))
    app = create_app(coordinator, sse_tick_s=0.05, sse_send_timeout_s=0.5, fleet_min_interval_s=0)
    fleet_feed: FleetFeed = app.state.fleet_feed
    async with ApiServer(coordinator, "127.0.0.1", 0, app=app) as server:
        with stalled_reader(server.port, "/api/v1/events"):
            await wait_for(lambda: fleet_feed.readers == 1, timeout=10)
            for i in range(200):  # a rollout at a time, each a delta of 200 KB
                if fleet_feed.readers == 0:
                    break
                judged = fleet_feed.judged

                def judged_or_dropped(before: int = judged) -> bool:
                    return fleet_feed.judged > before or fleet_feed.readers == 0

                feed(
                    coordinator,
                    command(f"r{i}", workers=["w1"], issued=1 + i / 100, overrides=BLOB),
                )
                await wait_for(judged_or_dropped, timeout=10)
            # Dropped, and the feed read by nobody stops judging.
            assert fleet_feed.readers == 0 and fleet_feed._task is None
