"""The agent's acks while the cluster cannot take them: fewer in-sync replicas than the acks
topic's ``min.insync.replicas`` (the idempotent producer retries such a write for ever).

On the session's 3-node cluster the test's acks topic has two replicas, on nodes 1 and 2, and
``min.insync.replicas=2``; stopping node 2 makes every ``acks=all`` write to it fail with the
retriable NOT_ENOUGH_REPLICAS, as on a cluster that lost two brokers of three, and starting it
again is the brokers coming back. (Kafka 4 caps ``min.insync.replicas`` at the replication
factor, so one broker cannot refuse writes this way.) The commands and workers topics live on
node 1 alone: commands flow and heartbeats go on, and say what the agent cannot publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, cast

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.bus import Consumer, Delivery, Producer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.protocol import AckState, Heartbeat, ReloadWeightsSpec, decode_ack
from tests import factories
from tests.factories import weights_dir
from tests.fleet import acks_tail, heartbeats_tail, latest, make_command, publish, terminal
from tests.integration.conftest import RecordingRunner, acks_on_the_topic, reload
from workers.agent import loop as agent_module
from workers.agent.journal import WorkerState
from workers.agent.loop import Agent

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: The node whose loss puts the acks topic below its min.insync.replicas.
REPLICA = 2


@pytest.fixture
def cluster(kafka_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield kafka_cluster
    if not kafka_cluster.node(REPLICA).status().running:  # a failed test left it down
        kafka_cluster.start_node(REPLICA, timeout=180)


@pytest.fixture
async def kafka(cluster: LocalCluster) -> KafkaSettings:
    """Fresh topics on the cluster: acks on nodes 1 and 2 (min ISR 2), the others on node 1."""
    settings = KafkaSettings(
        bootstrap_servers=cluster.bootstrap, topic_prefix=f"p{uuid.uuid4().hex[:10]}"
    )
    topics = settings.topics
    new = [
        NewTopic(
            spec.name,
            num_partitions=-1,
            replication_factor=-1,
            replica_assignments={p: replicas for p in range(spec.partitions)},
            topic_configs={**spec.config, "min.insync.replicas": str(len(replicas))},
        )
        for spec, replicas in [
            (topics.commands, [1]),
            (topics.acks, [1, REPLICA]),
            (topics.workers, [1]),
        ]
    ]
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(new)
        errors = [e for e in response.topic_errors if e[1] != 0]
        assert not errors, errors
    finally:
        await admin.close()
    return settings


async def acks_refused(cluster: LocalCluster, kafka: KafkaSettings) -> None:
    """Stop node 2 and wait until it left the acks topic's in-sync replicas."""
    await asyncio.to_thread(cluster.stop_node, REPLICA, kill=False)
    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.node(1).bootstrap)
    await admin.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            [described] = await admin.describe_topics([kafka.topics.acks.name])
            isrs = [p["isr"] for p in described["partitions"]]
            if isrs and all(REPLICA not in isr for isr in isrs):
                return
            assert time.monotonic() < deadline, isrs
            await asyncio.sleep(0.2)
    finally:
        await admin.close()


async def acks_taken(cluster: LocalCluster) -> None:
    await asyncio.to_thread(cluster.start_node, REPLICA, timeout=180)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        await asyncio.sleep(0.05)


async def committed(kafka: KafkaSettings, worker_id: str = "w1") -> int | None:
    async with Consumer(kafka, group_id=kafka.topics.worker_group(worker_id)) as probe:
        await probe.assign(kafka.topics.commands.name, [0])
        return await probe.committed(kafka.topics.commands.name, 0)


async def committed_becomes(kafka: KafkaSettings, offset: int) -> None:
    """Wait until w1's committed offset is ``offset``; it is never anything else but the one
    before (or None)."""
    deadline = time.monotonic() + 60
    while (now := await committed(kafka)) != offset:
        assert now is None or now == offset - 1, now
        assert time.monotonic() < deadline, "never committed"
        await asyncio.sleep(0.1)


def lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "workers.agent.loop" and text in r.getMessage()
    ]


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return weights_dir(tmp_path)


def agent_running(
    kafka: KafkaSettings, tmp_path: Path, runner: RecordingRunner, **kw: Any
) -> AbstractAsyncContextManager[tuple[Agent, asyncio.Task[None]]]:
    """An agent whose publishes are unconfirmed after 1 s (the delivery timeout)."""
    slow = kafka.model_copy(update={"delivery_timeout_ms": 1000})
    return factories.agent_running(
        factories.agent_settings(slow, tmp_path, labels={}, **kw), runner, ready_s=60
    )


def reporting(heartbeats: list[Heartbeat]) -> Heartbeat | None:
    """The latest heartbeat of w1 if it reports acks that cannot be published."""
    hb = latest(heartbeats, "w1")
    if hb is None or hb.acks_unpublished == 0 or hb.publish_failing_since is None:
        return None
    return hb


async def test_acks_the_cluster_refuses_are_waited_on_said_once_and_published_once(
    cluster: LocalCluster,
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    runner = RecordingRunner()
    cmd = reload(weights, "v2")
    async with (
        agent_running(kafka, tmp_path, runner),
        heartbeats_tail(kafka) as heartbeats,
    ):
        await acks_refused(cluster, kafka)
        await publish(kafka, cmd)
        # Heartbeats go on, and say how many acks wait and since when.
        await heartbeats.until(lambda hbs: reporting(hbs) is not None)
        first = reporting(heartbeats.items)
        assert first is not None and first.publish_failing_since is not None
        assert first.lease_s == 5  # 10 periods of 0.5 s
        since = first.publish_failing_since
        # Several delivery timeouts later: still unpublished, said once, nothing committed.
        await heartbeats.until(
            lambda hbs: (
                (hb := reporting(hbs)) is not None
                and hb.publish_failing_since == since
                and (hb.sent_at - since).total_seconds() > 4
            )
        )
        assert runner.applied == ["v2"]
        assert await committed(kafka) is None
        [said] = lines(caplog, "cannot publish to Kafka since")
        assert " ack(s) " in said and "retrying" in said, said
        assert not lines(caplog, "ack publish failed")
        await acks_taken(cluster)
        await until(lambda: bool(lines(caplog, "published again after")), "acks are published")
        await committed_becomes(kafka, 1)
        await heartbeats.until(
            lambda hbs: (
                (hb := latest(hbs, "w1")) is not None
                and hb.acks_unpublished == 0
                and hb.publish_failing_since is None
            )
        )
        # Fine again: the acks of a command are on their way for milliseconds, not news (the
        # heartbeat sent beside them reports none).
        recovered = len(heartbeats.items)
        marker = make_command(
            ReloadWeightsSpec(path=str(weights / "model.safetensors"), version="v3")
        )
        await publish(kafka, marker)
        await heartbeats.until(
            lambda hbs: any(hb.weights_version == "v3" for hb in hbs[recovered:])
        )
        after = heartbeats.items[recovered:]
        assert all(hb.acks_unpublished == 0 for hb in after), after
        assert all(hb.publish_failing_since is None for hb in after), after
    acks = [a for a in await acks_on_the_topic(kafka) if a.command_id == cmd.command_id]
    assert [a.state for a in acks] == [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED]
    assert runner.applied == ["v2", "v3"]
    assert len(lines(caplog, "cannot publish to Kafka since")) == 1
    assert len(lines(caplog, "published again after")) == 1


async def test_a_stop_while_acks_cannot_be_published_exits_and_the_next_start_publishes_them(
    cluster: LocalCluster,
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    runner = RecordingRunner()
    cmd = reload(weights, "v2")
    async with (
        agent_running(kafka, tmp_path, runner, drain_timeout_s=1) as (agent, task),
        heartbeats_tail(kafka) as heartbeats,
    ):
        await acks_refused(cluster, kafka)
        await publish(kafka, cmd)
        await heartbeats.until(lambda hbs: reporting(hbs) is not None)
        agent.request_stop()  # SIGTERM: the acks cannot go out; the agent must not wait for ever
        await asyncio.wait_for(task, 60)
    [said] = lines(caplog, "remain unpublished")
    assert "1 ack(s)" in said and "next start" in said, said
    assert await committed(kafka) is None
    state = WorkerState.open(tmp_path / "state" / "w1")
    try:
        outcome = state.outcome(cmd.command_id)
        assert outcome is not None and not outcome.published
    finally:
        state.close()
    await acks_taken(cluster)
    again = RecordingRunner()
    async with agent_running(kafka, tmp_path, again, restore_on_start=False):
        await committed_becomes(kafka, 1)
    assert again.applied == []  # applied once, by the first incarnation
    acks = [a for a in await acks_on_the_topic(kafka) if a.command_id == cmd.command_id]
    (final,) = terminal(acks, cmd.command_id)
    assert final.state is AckState.SUCCEEDED and final.result.get("replayed") is True


class _Refused:
    """A delivery the producer gave up on (nothing was queued): its wait fails."""

    done = True

    def __init__(self, topic: str) -> None:
        self.topic = topic

    async def wait(self, timeout_s: float) -> Any:
        raise BusError("publishing: the producer gave up (injected)", code=LocalCode.KAFKA_ERROR)


class _LandedButGivenUp:
    """A delivery that was written, though the producer reports it gave up on it."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery

    @property
    def done(self) -> bool:
        return self.delivery.done

    async def wait(self, timeout_s: float) -> Any:
        await self.delivery.wait(timeout_s)
        raise BusError("publishing: the producer gave up (injected)", code=LocalCode.KAFKA_ERROR)


@pytest.mark.parametrize("fault", ["unqueued", "given-up", "given-up-landed"])
@pytest.mark.parametrize("quick", [True, False], ids=["quick", "slow"])
async def test_acks_the_producer_did_not_take_are_handed_over_again_in_order(
    kafka: KafkaSettings,
    tmp_path: Path,
    weights: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    quick: bool,
    fault: str,
) -> None:
    """An ack the producer could not queue (``unqueued``: the running ack, after the accepted
    one was queued) or gave up on (``given-up``: the first ack's delivery fails; ``-landed``:
    it was written all the same) is handed over again with every ack after it, in order, before
    anything later; only the last case leaves duplicates (readers count the earliest).

    ``quick``: the command ends within the grace: accepted, running and the terminal ack go
    together. ``slow``: the grace ran out first (it is 0 here): accepted and running went
    alone, and the terminal ack waits until they are published.
    """
    faults: list[str] = []
    seen: set[tuple[str, AckState]] = set()
    over: list[bool] = []  # the first round ends when one of its acks is handed over again

    class FlakyProducer(Producer):
        async def submit(
            self,
            topic: str,
            value: bytes | None,
            *,
            key: bytes | None = None,
            timeout_s: float | None = None,
        ) -> Delivery:
            if topic != kafka.topics.acks.name:
                return await super().submit(topic, value, key=key, timeout_s=timeout_s)
            ack = decode_ack(value or b"")
            if ack.command_id == cmd.command_id and (ack.command_id, ack.state) in seen:
                over.append(True)
            seen.add((ack.command_id, ack.state))
            first_round = ack.command_id == cmd.command_id and not over
            if fault == "unqueued" and faults:
                first_round = False
            if not first_round:
                return await super().submit(topic, value, key=key, timeout_s=timeout_s)
            if fault == "unqueued":
                if ack.state is AckState.RUNNING:
                    faults.append(fault)
                    raise BusError("publishing: no metadata (injected)")
                return await super().submit(topic, value, key=key, timeout_s=timeout_s)
            faults.append(fault)
            if fault == "given-up":  # the whole request failed: nothing was written
                return cast(Delivery, _Refused(topic))
            landed = await super().submit(topic, value, key=key, timeout_s=timeout_s)
            return cast(Delivery, _LandedButGivenUp(landed))

    monkeypatch.setattr(agent_module, "Producer", FlakyProducer)
    sent = [AckState.ACCEPTED, AckState.RUNNING] + ([AckState.SUCCEEDED] if quick else [])
    then = [] if quick else [AckState.SUCCEEDED]
    expected = (sent * 2 if fault == "given-up-landed" else sent) + then
    runner = RecordingRunner(delay_s=0.0 if quick else 1.0)
    cmd = reload(weights, "v2")
    marker = reload(weights, "v3")
    grace = 3600.0 if quick else 0.0
    async with (
        agent_running(kafka, tmp_path, runner, progress_grace_s=grace),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, cmd)
        await publish(kafka, marker)  # acks are in order: all of cmd's come before its own
        await acks.until(lambda items: bool(terminal(items, marker.command_id)))
    assert [a.state for a in acks.items if a.command_id == cmd.command_id] == expected
    assert faults == [fault] * (1 if fault == "unqueued" else len(sent))
    assert len(lines(caplog, "cannot publish to Kafka since")) == 1
    assert len(lines(caplog, "acks published again after")) == 1
    assert runner.applied == ["v2", "v3"]


async def _acks_topic_config(kafka: KafkaSettings, **extra: str) -> None:
    """Set the test's acks topic's configs (those it was created with, plus ``extra``; the
    others go back to their defaults) and wait until the cluster reports them."""
    spec = kafka.topics.acks
    config = {**spec.config, "min.insync.replicas": "2", **extra}
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap_servers)
    await admin.start()
    try:
        resource = ConfigResource(ConfigResourceType.TOPIC, spec.name, config)
        [response] = await admin.alter_configs([resource])
        assert not [r for r in response.resources if r[0] != 0], response.resources
        deadline = time.monotonic() + 30
        while True:
            [described] = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, spec.name)]
            )
            entries = {e[0]: e[1] for e in described.resources[0][4]}
            if all(entries.get(k) == v for k, v in config.items()):
                return
            assert time.monotonic() < deadline, entries
            await asyncio.sleep(0.1)
    finally:
        await admin.close()


async def test_acks_go_out_again_after_the_producer_gave_up_on_one(
    kafka: KafkaSettings, tmp_path: Path, weights: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A record the idempotent producer gave up on leaves a gap in its sequence numbers, and
    the broker then refuses every later record of that partition from it
    (OutOfOrderSequenceNumber) for as long as it lives. Here the broker refuses the acks for
    good (larger than the topic's max.message.bytes) until the limit is lifted: then they go
    out, once, from a new producer (before, they were refused for ever, and the offset never
    committed). A batch that waited for a leader past the request timeout does the same."""
    caplog.set_level(logging.INFO, logger="workers.agent.loop")
    runner = RecordingRunner()
    # The first command's acks go out: the broker knows the producer's sequence from them (a
    # producer new to a partition may start anywhere).
    first = reload(weights, "v1")
    cmd = reload(weights, "v2")
    async with agent_running(kafka, tmp_path, runner):
        await publish(kafka, first)
        await committed_becomes(kafka, 1)
        await _acks_topic_config(kafka, **{"max.message.bytes": "200"})
        await publish(kafka, cmd)
        await until(lambda: bool(lines(caplog, "cannot publish to Kafka since")), "refused")
        assert await committed(kafka) == 1
        await _acks_topic_config(kafka)
        await until(lambda: bool(lines(caplog, "published again after")), "acks are published")
        await committed_becomes(kafka, 2)
    acks = [a for a in await acks_on_the_topic(kafka) if a.command_id == cmd.command_id]
    assert [a.state for a in acks] == [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED]
    [said] = lines(caplog, "cannot publish to Kafka since")
    assert "KAFKA_ERROR" in said, said
    assert runner.applied == ["v1", "v2"]
