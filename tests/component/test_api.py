"""The HTTP API in process: a Coordinator that is never started, its Fleet fed events directly.

No Kafka: reads, auth refusals, validation, metrics and SSE. Publishing (201) is in the
integration test, against the real broker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.api.models import parse_rollout_request
from controlplane.api.server import ApiServer, serve
from controlplane.coordinator.follower import Batch
from controlplane.coordinator.metrics import AckLatency
from controlplane.coordinator.publisher import resolve_selector
from controlplane.coordinator.service import (
    RESYNC,
    SUBSCRIBER_QUEUE,
    Coordinator,
    CoordinatorSettings,
)
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    Heartbeat,
    InFlight,
    ReloadWeightsSpec,
    Selector,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
)
from tests import factories
from tests.fleet import wait_for

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def at(seconds: float) -> datetime:
    return factories.at(seconds, T0)


class Clock:
    def __init__(self, seconds: float) -> None:
        self.now = at(seconds)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


# --------------------------------------------------------------------------- factories


def command(
    rollout_id: str,
    *,
    workers: list[str] | None = None,
    issued: float = 0.0,
    version: str = "v2",
    overrides: dict[str, Any] | None = None,
) -> Command:
    spec = (
        UpdateConfigSpec(overrides=overrides)
        if overrides is not None
        else ReloadWeightsSpec(path="/ckpt/model.safetensors", version=version)
    )
    return Command(
        command_id=f"{rollout_id}.c1",
        rollout_id=rollout_id,
        issued_at=at(issued),
        expires_at=at(issued + 3600),
        issuer="ci",
        selector=Selector(worker_ids=workers or ["w1", "w2"]),
        spec=spec,
    )


def ack(
    cmd: Command,
    worker_id: str,
    state: AckState,
    sent: float,
    *,
    code: str | None = None,
) -> Ack:
    error = None
    if state in (AckState.FAILED, AckState.REJECTED):
        error = AckError(code=code or "RUNNER_FAILED", message=f"{worker_id} could not")
    version = cmd.spec.version if isinstance(cmd.spec, ReloadWeightsSpec) else None
    return Ack(
        command_id=cmd.command_id,
        rollout_id=cmd.rollout_id,
        worker_id=worker_id,
        kind=cmd.kind,
        state=state,
        weights_version=version if state is AckState.SUCCEEDED else "v1",
        error=error,
        timings=Timings(
            received_at=at(sent - 0.5),
            started_at=at(sent - 0.4),
            finished_at=at(sent) if state.terminal else None,
        ),
        sent_at=at(sent),
    )


def heartbeat(
    worker_id: str,
    sent: float,
    *,
    version: str = "v1",
    labels: dict[str, str] | None = None,
    status: WorkerStatus = WorkerStatus.READY,
    in_flight: Command | None = None,
) -> Heartbeat:
    return factories.heartbeat(
        worker_id,
        sent,
        t0=T0,
        labels=labels if labels is not None else {"model": "tiny"},
        status=status,
        version=version,
        in_flight=(
            InFlight(
                command_id=in_flight.command_id,
                rollout_id=in_flight.rollout_id,
                kind=in_flight.kind,
                since=at(sent - 1),
            )
            if in_flight is not None
            else None
        ),
        seq=int(sent * 10) + 1000,
    )


def feed(coordinator: Coordinator, *events: Command | Ack | Heartbeat) -> None:
    """What the follower does with one fetch: fold into the Fleet, then tell the listeners."""
    batch = Batch()
    for event in events:
        if isinstance(event, Command):
            coordinator.fleet.observe_command(event)
            batch.commands.append(event)
        elif isinstance(event, Ack):
            coordinator.fleet.observe_ack(event)
            batch.acks.append(event)
        else:
            coordinator.fleet.observe_heartbeat(event)
            batch.heartbeats.append(event)
    for listener in coordinator.follower.listeners:
        listener(batch)


def succeeded(cmd: Command, *workers: str, sent: float = 5.0) -> list[Ack]:
    return [
        a
        for w in workers
        for a in (ack(cmd, w, AckState.RUNNING, sent - 1), ack(cmd, w, AckState.SUCCEEDED, sent))
    ]


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event, data) pairs of an SSE body, pings left out."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in block.split("\n")
            if ": " in line and not line.startswith(":")
        )
        if "event" in fields:
            out.append((fields["event"], fields.get("data", "")))
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def clock() -> Clock:
    return Clock(10.0)


@pytest.fixture
async def coordinator(clock: Clock) -> AsyncIterator[Coordinator]:
    """Never started: nothing here touches Kafka (the address is unroutable on purpose)."""
    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr(TOKEN)
    )
    coord = Coordinator(settings, clock=clock, current_as_of=clock)
    coord.follower.caught_up.set()
    try:
        yield coord
    finally:
        await coord.stop()


@pytest.fixture
def app(coordinator: Coordinator) -> FastAPI:
    return create_app(coordinator, sse_tick_s=0.05)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        yield c


@pytest.fixture
def fleet_of_two(coordinator: Coordinator) -> Iterator[dict[str, Command]]:
    """w1 and w2 alive; r-old succeeded on both, r-new progressing (w1 failed, w2 running)."""
    old = command("r-old", issued=1.0, version="v2")
    new = command("r-new", issued=6.0, version="v3")
    feed(coordinator, heartbeat("w1", 0.0), heartbeat("w2", 0.0), old)
    feed(coordinator, *succeeded(old, "w1", "w2", sent=4.0))
    feed(
        coordinator,
        new,
        ack(new, "w1", AckState.REJECTED, 7.0, code="CHECKSUM_MISMATCH"),
        ack(new, "w2", AckState.RUNNING, 7.5),
        heartbeat("w1", 9.0, version="v2"),
        heartbeat("w2", 9.0, version="v2", status=WorkerStatus.BUSY, in_flight=new),
    )
    yield {"old": old, "new": new}


# --------------------------------------------------------------------------- health


async def test_health_reports_readiness_and_readyz_is_503_until_caught_up(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    coordinator.follower.caught_up.clear()
    health = await client.get("/healthz")
    assert health.status_code == 200 and health.json()["ready"] is False
    ready = await client.get("/readyz")
    assert ready.status_code == 503 and ready.headers["retry-after"] == "1"
    assert ready.json()["error"]["code"] == "NOT_READY"
    # Statuses are incomplete during the replay: reads refuse rather than show false failures.
    assert (await client.get("/api/v1/rollouts")).status_code == 503

    coordinator.follower.caught_up.set()
    assert (await client.get("/healthz")).json()["ready"] is True
    assert (await client.get("/readyz")).status_code == 200


# --------------------------------------------------------------------------- rollouts


async def test_rollouts_newest_first_with_phase_filter_and_limit(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    listed = (await client.get("/api/v1/rollouts")).json()
    assert [r["rollout_id"] for r in listed] == ["r-new", "r-old"]
    assert listed[1]["phase"] == "succeeded" and listed[1]["exit_code"] == 0
    assert listed[0]["phase"] == "progressing" and listed[0]["counts"]["rejected"] == 1

    only = (await client.get("/api/v1/rollouts", params={"phase": "succeeded"})).json()
    assert [r["rollout_id"] for r in only] == ["r-old"]
    both = await client.get(
        "/api/v1/rollouts", params=[("phase", "succeeded"), ("phase", "progressing")]
    )
    assert len(both.json()) == 2
    assert [r["rollout_id"] for r in (await client.get("/api/v1/rollouts?limit=1")).json()] == [
        "r-new"
    ]

    bad = await client.get("/api/v1/rollouts", params={"phase": "done"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "INVALID_REQUEST"
    assert (await client.get("/api/v1/rollouts?limit=0")).status_code == 422


async def test_one_rollout_and_json_404s(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    status = (await client.get("/api/v1/rollouts/r-new")).json()
    w1 = next(w for w in status["workers"] if w["worker_id"] == "w1")
    assert w1["state"] == "rejected" and w1["error"]["code"] == "CHECKSUM_MISMATCH"

    missing = await client.get("/api/v1/rollouts/nope")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "code": "ROLLOUT_NOT_FOUND",
        "message": "no rollout 'nope' in the log",
        "retryable": False,
    }
    route = await client.get("/api/v1/nothing-here")
    assert route.status_code == 404 and route.json()["error"]["code"] == "NOT_FOUND"
    method = await client.delete("/api/v1/rollouts")
    assert method.status_code == 405 and method.json()["error"]["code"] == "METHOD_NOT_ALLOWED"


# --------------------------------------------------------------------------- workers


async def test_workers_show_desired_against_reported(
    coordinator: Coordinator,
    clock: Clock,
    client: httpx.AsyncClient,
    fleet_of_two: dict[str, Command],
) -> None:
    workers = {w["worker_id"]: w for w in (await client.get("/api/v1/workers")).json()}
    # r-new (v3) is progressing, so it is what both are desired to run; both report v2.
    assert (
        workers["w1"]["desired_version"] == "v3" and workers["w1"]["desired_rollout_id"] == "r-new"
    )
    assert workers["w1"]["reported_version"] == "v2" and workers["w1"]["in_sync"] is False
    assert workers["w2"]["heartbeat"]["in_flight"]["rollout_id"] == "r-new"
    assert workers["w2"]["heartbeat"]["labels"] == {"model": "tiny"}
    assert all(w["alive"] for w in workers.values())

    one = await client.get("/api/v1/workers/w2")
    assert one.status_code == 200 and one.json()["heartbeat"]["status"] == "busy"
    missing = await client.get("/api/v1/workers/w9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "WORKER_NOT_FOUND"

    clock.advance(60)  # three silent periods later, nobody is alive
    assert (await client.get("/api/v1/workers", params={"alive": "true"})).json() == []
    assert len((await client.get("/api/v1/workers", params={"alive": "false"})).json()) == 2


async def test_worker_expected_but_never_seen_has_no_heartbeat(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    feed(coordinator, heartbeat("w1", 9.0), command("r1", workers=["w1", "ghost"], issued=9.5))
    ghost = (await client.get("/api/v1/workers/ghost")).json()
    assert ghost["heartbeat"] is None and ghost["alive"] is False


# --------------------------------------------------------------------------- writes


RELOAD = {"kind": "reload_weights", "path": "/ckpt/model.safetensors", "version": "v9"}


def unreadable_nack(rollout_id: str, worker_id: str, sent: float, code: str) -> Ack:
    """A worker's NACK of a record it could not decode: its ids were readable, its kind not."""
    cmd = command(rollout_id)
    nack = ack(cmd, worker_id, AckState.REJECTED, sent, code=code)
    return nack.model_copy(update={"kind": None, "weights_version": None})


