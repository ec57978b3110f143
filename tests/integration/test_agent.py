"""The worker agent against a real broker, with an in-test runner (the torch runners have their own tests)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.protocol.admin import DeleteGroupsRequest

from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, ControlPlaneError, RunnerError, WireCode
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
    decode_ack,
    utcnow,
)
from tests.factories import running_agent, weights_dir
from tests.fleet import (
    Tail,
    acks_tail,
    has_terminal,
    heartbeats_tail,
    latest,
    make_command,
    publish,
    settled,
    terminal,
    wait_for,
)
from workers.agent import loop as agent_module
from workers.agent.journal import WorkerState
from workers.agent.loop import Agent
from workers.agent.settings import WorkerSettings
from workers.runners.base import ReloadResult, RunnerDescription, config_digest

pytestmark = pytest.mark.kafka


class RecordingRunner:
    """A minimal real Runner: records what it applied; versions named bad-* are refused.

    ``delay_s``: each reload takes that long. ``gate``: each reload waits until it is set (the
    test decides when a reload ends). Either way a reload stops when cancelled.
    """

    name = "recording"

    def __init__(
        self,
        delay_s: float = 0.0,
        *,
        gate: threading.Event | None = None,
        load_error: Exception | None = None,
    ) -> None:
        self.delay_s = delay_s
        self.gate = gate
        self.load_error = load_error
        self.version: str | None = None
        self.config: dict[str, Any] = {"max_new_tokens": 16}
        self.applied: list[str] = []
        self.loaded = False
        self.closed = False

    def load(self) -> None:
        if self.load_error is not None:
            raise self.load_error
        self.loaded = True
        self.version = "init"

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        if not self.loaded:
            raise RunnerError("no model is loaded", code=WireCode.MODEL_NOT_LOADED)
        if spec.version.startswith("bad-"):
            raise RunnerError(
                "tensor w has shape [2] in the checkpoint, [3] in the model",
                code=WireCode.WEIGHTS_SHAPE_MISMATCH,
            )
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end or (self.gate is not None and not self.gate.is_set()):
            if cancel is not None and cancel.is_set():
                raise RunnerError("cancelled before copying", code=WireCode.COMMAND_TIMEOUT)
            time.sleep(0.01)
        self.applied.append(spec.version)
        self.version = spec.version
        return ReloadResult(spec.version, 1, 1, path.stat().st_size, 0.0, 0.0, self.delay_s, 0.0)

    def update_config(self, overrides: dict[str, Any]) -> RunnerDescription:
        if set(overrides) - {"max_new_tokens"}:
            raise RunnerError(
                f"unknown keys {sorted(overrides)}", code=WireCode.CONFIG_KEY_REJECTED
            )
        self.config.update(overrides)
        return self.describe()

    def describe(self) -> RunnerDescription:
        return RunnerDescription(
            runner=self.name,
            device="cpu",
            model_loaded=self.loaded,
            weights_version=self.version,
            config=dict(self.config),
            config_digest=config_digest(self.config),
            accepts={"max_new_tokens": "integer"},
        )

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return weights_dir(tmp_path)


async def acks_on_the_topic(kafka: KafkaSettings) -> list[Ack]:
    """Every ack on the acks topic now: read up to each partition's end offset."""
    topic = kafka.topics.acks.name
    out: list[Ack] = []
    async with Consumer(kafka) as consumer:
        await consumer.assign(topic)
        await consumer.seek_to_beginning()
        ends = await consumer.end_offsets(topic)
        position = await consumer.beginning_offsets(topic)
        deadline = time.monotonic() + 30
        while any(position[p] < ends[p] for p in ends):
            assert time.monotonic() < deadline, f"acks not read to {ends}: at {position}"
            for _, partition, records in await consumer.fetch_partitions(timeout_s=0.2):
                for record in records:
                    if record.value is not None:
                        out.append(decode_ack(record.value))
                    position[partition] = record.offset + 1
    return out


def reload(weights: Path, version: str, **kw: Any) -> Any:
    return make_command(
        ReloadWeightsSpec(path=str(weights / "model.safetensors"), version=version), **kw
    )


