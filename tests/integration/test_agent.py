"""The worker agent against a real broker, with an in-test runner (the torch runners have their own tests)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from controlplane.bus import Consumer, Producer
from controlplane.errors import BusError, ErrorCode, RunnerError
from controlplane.protocol import (
    AckState,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
    utcnow,
)
from controlplane.settings import KafkaSettings
from tests.fleet import (
    acks_tail,
    has_terminal,
    heartbeats_tail,
    latest,
    make_command,
    publish,
    terminal,
)
from workers import agent as agent_module
from workers.agent import Agent
from workers.runner import ReloadResult, RunnerDescription, config_digest
from workers.settings import WorkerSettings

pytestmark = pytest.mark.kafka


class RecordingRunner:
    """A minimal real Runner: records what it applied; versions named bad-* are refused."""

    name = "recording"

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.version: str | None = None
        self.config: dict[str, Any] = {"max_new_tokens": 16}
        self.applied: list[str] = []
        self.loaded = False

    def load(self) -> None:
        self.loaded = True
        self.version = "init"

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        if spec.version.startswith("bad-"):
            raise RunnerError(
                "tensor w has shape [2] in the checkpoint, [3] in the model",
                code=ErrorCode.WEIGHTS_SHAPE_MISMATCH,
            )
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end:
            if cancel is not None and cancel.is_set():
                raise RunnerError("cancelled before copying", code=ErrorCode.COMMAND_TIMEOUT)
            time.sleep(0.01)
        self.applied.append(spec.version)
        self.version = spec.version
        return ReloadResult(spec.version, 1, 1, path.stat().st_size, 0.0, 0.0, self.delay_s, 0.0)

    def update_config(self, overrides: dict[str, Any]) -> RunnerDescription:
        if set(overrides) - {"max_new_tokens"}:
            raise RunnerError(
                f"unknown keys {sorted(overrides)}", code=ErrorCode.CONFIG_KEY_REJECTED
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
        pass


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    return root


@asynccontextmanager
async def running_agent(
    kafka: KafkaSettings, tmp_path: Path, runner: Any, **kw: Any
) -> AsyncIterator[Agent]:
    settings = WorkerSettings(
        worker_id=kw.pop("worker_id", "w1"),
        labels=kw.pop("labels", {"model": "tiny"}),
        kafka=kafka,
        allowed_roots=[tmp_path / "ckpts"],
        state_dir=tmp_path / "state",
        heartbeat_interval_s=kw.pop("heartbeat_interval_s", 0.5),
        **kw,
    )
    agent = Agent(settings, runner)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 30)
        yield agent
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, 60)


def reload(weights: Path, version: str, **kw: Any) -> Any:
    return make_command(
        ReloadWeightsSpec(path=str(weights / "model.safetensors"), version=version), **kw
    )


async def test_reload_is_acked_through_every_state(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, "v2")
        await publish(kafka, cmd)
        await acks.until(has_terminal(cmd.command_id))
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
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, "bad-v3")
        await publish(kafka, cmd)
        await acks.until(has_terminal(cmd.command_id))
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


async def test_duplicate_delivery_and_restart_apply_once(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    cmd = reload(weights, "v7")
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, runner):
            await publish(kafka, cmd, cmd)  # the same command twice (a producer retry, a replay)
            await acks.until(has_terminal(cmd.command_id))
            await acks.drain(1.0)
        # Restart on the same state with the committed offset deleted: reads from the local state.
        second = RecordingRunner()
        async with running_agent(kafka, tmp_path, second):
            marker = reload(weights, "v8")
            await publish(kafka, cmd, marker)
            await acks.until(has_terminal(marker.command_id))
    assert runner.applied == ["v7"]
    assert second.applied == [
        "v7",
        "v8",
    ]  # v7 restored at start-up (level), not re-applied as a command
    assert len(terminal(acks.items, cmd.command_id)) == 1


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
    runner = RecordingRunner(delay_s=4.0)
    async with (
        running_agent(kafka, tmp_path, runner),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as hbs,
    ):
        slow = reload(weights, "v-slow")
        await publish(kafka, slow)
        await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        t0 = time.monotonic()
        await hbs.until(
            lambda items: sum(1 for h in items if h.in_flight is not None) >= 4, timeout=10
        )
        assert time.monotonic() - t0 < 4.0, "heartbeats stalled behind the reload"
        busy = [h for h in hbs.items if h.in_flight is not None]
        assert {h.status for h in busy} == {WorkerStatus.BUSY}
        assert busy[-1].in_flight and busy[-1].in_flight.command_id == slow.command_id
        await acks.until(has_terminal(slow.command_id))
        short = reload(weights, "v-too-slow", timeout_s=0.5)
        await publish(kafka, short)
        await acks.until(has_terminal(short.command_id))
    assert terminal(acks.items, slow.command_id)[0].state is AckState.SUCCEEDED
    (t,) = terminal(acks.items, short.command_id)
    assert t.state is AckState.FAILED and t.error and t.error.code == "COMMAND_TIMEOUT"
    assert t.weights_version == "v-slow"
    assert latest(hbs.items, "w1") is not None


async def test_stop_drains_in_flight_and_sends_a_last_heartbeat(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner(delay_s=2.0)
    async with acks_tail(kafka) as acks, heartbeats_tail(kafka) as hbs:
        async with running_agent(kafka, tmp_path, runner):
            cmd = reload(weights, "v-drain")
            await publish(kafka, cmd)
            await acks.until(lambda items: any(a.state is AckState.RUNNING for a in items))
        # running_agent's exit requested the stop while the reload ran; run() returned.
        await acks.until(has_terminal(cmd.command_id), timeout=5)
        await hbs.until(
            lambda items: (
                latest(items, "w1") is not None
                and latest(items, "w1").status is WorkerStatus.STOPPED
            ),
            timeout=5,
        )
    assert terminal(acks.items, cmd.command_id)[0].state is AckState.SUCCEEDED
    assert runner.applied == ["v-drain"]


async def test_commits_position_only_after_terminal_ack(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, "v9")
        await publish(kafka, cmd)
        await acks.until(has_terminal(cmd.command_id))
        await asyncio.sleep(0.3)
        async with Consumer(kafka, group_id=kafka.topics.worker_group("w1")) as probe:
            await probe.assign(kafka.topics.commands.name, [0])
            assert await probe.committed(kafka.topics.commands.name, 0) == 1


@pytest.mark.parametrize("landed", [False, True], ids=["lost", "ambiguous"])
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "slow"])
async def test_acks_that_fail_are_sent_again_in_order(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    quick: bool,
    landed: bool,
) -> None:
    """The first ack publish fails: the cluster did not take the acks ("lost"), or took them
    and the answer failed ("ambiguous"). All are sent again, in order, before anything later.

    ``quick``: the command ends within the grace: accepted, running and the terminal ack go in
    one request. ``slow``: the grace ran out first (it is 0 here): accepted and running went
    alone, not awaited, and the terminal ack waits until they are published.
    """
    failures: list[str] = []

    class FlakyProducer(Producer):
        async def send_many(
            self, topic: str, items: Sequence[tuple[bytes | None, bytes | None]]
        ) -> None:
            if not failures:
                failures.append(topic)
                if landed:
                    await super().send_many(topic, items)
                raise BusError("publishing: Kafka unreachable (injected)")
            await super().send_many(topic, items)

    monkeypatch.setattr(agent_module, "Producer", FlakyProducer)
    sent = [AckState.ACCEPTED, AckState.RUNNING] + ([AckState.SUCCEEDED] if quick else [])
    then = [] if quick else [AckState.SUCCEEDED]
    expected = (sent * 2 if landed else sent) + then
    runner = RecordingRunner(delay_s=0.0 if quick else 1.0)
    cmd = reload(weights, "v2")
    grace = 3600.0 if quick else 0.0
    async with (
        running_agent(kafka, tmp_path, runner, progress_grace_s=grace),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, cmd)
        await acks.until(
            lambda items: len([a for a in items if a.command_id == cmd.command_id]) >= len(expected)
        )
        await acks.drain(0.3)
    assert [a.state for a in acks.items if a.command_id == cmd.command_id] == expected
    assert failures == [kafka.topics.acks.name]
    failed = "accepted/running/succeeded" if quick else "accepted/running"
    assert f"{failed} ack publish failed, retrying" in caplog.text
    assert runner.applied == ["v2"]


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
        await publish(kafka, cmd)
        await acks.until(has_terminal(cmd.command_id))
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
            await acks.drain(0.3)
            assert not [a for a in acks.items if a.command_id == cmd.command_id]
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
