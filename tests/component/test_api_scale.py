"""The HTTP API at fleet scale (issue 18): summaries, pagination, bounded responses, cached judgments.

No Kafka: a Coordinator that is never started, fed directly (fixtures in tests/component/
conftest.py; larger fleets from tests/fleet_at_scale.py). Nothing here asserts on time: sizes,
pages and how many judgments a read made. The timings at 10,000 workers x 100 rollouts come from
``python -m tests.fleet_at_scale`` (see docs/api.md).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.coordinator.summary import Summaries
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import AckState, Command, WorkerStatus
from tests import fleet_at_scale
from tests.component.conftest import (
    Clock,
    ack,
    command,
    feed,
    heartbeat,
    sample,
    sse_events,
    succeeded,
)
from tests.fleet import wait_for

# --------------------------------------------------------------------------- helpers


async def every_page(client: httpx.AsyncClient, url: str) -> tuple[list[Any], list[int]]:
    """Follow ``Link: rel=next`` from ``url``: every item, and each page's length."""
    items: list[Any] = []
    sizes: list[int] = []
    next_url: str | None = url
    while next_url is not None:
        response = await client.get(next_url)
        assert response.status_code == 200, response.text
        page = response.json()
        items.extend(page)
        sizes.append(len(page))
        link = response.links.get("next")
        next_url = None if link is None else link["url"]
    return items, sizes


def many_workers(coordinator: Coordinator, n: int, *, sent: float = 9.0) -> list[str]:
    """``n`` workers w0000.., labels zone=z0..z3, every 10th busy, versions v1/v2 alternating."""
    ids = [f"w{i:04d}" for i in range(n)]
    feed(
        coordinator,
        *(
            heartbeat(
                w,
                sent,
                version="v2" if i % 2 else "v1",
                labels={"model": "big", "zone": f"z{i % 4}"},
                status=WorkerStatus.BUSY if i % 10 == 0 else WorkerStatus.READY,
            )
            for i, w in enumerate(ids)
        ),
    )
    return ids


Big = tuple[Coordinator, FastAPI, httpx.AsyncClient, Clock]


@pytest.fixture
async def big() -> AsyncIterator[Big]:
    """1,500 workers and 30 reload rollouts pinned to all of them (the last two in progress)."""
    clock = Clock(1.0)
    assert clock() == fleet_at_scale.NOW + timedelta(seconds=1)
    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr("t")
    )
    coordinator = Coordinator(settings, clock=clock, current_as_of=clock)
    coordinator.follower.caught_up.set()
    app = create_app(coordinator)
    fleet_at_scale.build(coordinator, workers=1500, rollouts=30)
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as client:
            yield coordinator, app, client, clock
    finally:
        app.state.summaries.close()
        await coordinator.stop()


# --------------------------------------------------------------------------- workers of the fleet


async def test_fleet_workers_come_in_pages_every_worker_once_in_order(
    coordinator: Coordinator, clock: Clock, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 1203)
    first = await client.get("/api/v1/workers")
    assert len(first.json()) == 500 and "next" in first.links  # the default page
    workers, sizes = await every_page(client, "/api/v1/workers?limit=100")
    assert [w["worker_id"] for w in workers] == ids  # all of them, once, by id
    assert sizes == [100] * 12 + [3]

    # Filters page the same way; each is what the filter says, whole.
    busy, _ = await every_page(client, "/api/v1/workers?status=busy&limit=7")
    assert [w["worker_id"] for w in busy] == ids[::10]
    z1v2, _ = await every_page(client, "/api/v1/workers?selector=zone%3Dz1,model%3Dbig&version=v2")
    assert [w["worker_id"] for w in z1v2] == [w for i, w in enumerate(ids) if i % 4 == 1]
    feed(coordinator, *(heartbeat(w, 40.0) for w in ids[:5]))  # only five go on
    clock.advance(31)
    alive, _ = await every_page(client, "/api/v1/workers?alive=true&limit=2")
    assert [w["worker_id"] for w in alive] == ids[:5]
    dead, sizes = await every_page(client, "/api/v1/workers?alive=false&limit=600")
    assert [w["worker_id"] for w in dead] == ids[5:] and sizes == [600, 598]


async def test_a_worker_added_between_two_pages_breaks_no_page(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 30)
    first = await client.get("/api/v1/workers?limit=10")
    feed(coordinator, heartbeat("w0001a", 9.5), heartbeat("w9999", 9.5))  # before and after
    rest, _ = await every_page(client, first.links["next"]["url"])
    got = [w["worker_id"] for w in first.json() + rest]
    assert got == [*ids, "w9999"]  # the earlier one is behind the cursor: no worker twice


