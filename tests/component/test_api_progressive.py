"""Targets and progressive rollouts over HTTP, in process: a Coordinator that is never started,
its fold of the controller topic fed records directly (issue 12).

No Kafka: reads, the controller's view, SSE, auth and every refusal that is decided before
anything is written. Writes that reach the controller topic (201, 202) are in
tests/integration/test_api_progressive.py, against the real broker.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.api.models import from_domain
from controlplane.api.server import ApiServer
from controlplane.coordinator.follower import Batch
from controlplane.coordinator.service import SUBSCRIBER_QUEUE, Coordinator
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    ControlRecord,
    Desired,
    GateResult,
    LeaderRecord,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    Strategy,
    TargetSpec,
    WeightsRef,
)
from controlplane.wire.errors import ControlPlaneError, LocalCode
from tests.component.conftest import AUTH, TOKEN, at, feed, heartbeat, sse_events
from tests.fleet import wait_for

WAVES = [["w1"], ["w2", "w3"]]


def weights(version: str) -> Desired:
    return Desired(weights=WeightsRef(path="/ckpt/model.safetensors", version=version))


def target_spec(name: str = "tiny", stable: str | None = "v1", model: str = "tiny") -> TargetSpec:
    return TargetSpec(
        name=name,
        selector={"model": model},
        stable=None if stable is None else weights(stable),
        issued_at=at(1.0),
        issuer="tests",
    )


def rollout_spec(rollout_id: str, version: str, target: str = "tiny", **kw: Any) -> RolloutSpec:
    return RolloutSpec(
        rollout_id=rollout_id,
        target=target,
        desired=weights(version),
        strategy=Strategy(canary=1),
        issued_at=at(2.0),
        issuer="tests",
        **kw,
    )


def state(
    rollout_id: str,
    phase: ControlPhase,
    revision: int,
    *,
    wave: int = 0,
    gates: Sequence[GateResult] = (),
    code: str | None = None,
    target: str = "tiny",
) -> RolloutState:
    return RolloutState(
        rollout_id=rollout_id,
        target=target,
        revision=revision,
        phase=phase,
        waves=WAVES,
        wave=wave,
        gates=list(gates),
        previous=weights("v1"),
        code=code,
        message=f"{phase.value} at revision {revision}",
        started_at=at(3.0),
        updated_at=at(3.0 + revision),
        ended_at=at(3.0 + revision) if phase.terminal else None,
    )


def gate(wave: int, name: str = "health", passed: bool = True) -> GateResult:
    return GateResult(wave=wave, gate=name, passed=passed)


def feed_control(coordinator: Coordinator, *records: ControlRecord) -> None:
    """What the follower does with a fetch of the controller topic: fold, then tell listeners."""
    batch = Batch()
    for record in records:
        coordinator.control.observe(record)
        batch.control.append(record)
    for listener in coordinator.follower.listeners:
        listener(batch)


@pytest.fixture
def targets(coordinator: Coordinator) -> None:
    """w1..w3 (model=tiny) alive on v2. Target tiny: stable v1, then r-done made v2 stable;
    r-bad (v3) was rolled back at its canary's probe gate. Target empty: no stable state."""
    feed(coordinator, *(heartbeat(w, 9.0, version="v2") for w in ("w1", "w2", "w3")))
    feed_control(
        coordinator,
        target_spec(),
        target_spec("empty", stable=None, model="none"),
        rollout_spec("r-done", "v2"),
        state("r-done", ControlPhase.SUCCEEDED, 5, wave=2, gates=[gate(0), gate(1)]),
        rollout_spec("r-bad", "v3"),
        state(
            "r-bad",
            ControlPhase.ROLLED_BACK,
            4,
            gates=[gate(0), gate(0, "probe", passed=False)],
            code="GATE_FAILED",
        ),
    )


# --------------------------------------------------------------------------- reads


