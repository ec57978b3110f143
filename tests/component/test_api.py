"""The HTTP API in process: a Coordinator that is never started, its Fleet fed events directly.

No Kafka: health, reads, auth refusals and validation of writes. Metrics are in test_api_metrics,
SSE and serving in test_api_streams; the fixtures in tests/component/conftest.py. Publishing
(201) is in the integration test, against the real broker.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.api.models import parse_rollout_request
from controlplane.coordinator.publisher import resolve_selector
from controlplane.coordinator.service import (
    Coordinator,
    CoordinatorSettings,
)
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
)
from tests.component.conftest import (
    AUTH,
    TOKEN,
    Clock,
    ack,
    at,
    command,
    feed,
    heartbeat,
    sample,
    sse_events,
    succeeded,
)

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
