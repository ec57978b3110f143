"""The coordinator's HTTP API end to end: real broker, real agents, real uvicorn on a free port.

POST a rollout with the token, follow it over SSE until the agents have acked it, then restart
the coordinator on the same topics and get the same final statuses back from the log. A POST
whose publish the cluster does not confirm in time is 504 PUBLISH_OUTCOME_UNKNOWN (it may be in
the log), and the coordinator keeps serving and keeps trying it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.api.models import from_domain
from controlplane.api.server import ApiServer
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.protocol import ReloadWeightsSpec, encode
from tests.factories import running_agent
from tests.fleet import make_command, publish
from tests.integration.test_bus_publish import (
    fleet_below_min_isr,
    node_down,
    read_topic,
    restore_commands_topic,
)
from tests.integration.test_cli_publish import live_worker
from workers.runners.fake_runner import FakeRunner

pytestmark = pytest.mark.kafka

TOKEN = "integration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@asynccontextmanager
async def running_coordinator(kafka: KafkaSettings) -> AsyncIterator[httpx.AsyncClient]:
    """A coordinator caught up with the log, its API on a free port, and a client for it."""
    coordinator = Coordinator(CoordinatorSettings(kafka=kafka, api_token=SecretStr(TOKEN)))
    app = create_app(coordinator, sse_tick_s=0.2)  # before start: the metrics see the replay
    async with coordinator:
        await coordinator.wait_ready(60)
        async with (
            ApiServer(coordinator, "127.0.0.1", 0, app=app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
        ):
            yield client


async def until(
    client: httpx.AsyncClient, path: str, check: Callable[[Any], bool], timeout: float = 30
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        body = (await client.get(path)).json()
        if check(body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"GET {path} never satisfied the check; last: {body}")
        await asyncio.sleep(0.1)


async def follow(client: httpx.AsyncClient, rollout_id: str) -> list[tuple[str, Any]]:
    """Every SSE event of the rollout until the server closes the stream."""
    events: list[tuple[str, Any]] = []
    name = None
    async with (
        asyncio.timeout(60),
        client.stream(
            "GET", f"/api/v1/rollouts/{rollout_id}/events", params={"wait_s": 30}
        ) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: ") and name is not None:
                events.append((name, json.loads(line.removeprefix("data: "))))
                name = None
    return events


def without_as_of(statuses: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in s.items() if k != "as_of"} for s in statuses]


async def test_post_follow_and_restart(kafka: KafkaSettings, tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "model.safetensors").write_bytes(b"\0" * 128)
    reload_body = {
        "kind": "reload_weights",
        "path": str(tmp_path / "ckpts" / "model.safetensors"),
        "version": "v2",
        "selector": {"labels": {"model": "tiny"}},
        "timeout_s": 30,
    }
    async with AsyncExitStack() as agents, running_coordinator(kafka) as api:
        for worker_id in ("w1", "w2"):
            await agents.enter_async_context(
                running_agent(
                    kafka,
                    tmp_path,
                    FakeRunner({"reload_delay_s": 0.2}),
                    worker_id=worker_id,
                    runner="fake",
                )
            )
        await until(api, "/api/v1/workers", lambda ws: sum(w["alive"] for w in ws) == 2)

        denied = await api.post("/api/v1/rollouts", json=reload_body)
        assert denied.status_code == 401

        created = await api.post("/api/v1/rollouts", json=reload_body, headers=AUTH)
        assert created.status_code == 201, created.text
        rollout_id = created.json()["rollout_id"]
        assert created.headers["location"] == f"/api/v1/rollouts/{rollout_id}"
        assert created.json()["command"]["selector"]["worker_ids"] == ["w1", "w2"]

        events = await follow(api, rollout_id)
        assert [name for name, _ in events][-1] == "end"
        assert events[-1][1] == {
            "rollout_id": rollout_id,
            "phase": "succeeded",
            "reason": None,
            "exit_code": 0,
        }
        final = events[-2][1]
        assert final["phase"] == "succeeded" and final["counts"]["succeeded"] == 2
        assert {w["weights_version"] for w in final["workers"]} == {"v2"}
        assert all(s["phase"] in ("pending", "progressing") for _, s in events[:-2])

        got = (await api.get(f"/api/v1/rollouts/{rollout_id}")).json()
        assert without_as_of([got]) == without_as_of([final])
        workers = await until(
            api, "/api/v1/workers", lambda ws: all(w["reported_version"] == "v2" for w in ws)
        )
        assert all(w["in_sync"] and w["desired_version"] == "v2" for w in workers)
        # The same in counts, and one worker a page.
        summary = await until(
            api, "/api/v1/summary", lambda b: b["workers"]["by_version"].get("v2", {}).get("alive")
        )
        assert (summary["workers"]["known"], summary["workers"]["alive"]) == (2, 2)
        assert summary["workers"]["in_sync"] == 2
        assert summary["rollouts"]["by_phase"]["succeeded"] == 1
        first = await api.get("/api/v1/workers", params={"limit": 1})
        second = await api.get(first.links["next"]["url"])
        assert [w["worker_id"] for w in first.json() + second.json()] == ["w1", "w2"]
        assert "next" not in second.links
        counts = (await api.get(f"/api/v1/rollouts/{rollout_id}/summary")).json()
        assert counts["counts"]["succeeded"] == 2 and counts["versions"] == {"v2": 2}

        # A config key the runner does not accept: refused by both workers, with the code.
        bad = await api.post(
            "/api/v1/rollouts",
            json={
                "kind": "update_config",
                "overrides": {"no_such_key": 1},
                "rollout_id": "r-bad-config",
            },
            headers=AUTH,
        )
        assert bad.status_code == 201, bad.text
        events = await follow(api, "r-bad-config")
        assert events[-1][1]["exit_code"] == 1
        assert {w["error"]["code"] for w in events[-2][1]["workers"]} == {"CONFIG_KEY_REJECTED"}

        metrics = (await api.get("/metrics")).text
        assert 'controlplane_acks_total{code="",state="succeeded"} 2.0' in metrics
        assert 'controlplane_acks_total{code="CONFIG_KEY_REJECTED",state="rejected"} 2.0' in metrics
        assert (
            'controlplane_command_ack_latency_seconds_count{kind="reload_weights",state="succeeded"} 2.0'
            in metrics
        )
        assert 'controlplane_rollouts{phase="succeeded"} 1.0' in metrics

        # A command no worker can read (schema_version 99, from any Kafka client): every
        # worker NACKs it with the decoder's code; the rollout shows as rejected, not 404.
        unreadable = make_command(
            ReloadWeightsSpec(path=str(tmp_path / "ckpts" / "model.safetensors"), version="v3"),
            rollout_id="r-unreadable",
        )
        raw = json.loads(encode(unreadable))
        raw["schema_version"] = 99
        await publish(kafka, json.dumps(raw).encode())
        rejected = await until(
            api,
            "/api/v1/rollouts/r-unreadable",
            lambda s: s.get("counts", {}).get("rejected") == 2,
        )
        assert (rejected["phase"], rejected["reason"]) == ("failed", "COMMAND_REJECTED")
        assert {w["error"]["code"] for w in rejected["workers"]} == {"UNSUPPORTED_SCHEMA_VERSION"}

        # Its id is taken, like any id in the log: refused before anything is published.
        again = await api.post(
            "/api/v1/rollouts", json={**reload_body, "rollout_id": "r-unreadable"}, headers=AUTH
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "ROLLOUT_EXISTS"

        before = (await api.get("/api/v1/rollouts")).json()
        assert [s["rollout_id"] for s in before] == ["r-unreadable", "r-bad-config", rollout_id]
        # The list is in counts; the rollout itself has its workers.
        assert all("workers" not in s for s in before)
        full = (await api.get(f"/api/v1/rollouts/{rollout_id}")).json()
        assert without_as_of([full]) == without_as_of([got])

    # A new coordinator on the same topics: everything comes back from the log, identical.
    async with running_coordinator(kafka) as api:
        after = (await api.get("/api/v1/rollouts")).json()
        assert without_as_of(after) == without_as_of(before)
        replayed = await follow(api, rollout_id)
        assert [name for name, _ in replayed] == ["status", "end"]
        assert without_as_of([replayed[0][1]]) == without_as_of([full])
        assert without_as_of([before[2]]) == without_as_of(
            [(await api.get(f"/api/v1/rollouts/{rollout_id}/summary")).json()]
        )
        again = await api.post(
            "/api/v1/rollouts", json={**reload_body, "rollout_id": "r-bad-config"}, headers=AUTH
        )
        assert again.status_code == 409 and again.json()["error"]["code"] == "ROLLOUT_EXISTS"
        metrics = (await api.get("/metrics")).text
        assert (
            'controlplane_command_ack_latency_seconds_count{kind="reload_weights",state="succeeded"} 2.0'
            in metrics
        )


def test_kafka_unreachable_is_503_and_an_unknown_outcome_504() -> None:
    down = from_domain(BusError("no broker", code=LocalCode.BROKER_UNAVAILABLE))
    assert (down.status, down.info.code, down.info.retryable) == (503, "BROKER_UNAVAILABLE", True)
    unknown = from_domain(BusError("?", code=LocalCode.PUBLISH_OUTCOME_UNKNOWN))
    assert (unknown.status, unknown.info.retryable) == (504, False)


@pytest.mark.slow
async def test_a_post_below_min_isr_is_504_unknown_and_the_coordinator_keeps_trying(
    kafka_cluster: LocalCluster,
) -> None:
    settings = await fleet_below_min_isr(kafka_cluster)
    worker = await live_worker(settings)
    body = {"kind": "update_config", "overrides": {"a": 1}, "rollout_id": "r-unknown"}
    bounded = settings.model_copy(update={"delivery_timeout_ms": 3000})
    async with node_down(kafka_cluster), running_coordinator(bounded) as api:
        await until(api, "/api/v1/workers", lambda ws: [w["worker_id"] for w in ws] == [worker])
        posted = await api.post("/api/v1/rollouts", json=body, headers=AUTH)
        assert posted.status_code == 504, posted.text
        error = posted.json()["error"]
        assert error["code"] == "PUBLISH_OUTCOME_UNKNOWN" and error["retryable"] is False
        assert error["details"][0]["rollout_id"] == "r-unknown"
        command_id = error["details"][0]["command_id"]
        assert error["message"].startswith(
            f"rollout r-unknown (command {command_id}) may have been published: "
        )
        assert "GET /api/v1/rollouts/r-unknown" in error["message"]
        # Still serving; the same rollout id is refused while the first may still land.
        assert (await api.get("/healthz")).status_code == 200
        assert (await api.get("/api/v1/rollouts/r-unknown")).status_code == 404
        again = await api.post("/api/v1/rollouts", json=body, headers=AUTH)
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "ROLLOUT_EXISTS"
        assert command_id in again.json()["error"]["message"]
        # The topic takes writes again: the record the coordinator kept retrying lands, once.
        await restore_commands_topic(settings)
        landed = await until(
            api, "/api/v1/rollouts/r-unknown", lambda r: r.get("rollout_id") == "r-unknown", 120
        )
        assert landed["workers"][0]["worker_id"] == worker
        again = await api.post("/api/v1/rollouts", json=body, headers=AUTH)
        assert again.status_code == 409 and again.json()["error"]["code"] == "ROLLOUT_EXISTS"
    [record] = await read_topic(settings, settings.topics.commands.name)
    assert record.value is not None and command_id.encode() in record.value
