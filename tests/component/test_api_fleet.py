"""What the dashboard reads (issue 15): the fleet event stream (a snapshot in counts, then only
what changed, resumable with Last-Event-ID), target summaries, the workers filtered and paged
(problems first), ETags with 304, and the API docs and favicon served without the internet.

No Kafka: a Coordinator that is never started, fed directly (tests/component/conftest.py),
served by uvicorn on a free port where a stream is read as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.server import ApiServer
from controlplane.coordinator.service import Coordinator
from controlplane.wire.control import ControlPhase
from controlplane.wire.protocol import AckState, Command, Degraded, Heartbeat
from tests.component.conftest import Clock, ack, command, feed, heartbeat, sse_events, succeeded
from tests.component.test_api_progressive import feed_control, gate, rollout_spec, state
from tests.component.test_api_progressive import targets as targets  # the fixture
from tests.component.test_api_scale import every_page, many_workers


@pytest.fixture
async def live(coordinator: Coordinator, app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        ApiServer(coordinator, port=0, app=app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as c,
    ):
        yield c


def degraded(hb: Heartbeat) -> Heartbeat:
    """``hb`` from a worker whose weights are a mix of two versions."""
    mixed = Degraded(
        code="RUNNER_FAILED", message="half", from_version="v1", to_version="v2", since=hb.sent_at
    )
    return hb.model_copy(update={"degraded": mixed})


class Stream:
    """An SSE stream read event by event, as they come: (id, event, data)."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self.lines = lines

    async def next(self) -> tuple[int, str, dict[str, Any]]:
        seen: dict[str, str] = {}
        async with asyncio.timeout(10):
            async for line in self.lines:
                if not line:
                    if "data" in seen:
                        return int(seen["id"]), seen["event"], json.loads(seen["data"])
                    continue
                key, _, value = line.partition(": ")
                seen[key] = value
        raise AssertionError("the stream ended")


# --------------------------------------------------------------------------- the event stream