async def reloaded(
    kafka: KafkaSettings, tmp_path: Path, runner: RecordingRunner, weights: Path, version: str
) -> tuple[Tail, Command]:
    """An agent on ``runner`` is sent one reload to ``version`` and stopped once it is acked:
    the acks read until then, and the command."""
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, version)
        await settled(kafka, acks, cmd)
    return acks, cmd


async def test_reload_is_acked_through_every_state(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    acks, cmd = await reloaded(kafka, tmp_path, runner, weights, "v2")
    states = [a.state for a in acks.items if a.command_id == cmd.command_id]
    assert states == [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED]
    final = acks.items[-1]
    assert final.weights_version == "v2" and final.worker_id == "w1" and final.error is None
    assert final.result["bytes"] == 64
    assert final.timings.duration_s is not None
    assert runner.applied == ["v2"]


async def test_failed_reload_never_advances_the_version(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    acks, cmd = await reloaded(kafka, tmp_path, runner, weights, "bad-v3")
    (final,) = terminal(acks.items, cmd.command_id)
    assert final.state is AckState.REJECTED
    assert final.error is not None and final.error.code == "WEIGHTS_SHAPE_MISMATCH"
    assert final.weights_version == "init"


async def test_selector_filters_and_expiry_and_roots_reject(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(b"\0" * 8)
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        other = reload(weights, "v-other", selector=Selector(labels={"model": "llama"}))
        not_me = reload(weights, "v-not-me", selector=Selector(worker_ids=["w2"]))
        now = utcnow()
        expired = reload(
            weights,
            "v-old",
            issued_at=now - timedelta(minutes=5),
            expires_at=now - timedelta(minutes=1),
        )
        escape = make_command(
            ReloadWeightsSpec(path=str(weights / ".." / "elsewhere.safetensors"), version="v-x")
        )
        marker = reload(
            weights, "v-marker", selector=Selector(worker_ids=["w1"], labels={"model": "tiny"})
        )
        await publish(kafka, other, not_me, expired, escape, marker)
        await acks.until(has_terminal(marker.command_id))
    assert not [a for a in acks.items if a.command_id in (other.command_id, not_me.command_id)]
    (exp,) = terminal(acks.items, expired.command_id)
    assert exp.state is AckState.REJECTED and exp.error and exp.error.code == "EXPIRED"
    (esc,) = terminal(acks.items, escape.command_id)
    assert esc.state is AckState.REJECTED and esc.error and esc.error.code == "PATH_NOT_ALLOWED"
    assert runner.applied == ["v-marker"]


async def test_garbage_is_survived_and_next_command_applied(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with (
        running_agent(kafka, tmp_path, runner, max_message_bytes=64 * 1024),
        acks_tail(kafka) as acks,
    ):
        nack_me = (
            b'{"schema_version": 1, "command_id": "c-broken", "rollout_id": "r-broken", "spec": 42}'
        )
        good = reload(weights, "v5")
        await publish(
            kafka,
            b"\xff\xfe not json",
            b"[]",
            b'{"schema_version": 1, "command_id": "c-huge", "pad": "' + b"x" * 200_000 + b'"}',
            nack_me,
            b'{"schema_version": 99, "command_id": "c-future"}',
            good,
        )
        await acks.until(has_terminal(good.command_id))
    by_id = {a.command_id: a for a in acks.items if a.state.terminal}
    assert (
        by_id["c-broken"].state is AckState.REJECTED
        and by_id["c-broken"].error.code == "SCHEMA_INVALID"
    )
    assert by_id["c-broken"].rollout_id == "r-broken"
    assert by_id["c-future"].error.code == "UNSUPPORTED_SCHEMA_VERSION"
    assert by_id["c-huge"].error.code == "MESSAGE_TOO_LARGE"
    assert by_id[good.command_id].state is AckState.SUCCEEDED
    assert runner.applied == ["v5"]


async def delete_worker_group(kafka: KafkaSettings, worker_id: str) -> None:
    """Delete the worker's consumer group on the broker (its committed offset with it), as
    Kafka does when offsets expire on a quiet topic (``offsets.retention.minutes``)."""
    group = kafka.topics.worker_group(worker_id)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        node = await admin.find_coordinator(group)
        response = await admin._send_request(DeleteGroupsRequest([group]), node)
        assert [tuple(r) for r in response.results] == [(group, 0)]
    finally:
        await admin.close()
    async with Consumer(kafka, group_id=group) as probe:
        await probe.assign(kafka.topics.commands.name, [0])
        assert await probe.committed(kafka.topics.commands.name, 0) is None


async def test_duplicate_delivery_and_restart_apply_once(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    runner = RecordingRunner()
    cmd = reload(weights, "v7")
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, runner):
            await publish(kafka, cmd, cmd)  # the same command twice (a producer retry, a replay)
            first_marker = reload(weights, "v7b")
            await publish(kafka, first_marker)  # acks are in order: all of cmd's came before
            await acks.until(has_terminal(first_marker.command_id))
        assert len(terminal(acks.items, cmd.command_id)) == 1
        # While the worker is down its committed offset is deleted and a command is published:
        # it resumes from its local journal (the head of the log would skip the missed one).
        await delete_worker_group(kafka, "w1")
        missed = reload(weights, "v8")
        await publish(kafka, missed)
        second = RecordingRunner()
        caplog.clear()
        async with running_agent(kafka, tmp_path, second):
            marker = reload(weights, "v9")
            await publish(kafka, cmd, marker)
            await acks.until(has_terminal(marker.command_id))
    assert "(local state (committed offset expired))" in caplog.text
    assert runner.applied == ["v7", "v7b"]
    # v7b restored at start-up (level), then the missed command, then the marker; the replayed
    # v7 is a duplicate by its id in the journal and is not applied again.
    assert second.applied == ["v7b", "v8", "v9"]
    assert len(terminal(acks.items, cmd.command_id)) == 1
    (applied,) = terminal(acks.items, missed.command_id)
    assert applied.state is AckState.SUCCEEDED


async def test_update_config_acks_and_rejects_unknown_keys(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        ok = make_command(UpdateConfigSpec(overrides={"max_new_tokens": 4}))
        bad = make_command(UpdateConfigSpec(overrides={"nope": 1}))
        await publish(kafka, ok, bad)
        await acks.until(has_terminal(bad.command_id))
    (a,) = terminal(acks.items, ok.command_id)
    (b,) = terminal(acks.items, bad.command_id)
    assert a.state is AckState.SUCCEEDED and runner.config["max_new_tokens"] == 4
    assert b.state is AckState.REJECTED and b.error and b.error.code == "CONFIG_KEY_REJECTED"
    assert a.config_digest == b.config_digest  # the rejected one changed nothing


async def test_heartbeats_continue_during_a_slow_reload_and_timeout_cancels(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    gate = threading.Event()  # a reload ends only when the test opens it (or on cancellation)
    runner = RecordingRunner(gate=gate)
    async with (
        running_agent(kafka, tmp_path, runner),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        slow = reload(weights, "v-slow")
        await publish(kafka, slow)
        await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        await hbs.until(lambda items: sum(1 for h in items if h.in_flight is not None) >= 4)
        # Four heartbeats went out while the reload was still held at the gate.
        assert runner.applied == [] and not terminal(acks.items, slow.command_id)
        busy = [h for h in hbs.items if h.in_flight is not None]
        assert {h.status for h in busy} == {WorkerStatus.BUSY}
        assert busy[-1].in_flight and busy[-1].in_flight.command_id == slow.command_id
        gate.set()
        await acks.until(has_terminal(slow.command_id))
        gate.clear()  # the next reload never ends by itself: only its timeout stops it
        short = reload(weights, "v-too-slow", timeout_s=0.5)
        await settled(kafka, acks, short)
    assert terminal(acks.items, slow.command_id)[0].state is AckState.SUCCEEDED
    (t,) = terminal(acks.items, short.command_id)
    assert t.state is AckState.FAILED and t.error and t.error.code == "COMMAND_TIMEOUT"
    assert t.weights_version == "v-slow"
    assert latest(hbs.items, "w1") is not None


async def test_stop_drains_in_flight_and_sends_a_last_heartbeat(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    gate = threading.Event()
    runner = RecordingRunner(gate=gate)

    def status_is(status: WorkerStatus) -> Callable[[list[Any]], bool]:
        return lambda items: (hb := latest(items, "w1")) is not None and hb.status is status

    async with acks_tail(kafka) as acks, heartbeats_tail(kafka) as hbs:
        async with running_agent(kafka, tmp_path, runner) as agent:
            cmd = reload(weights, "v-drain")
            await publish(kafka, cmd)
            await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
            agent.request_stop()  # while the reload is held at the gate
            await hbs.until(status_is(WorkerStatus.STOPPING))
            assert not terminal(acks.items, cmd.command_id)
            gate.set()  # the reload in flight ends within the drain timeout
        # run() returned: the command was acked, then a last heartbeat was sent.
        await acks.until(has_terminal(cmd.command_id))
        await hbs.until(status_is(WorkerStatus.STOPPED))
    assert terminal(acks.items, cmd.command_id)[0].state is AckState.SUCCEEDED
    assert runner.applied == ["v-drain"]


async def test_commits_position_only_after_terminal_ack(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, "v9")
        await settled(kafka, acks, cmd)
        async with Consumer(kafka, group_id=kafka.topics.worker_group("w1")) as probe:
            await probe.assign(kafka.topics.commands.name, [0])
            committed: list[int | None] = []

            async def committed_now() -> int | None:
                committed.append(await probe.committed(kafka.topics.commands.name, 0))
                return committed[-1]

            deadline = time.monotonic() + 30
            while await committed_now() != 1:
                assert time.monotonic() < deadline, f"never committed: {committed[-5:]}"
                await asyncio.sleep(0.05)
            assert set(committed) <= {None, 1}


async def test_a_quick_command_needs_no_busy_heartbeat_and_its_end_sends_one(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The busy heartbeat waits for a grace period (the slow-reload test above shows it sent);
    a command done within it is reported by its acks and by the heartbeat at its end."""
    runner = RecordingRunner()
    async with (
        running_agent(
            kafka, tmp_path, runner, heartbeat_interval_s=3600.0, progress_grace_s=3600.0
        ),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        await hbs.until(lambda items: latest(items, "w1") is not None)
        cmd = reload(weights, "v2")
        await settled(kafka, acks, cmd)
        await hbs.until(lambda items: any(h.weights_version == "v2" for h in items))
    assert WorkerStatus.BUSY not in {h.status for h in hbs.items}
    assert all(h.in_flight is None for h in hbs.items)
    last = hbs.items[-1]
    assert last.status is WorkerStatus.READY and last.weights_version == "v2"


async def test_heartbeats_go_on_while_the_journal_syncs_and_the_ack_waits_for_it(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal's fsync runs off the event loop: while it hangs, heartbeats still go out,
    and the terminal ack does not (its outcome is not durable yet)."""
    real_fsync = os.fsync
    armed, inside, release = threading.Event(), threading.Event(), threading.Event()

    def hanging_fsync(fd: int) -> None:
        if armed.is_set():
            inside.set()
            release.wait(15)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", hanging_fsync)
    runner = RecordingRunner()
    cmd = reload(weights, "v2")
    try:
        async with (
            running_agent(kafka, tmp_path, runner, heartbeat_interval_s=0.2),
            acks_tail(kafka) as acks,
            heartbeats_tail(kafka) as hbs,
        ):
            armed.set()
            await publish(kafka, cmd)
            assert await asyncio.to_thread(inside.wait, 60), "the journal was never synced"
            seen = len(hbs.items)
            await hbs.until(lambda items: len(items) >= seen + 3)  # the loop is not blocked
            assert not [a for a in await acks_on_the_topic(kafka) if a.command_id == cmd.command_id]
            assert runner.applied == ["v2"]  # applied, but not durable: nothing said yet
            armed.clear()
            release.set()
            await acks.until(has_terminal(cmd.command_id))
    finally:
        release.set()
    assert [a.state for a in acks.items if a.command_id == cmd.command_id] == [
        AckState.ACCEPTED,
        AckState.RUNNING,
        AckState.SUCCEEDED,
    ]


# --------------------------------------------------------------------------- hardening (issue 10)


async def test_a_runner_that_fails_to_load_is_degraded_and_refuses_reloads(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    """Not ``ready`` with no version: degraded, with the code and the reason, in every
    heartbeat; the worker keeps running and NACKs reloads with MODEL_NOT_LOADED."""
    runner = RecordingRunner(load_error=RuntimeError("CUDA out of memory (injected)"))
    async with (
        running_agent(kafka, tmp_path, runner) as agent,
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        cmd = reload(weights, "v2")
        await settled(kafka, acks, cmd)
        await hbs.until(
            lambda items: sum(1 for h in items if h.status is WorkerStatus.DEGRADED) >= 3
        )
        assert agent.ready.is_set()
    (nack,) = terminal(acks.items, cmd.command_id)
    assert nack.state is AckState.REJECTED
    assert nack.error is not None and nack.error.code == "MODEL_NOT_LOADED"
    loaded = [h for h in hbs.items if h.status is not WorkerStatus.STARTING]  # after load()
    assert WorkerStatus.READY not in {h.status for h in loaded}
    for hb in loaded:
        assert hb.degraded is not None and hb.degraded.code == "RUNNER_LOAD_FAILED"
        assert "CUDA out of memory (injected)" in hb.degraded.message
        assert hb.degraded.to_version is None and hb.weights_version is None
    assert runner.applied == [] and runner.closed


#: Records that are not commands but whose ids are plainly readable, and the code of their NACK.
GARBAGE_WITH_IDS: dict[str, tuple[str, str]] = {
    "schema": (
        '{"schema_version":1,"command_id":"%s","rollout_id":"%s","spec":42}',
        "SCHEMA_INVALID",
    ),
    "truncated": (
        '{"schema_version":1,"command_id":"%s","rollout_id":"%s","spec":{',
        "MALFORMED_JSON",
    ),
    "nan": (
        '{"schema_version":1,"command_id":"%s","rollout_id":"%s","timeout_s":NaN}',
        "MALFORMED_JSON",
    ),
}


@pytest.mark.parametrize("kind", sorted(GARBAGE_WITH_IDS))
async def test_a_nack_of_garbage_is_not_remembered_and_the_real_command_still_applies(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, kind: str
) -> None:
    """Anyone can put a record with a guessable id (``{rollout_id}.c1``) in front of the real
    command: its NACK is published and its offset committed, but it never enters the journal,
    so the real command of that id is applied when it comes (here after a restart)."""
    real = reload(weights, "v2")
    template, code = GARBAGE_WITH_IDS[kind]
    garbage = (template % (real.command_id, real.rollout_id)).encode()
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, RecordingRunner()):
            await publish(kafka, garbage)
            await acks.until(has_terminal(real.command_id))
        state = WorkerState.open(tmp_path / "state" / "w1")
        try:
            assert state.outcome(real.command_id) is None
        finally:
            state.close()
        async with Consumer(kafka, group_id=kafka.topics.worker_group("w1")) as probe:
            await probe.assign(kafka.topics.commands.name, [0])
            assert await probe.committed(kafka.topics.commands.name, 0) == 1
        runner = RecordingRunner()
        async with running_agent(kafka, tmp_path, runner):
            await publish(kafka, garbage, real)
            await acks.until(
                lambda items: any(
                    a.command_id == real.command_id and a.state is AckState.SUCCEEDED for a in items
                )
            )
    states = [a.state for a in acks.items if a.command_id == real.command_id]
    assert states == [
        AckState.REJECTED,
        AckState.REJECTED,
        AckState.ACCEPTED,
        AckState.RUNNING,
        AckState.SUCCEEDED,
    ]
    nack = acks.items[0]
    assert nack.error is not None and nack.error.code == code
    assert nack.rollout_id == real.rollout_id
    assert runner.applied == ["v2"]


async def test_ttl_too_long_and_issued_in_the_future_are_refused(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    now = utcnow()
    week = timedelta(days=7)
    forever = reload(weights, "v-2098", expires_at=now + 2 * week)
    future = reload(
        weights,
        "v-future",
        issued_at=now + timedelta(hours=1),
        expires_at=now + timedelta(hours=2),
    )
    skewed = reload(  # a little ahead (clocks differ): accepted
        weights, "v-skewed", issued_at=now + timedelta(seconds=30)
    )
    long_ok = reload(weights, "v-long", expires_at=now + timedelta(days=1))
    async with (
        running_agent(kafka, tmp_path, runner, max_ttl_s=2 * 24 * 3600.0, max_clock_skew_s=60.0),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, forever, future, skewed, long_ok)
        await acks.until(has_terminal(long_ok.command_id))
    (too_long,) = terminal(acks.items, forever.command_id)
    assert too_long.state is AckState.REJECTED
    assert too_long.error is not None and too_long.error.code == "TTL_TOO_LONG"
    (early,) = terminal(acks.items, future.command_id)
    assert early.state is AckState.REJECTED
    assert early.error is not None and early.error.code == "ISSUED_IN_FUTURE"
    assert runner.applied == ["v-skewed", "v-long"]


async def test_each_run_on_a_state_dir_reports_a_higher_incarnation(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with heartbeats_tail(kafka) as hbs:
        async with running_agent(kafka, tmp_path, RecordingRunner()):
            await hbs.until(lambda items: len(items) > 0)
        first = hbs.items[0].incarnation
        async with running_agent(kafka, tmp_path, RecordingRunner()):
            await hbs.until(lambda items: items[-1].incarnation != first)
        second = hbs.items[-1].incarnation
    assert 0 < first < second
    assert [h.incarnation for h in hbs.items] == sorted(h.incarnation for h in hbs.items)


async def test_a_journal_that_cannot_be_written_stops_the_worker_with_a_coded_error(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A full disk: the outcome cannot be made durable, so its ack is never sent; the worker
    stops taking commands, says why in a degraded heartbeat, closes its runner and run()
    raises JOURNAL_WRITE_FAILED (the one the disk gave, not a later one from closing)."""
    real_fsync = os.fsync
    disk_full = threading.Event()

    def fsync(fd: int) -> None:
        if disk_full.is_set():
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    runner = RecordingRunner()
    settings = WorkerSettings(
        worker_id="w1",
        kafka=kafka,
        allowed_roots=[tmp_path / "ckpts"],
        state_dir=tmp_path / "state",
        heartbeat_interval_s=0.5,
    )
    agent = Agent(settings, runner)
    cmd = reload(weights, "v2")
    async with heartbeats_tail(kafka) as hbs:
        task = asyncio.create_task(agent.run())
        try:
            await asyncio.wait_for(agent.ready.wait(), 30)
            disk_full.set()
            await publish(kafka, cmd)
            with pytest.raises(ControlPlaneError) as raised:
                await asyncio.wait_for(task, 60)
        finally:
            agent.request_stop()
            if not task.done():
                await asyncio.wait_for(asyncio.shield(task), 60)
        await hbs.until(
            lambda items: (
                (hb := latest(items, "w1")) is not None and hb.status is WorkerStatus.STOPPED
            )
        )
    assert raised.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert "No space left on device" in raised.value.message
    assert runner.applied == ["v2"] and runner.closed
    # Its accepted and running acks may be out; its outcome is not: it was never durable.
    assert not terminal(await acks_on_the_topic(kafka), cmd.command_id)
    degraded = [h for h in hbs.items if h.status is WorkerStatus.DEGRADED]
    assert degraded and degraded[0].degraded is not None
    assert degraded[0].degraded.code == "JOURNAL_WRITE_FAILED"
    last = hbs.items[-1]
    assert last.degraded is not None and last.degraded.code == "JOURNAL_WRITE_FAILED"
    assert "the journal could not be closed" in caplog.text  # logged, not raised over it


async def test_a_fetch_outage_is_logged_once_when_it_starts_and_once_when_it_ends(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The command loop retries a failing fetch every second: not a WARNING each time."""
    caplog.set_level(logging.DEBUG, logger="workers.agent.loop")
    down = threading.Event()
    failures: list[int] = []

    class CutConsumer(Consumer):
        async def fetch(self, *, timeout_s: float = 1.0, max_records: int | None = None) -> Any:
            if down.is_set():
                failures.append(1)
                raise BusError("fetching: Kafka unreachable (injected)")
            return await super().fetch(timeout_s=timeout_s, max_records=max_records)

    monkeypatch.setattr(agent_module, "Consumer", CutConsumer)
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        down.set()
        await wait_for(lambda: len(failures) >= 4)
        down.clear()
        cmd = reload(weights, "v2")
        await settled(kafka, acks, cmd)
    agent_lines = [r for r in caplog.records if r.name == "workers.agent.loop"]

    def count(text: str, level: int) -> int:
        return sum(1 for r in agent_lines if text in r.getMessage() and r.levelno == level)

    assert count("Kafka unreachable since", logging.WARNING) == 1
    assert count("Kafka reachable again", logging.WARNING) == 1
    assert count("fetch failed, retrying", logging.DEBUG) == len(failures) - 1
    assert count("fetch failed", logging.WARNING) == 0
    assert runner.applied == ["v2"]