async def test_a_rollout_whose_command_no_worker_could_read_is_rejected_not_404(
    coordinator: Coordinator, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    feed(
        coordinator,
        unreadable_nack("r-bad", "w1", 8.0, "SCHEMA_INVALID"),
        unreadable_nack("r-bad", "w2", 8.5, "UNSUPPORTED_SCHEMA_VERSION"),
    )
    r = await client.get("/api/v1/rollouts/r-bad")
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["phase"], body["reason"], body["exit_code"]) == ("failed", "COMMAND_REJECTED", 1)
    assert body["kind"] is None and body["counts"]["rejected"] == 2
    assert [w["error"]["code"] for w in body["workers"]] == [
        "SCHEMA_INVALID",
        "UNSUPPORTED_SCHEMA_VERSION",
    ]
    listed = (await client.get("/api/v1/rollouts")).json()
    assert [x["rollout_id"] for x in listed] == ["r-bad", "r-new", "r-old"]
    events = sse_events((await client.get("/api/v1/rollouts/r-bad/events")).text)
    assert [e for e, _ in events] == ["status", "end"]
    assert (await client.get("/")).status_code == 200
    # Its id is taken.
    r = await client.post("/api/v1/rollouts", json={**RELOAD, "rollout_id": "r-bad"}, headers=AUTH)
    assert r.status_code == 409 and r.json()["error"]["code"] == "ROLLOUT_EXISTS"


