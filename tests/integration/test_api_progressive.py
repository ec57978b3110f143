"""Targets and progressive rollouts over HTTP, end to end on the real broker (issue 12).

In-process agents with the fake runner and a coordinator whose controller leads
(test_progressive.fleet_of); the API is served by a second coordinator, a replica that does not
campaign: what it writes goes through Kafka to the controller, what it shows is its own fold of
the log. Real uvicorn on a free port, SSE read as it comes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.api.server import ApiServer
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.topics import Topics
from tests.integration.test_bus_publish import (
    LEADER,
    VICTIM,
    create_topic,
    fleet_below_min_isr,
    node_down,
    set_topic_config,
)
from tests.integration.test_coordinator_api import until
from tests.integration.test_progressive import Fleet, fleet_of

pytestmark = pytest.mark.kafka

TOKEN = "integration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
Events = list[tuple[str, dict[str, Any]]]


@asynccontextmanager
async def api_of(kafka: KafkaSettings) -> AsyncIterator[httpx.AsyncClient]:
    """A coordinator that serves the API and does not campaign for the controller."""
    settings = CoordinatorSettings(kafka=kafka, api_token=SecretStr(TOKEN), controller=False)
    coordinator = Coordinator(settings)
    app = create_app(coordinator, sse_tick_s=0.2)
    async with coordinator:
        await coordinator.wait_ready(60)
        async with (
            ApiServer(coordinator, "127.0.0.1", 0, app=app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
        ):
            yield client


async def follow(client: httpx.AsyncClient, rollout_id: str) -> Events:
    """Every SSE event of the rollout until the server closes the stream."""
    events: Events = []
    name = None
    path = f"/api/v1/progressive-rollouts/{rollout_id}/events"
    async with (
        asyncio.timeout(120),
        client.stream("GET", path, params={"wait_s": 10}) as stream,
    ):
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name is not None:
                events.append((name, json.loads(line.removeprefix("data: "))))
    return events


def waves_seen(events: Events) -> list[int]:
    return [body["wave"] for name, body in events if name == "wave"]


async def start(client: httpx.AsyncClient, fleet: Fleet, body: dict[str, Any]) -> httpx.Response:
    desired = {"weights": fleet.weights(body.pop("version")).model_dump(mode="json")}
    return await client.post("/api/v1/targets/tiny/rollouts", json={"desired": desired, **body})


async def test_a_rollout_over_the_api_waits_for_promote_wave_by_wave_then_undo(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 4) as fleet, api_of(kafka) as api:
        # The controller, as the replica sees it: not this one; the leader from the log.
        controller = fleet.coordinator.controller
        assert controller is not None
        seen = await until(api, "/api/v1/controller", lambda b: b["leader"] is not None)
        assert (seen["enabled"], seen["leading"]) == (False, False)
        assert seen["leader"]["member"] == controller.member
        leader_app = httpx.ASGITransport(app=create_app(fleet.coordinator))
        async with httpx.AsyncClient(transport=leader_app, base_url="http://leader") as c:
            own = (await c.get("/api/v1/controller")).json()
        assert (own["leading"], own["generation"]) == (True, controller.leading)

        stable = {"weights": fleet.weights("v1").model_dump(mode="json")}
        put = await api.put("/api/v1/targets/tiny", json={"selector": {"model": "tiny"}})
        assert put.status_code == 201 and put.json()["created"] is True, put.text
        put = await api.put(
            "/api/v1/targets/tiny", json={"selector": {"model": "tiny"}, "stable": stable}
        )
        assert put.status_code == 200 and put.json()["created"] is False, put.text
        # Read back before the answer: the target is there at once.
        tiny = (await api.get("/api/v1/targets/tiny")).json()
        assert tiny["stable_version"] == "v1"
        tiny = await until(api, "/api/v1/targets/tiny", lambda b: b["at_stable"] == 4)
        assert tiny["workers"] == 4 and tiny["drifting"] == 0

        strategy = {"canary": 1, "steps": ["50%", "100%"], "pause": "manual"}
        r = await start(api, fleet, {"version": "v2", "strategy": strategy, "rollout_id": "r-api"})
        assert r.status_code == 201, r.text
        assert (
            r.headers["location"] == r.json()["status_url"] == "/api/v1/progressive-rollouts/r-api"
        )
        stream = asyncio.create_task(follow(api, "r-api"))

        status = "/api/v1/progressive-rollouts/r-api"
        for wave in (0, 1):  # each passed wave waits at its boundary for a promote

            def paused_at(body: Any, wave: int = wave) -> bool:
                state = body["state"] or {}
                return (body["phase"], state.get("wave")) == ("paused", wave)

            at_boundary = await until(api, status, paused_at)
            assert at_boundary["waves"][wave]["passed"] is True
            ok = await api.post(f"{status}/promote", json={"action_id": f"promote-{wave}"})
            assert ok.status_code == 202 and ok.json()["action"] == "promote", ok.text
        events = await asyncio.wait_for(stream, 120)
        assert events[-1] == (
            "end",
            {"rollout_id": "r-api", "phase": "succeeded", "code": None, "exit_code": 0},
        )
        assert waves_seen(events)[-1] == 3 and {0, 1, 2} <= set(waves_seen(events))
        assert waves_seen(events) == sorted(waves_seen(events))
        last_wave = [b for n, b in events if n == "wave"][-1]
        assert {g["wave"] for g in last_wave["gates"]} == {0, 1, 2}
        assert all(g["passed"] for g in last_wave["gates"])
        assert any(b["phase"] == "paused" for n, b in events if n == "state")

        done = (await api.get(status)).json()
        assert [len(w["workers"]) for w in done["waves"]] == [1, 1, 2]
        assert [a["action_id"] for a in done["actions"]] == ["promote-0", "promote-1"]
        tiny = await until(api, "/api/v1/targets/tiny", lambda b: b["at_stable"] == 4)
        assert tiny["stable_version"] == "v2"
        assert [e["desired"]["weights"]["version"] for e in tiny["history"]] == ["v1", "v2"]

        # Undo: a new rollout back to the previous stable state.
        undo = await api.post("/api/v1/targets/tiny/undo")
        assert undo.status_code == 201, undo.text
        undo_id = undo.json()["rollout_id"]
        assert undo.json()["spec"]["undo_of"] == "r-api"
        events = await follow(api, undo_id)
        assert events[-1][1]["phase"] == "succeeded"
        tiny = await until(api, "/api/v1/targets/tiny", lambda b: b["at_stable"] == 4)
        assert tiny["stable_version"] == "v1"
        assert all(r.history[-1] == "v1" for r in fleet.runners.values())


async def test_abort_over_the_api_rolls_the_canary_back_and_the_rollout_is_ended(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with fleet_of(kafka, tmp_path, 3) as fleet, api_of(kafka) as api:
        await fleet.target()
        await until(api, "/api/v1/targets/tiny", lambda b: b["at_stable"] == 3)
        strategy = {"canary": 1, "pause": "manual"}
        r = await start(api, fleet, {"version": "v2", "strategy": strategy, "rollout_id": "r-ab"})
        assert r.status_code == 201, r.text
        stream = asyncio.create_task(follow(api, "r-ab"))
        status = "/api/v1/progressive-rollouts/r-ab"
        await until(api, status, lambda b: b["phase"] == "paused")

        # The target is busy; the id is taken.
        busy = await start(api, fleet, {"version": "v3"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "TARGET_BUSY"
        again = await start(api, fleet, {"version": "v3", "rollout_id": "r-ab"})
        assert again.status_code == 409 and again.json()["error"]["code"] == "ROLLOUT_EXISTS"

        abort = await api.post(f"{status}/abort", json={"reason": "wrong checkpoint"})
        assert abort.status_code == 202, abort.text
        events = await asyncio.wait_for(stream, 120)
        assert events[-1] == (
            "end",
            {
                "rollout_id": "r-ab",
                "phase": "rolled_back",
                "code": "ABORTED_BY_OPERATOR",
                "exit_code": 8,
            },
        )
        body = (await api.get(status)).json()
        assert body["actions"][0]["reason"] == "wrong checkpoint" and body["exit_code"] == 8
        canary = body["waves"][0]["workers"][0]
        assert fleet.runners[canary].history == ["v1", "v2", "v1"]
        ended = await api.post(f"{status}/resume")
        assert ended.status_code == 409 and ended.json()["error"]["code"] == "ROLLOUT_ENDED"
        # Nothing to undo: the stable state never changed.
        undo = await api.post("/api/v1/targets/tiny/undo")
        assert undo.status_code == 409 and undo.json()["error"]["code"] == "ROLLBACK_UNAVAILABLE"


@pytest.mark.slow
async def test_a_write_kafka_does_not_confirm_is_504_unknown_and_says_what_to_look_for(
    kafka_cluster: LocalCluster,
) -> None:
    """The controller topic below its min ISR: the write may still land (the producer keeps
    trying), so it is 504 PUBLISH_OUTCOME_UNKNOWN naming the target, never 503."""
    settings = await fleet_below_min_isr(kafka_cluster, held="none")  # the three on LEADER
    spec = Topics(prefix=settings.topic_prefix, replication_factor=1).controller
    await create_topic(
        settings.bootstrap_servers,
        spec.name,
        {**spec.config, "min.insync.replicas": "2"},
        partitions=spec.partitions,
        replicas=[LEADER, VICTIM],
    )
    bounded = settings.model_copy(update={"delivery_timeout_ms": 3000})
    async with node_down(kafka_cluster), api_of(bounded) as api:
        put = await api.put("/api/v1/targets/t-unknown", json={"selector": {"model": "tiny"}})
        assert put.status_code == 504, put.text
        error = put.json()["error"]
        assert (error["code"], error["retryable"]) == ("PUBLISH_OUTCOME_UNKNOWN", False)
        assert error["details"] == [{"target": "t-unknown"}]
        assert "GET it before sending it again" in error["message"]
        assert (await api.get("/healthz")).status_code == 200  # still serving
        # The topic takes writes again: the record the coordinator kept trying lands.
        await set_topic_config(settings.bootstrap_servers, spec.name, spec.config)
        landed = await until(api, "/api/v1/targets/t-unknown", lambda b: "name" in b, 120)
        assert landed["selector"] == {"model": "tiny"}
