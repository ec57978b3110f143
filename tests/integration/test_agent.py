"""The worker agent against a real broker, with an in-test runner (the torch runners have their own
tests): commands applied, refused and rejected (reloads, config updates, selectors, expiry,
garbage, a runner that cannot load). Journal and restarts are in test_agent_journal, heartbeats
and stopping in test_agent_liveness; the shared runner and helpers in tests/integration/conftest.py
(re-exported here for the tests that import them from this module).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    AckState,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
    utcnow,
)
from tests.factories import running_agent
from tests.fleet import (
    acks_tail,
    has_terminal,
    heartbeats_tail,
    make_command,
    publish,
    settled,
    terminal,
)
from tests.integration.conftest import RecordingRunner, reload, reloaded
from workers.agent.journal import WorkerState

pytestmark = pytest.mark.kafka


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


async def test_a_command_pinned_to_a_packed_fleet_reaches_its_workers_only(
    kafka: KafkaSettings, tmp_path: Path, weights: Path
) -> None:
    """Past 1,000 ids the selector goes packed on the wire (docs/wire.md): the agent unpacks it
    and applies a command whose set holds it, and ignores one whose set does not."""
    fleet = [f"other-{i:05d}" for i in range(3000)]
    runner = RecordingRunner()
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        not_me = reload(weights, "v-not-me", selector=Selector(worker_ids=fleet))
        mine = reload(weights, "v-packed", selector=Selector(worker_ids=sorted([*fleet, "w1"])))
        await publish(kafka, not_me, mine)
        await acks.until(has_terminal(mine.command_id))
    assert not [a for a in acks.items if a.command_id == not_me.command_id]
    (final,) = terminal(acks.items, mine.command_id)
    assert final.state is AckState.SUCCEEDED
    assert runner.applied == ["v-packed"]