async def test_the_coordinator_refuses_a_rollout_id_already_in_the_log(
    coordinator: Coordinator, fleet_of_two: dict[str, Command]
) -> None:
    with pytest.raises(ControlPlaneError) as caught:
        await coordinator.create_rollout(
            ReloadWeightsSpec(path="/ckpt", version="v9"), Selector(), rollout_id="r-old"
        )
    assert caught.value.code is LocalCode.ROLLOUT_EXISTS


@pytest.mark.parametrize("interval", [1e300, float("inf"), float("nan")])
async def test_a_heartbeat_with_a_huge_interval_breaks_no_read_and_no_publish(
    coordinator: Coordinator,
    client: httpx.AsyncClient,
    fleet_of_two: dict[str, Command],
    interval: float,
) -> None:
    """The trial's heartbeat: ``interval_s`` 1e300 made every read and publish overflow."""
    hostile = heartbeat("w3", 9.5).model_copy(update={"interval_s": interval})
    feed(coordinator, hostile)
    for path in ("/api/v1/workers", "/api/v1/workers/w3", "/api/v1/rollouts", "/metrics", "/"):
        assert (await client.get(path)).status_code == 200, path
    pinned = resolve_selector(Selector(), coordinator.fleet.registry, coordinator.now())
    assert pinned.worker_ids == ["w1", "w2", "w3"]