async def test_the_fleet_stream_sends_a_snapshot_then_only_what_changed(
    coordinator: Coordinator, live: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    async with live.stream("GET", "/api/v1/events") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = Stream(response.aiter_lines())
        first, name, snapshot = await events.next()
        assert name == "snapshot"
        assert [r["rollout_id"] for r in snapshot["rollouts"]] == ["r-new", "r-old"]
        assert snapshot["rollouts"][0]["counts"]["rejected"] == 1
        assert "workers" not in snapshot["rollouts"][0]  # in counts: no worker rows
        assert snapshot["summary"]["rollouts"]["active"] == 1
        assert snapshot["progressive"] == [] and snapshot["targets"] == []

        feed(coordinator, ack(fleet_of_two["new"], "w2", AckState.SUCCEEDED, 9.5))
        second, name, delta = await events.next()
        assert name == "delta" and second > first
        # Only r-new changed (r-old is not sent again), and the fleet's counts with it.
        assert [r["rollout_id"] for r in delta["rollouts"]] == ["r-new"]
        assert delta["rollouts"][0]["phase"] == "failed"
        assert delta["summary"]["rollouts"]["active"] == 0
        assert set(delta) == {"rollouts", "summary"}  # same order: no rollouts_order

        later = command("r-later", workers=["w1"], issued=9.8)
        feed(coordinator, later)
        third, _, delta = await events.next()
        assert third > second
        assert [r["rollout_id"] for r in delta["rollouts"]] == ["r-later"]
        assert delta["rollouts_order"] == ["r-later", "r-new", "r-old"]


async def test_a_client_reconnecting_with_last_event_id_gets_what_it_missed(
    coordinator: Coordinator, live: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    async with live.stream("GET", "/api/v1/events") as response:
        events = Stream(response.aiter_lines())
        seen, _, _ = await events.next()
        feed(coordinator, ack(fleet_of_two["new"], "w2", AckState.SUCCEEDED, 9.5))
        missed, name, _ = await events.next()
        assert name == "delta"
    resumed = {"Last-Event-ID": str(seen)}
    async with live.stream("GET", "/api/v1/events", headers=resumed) as response:
        replayed, name, delta = await Stream(response.aiter_lines()).next()
        assert (replayed, name) == (missed, "delta")
        assert delta["rollouts"][0]["phase"] == "failed"
    # An id this coordinator never sent (another one's, before a restart): a fresh snapshot.
    for stale in ("5", "not-a-number"):
        headers = {"Last-Event-ID": stale}
        async with live.stream("GET", "/api/v1/events", headers=headers) as response:
            at, name, snapshot = await Stream(response.aiter_lines()).next()
            assert (at, name) == (missed, "snapshot")
            assert snapshot["rollouts"][0]["phase"] == "failed"


async def test_the_fleet_stream_carries_targets_and_progressive_rollouts_in_counts(
    coordinator: Coordinator, live: httpx.AsyncClient, targets: None
) -> None:
    async with live.stream("GET", "/api/v1/events") as response:
        events = Stream(response.aiter_lines())
        _, _, snapshot = await events.next()
        tiny = {t["name"]: t for t in snapshot["targets"]}["tiny"]
        assert tiny["by_version"] == {"v2": 3} and tiny["by_state"]["succeeded"] == 3
        assert tiny["undo_available"] is True and "members" not in tiny
        assert [p["rollout_id"] for p in snapshot["progressive"]] == ["r-bad", "r-done"]
        bad = snapshot["progressive"][0]
        assert (bad["phase"], bad["code"], bad["exit_code"]) == ("rolled_back", "GATE_FAILED", 8)
        assert [w["size"] for w in bad["waves"]] == [1, 2] and "workers" not in bad["waves"][0]

        feed_control(coordinator, rollout_spec("r-live", "v4"))
        feed_control(coordinator, state("r-live", ControlPhase.PAUSED, 1, gates=[gate(0)]))
        delta: dict[str, Any] = {}
        while "r-live" not in {p["rollout_id"] for p in delta.get("progressive", [])} or any(
            p["phase"] != "paused" for p in delta["progressive"] if p["rollout_id"] == "r-live"
        ):
            _, _, delta = await events.next()
        assert [p["rollout_id"] for p in delta["progressive"]] == ["r-live"]
        assert delta["progressive_order"][0] == "r-live"


async def test_the_target_summaries_count_workers_by_state_and_version(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None
) -> None:
    feed(
        coordinator,
        heartbeat("w4", 9.0, version="v1"),  # drifting: tiny's stable is v2
        heartbeat("w5", -100.0, version="v2"),  # silent: lost
        degraded(heartbeat("w6", 9.0, version="v2")),
    )
    one = (await client.get("/api/v1/targets/tiny/summary")).json()
    assert one["by_state"] == {
        "succeeded": 3,
        "running": 0,
        "failed": 1,
        "drifting": 1,
        "lost": 1,
        "conflict": 0,
    }
    assert one["by_version"] == {"v2": 4, "v1": 1}  # live ones, largest group first
    listed = (await client.get("/api/v1/summary/targets")).json()
    assert [t["name"] for t in listed] == ["empty", "tiny"] and listed[1] == one
    missing = await client.get("/api/v1/targets/nope/summary")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "TARGET_UNKNOWN"

    # A target's workers: its members only, filtered and paged as /workers.
    members = (await client.get("/api/v1/targets/tiny/workers?order=problems")).json()
    assert [(w["worker_id"], w["state"]) for w in members][:3] == [
        ("w5", "lost"),
        ("w6", "failed"),
        ("w4", "drifting"),
    ]
    v1 = (await client.get("/api/v1/targets/tiny/workers", params={"version": "v1"})).json()
    assert [w["worker_id"] for w in v1] == ["w4"]
    none = await client.get("/api/v1/targets/empty/workers")
    assert none.status_code == 200 and none.json() == []


# --------------------------------------------------------------------------- workers


async def test_workers_filter_by_state_label_version_and_search_problems_first(
    coordinator: Coordinator, clock: Clock, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 120)
    clock.advance(31)
    # The first 100 go on (as they were), the last 20 fall silent; one of them is degraded.
    again = [
        heartbeat(w, 40.0, labels={"model": "big", "zone": f"z{i % 4}"})
        for i, w in enumerate(ids[:100])
    ]
    again[7] = degraded(again[7])
    feed(coordinator, *again)
    everyone, sizes = await every_page(client, "/api/v1/workers?order=problems&limit=7")
    assert sizes[0] == 7 and len(everyone) == 120  # every worker once, across pages
    order = [w["worker_id"] for w in everyone]
    assert order[:20] == ids[100:]  # lost first, by id
    assert order[20] == ids[7] and everyone[20]["state"] == "failed"
    assert sorted(order) == sorted(ids)

    lost, _ = await every_page(client, "/api/v1/workers?state=lost&limit=9")
    assert [w["worker_id"] for w in lost] == ids[100:]
    labelled = (await client.get("/api/v1/workers?label=zone%3Dz1&label=model%3Dbig")).json()
    by_selector = (await client.get("/api/v1/workers?selector=zone%3Dz1,model%3Dbig")).json()
    assert labelled == by_selector and labelled
    found = (await client.get("/api/v1/workers", params={"search": ids[7].upper()})).json()
    assert [w["worker_id"] for w in found] == [ids[7]]
    failed = (await client.get("/api/v1/workers", params={"search": "failed"})).json()
    assert [w["worker_id"] for w in failed] == [ids[7]]
    bad = await client.get("/api/v1/workers", params={"state": "sleepy"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "INVALID_REQUEST"


async def test_a_rollouts_workers_filter_by_version_label_and_search(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 30)
    cmd = command("r-big", workers=ids, issued=9.5)
    feed(coordinator, cmd, *(a for w in ids[:10] for a in succeeded(cmd, w, sent=12.0)))
    feed(coordinator, ack(cmd, ids[12], AckState.FAILED, 12.5, code="RUNNER_FAILED"))
    path = "/api/v1/rollouts/r-big/workers"
    coded, _ = await every_page(client, f"{path}?search=runner_failed&limit=1")
    assert [w["worker_id"] for w in coded] == [ids[12]]
    v2, sizes = await every_page(client, f"{path}?version=v2&limit=4")
    assert [w["worker_id"] for w in v2] == ids[:10] and sizes == [4, 4, 2]
    zone = (await client.get(path, params={"label": "zone=z1", "state": "succeeded"})).json()
    expected = [w for i, w in enumerate(ids[:10]) if i % 4 == 1]
    assert [w["worker_id"] for w in zone] == expected


# --------------------------------------------------------------------------- ETags


async def test_polled_reads_answer_304_while_nothing_changed(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    for path in (
        "/api/v1/workers?order=problems&limit=50",
        "/api/v1/summary",
        "/api/v1/rollouts",
        "/api/v1/rollouts/r-new/workers",
        "/api/v1/summary/targets",
    ):
        first = await client.get(path)
        tag = first.headers["etag"]
        assert tag.startswith('W/"') and first.headers["cache-control"] == "no-cache"
        again = await client.get(path, headers={"If-None-Match": tag})
        assert again.status_code == 304 and again.content == b"", path
        assert again.headers["etag"] == tag
        other = await client.get(path, headers={"If-None-Match": 'W/"else"'})
        assert other.status_code == 200 and other.content == first.content
    tag = (await client.get("/api/v1/workers")).headers["etag"]
    feed(coordinator, heartbeat("w1", 9.5, version="v3"))
    changed = await client.get("/api/v1/workers", headers={"If-None-Match": tag})
    assert changed.status_code == 200 and changed.headers["etag"] != tag
    # Errors carry no ETag.
    missing = await client.get("/api/v1/rollouts/nope/summary")
    assert missing.status_code == 404 and "etag" not in missing.headers


# --------------------------------------------------------------------------- docs, favicon


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
async def test_the_api_docs_load_everything_from_this_server(
    client: httpx.AsyncClient, page: str
) -> None:
    shown = await client.get(page)
    assert shown.status_code == 200 and shown.headers["content-type"].startswith("text/html")
    assert "://" not in shown.text  # no CDN, no font service: it works offline
    assets = re.findall(r'(?:src|href)="(/[^"]+)"', shown.text)
    assert any(a.endswith(".js") for a in assets)
    for asset in assets:
        got = await client.get(asset)
        assert got.status_code == 200 and len(got.content) > 100, asset
    assert "/openapi.json" in shown.text
    assert (await client.get("/openapi.json")).status_code == 200


async def test_the_favicon_is_served(client: httpx.AsyncClient) -> None:
    for path in ("/favicon.ico", "/favicon.svg"):
        icon = await client.get(path)
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert icon.content.startswith(b"<svg")


async def test_a_page_whose_next_link_changed_is_not_304(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    path = "/api/v1/rollouts?limit=2"
    first = await client.get(path)
    assert [r["rollout_id"] for r in first.json()] == ["r-new", "r-old"]
    assert "link" not in first.headers
    # An older rollout: the page's body is the same, but now it has a next page.
    feed(coordinator, command("r-oldest", issued=0.5, version="v1"))
    again = await client.get(path, headers={"If-None-Match": first.headers["etag"]})
    assert again.status_code == 200 and again.content == first.content
    assert 'rel="next"' in again.headers["link"]
    assert again.headers["etag"] != first.headers["etag"]
    # Unchanged, Link included: 304, and the Link still said.
    same = await client.get(path, headers={"If-None-Match": again.headers["etag"]})
    assert same.status_code == 304 and same.headers["link"] == again.headers["link"]


async def test_a_reader_arriving_while_the_last_one_tears_down_gets_a_new_feed(
    coordinator: Coordinator, app: FastAPI, fleet_of_two: dict[str, Command]
) -> None:
    fleet_feed = app.state.fleet_feed
    first = fleet_feed.events(None)
    _, name, _ = _parsed(await anext(first))
    assert name == "snapshot" and fleet_feed.readers == 1
    # Stepped by hand: the last reader's teardown up to where it waits for the cancelled feed.
    closing = first.aclose()
    waited = closing.send(None)  # the feed task, cancelled, not done yet
    assert fleet_feed.readers == 0 and isinstance(waited, asyncio.Task) and not waited.done()
    second = fleet_feed.events(None)
    try:
        _, name, snapshot = _parsed(await anext(second))
        assert name == "snapshot" and snapshot["rollouts"][0]["rollout_id"] == "r-new"
        feed(coordinator, ack(fleet_of_two["new"], "w2", AckState.SUCCEEDED, 9.5))
        _, name, delta = _parsed(await anext(second))
        # The bug: the cancelled feed was reused, and this stream ended here.
        assert name == "delta" and delta["rollouts"][0]["phase"] == "failed"
        feed_of_fleet = fleet_feed._task
        assert feed_of_fleet is not None and feed_of_fleet is not waited
        with contextlib.suppress(asyncio.CancelledError):
            await waited
        with pytest.raises(StopIteration):
            closing.send(None)  # the old reader's teardown ends; the new feed goes on
        assert (
            fleet_feed._task is feed_of_fleet
            and not feed_of_fleet.done()
            and fleet_feed.readers == 1
        )
    finally:
        await second.aclose()


def _parsed(event: Any) -> tuple[int, str, dict[str, Any]]:
    return int(event.id), event.event, json.loads(event.data)


# --------------------------------------------------------------------------- dry runs


async def test_a_dry_run_says_so_wherever_a_rollout_is_shown(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    checked = command("r-dry", issued=9.6, version="v4").model_copy(update={"dry_run": True})
    feed(coordinator, checked, *succeeded(checked, "w1", "w2", sent=9.8))
    listed = {r["rollout_id"]: r for r in (await client.get("/api/v1/rollouts")).json()}
    assert listed["r-dry"]["dry_run"] is True and listed["r-dry"]["phase"] == "succeeded"
    assert listed["r-new"]["dry_run"] is False and listed["r-old"]["dry_run"] is False
    summary = (await client.get("/api/v1/rollouts/r-dry/summary")).json()
    assert summary["dry_run"] is True
    assert (await client.get("/api/v1/rollouts/r-old/summary")).json()["dry_run"] is False
    status = (await client.get("/api/v1/rollouts/r-dry")).json()
    assert status["dry_run"] is True
    events = sse_events((await client.get("/api/v1/rollouts/r-dry/events")).text)
    assert [e for e, _ in events] == ["status", "end"]
    assert json.loads(events[0][1])["dry_run"] is True
    assert json.loads(events[1][1])["dry_run"] is True
    snapshot = sse_events((await client.get("/api/v1/events?once=true")).text)[0][1]
    shown = {r["rollout_id"]: r["dry_run"] for r in json.loads(snapshot)["rollouts"]}
    assert shown == {"r-dry": True, "r-new": False, "r-old": False}
