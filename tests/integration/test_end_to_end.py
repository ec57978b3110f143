"""End to end, every part its own OS process: the session's Kafka broker, a coordinator, worker
agents with real models (torch on the CPU, torch_xla through PJRT_DEVICE=CPU), and the CLI.

Each CLI exit code is shown for a real cause: 0 a good reload, 1 a checkpoint every worker
refuses, 2 a reload that outlasts the command's TTL, 3 no matching worker, 4 no broker. A command
written by a plain Kafka producer is tracked like any other, and a coordinator killed in the
middle of a rollout is replaced by one that reports exactly the same statuses.

The fleet (coordinator and workers) starts once for the module, on its own topic prefix; the
tests run in file order and each leaves the fleet idle. Process logs go to files; their tails
are printed when a test fails. The processes and how the fleet starts: tests/e2e.py.
"""

from __future__ import annotations

import asyncio
import json
import signal
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import AIOKafkaProducer

from tests import e2e
from tests.e2e import JSON, Fleet, minus_as_of, report
from tests.factories import free_port, tail

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.fixture(scope="module")
def fleet(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Fleet]:
    yield from e2e.start_fleet(kafka_bootstrap, tmp_path_factory, request)


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """When the test fails, print the tail of every process log of the module's fleet."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before or "fleet" not in request.fixturenames:
        return
    fleet: Fleet = request.getfixturevalue("fleet")
    logs = sorted(fleet.root.glob("*.log"))
    for log in logs:
        report(request, f"\n==== {log.name} (last lines)\n{tail(log, 25)}")


def test_each_worker_runs_the_runner_it_was_given(fleet: Fleet) -> None:
    """The XLA worker reports the xla runner on an XLA device (torch_xla on PJRT's CPU)."""
    views = {w["worker_id"]: w["heartbeat"] for w in fleet.api("/api/v1/workers")}
    assert views["xla-c"]["runner"] == "xla"
    assert views["xla-c"]["device"].startswith("xla") and "(CPU)" in views["xla-c"]["device"]
    assert {views[w]["runner"] for w in ("torch-a", "torch-b")} == {"torch"}
    assert all(views[w]["degraded"] is None for w in fleet.main_ids)


# --------------------------------------------------------------------------- exit code 0


def test_good_reload_succeeds_on_every_worker_and_they_report_the_new_version(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    path = fleet.checkpoints["good"]
    assert path.name == "model.safetensors.index.json"  # sharded: two files and an index
    result = fleet.reload(
        path,
        "v-e2e-1",
        "model=tiny",
        "--wait-timeout",
        "90",
        "--ttl",
        "300",
        "--timeout",
        "120",
        "--json",
    )
    assert result.rc == 0, str(result)
    status = result.json()
    assert status["phase"] == "succeeded" and status["exit_code"] == 0
    assert status["expected"] == 3
    assert status["counts"]["succeeded"] == 3
    assert {w["worker_id"] for w in status["workers"]} == set(fleet.main_ids)
    assert {w["weights_version"] for w in status["workers"]} == {"v-e2e-1"}
    report(
        request,
        f"[e2e] reload on 3 workers: publish -> succeeded {status['duration_s']:.3f}s "
        f"(status duration_s); CLI wall time {result.wall_s:.2f}s; per worker "
        + ", ".join(f"{w['worker_id']} {w['duration_s']:.3f}s" for w in status["workers"]),
    )

    def versions_reported() -> dict[str, str | None] | None:
        versions = fleet.worker_versions()
        ours = {wid: versions.get(wid) for wid in fleet.main_ids}
        return ours if set(ours.values()) == {"v-e2e-1"} else None

    fleet.until(versions_reported, 30, "`workers --json` reports v-e2e-1 for the three workers")
    # The coordinator agrees, and says the workers are at the desired level.
    assert fleet.api(f"/api/v1/rollouts/{status['rollout_id']}")["phase"] == "succeeded"
    levels = {w["worker_id"]: w for w in fleet.api("/api/v1/workers")}
    for wid in fleet.main_ids:
        assert levels[wid]["desired_version"] == "v-e2e-1"
        assert levels[wid]["reported_version"] == "v-e2e-1"


# --------------------------------------------------------------------------- exit code 1


def test_broken_checkpoint_is_rejected_everywhere_and_versions_stay(fleet: Fleet) -> None:
    before = fleet.worker_versions()
    assert all(before[wid] is not None for wid in fleet.main_ids)
    result = fleet.reload(
        fleet.checkpoints["shape"], "v-broken", "model=tiny", "--wait-timeout", "90", "--json"
    )
    assert result.rc == 1, str(result)
    status = result.json()
    assert status["phase"] == "failed" and status["reason"] == "WORKERS_FAILED"
    assert status["expected"] == 3
    assert status["counts"]["succeeded"] == 0
    for worker in status["workers"]:
        assert worker["state"] in ("rejected", "failed"), worker
        assert worker["error"]["code"] == "WEIGHTS_SHAPE_MISMATCH", worker
        assert worker["weights_version"] == before[worker["worker_id"]], worker
    after = fleet.worker_versions()
    assert {wid: after[wid] for wid in fleet.main_ids} == {
        wid: before[wid] for wid in fleet.main_ids
    }


# --------------------------------------------------------------------------- exit code 2


def test_reload_that_outlasts_its_ttl_times_out(fleet: Fleet) -> None:
    result = fleet.reload(
        fleet.checkpoints["good"],
        "v-late",
        "role=ttl",
        "--ttl",
        "2",
        "--wait-timeout",
        "60",
        "--json",
    )
    assert result.rc == 2, str(result)
    status = result.json()
    assert status["phase"] == "timed_out" and status["reason"] == "EXPIRED"
    assert status["expected"] == 1
    (worker,) = status["workers"]
    assert worker["worker_id"] == "slow-ttl" and worker["state"] == "running"
    assert status["finished_at"] == status["expires_at"]

    # The worker finishes after the deadline: shown as a late state, the phase does not move.
    def late() -> JSON | None:
        now = fleet.rollout(status["rollout_id"])
        assert now is not None
        return now if now["workers"][0]["late_state"] == "succeeded" else None

    settled = fleet.until(late, 30, "the late success is visible")
    assert settled["phase"] == "timed_out"
    rc, from_log = fleet.cli_status(status["rollout_id"])
    assert rc == 2
    assert minus_as_of(from_log) == minus_as_of(settled)


# --------------------------------------------------------------------------- exit codes 3 and 4


def test_no_matching_worker_is_invalid_input(fleet: Fleet) -> None:
    result = fleet.reload(fleet.checkpoints["good"], "v-nobody", "model=nobody-runs-this")
    assert result.rc == 3, str(result)
    assert "NO_MATCHING_WORKERS" in result.stderr
    assert result.stdout.strip() == ""  # nothing was published


def test_unreachable_broker(fleet: Fleet) -> None:
    closed = free_port()  # bound and released: nothing listens there
    result = fleet.reload(
        fleet.checkpoints["good"],
        "v-nowhere",
        "model=tiny",
        "--bootstrap",
        f"127.0.0.1:{closed}",
        "--topic-prefix",
        fleet.prefix,
        kafka=False,
        timeout=90,
    )
    assert result.rc == 4, str(result)
    assert "BROKER_UNAVAILABLE" in result.stderr


# --------------------------------------------------------------------------- any Kafka client


def test_command_from_a_plain_kafka_producer_is_rolled_out_and_tracked(fleet: Fleet) -> None:
    """What kcat would send: a JSON object, no key, a labels-only selector, not our code."""
    now = datetime.now(UTC).replace(microsecond=0)
    rollout_id = f"r-kcat-{uuid.uuid4().hex[:8]}"
    command = {
        "schema_version": 1,
        "command_id": f"{rollout_id}.c1",
        "rollout_id": rollout_id,
        "issued_at": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "expires_at": (now + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "issuer": "kcat@ci",
        "selector": {"labels": {"model": "tiny"}},
        "spec": {
            "kind": "reload_weights",
            "path": str(fleet.checkpoints["kcat"]),
            "version": "v-kcat",
        },
    }

    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=fleet.bootstrap, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(
                f"{fleet.prefix}.commands", json.dumps(command).encode("utf-8")
            )
        finally:
            await producer.stop()

    asyncio.run(produce())
    status = fleet.terminal_rollout(rollout_id, timeout=90)
    assert status["phase"] == "succeeded", status
    assert status["expected"] == 3 and status["counts"]["succeeded"] == 3
    assert {w["worker_id"] for w in status["workers"]} == set(fleet.main_ids)
    assert status["selector"] == {"worker_ids": None, "labels": {"model": "tiny"}}
    listed = {s["rollout_id"]: s for s in fleet.api("/api/v1/rollouts")}
    assert listed[rollout_id]["phase"] == "succeeded"
    rc, from_log = fleet.cli_status(rollout_id)
    assert rc == 0
    assert minus_as_of(from_log) == minus_as_of(fleet.api(f"/api/v1/rollouts/{rollout_id}"))
    fleet.until(
        lambda: {fleet.worker_versions()[w] for w in fleet.main_ids} == {"v-kcat"},
        30,
        "the workers report v-kcat",
    )


# --------------------------------------------------------------------------- coordinator restart


def test_coordinator_restarted_mid_rollout_reports_the_same_status(fleet: Fleet) -> None:
    # What the first coordinator says about every rollout that has ended.
    ended_before = {
        s["rollout_id"]: minus_as_of(s)
        for s in fleet.api("/api/v1/rollouts")
        if s["exit_code"] is not None
    }
    assert len(ended_before) >= 3, sorted(ended_before)
    # (list items are summaries, counts only: the full statuses, workers included, too)
    full_before = {rid: minus_as_of(fleet.api(f"/api/v1/rollouts/{rid}")) for rid in ended_before}
    rollout_id = f"r-restart-{uuid.uuid4().hex[:8]}"
    waiter = fleet.cli_background(
        "cli-wait-restart",
        "reload-weights",
        str(fleet.checkpoints["good"]),
        "--version",
        "v-restart",
        "-s",
        "role=restart",
        "--rollout-id",
        rollout_id,
        "--ttl",
        "300",
        "--wait",
        "--wait-timeout",
        "120",
        "--json",
    )
    try:

        def running() -> JSON | None:
            status = fleet.rollout(rollout_id)
            if status is None or status["phase"] != "progressing":
                return None
            return status if status["counts"]["running"] == 1 else None

        seen_by_first = fleet.until(running, 60, "the slow rollout is running")
        assert fleet.coordinator.kill() == -signal.SIGKILL
        fleet.start_coordinator()  # same settings, same port, nothing but the log to go on
        second_phase = fleet.api(f"/api/v1/rollouts/{rollout_id}")["phase"]
        final = fleet.terminal_rollout(rollout_id, timeout=90)
        assert waiter.wait(60) == 0, tail(waiter.log, 25)
    finally:
        waiter.kill()
    assert final["phase"] == "succeeded", final
    assert second_phase in ("progressing", "succeeded")

    # The second coordinator, the CLI computing from the log, and the CLI that waited all agree.
    rc, from_log = fleet.cli_status(rollout_id)
    assert rc == 0
    assert minus_as_of(from_log) == minus_as_of(final)
    assert waiter.out is not None
    waited = json.loads(waiter.out.read_text())
    assert minus_as_of(waited) == minus_as_of(final)
    # What the first coordinator saw of it has not changed.
    for key in ("command_id", "issued_at", "expires_at", "selector", "expected", "started_at"):
        assert final[key] == seen_by_first[key], key
    (worker,) = final["workers"]
    assert worker["started_at"] == seen_by_first["workers"][0]["started_at"]
    assert worker["weights_version"] == "v-restart"

    # Every rollout that ended before the restart reads exactly as it did.
    ended_after = {
        s["rollout_id"]: minus_as_of(s)
        for s in fleet.api("/api/v1/rollouts")
        if s["rollout_id"] in ended_before
    }
    assert ended_after == ended_before
    for rid, before in ended_before.items():
        assert minus_as_of(fleet.api(f"/api/v1/rollouts/{rid}/summary")) == before, rid
    for rid, before in full_before.items():
        assert minus_as_of(fleet.api(f"/api/v1/rollouts/{rid}")) == before, rid