async def test_targets_show_desired_against_actual_with_history_and_rollouts(
    client: httpx.AsyncClient, targets: None
) -> None:
    listed = (await client.get("/api/v1/targets")).json()
    assert [t["name"] for t in listed] == ["empty", "tiny"]
    tiny = listed[1]
    assert (tiny["stable_version"], tiny["workers"], tiny["at_stable"]) == ("v2", 3, 3)
    assert tiny["rollout"] is None and tiny["drifting"] == 0
    assert {m["alignment"] for m in tiny["members"]} == {"in_sync"}

    one = (await client.get("/api/v1/targets/tiny")).json()
    assert {k: v for k, v in one.items() if k not in ("history", "rollouts")} == tiny
    assert [(e["desired"]["weights"]["version"], e["rollout_id"]) for e in one["history"]] == [
        ("v1", None),
        ("v2", "r-done"),
    ]
    assert [(r["rollout_id"], r["phase"], r["code"]) for r in one["rollouts"]] == [
        ("r-done", "succeeded", None),
        ("r-bad", "rolled_back", "GATE_FAILED"),
    ]


async def test_38_of_40_updated_and_2_killed_shows_38_in_sync_and_2_lost(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    """The issue's case: after a rollout to v2 where 2 of 40 workers were killed, the 38 that
    applied it are in sync (not red), the 2 dead ones lost (not "in sync")."""
    alive = [f"w{i:02d}" for i in range(38)]
    feed(coordinator, *(heartbeat(w, 9.0, version="v2") for w in alive))
    feed(coordinator, heartbeat("w38", -100.0), heartbeat("w39", -100.0))  # killed on v1
    feed_control(
        coordinator,
        target_spec(),
        rollout_spec("r-38", "v2"),
        state("r-38", ControlPhase.SUCCEEDED, 3, wave=2, gates=[gate(0), gate(1)]),
    )
    tiny = (await client.get("/api/v1/targets/tiny")).json()
    counts = {k: tiny[k] for k in ("workers", "at_stable", "drifting", "lost", "updating")}
    assert (tiny["stable_version"], counts) == (
        "v2",
        {"workers": 38, "at_stable": 38, "drifting": 0, "lost": 2, "updating": 0},
    )
    members = {m["worker_id"]: m for m in tiny["members"]}
    assert {members[w]["alignment"] for w in alive} == {"in_sync"}
    assert [(members[w]["alignment"], members[w]["reported_version"]) for w in ("w38", "w39")] == [
        ("lost", "v1"),
        ("lost", "v1"),
    ]
    # the dashboard's source agrees: desired is the target's, not the last classic rollout's
    workers = {w["worker_id"]: w for w in (await client.get("/api/v1/workers")).json()}
    assert {(w["target"], w["desired_version"], w["in_sync"]) for w in workers.values()} >= {
        ("tiny", "v2", True)
    }
    assert all(workers[w]["in_sync"] and workers[w]["alive"] for w in alive)
    assert [(workers[w]["in_sync"], workers[w]["alive"]) for w in ("w38", "w39")] == [
        (False, False),
        (False, False),
    ]


async def test_a_rollout_in_progress_shows_on_its_target(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None
) -> None:
    feed_control(coordinator, rollout_spec("r-live", "v4"))
    pending = (await client.get("/api/v1/targets/tiny")).json()["rollout"]
    assert (pending["rollout_id"], pending["phase"]) == ("r-live", None)
    feed_control(coordinator, state("r-live", ControlPhase.PROGRESSING, 1))
    live = (await client.get("/api/v1/targets/tiny")).json()
    assert live["rollout"]["phase"] == "progressing" and live["rollout"]["waves"] == 2
    # The canary's wave is in progress: w1 is the rollout's, w2 and w3 stay on stable.
    members = {m["worker_id"]: m for m in live["members"]}
    assert members["w1"]["desired_version"] is None and members["w1"]["alignment"] == "updating"
    assert members["w2"]["desired_version"] == "v2" and members["w2"]["alignment"] == "in_sync"


async def test_progressive_rollouts_with_waves_gates_actions_and_exit_codes(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None
) -> None:
    abort = RolloutAction(
        rollout_id="r-other",
        action_id="abort-1",
        action=ActionKind.ABORT,
        rollback=False,
        reason="wrong model",
        issued_at=at(4.0),
        issuer="tests",
    )
    feed_control(
        coordinator,
        target_spec("other", model="other"),
        rollout_spec("r-other", "v9", "other"),
        abort,
    )
    listed = (await client.get("/api/v1/progressive-rollouts")).json()
    assert [r["rollout_id"] for r in listed] == ["r-other", "r-bad", "r-done"]
    by_target = await client.get("/api/v1/progressive-rollouts", params={"target": "tiny"})
    assert [r["rollout_id"] for r in by_target.json()] == ["r-bad", "r-done"]
    limited = await client.get("/api/v1/progressive-rollouts", params={"limit": 1})
    assert [r["rollout_id"] for r in limited.json()] == ["r-other"]

    bad = (await client.get("/api/v1/progressive-rollouts/r-bad")).json()
    assert (bad["phase"], bad["ended"], bad["code"], bad["exit_code"]) == (
        "rolled_back",
        True,
        "GATE_FAILED",
        8,
    )
    assert [(w["index"], w["workers"], w["passed"], w["current"]) for w in bad["waves"]] == [
        (0, ["w1"], False, False),
        (1, ["w2", "w3"], False, False),
    ]
    assert [(g["gate"], g["passed"]) for g in bad["waves"][0]["gates"]] == [
        ("health", True),
        ("probe", False),
    ]
    assert bad["spec"]["desired"]["weights"]["version"] == "v3"
    assert bad["state"]["revision"] == 4 and bad["state"]["previous"]["weights"]["version"] == "v1"

    done = (await client.get("/api/v1/progressive-rollouts/r-done")).json()
    assert (done["phase"], done["exit_code"]) == ("succeeded", 0)
    assert [w["passed"] for w in done["waves"]] == [True, True]

    pending = (await client.get("/api/v1/progressive-rollouts/r-other")).json()
    assert (pending["phase"], pending["ended"], pending["exit_code"], pending["waves"]) == (
        None,
        False,
        None,
        [],
    )
    assert pending["message"] == "waiting for a controller"
    assert [(a["action"], a["rollback"], a["reason"]) for a in pending["actions"]] == [
        ("abort", False, "wrong model")
    ]


async def test_unknown_targets_and_rollouts_are_404_with_their_codes(
    client: httpx.AsyncClient, targets: None
) -> None:
    for path, code in [
        ("/api/v1/targets/nope", "TARGET_UNKNOWN"),
        ("/api/v1/progressive-rollouts/nope", "ROLLOUT_UNKNOWN"),
        ("/api/v1/progressive-rollouts/nope/events", "ROLLOUT_UNKNOWN"),
    ]:
        r = await client.get(path)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == code


async def test_every_route_waits_until_the_log_is_read(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None
) -> None:
    coordinator.follower.caught_up.clear()
    for method, path in [*READS, *WRITES]:
        r = await client.request(method, path, headers=AUTH, json={})
        assert r.status_code == 503 and r.json()["error"]["code"] == "NOT_READY", path
    for method, path in WRITES:  # the token first: nothing is said to a caller without it
        r = await client.request(method, path, json={})
        assert r.status_code == 401, path


# --------------------------------------------------------------------------- the controller


async def test_the_controller_says_whether_it_leads_and_who_leads_as_the_log_says(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    body = (await client.get("/api/v1/controller")).json()
    assert body["enabled"] is True and body["leading"] is False and body["generation"] is None
    assert body["leader"] is None and body["fenced"] == 0 and body["decisions"] == 0
    assert coordinator.controller is not None
    assert body["member"] == coordinator.controller.member

    leader = LeaderRecord(member="other-7", generation=4, producer_epoch=2, since=at(5.0))
    feed_control(coordinator, leader)
    body = (await client.get("/api/v1/controller")).json()
    assert body["leading"] is False  # another coordinator leads
    assert (body["leader"]["member"], body["leader"]["generation"]) == ("other-7", 4)

    coordinator.controller.leading = 5  # this one took over (what its loop sets once elected)
    coordinator.controller.fenced = 1
    coordinator.controller.last_error = "CONTROLLER_FENCED: generation 3"
    body = (await client.get("/api/v1/controller")).json()
    assert (body["leading"], body["generation"], body["fenced"]) == (True, 5, 1)
    assert body["last_error"].startswith("CONTROLLER_FENCED")


async def test_a_coordinator_without_a_controller_still_shows_the_leader(
    coordinator: Coordinator,
) -> None:
    settings = coordinator.settings.model_copy(update={"controller": False})
    replica = Coordinator(settings)
    replica.follower.caught_up.set()
    try:
        feed_control(replica, LeaderRecord(member="m", generation=1, producer_epoch=0, since=at(1)))
        transport = httpx.ASGITransport(app=create_app(replica))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            body = (await c.get("/api/v1/controller")).json()
        assert (body["enabled"], body["leading"], body["member"]) == (False, False, None)
        assert body["leader"]["member"] == "m"
    finally:
        await replica.stop()


# --------------------------------------------------------------------------- writes: refusals

READS = [
    ("GET", "/api/v1/targets"),
    ("GET", "/api/v1/targets/tiny"),
    ("GET", "/api/v1/progressive-rollouts"),
    ("GET", "/api/v1/progressive-rollouts/r-done"),
    ("GET", "/api/v1/progressive-rollouts/r-done/events"),
    ("GET", "/api/v1/controller"),
]
WRITES = [
    ("PUT", "/api/v1/targets/tiny"),
    ("POST", "/api/v1/targets/tiny/rollouts"),
    ("POST", "/api/v1/targets/tiny/undo"),
    *(("POST", f"/api/v1/progressive-rollouts/r-done/{a.value}") for a in ActionKind),
]
START = {"desired": {"weights": {"path": "/ckpt/model.safetensors", "version": "v5"}}}


@pytest.mark.parametrize(("method", "path"), WRITES)
async def test_every_write_needs_the_token(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None, method: str, path: str
) -> None:
    # An invalid body too: the token is checked before anything is parsed.
    for headers, error in [
        ({}, None),
        ({"Authorization": "Bearer wrong"}, "invalid_token"),
        ({"Authorization": f"Basic {TOKEN}"}, None),
    ]:
        r = await client.request(method, path, content=b"{not json", headers=headers)
        assert r.status_code == 401, (path, headers)
        assert r.json()["error"]["code"] == "UNAUTHORIZED"
        challenge = r.headers["www-authenticate"]
        assert (f'error="{error}"' in challenge) == (error is not None)

    settings = coordinator.settings.model_copy(update={"api_token": None})
    tokenless = Coordinator(settings)
    tokenless.follower.caught_up.set()
    try:
        transport = httpx.ASGITransport(app=create_app(tokenless))
        async with httpx.AsyncClient(transport=transport, base_url="http://c") as c:
            r = await c.request(method, path, json=START, headers=AUTH)
        assert r.status_code == 403 and r.json()["error"]["code"] == "WRITES_DISABLED"
    finally:
        await tokenless.stop()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        # The CLI's refusals, with the same codes.
        ("POST", "/api/v1/targets/nope/rollouts", START, 404, "TARGET_UNKNOWN"),
        ("POST", "/api/v1/targets/busy/rollouts", START, 409, "TARGET_BUSY"),
        ("POST", "/api/v1/targets/queued/rollouts", START, 409, "TARGET_BUSY"),
        (
            "POST",
            "/api/v1/targets/tiny/rollouts",
            {**START, "rollout_id": "r-bad"},
            409,
            "ROLLOUT_EXISTS",
        ),
        ("POST", "/api/v1/targets/nope/undo", None, 404, "TARGET_UNKNOWN"),
        ("POST", "/api/v1/targets/empty/undo", None, 409, "ROLLBACK_UNAVAILABLE"),
        ("POST", "/api/v1/targets/busy/undo", {}, 409, "TARGET_BUSY"),
        ("POST", "/api/v1/progressive-rollouts/nope/pause", None, 404, "ROLLOUT_UNKNOWN"),
        ("POST", "/api/v1/progressive-rollouts/r-done/promote", None, 409, "ROLLOUT_ENDED"),
        ("POST", "/api/v1/progressive-rollouts/r-bad/abort", {"reason": "x"}, 409, "ROLLOUT_ENDED"),
        # Bodies: strict, as the controller topic's records are.
        ("POST", "/api/v1/targets/tiny/rollouts", b"{not json", 400, "MALFORMED_JSON"),
        ("POST", "/api/v1/targets/tiny/rollouts", {"desired": {}}, 422, "SCHEMA_INVALID"),
        (
            "POST",
            "/api/v1/targets/tiny/rollouts",
            {**START, "strategy": {"steps": ["50%"]}},
            422,
            "SCHEMA_INVALID",
        ),
        (
            "POST",
            "/api/v1/targets/tiny/rollouts",
            {**START, "colour": "red"},
            422,
            "SCHEMA_INVALID",
        ),
        (
            "POST",
            "/api/v1/targets/tiny/rollouts",
            {**START, "rollout_id": "bad id!"},
            422,
            "SCHEMA_INVALID",
        ),
        (
            "POST",
            "/api/v1/targets/tiny/rollouts",
            {**START, "rollback": "yes"},
            422,
            "SCHEMA_INVALID",
        ),
        ("PUT", "/api/v1/targets/tiny", {"selector": {}}, 422, "SCHEMA_INVALID"),
        ("PUT", "/api/v1/targets/tiny", b"", 400, "MALFORMED_JSON"),
        ("PUT", "/api/v1/targets/bad%20name!", {"selector": {"a": "b"}}, 422, "SCHEMA_INVALID"),
        (
            "POST",
            "/api/v1/progressive-rollouts/live/abort",
            {"rollback": "no"},
            422,
            "SCHEMA_INVALID",
        ),
        (
            "POST",
            "/api/v1/progressive-rollouts/live/pause",
            {"action_id": "a b"},
            422,
            "SCHEMA_INVALID",
        ),
        ("POST", "/api/v1/progressive-rollouts/live/resume", b"[]", 422, "SCHEMA_INVALID"),
        (
            "POST",
            "/api/v1/progressive-rollouts/live/promote",
            b"x" * 2_000_000,
            413,
            "MESSAGE_TOO_LARGE",
        ),
    ],
)
async def test_refused_writes_say_why_with_a_code(
    coordinator: Coordinator,
    client: httpx.AsyncClient,
    targets: None,
    method: str,
    path: str,
    body: dict[str, Any] | bytes | None,
    status: int,
    code: str,
) -> None:
    feed_control(
        coordinator,
        target_spec("busy", stable="v0", model="busy"),
        target_spec("busy", model="busy"),  # v1 stable after v0: undo has somewhere to go
        rollout_spec("live", "v4", "busy"),
        state("live", ControlPhase.PROGRESSING, 1, target="busy"),
        target_spec("queued", model="queued"),
        rollout_spec("r-queued", "v4", "queued"),  # requested, not started by a controller yet
    )
    content = body if isinstance(body, bytes) else None if body is None else json.dumps(body)
    r = await client.request(method, path, content=content, headers=AUTH)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code
    if code == "TARGET_BUSY":
        assert "live" in error["message"] or "r-queued" in error["message"]
    if code == "SCHEMA_INVALID" and body != b"":
        assert error["details"], error


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (LocalCode.TARGET_UNKNOWN, 404),
        (LocalCode.ROLLOUT_UNKNOWN, 404),
        (LocalCode.TARGET_BUSY, 409),
        (LocalCode.ROLLOUT_EXISTS, 409),
        (LocalCode.ROLLOUT_ENDED, 409),
        (LocalCode.ROLLBACK_UNAVAILABLE, 409),
        (LocalCode.NO_MATCHING_WORKERS, 409),
        (LocalCode.PUBLISH_OUTCOME_UNKNOWN, 504),
        (LocalCode.SETTINGS_INVALID, 400),
    ],
)
def test_domain_codes_map_to_http_statuses(code: LocalCode, status: int) -> None:
    error = from_domain(ControlPlaneError("no", code=code))
    assert (error.status, error.info.code) == (status, code.value)