async def test_ended_rollouts_beyond_the_bound_are_served_as_summaries(clock: Clock) -> None:
    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), max_ended_rollouts=1
    )
    coord = Coordinator(settings, clock=clock, current_as_of=clock)
    coord.follower.caught_up.set()
    app = create_app(coord)
    try:
        feed(coord, heartbeat("w1", 9.0), heartbeat("w2", 9.0))
        for i in range(3):
            cmd = command(f"r{i}", issued=float(i))
            feed(coord, cmd, *succeeded(cmd, "w1", "w2", sent=i + 2.0))
        assert coord.compact() == 2
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            listed = (await c.get("/api/v1/rollouts")).json()
            assert [(r["rollout_id"], r["details_dropped"]) for r in listed] == [
                ("r2", False),
                ("r1", True),
                ("r0", True),
            ]
            old = (await c.get("/api/v1/rollouts/r0")).json()
            assert (old["phase"], old["counts"]["succeeded"], old["workers"]) == (
                "succeeded",
                2,
                [],
            )
            metrics = (await c.get("/metrics")).text
            assert sample(metrics, "controlplane_rollouts", phase="succeeded") == 3
            assert sample(metrics, "controlplane_rollouts_summarized") == 2
    finally:
        await coord.stop()


async def test_status_and_liveness_are_judged_when_the_replica_was_last_known_current(
    clock: Clock,
) -> None:
    """Cut off from Kafka at 10 s, its clock at 1000 s: nobody is judged lost for the silence
    the replica could not see (its as-of stops), and the rollout is not timed out."""
    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr(TOKEN)
    )
    as_of = Clock(10.0)
    coord = Coordinator(settings, clock=clock, current_as_of=as_of)
    coord.follower.caught_up.set()
    app = create_app(coord)
    try:
        new = command("r-new", issued=6.0)
        feed(coord, heartbeat("w1", 9.0), heartbeat("w2", 9.0), new)
        feed(coord, ack(new, "w1", AckState.RUNNING, 7.0), ack(new, "w2", AckState.RUNNING, 7.0))
        clock.advance(990)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            workers = (await c.get("/api/v1/workers")).json()
            assert [w["alive"] for w in workers] == [True, True]
            status = (await c.get("/api/v1/rollouts/r-new")).json()
            assert status["phase"] == "progressing" and status["counts"]["lost"] == 0
            assert status["as_of"] == at(10).isoformat().replace("+00:00", "Z")
            assert sample((await c.get("/metrics")).text, "controlplane_workers_alive") == 2
            as_of.advance(990)  # back: it knows the log up to its clock again
            workers = (await c.get("/api/v1/workers")).json()
            assert [w["alive"] for w in workers] == [False, False]
            health = (await c.get("/healthz")).json()
            assert health["as_of"] == clock().isoformat().replace("+00:00", "Z")
        assert coord.judge_time() == clock()
        coord.follower.caught_up.clear()
        assert coord.judge_time() is None
    finally:
        await coord.stop()


async def test_writes_disabled_without_a_configured_token(coordinator: Coordinator) -> None:
    settings = coordinator.settings.model_copy(update={"api_token": None})
    tokenless = Coordinator(settings)
    tokenless.follower.caught_up.set()
    try:
        transport = httpx.ASGITransport(app=create_app(tokenless))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            r = await c.post("/api/v1/rollouts", json=RELOAD, headers=AUTH)
        assert r.status_code == 403
        assert r.json()["error"]["code"] == "WRITES_DISABLED"
    finally:
        await tokenless.stop()