async def test_bad_cursor_and_selector_are_coded_422(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    for path in (
        "/api/v1/workers?cursor=not-a-cursor",
        "/api/v1/workers?selector=model",
        "/api/v1/workers?limit=1001",
        "/api/v1/rollouts?cursor=WyJ4Il0",  # a worker cursor is no rollout cursor
        "/api/v1/rollouts?cursor=WyIyMDI1LTAxLTAxVDAwOjAwOjAwIiwiciJd",  # a time without offset
        "/api/v1/rollouts/r-new/workers?cursor=%%%",
    ):
        r = await client.get(path)
        assert r.status_code == 422, (path, r.text)
        assert r.json()["error"]["code"] == "INVALID_REQUEST"
    assert (await client.get("/api/v1/rollouts/nope/workers")).status_code == 404
    assert (await client.get("/api/v1/rollouts/nope/summary")).status_code == 404


# --------------------------------------------------------------------------- one rollout


async def test_a_rollouts_workers_come_in_pages_with_filters(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 1100)
    cmd = command("r-big", workers=ids, issued=9.5)
    failing = ids[::100]
    feed(
        coordinator,
        cmd,
        *(
            ack(cmd, w, AckState.FAILED, 12.0, code="OOM" if i % 2 else "RUNNER_FAILED")
            for i, w in enumerate(failing)
        ),
        *(a for w in ids[1:300] if w not in failing for a in succeeded(cmd, w, sent=12.0)),
        ack(command("r-big"), "x-stranger", AckState.SUCCEEDED, 12.0),  # unexpected
    )
    rows, sizes = await every_page(client, "/api/v1/rollouts/r-big/workers?limit=250")
    assert [r["worker_id"] for r in rows] == [*ids, "x-stranger"]
    assert sizes == [250] * 4 + [101]
    assert [r["worker_id"] for r in rows if r["unexpected"]] == ["x-stranger"]
    failed, _ = await every_page(client, "/api/v1/rollouts/r-big/workers?state=failed&limit=3")
    assert [r["worker_id"] for r in failed] == failing
    oom, _ = await every_page(client, "/api/v1/rollouts/r-big/workers?code=OOM")
    assert [r["worker_id"] for r in oom] == failing[1::2]

    # The rollout itself: its first workers, and where the others are.
    status = (await client.get("/api/v1/rollouts/r-big?workers_limit=100")).json()
    assert [w["worker_id"] for w in status["workers"]] == ids[:100]
    assert status["counts"]["failed"] == 11 and status["expected"] == 1100
    rest, _ = await every_page(client, status["workers_next"])
    assert [r["worker_id"] for r in rest] == ids[100:]
    whole = (await client.get("/api/v1/rollouts/r-big")).json()
    assert len(whole["workers"]) == 1000 and whole["workers_next"] is not None

    summary = (await client.get("/api/v1/rollouts/r-big/summary")).json()
    assert "workers" not in summary and summary["selector"]["worker_ids"] is None
    assert summary["pinned_workers"] == 1100 and summary["unexpected_workers"] == 1
    assert summary["counts"] == whole["counts"]
    assert summary["errors"] == {"OOM": 5, "RUNNER_FAILED": 6}
    versions = Counter(r["weights_version"] for r in rows if r["weights_version"])
    assert summary["versions"] == dict(versions - Counter({"v2": 1}))  # not the stranger's
    assert summary["versions"]["v2"] == 297
    assert len(json.dumps(summary)) < 2000


async def test_events_carry_the_first_page_of_workers(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    ids = many_workers(coordinator, 1001)
    cmd = command("r-big", workers=ids, issued=9.5)
    feed(coordinator, cmd, *(a for w in ids for a in succeeded(cmd, w, sent=12.0)))
    events = sse_events((await client.get("/api/v1/rollouts/r-big/events")).text)
    assert [e for e, _ in events] == ["status", "end"]
    status = json.loads(events[0][1])
    assert status["phase"] == "succeeded" and len(status["workers"]) == 1000
    assert status["workers_next"].startswith("/api/v1/rollouts/r-big/workers?")
    counts = sse_events((await client.get("/api/v1/rollouts/r-big/events?workers_limit=0")).text)
    status = json.loads(counts[0][1])
    assert status["workers"] == [] and status["counts"]["succeeded"] == 1001


# --------------------------------------------------------------------------- summaries


async def test_the_fleet_summary_counts_workers_and_rollouts(
    coordinator: Coordinator,
    clock: Clock,
    client: httpx.AsyncClient,
    fleet_of_two: dict[str, Command],
) -> None:
    feed(
        coordinator,
        heartbeat("w3", 9.0, version="v3", status=WorkerStatus.STOPPED),
        heartbeat("w4", 1.0, version="v3"),  # silent since 1 s: lost at 16 s
    )
    summary = (await client.get("/api/v1/summary")).json()
    workers = summary["workers"]
    assert (workers["known"], workers["alive"], workers["lost"]) == (4, 3, 1)
    assert workers["by_version"] == {
        "v2": {"workers": 2, "alive": 2},
        "v3": {"workers": 2, "alive": 1},
    }
    assert workers["by_status"]["stopped"] == {"workers": 1, "alive": 0}
    assert workers["by_status"]["busy"] == {"workers": 1, "alive": 1}
    assert workers["in_sync"] == 2  # w3, w4: nothing desired; w1, w2: v3 desired, run v2
    assert summary["rollouts"]["by_phase"]["succeeded"] == 1
    assert (summary["rollouts"]["total"], summary["rollouts"]["active"]) == (2, 1)

    clock.advance(10)  # w4 silent past its lease; nobody else either yet
    workers = (await client.get("/api/v1/summary")).json()["workers"]
    assert (workers["alive"], workers["lost"]) == (2, 2)
    coordinator.fleet.registry.forget("w4")  # a tombstone: the counts follow the registry
    assert (await client.get("/api/v1/summary")).json()["workers"]["known"] == 3
    listed = (await client.get("/api/v1/workers")).json()
    assert [w["worker_id"] for w in listed] == ["w1", "w2", "w3"]


async def test_a_summary_judges_again_only_what_can_have_changed(big: Big) -> None:
    coordinator, app, client, clock = big
    summaries: Summaries = app.state.summaries
    first = (await client.get("/api/v1/summary")).json()
    assert first["rollouts"]["by_phase"]["progressing"] == 2
    assert first["rollouts"]["by_phase"]["failed"] == 1  # r0000: 30 workers failed it
    assert first["workers"]["known"] == 1500 and first["workers"]["alive"] == 1500
    judged = summaries.judgments
    assert judged <= 30 + 1  # each rollout once, and the desired levels
    for path in ("/api/v1/summary", "/metrics", "/api/v1/rollouts?limit=30"):
        assert (await client.get(path)).status_code == 200
    assert summaries.judgments == judged  # nothing changed: nothing judged again
    clock.advance(2)  # past max_age: what is in progress (and the levels) may have changed
    await client.get("/api/v1/summary")
    await client.get("/metrics")
    # Served as judged (stale, with their as_of) or judged again at once; judged again in the
    # background anyway: the two in progress and the levels, no ended one.
    await wait_for(lambda: summaries.judgments - judged >= 3)
    assert summaries.judgments - judged == 3
    judged = summaries.judgments

    # An ack for an ended rollout (late): that rollout alone is judged again.
    done = fleet_at_scale.rollout_command(5, 30, fleet_at_scale.worker_ids(1500))
    feed(coordinator, ack(done, "w00000", AckState.SUCCEEDED, 0.0))
    assert (await client.get("/api/v1/rollouts/r0005/summary")).status_code == 200
    await client.get("/api/v1/summary")
    await wait_for(lambda: summaries.judgments - judged >= 2)
    assert summaries.judgments - judged == 2  # r0005, and the desired levels it dirtied


#: What the dashboard's script reads (controlplane/api/static/dashboard.html): the fleet event
#: stream, and pages of workers (no list of every rollout or worker, no polling).
DASHBOARD_READS = ("${API}/events`", '${API}/workers?${query({ order: "problems", limit: PAGE')


async def test_one_dashboard_update_and_the_lists_are_bounded(big: Big) -> None:
    _, _, client, _ = big
    page = (await client.get("/")).text
    for fragment in DASHBOARD_READS:  # what the dashboard asks for
        assert fragment in page, fragment
    # Its first render: the fleet stream's snapshot (in counts), a page of workers and the
    # open rollout's workers (problems first, then a page of the others): what
    # `python -m tests.fleet_at_scale` measures as one dashboard update. No polled list.
    first = 0
    paths = fleet_at_scale.dashboard_paths("r0029")
    assert paths[0] == "/api/v1/events?once=true"
    assert not any(
        p.startswith(("/healthz", "/api/v1/summary", "/api/v1/rollouts?")) for p in paths
    )
    assert [p.partition("?")[0] for p in paths] == [
        "/api/v1/events",
        "/api/v1/workers",
        "/api/v1/rollouts/r0029/workers",
        "/api/v1/rollouts/r0029/workers",
    ]
    for path in paths:
        response = await client.get(path)
        assert response.status_code == 200
        first += len(response.content)
    assert first < 100_000

    rollouts = await client.get("/api/v1/rollouts?limit=30")
    assert len(rollouts.content) < 30 * 2_000  # counts only: no worker of any rollout
    assert '"workers"' not in rollouts.text and "w00001" not in rollouts.text
    metrics = (await client.get("/metrics")).text
    assert "w00001" not in metrics and len(metrics.splitlines()) < 300
    assert sample(metrics, "controlplane_rollouts", phase="succeeded") == 27
    assert sample(metrics, "controlplane_workers_alive") == 1500


async def test_rollout_list_pages_newest_first_with_a_phase_filter(big: Big) -> None:
    _, _, client, _ = big
    every, sizes = await every_page(client, "/api/v1/rollouts?limit=7")
    assert [r["rollout_id"] for r in every] == [f"r{i:04d}" for i in reversed(range(30))]
    assert sizes == [7, 7, 7, 7, 2]
    ended, _ = await every_page(client, "/api/v1/rollouts?limit=4&phase=succeeded&phase=failed")
    assert [r["rollout_id"] for r in ended] == [f"r{i:04d}" for i in reversed(range(28))]
    assert all(set(r["counts"]) >= {"succeeded", "failed"} for r in every)