async def test_openapi_documents_the_progressive_routes_and_their_bodies(
    client: httpx.AsyncClient,
) -> None:
    doc = (await client.get("/openapi.json")).json()
    paths = doc["paths"]
    assert {m.upper() for m in paths["/api/v1/targets/{name}"]} == {"GET", "PUT"}
    for action in ActionKind:
        post = paths[f"/api/v1/progressive-rollouts/{{rollout_id}}/{action.value}"]["post"]
        assert {"202", "401", "403", "404", "409"} <= post["responses"].keys()
    start = paths["/api/v1/targets/{name}/rollouts"]["post"]
    assert start["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/RolloutStartRequest"
    )
    schemas = doc["components"]["schemas"]
    assert {"RolloutStartRequest", "TargetRequest", "AbortRequest", "Strategy", "Desired"} <= (
        schemas.keys()
    )
    assert "HTTPValidationError" not in json.dumps(paths)


# --------------------------------------------------------------------------- SSE


async def test_events_of_an_ended_rollout_are_its_state_its_wave_then_end(
    client: httpx.AsyncClient, targets: None
) -> None:
    r = await client.get("/api/v1/progressive-rollouts/r-bad/events")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e for e, _ in events] == ["state", "wave", "end"]
    assert json.loads(events[0][1])["phase"] == "rolled_back"
    wave = json.loads(events[1][1])
    assert (wave["wave"], wave["waves"], wave["phase"]) == (0, 2, "rolled_back")
    assert [(g["gate"], g["passed"]) for g in wave["gates"]] == [("health", True), ("probe", False)]
    assert json.loads(events[2][1]) == {
        "rollout_id": "r-bad",
        "phase": "rolled_back",
        "code": "GATE_FAILED",
        "exit_code": 8,
    }