@pytest.mark.parametrize(
    ("headers", "error"),
    [
        ({}, None),
        ({"Authorization": "Bearer wrong"}, "invalid_token"),
        ({"Authorization": f"Basic {TOKEN}"}, None),
        ({"Authorization": f"Bearer {TOKEN}x"}, "invalid_token"),
        ({"Authorization": "Bearer \u00e9t\u00e9".encode()}, "invalid_token"),  # not ASCII
    ],
)
async def test_missing_or_wrong_token_is_401(
    client: httpx.AsyncClient, headers: dict[str, str | bytes], error: str | None
) -> None:
    # An invalid body too: authentication is checked before anything is parsed.
    r = await client.post("/api/v1/rollouts", content=b"{not json", headers=headers)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "UNAUTHORIZED"
    challenge = r.headers["www-authenticate"]
    assert challenge.startswith("Bearer ")
    assert (f'error="{error}"' in challenge) == (error is not None)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "MALFORMED_JSON"),
        (
            json.dumps({**RELOAD, "ttl_s": "30"}).encode(),
            422,
            "SCHEMA_INVALID",
        ),  # strict, as on the wire
        # Longer than the workers' default max_ttl_s: every worker would refuse it (TTL_TOO_LONG).
        (json.dumps({**RELOAD, "ttl_s": 8 * 86400}).encode(), 422, "SCHEMA_INVALID"),
        (json.dumps({**RELOAD, "version": "bad version!"}).encode(), 422, "SCHEMA_INVALID"),
        (json.dumps({**RELOAD, "colour": "red"}).encode(), 422, "SCHEMA_INVALID"),
        (json.dumps({"kind": "update_config", "overrides": {}}).encode(), 422, "SCHEMA_INVALID"),
        (json.dumps({"kind": "reboot"}).encode(), 422, "SCHEMA_INVALID"),
        (
            json.dumps({**RELOAD, "selector": {"labels": {"model": "none"}}}).encode(),
            409,
            "NO_MATCHING_WORKERS",
        ),
        (json.dumps({**RELOAD, "rollout_id": "r-old"}).encode(), 409, "ROLLOUT_EXISTS"),
    ],
)
async def test_refused_writes(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command], body: bytes, status: int, code: str
) -> None:
    r = await client.post(
        "/api/v1/rollouts", content=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code


async def test_schema_errors_say_where(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    r = await client.post("/api/v1/rollouts", json={**RELOAD, "timeout_s": -1}, headers=AUTH)
    details = r.json()["error"]["details"]
    assert any("timeout_s" in d["loc"] for d in details)


async def test_no_live_worker_is_409_even_when_ids_are_named(
    clock: Clock, client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    clock.advance(120)  # both workers silent for too long
    r = await client.post(
        "/api/v1/rollouts", json={**RELOAD, "selector": {"worker_ids": ["w1"]}}, headers=AUTH
    )
    assert r.status_code == 409 and r.json()["error"]["code"] == "NO_MATCHING_WORKERS"


def test_request_is_split_into_the_wire_spec_and_options() -> None:
    body = {
        **RELOAD,
        "sha256": {"model.safetensors": "0" * 64},
        "strict": False,
        "selector": {"labels": {"model": "tiny"}},
        "ttl_s": 60,
        "timeout_s": 30,
        "rollout_id": "r-x",
    }
    spec, options = parse_rollout_request(json.dumps(body).encode())
    assert type(spec) is ReloadWeightsSpec and spec.strict is False and spec.version == "v9"
    assert (
        options.selector.labels == {"model": "tiny"}
        and options.ttl_s == 60
        and options.rollout_id == "r-x"
    )
    spec2, _ = parse_rollout_request(b'{"kind": "update_config", "overrides": {"top_k": 5}}')
    assert type(spec2) is UpdateConfigSpec and spec2.overrides == {"top_k": 5}


# --------------------------------------------------------------------------- metrics


def sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        got = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p) if rest else {}
        if metric == name and {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    return None


async def test_metrics_count_acks_phases_workers_and_latency(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert sample(text, "controlplane_rollouts", phase="succeeded") == 1
    assert sample(text, "controlplane_rollouts", phase="progressing") == 1
    assert sample(text, "controlplane_rollouts", phase="failed") == 0
    assert sample(text, "controlplane_acks_total", state="succeeded", code="") == 2
    assert sample(text, "controlplane_acks_total", state="rejected", code="CHECKSUM_MISMATCH") == 1
    assert sample(text, "controlplane_acks_total", state="running", code="") == 3
    assert sample(text, "controlplane_workers") == 2
    assert sample(text, "controlplane_workers_alive") == 2
    assert sample(text, "controlplane_workers_in_sync") == 0
    assert sample(text, "controlplane_messages_total", kind="heartbeat") == 4
    assert sample(text, "controlplane_ready") == 1
    # r-old: issued at 1 s, both succeeded at 4 s; r-new: w1 rejected at 7 s, issued at 6 s.
    count = "controlplane_command_ack_latency_seconds_count"
    total = "controlplane_command_ack_latency_seconds_sum"
    assert sample(text, count, kind="reload_weights", state="succeeded") == 2
    assert sample(text, total, kind="reload_weights", state="succeeded") == pytest.approx(6.0)
    assert sample(text, count, kind="reload_weights", state="rejected") == 1
    assert "controlplane_records_undecodable_total 0.0" in text


async def test_each_app_has_its_own_registry(coordinator: Coordinator, app: FastAPI) -> None:
    other = create_app(coordinator)  # a second app on the same coordinator must not collide
    assert other.state.metrics.registry is not app.state.metrics.registry
    feed(coordinator, heartbeat("w1", 9.0))
    assert sample(other.state.metrics.render().decode(), "controlplane_workers") == 1


def test_latency_pairs_acks_and_commands_in_any_order_once_per_worker() -> None:
    cmd = command("r1", issued=0.0)
    first_w1, late_w1 = (
        ack(cmd, "w1", AckState.SUCCEEDED, 3.0),
        ack(cmd, "w1", AckState.SUCCEEDED, 9.0),
    )
    tracker = AckLatency()
    # Replay order: acks (out of order, redelivered) before their command.
    assert tracker.ack(late_w1) == [] and tracker.ack(first_w1) == [] and tracker.ack(late_w1) == []
    assert tracker.ack(ack(cmd, "w2", AckState.RUNNING, 1.0)) == []  # not terminal
    assert tracker.waiting == 1
    assert [s.seconds for s in tracker.command(cmd)] == [3.0]  # the earliest sent counts
    assert tracker.command(cmd) == []  # the command again: nothing more
    assert tracker.ack(late_w1) == []  # already sampled
    [w2] = tracker.ack(ack(cmd, "w2", AckState.FAILED, 4.0))
    assert (w2.kind, w2.state, w2.seconds) == ("reload_weights", "failed", 4.0)
    assert tracker.ack(ack(cmd, "w2", AckState.FAILED, 5.0)) == [] and tracker.waiting == 0


async def test_latency_is_observed_when_the_command_arrives_after_its_acks(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    cmd = command("r1", workers=["w1"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.5), ack(cmd, "w1", AckState.SUCCEEDED, 3.5))
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_ack_latency_waiting") == 1
    feed(coordinator, cmd)
    text = (await client.get("/metrics")).text
    assert (
        sample(
            text,
            "controlplane_command_ack_latency_seconds_sum",
            kind="reload_weights",
            state="succeeded",
        )
        == 2.5
    )
    assert sample(text, "controlplane_ack_latency_waiting") == 0


def test_latency_tracking_is_bounded() -> None:
    tracker = AckLatency(max_commands=3)
    for i in range(10):
        cmd = command(f"r{i}", issued=0.0)
        tracker.command(cmd)
        tracker.ack(ack(cmd, "w1", AckState.SUCCEEDED, 1.0))
        orphan = command(f"x{i}", issued=0.0)
        tracker.ack(ack(orphan, "w1", AckState.SUCCEEDED, 1.0))  # its command never comes
    assert tracker.tracked == 6 and tracker.waiting == 3


async def test_unknown_error_codes_are_one_label_value(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    cmd = command("r1", workers=["w1"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.5), cmd)
    for i in range(5):  # a worker (or a forger) inventing codes: no new time series each
        feed(coordinator, ack(cmd, f"w{i}", AckState.FAILED, 2.0, code=f"MADE_UP_{i}"))
    feed(coordinator, ack(cmd, "w9", AckState.FAILED, 2.0, code="RUNNER_FAILED"))
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_acks_total", state="failed", code="OTHER") == 5
    assert sample(text, "controlplane_acks_total", state="failed", code="RUNNER_FAILED") == 1
    assert "MADE_UP" not in text


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
    assert len(operations) == 9 and all(op.get("summary") for op in operations)
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
    assert '"/api/v1"' in r.text and "/workers`" in r.text and "/rollouts?limit=" in r.text
    assert "http://" not in r.text and "https://" not in r.text


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