@pytest.fixture
async def served(
    coordinator: Coordinator, app: FastAPI, targets: None
) -> AsyncIterator[httpx.AsyncClient]:
    async with (
        ApiServer(coordinator, port=0, app=app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as c,
    ):
        yield c


class Events:
    """An SSE stream read event by event, as they come."""

    def __init__(self, lines: AsyncIterator[str]) -> None:
        self.lines = lines

    async def next(self) -> tuple[str, dict[str, Any]]:
        name = None
        async with asyncio.timeout(10):
            async for line in self.lines:
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: ") and name is not None:
                    return name, json.loads(line.removeprefix("data: "))
        raise AssertionError("the stream ended")

    async def names(self, count: int) -> list[str]:
        return [(await self.next())[0] for _ in range(count)]


async def test_events_follow_waves_and_gates_until_the_end(
    coordinator: Coordinator, served: httpx.AsyncClient
) -> None:
    feed_control(coordinator, rollout_spec("r-live", "v4"))
    path = "/api/v1/progressive-rollouts/r-live/events"
    async with served.stream("GET", path) as stream:
        events = Events(stream.aiter_lines())
        name, pending = await events.next()
        assert (name, pending["phase"]) == ("state", None)  # no wave before a controller starts

        feed_control(coordinator, state("r-live", ControlPhase.PROGRESSING, 1))
        assert await events.names(2) == ["state", "wave"]  # wave 0 started

        # A new batch within the wave: the state changed, the wave did not.
        moved = state("r-live", ControlPhase.PROGRESSING, 2).model_copy(update={"batch": 1})
        feed_control(coordinator, moved)
        name, body = await events.next()
        assert (name, body["state"]["batch"]) == ("state", 1)

        feed_control(coordinator, state("r-live", ControlPhase.PROGRESSING, 3, gates=[gate(0)]))
        name, body = await events.next()
        assert [(w["passed"], w["current"]) for w in body["waves"]] == [
            (True, True),  # its gates passed: it waits at its boundary
            (False, False),
        ]
        name, wave = await events.next()
        assert (name, wave["wave"], len(wave["gates"])) == ("wave", 0, 1)  # a gate result

        gates = [gate(0), gate(0, "agreement")]
        feed_control(coordinator, state("r-live", ControlPhase.PAUSED, 4, wave=1, gates=gates))
        assert await events.names(1) == ["state"]
        name, wave = await events.next()
        assert (name, wave["wave"], wave["phase"]) == ("wave", 1, "paused")

        gates = [*gates, gate(1)]
        feed_control(coordinator, state("r-live", ControlPhase.SUCCEEDED, 5, wave=2, gates=gates))
        assert await events.names(2) == ["state", "wave"]
        name, end = await events.next()
        assert (name, end) == (
            "end",
            {"rollout_id": "r-live", "phase": "succeeded", "code": None, "exit_code": 0},
        )
        rest = [line async for line in events.lines if line.startswith("event:")]
        assert rest == []  # the server closed the stream


async def test_news_that_changes_nothing_sends_nothing(
    coordinator: Coordinator, served: httpx.AsyncClient
) -> None:
    feed_control(
        coordinator, rollout_spec("r-live", "v4"), state("r-live", ControlPhase.PROGRESSING, 1)
    )
    async with served.stream("GET", "/api/v1/progressive-rollouts/r-live/events") as stream:
        events = Events(stream.aiter_lines())
        assert await events.names(2) == ["state", "wave"]
        # The same state read twice (the controller's own write read back), heartbeats.
        feed_control(coordinator, state("r-live", ControlPhase.PROGRESSING, 1))
        feed(coordinator, heartbeat("w1", 9.5, version="v2"))
        await wait_for(lambda: coordinator.backlog == 0)
        # A phase that changes, wave and gates the same: a state, no wave.
        feed_control(coordinator, state("r-live", ControlPhase.ROLLED_BACK, 2, code="X"))
        assert await events.names(2) == ["state", "end"]


async def test_a_client_too_slow_for_the_change_feed_gets_a_resync_then_the_state(
    coordinator: Coordinator, served: httpx.AsyncClient
) -> None:
    feed_control(
        coordinator, rollout_spec("r-live", "v4"), state("r-live", ControlPhase.PROGRESSING, 1)
    )
    async with served.stream("GET", "/api/v1/progressive-rollouts/r-live/events") as stream:
        events = Events(stream.aiter_lines())
        assert await events.names(2) == ["state", "wave"]
        await wait_for(lambda: coordinator.subscribers == 1)
        for i in range(SUBSCRIBER_QUEUE * 3):  # faster than it reads: its queue stays bounded
            feed(coordinator, heartbeat("w1", 9.1 + i / 1000, version="v2"))
            assert coordinator.backlog <= SUBSCRIBER_QUEUE
        # The changes it missed were dropped: the full state again, even if unchanged.
        assert await events.names(2) == ["resync", "state"]
        feed_control(coordinator, state("r-live", ControlPhase.SUCCEEDED, 2, wave=2))
        assert await events.names(3) == ["state", "wave", "end"]


async def test_events_wait_for_a_rollout_just_requested(
    coordinator: Coordinator, client: httpx.AsyncClient, targets: None
) -> None:
    stream = asyncio.create_task(
        client.get("/api/v1/progressive-rollouts/r-later/events", params={"wait_s": 10})
    )
    await wait_for(lambda: coordinator.subscribers == 1)  # it is waiting
    feed_control(
        coordinator, rollout_spec("r-later", "v4"), state("r-later", ControlPhase.REJECTED, 1)
    )
    r = await asyncio.wait_for(stream, 10)
    assert r.status_code == 200
    names = [e for e, _ in sse_events(r.text)]
    assert names[-1] == "end" and json.loads(sse_events(r.text)[-1][1])["exit_code"] == 3


async def test_events_end_when_the_server_stops(
    coordinator: Coordinator, app: FastAPI, targets: None
) -> None:
    feed_control(
        coordinator, rollout_spec("r-live", "v4"), state("r-live", ControlPhase.PROGRESSING, 1)
    )
    async with (
        ApiServer(coordinator, port=0, app=app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=10) as c,
        c.stream("GET", "/api/v1/progressive-rollouts/r-live/events") as stream,
    ):
        events = Events(stream.aiter_lines())
        assert await events.names(2) == ["state", "wave"]
        await server.stop()
        rest = [line async for line in events.lines if line.startswith("event:")]
    assert rest == []
