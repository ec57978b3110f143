"""Kafka outages, on a private broker this module stops and restarts on the same data dir.

`--wait` keeps waiting through an outage (it says so once), judges nothing from the heartbeats
it could not read, and exits 4 only when its timeout passes with Kafka still unreachable. No
CLI command prints a traceback when Kafka is down, and aiokafka's per-retry errors become one
line per change of state.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from controlplane.kafka.broker import BrokerConfig, LocalBroker, LocalCluster
from controlplane.kafka.bus import Admin, Consumer, Producer, health, log_filter
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError
from controlplane.wire.protocol import (
    Selector,
    UpdateConfigSpec,
    encode,
    utcnow,
)
from controlplane.wire.topics import worker_key
from tests.factories import fake_heartbeat, free_port, succeeded_acks
from tests.fleet import make_command, publish
from tests.integration.test_bus_publish import fleet_below_min_isr, node_down

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
INTERVAL_S = 1.0  # the fake worker's heartbeat period: silent 3 s, it would count as lost


@pytest.fixture(scope="module")
def private_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalBroker]:
    broker = LocalBroker(
        BrokerConfig(
            port=free_port(),
            controller_port=free_port(),
            data_dir=tmp_path_factory.mktemp("outage-kafka"),
        )
    )
    broker.start(timeout=120)
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
async def outage_kafka(private_broker: LocalBroker) -> AsyncIterator[KafkaSettings]:
    """Fresh topics on the private broker (started again if a test left it stopped)."""
    if not private_broker.status().running:
        await asyncio.to_thread(private_broker.start, timeout=120)
    settings = KafkaSettings(
        bootstrap_servers=private_broker.bootstrap, topic_prefix=f"o{uuid.uuid4().hex[:10]}"
    )
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    yield settings
    if not private_broker.status().running:
        await asyncio.to_thread(private_broker.start, timeout=120)


async def until(predicate: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------- a fake worker


class FakeWorker:
    """Publishes heartbeats every INTERVAL_S (when Kafka takes them); acks on demand."""

    def __init__(self, settings: KafkaSettings, worker_id: str) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.started_at = utcnow()
        self.seq = 0
        self.last_sent = utcnow()
        self._producer = Producer(settings)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> FakeWorker:
        await self._producer.start()
        await self.beat()
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._producer.stop()

    async def beat(self) -> None:
        self.seq += 1
        now = utcnow()
        hb = fake_heartbeat(
            self.worker_id, now, started_at=self.started_at, seq=self.seq, interval_s=INTERVAL_S
        )
        await self._producer.send(
            self.settings.topics.workers.name, encode(hb), key=worker_key(self.worker_id)
        )
        self.last_sent = now

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(BusError):  # Kafka down: the next period tries again
                await self.beat()
            await asyncio.sleep(INTERVAL_S)  # the worker's own period, not a synchronization

    async def ack(self, rollout_id: str, command_id: str) -> None:
        for ack in succeeded_acks(self.worker_id, rollout_id, command_id):
            await self._producer.send(
                self.settings.topics.acks.name, encode(ack), key=worker_key(self.worker_id)
            )


# --------------------------------------------------------------------------- the CLI


@dataclass
class Cli:
    proc: asyncio.subprocess.Process
    out: list[str] = field(default_factory=list)
    err: list[str] = field(default_factory=list)
    _readers: list[asyncio.Task[None]] = field(default_factory=list)

    @classmethod
    async def start(cls, *args: str) -> Cli:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "controlplane",
            *args,
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "COLUMNS": "200"},
        )
        cli = cls(proc)
        assert proc.stdout is not None and proc.stderr is not None
        cli._readers = [
            asyncio.create_task(cli._read(proc.stdout, cli.out)),
            asyncio.create_task(cli._read(proc.stderr, cli.err)),
        ]
        return cli

    @staticmethod
    async def _read(stream: asyncio.StreamReader, into: list[str]) -> None:
        async for line in stream:
            into.append(line.decode(errors="replace").rstrip("\n"))

    async def wait(self, timeout: float = 120.0) -> int:
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            await asyncio.gather(*self._readers)
        return code

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()

    @property
    def text(self) -> str:
        return "\n".join(self.out + self.err)


async def _publish_and_stop_kafka(
    settings: KafkaSettings, broker: LocalBroker, worker: FakeWorker, wait_timeout: float
) -> tuple[Cli, str, str]:
    """Start `update-config --wait`, let it publish, stop Kafka; returns (cli, rollout, command)."""
    cli = await Cli.start(
        "update-config",
        "--set",
        "temperature=0.5",
        "--worker",
        worker.worker_id,
        "--wait",
        "--wait-timeout",
        str(wait_timeout),
        "--bootstrap",
        settings.bootstrap_servers,
        "--topic-prefix",
        settings.topic_prefix,
    )
    pattern = re.compile(r"published rollout (\S+) \(command (\S+),")
    await until(lambda: any(pattern.search(line) for line in cli.out), "the publish", 90)
    match = next(m for m in map(pattern.search, cli.out) if m)
    await asyncio.to_thread(broker.stop)  # the worker goes on beating, in vain
    await until(lambda: "Kafka unreachable since" in cli.text, "the outage notice", 60)
    # The outage outlasts the worker's liveness window (3 periods) several times over.
    silent_from = worker.last_sent
    await until(
        lambda: (utcnow() - silent_from).total_seconds() > 8 * INTERVAL_S, "the silence", 30
    )
    return cli, match.group(1), match.group(2)


async def test_wait_rides_out_an_outage_and_reports_the_real_outcome(
    outage_kafka: KafkaSettings, private_broker: LocalBroker
) -> None:
    async with FakeWorker(outage_kafka, f"w-{uuid.uuid4().hex[:6]}") as worker:
        cli, rollout_id, command_id = await _publish_and_stop_kafka(
            outage_kafka, private_broker, worker, wait_timeout=300
        )
        try:
            assert cli.proc.returncode is None, cli.text  # still waiting
            await asyncio.to_thread(private_broker.start, timeout=120)
            await worker.ack(rollout_id, command_id)
            code = await cli.wait()
        finally:
            cli.kill()
    assert code == 0, cli.text
    assert cli.text.count("Kafka unreachable") == 1, cli.text  # once, in --wait's words
    assert "Traceback" not in cli.text
    assert not [line for line in cli.out + cli.err if " lost" in line], cli.text
    assert len([line for line in cli.err if "Unable connect" in line]) <= 1, cli.text


async def test_wait_exits_2_not_4_when_its_timeout_passes_with_kafka_down_after_publishing(
    outage_kafka: KafkaSettings, private_broker: LocalBroker
) -> None:
    async with FakeWorker(outage_kafka, f"w-{uuid.uuid4().hex[:6]}") as worker:
        cli, _, _ = await _publish_and_stop_kafka(
            outage_kafka, private_broker, worker, wait_timeout=12
        )
        try:
            code = await cli.wait()
        finally:
            cli.kill()
    # Published, so not 4 ("not published": a script would publish it again): gave up waiting.
    assert code == 2, cli.text
    assert "Traceback" not in cli.text
    assert cli.err[-2].startswith("error: BROKER_UNAVAILABLE: Kafka unreachable since"), cli.text
    assert cli.err[-1].startswith("gave up waiting: rollout "), cli.text
    assert "was published" in cli.err[-1], cli.text
    assert not [line for line in cli.out + cli.err if " lost" in line], cli.text


@pytest.mark.parametrize(
    "args",
    [
        ["workers"],
        ["status"],
        ["status", "r-1"],
        ["update-config", "--set", "a=1", "--all", "--wait"],
        ["topics", "ensure"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
async def test_kafka_down_at_start_is_exit_4_with_one_coded_line(args: list[str]) -> None:
    cli = await Cli.start(*args, "--bootstrap", f"127.0.0.1:{free_port()}")
    code = await cli.wait(timeout=90)
    assert code == 4, cli.text
    assert "Traceback" not in cli.text
    assert [line for line in cli.err if line.startswith("error: ")] == cli.err[-1:], cli.text
    assert cli.err[-1].startswith("error: BROKER_UNAVAILABLE"), cli.text


# --------------------------------------------------------------------------- log lines


async def test_an_outage_is_one_log_line_each_way_not_one_per_retry(
    outage_kafka: KafkaSettings,
    private_broker: LocalBroker,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    consumer = Consumer(outage_kafka)
    producer = Producer(outage_kafka)
    await consumer.start()
    await producer.start()
    try:
        await consumer.assign_many([t.name for t in outage_kafka.topics.all()])
        await consumer.seek_to_beginning()
        await consumer.fetch(timeout_s=0.2)
        caplog.clear()
        await asyncio.to_thread(private_broker.stop)
        # Fetch through the outage until aiokafka has failed (and logged) a hundred times.
        dropped = log_filter.dropped
        deadline = time.monotonic() + 60
        while log_filter.dropped < dropped + 100:
            assert time.monotonic() < deadline, "aiokafka did not retry"
            await consumer.fetch(timeout_s=0.2)
        assert not health.reachable
        await asyncio.to_thread(private_broker.start, timeout=120)
        await until(lambda: health.reachable, "reachable again", 60)
        await producer.send(outage_kafka.topics.commands.name, b"{}")
    finally:
        await consumer.stop()
        await producer.stop()
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    down = [r for r in lines if r.getMessage().startswith("Kafka unreachable")]
    up = [r for r in lines if r.getMessage().startswith("Kafka reachable again after")]
    aiokafka = [r for r in lines if r.name.startswith("aiokafka")]
    assert len(down) == 1 and len(up) == 1, [r.getMessage() for r in lines]
    assert len(aiokafka) <= 5, [r.getMessage() for r in aiokafka]


async def test_a_follower_stops_cleanly_while_kafka_is_down(
    outage_kafka: KafkaSettings, private_broker: LocalBroker
) -> None:
    """aiokafka's Fetcher.close() awaits the fetch tasks it cancels and lets their
    CancelledError out; stop() must not (it was a traceback at the end of `--wait`)."""
    from controlplane.coordinator.follower import Follower

    follower = Follower(outage_kafka)
    await follower.start()
    await follower.catch_up()
    await asyncio.to_thread(private_broker.stop)
    async with asyncio.timeout(60):
        while health.reachable:
            await follower.poll(timeout_s=0.2)
    await follower.stop()  # raises nothing
    assert follower.current_as_of() is not None  # what it knew before the outage


async def test_a_producer_with_a_record_pending_stops_while_kafka_is_down(
    outage_kafka: KafkaSettings, private_broker: LocalBroker
) -> None:
    """aiokafka's stop() flushes pending records and, with Kafka down, waits for ever (a CLI
    whose publish failed hung in ``async with Producer``). Our stop() is bounded."""
    producer = Producer(outage_kafka)
    await producer.start()
    await asyncio.to_thread(private_broker.stop)
    sending = asyncio.create_task(producer.send(outage_kafka.topics.commands.name, b"{}"))
    async with asyncio.timeout(60):
        while health.reachable:
            await asyncio.wait({sending}, timeout=0.1)
    sending.cancel()
    with contextlib.suppress(asyncio.CancelledError, BusError):
        await sending
    async with asyncio.timeout(60):
        await producer.stop()


# --------------------------------------------------------------------------- writes held back


async def test_status_judges_no_worker_lost_while_kafka_holds_heartbeats_back(
    kafka_cluster: LocalCluster,
) -> None:
    """Fetches answer but the workers topic takes no write (below min ISR: a broker failover
    looks the same until it is fenced). The worker's heartbeats are held back, not missing:
    `status` and `workers` judge as of what they could read back (their probe), so nobody is
    lost."""
    settings = await fleet_below_min_isr(kafka_cluster, held="workers")
    worker_id = f"w-{uuid.uuid4().hex[:6]}"
    command = make_command(
        UpdateConfigSpec(overrides={"a": 1}),
        selector=Selector(worker_ids=[worker_id]),
        rollout_id="r-held",
    )
    args = ("--bootstrap", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix)
    async with FakeWorker(settings, worker_id) as worker:
        await publish(settings, command)
        async with node_down(kafka_cluster):
            silent_from = worker.last_sent
            await until(
                lambda: (utcnow() - silent_from).total_seconds() > 8 * INTERVAL_S,
                "the worker's heartbeats held back for several lease periods",
                60,
            )
            status = await Cli.start("status", "r-held", "--json", *args)
            assert await status.wait() == 0, status.text
            workers = await Cli.start("workers", "--json", *args)
            assert await workers.wait() == 0, workers.text
    judged = json.loads(status.out[-1])
    assert judged["counts"]["lost"] == 0, judged
    assert [w["state"] for w in judged["workers"]] == ["pending"], judged
    [view] = json.loads(workers.out[-1])
    assert view["worker_id"] == worker_id and view["alive"] is True, view
    assert "not confirming writes" in status.text, status.text
    assert "Traceback" not in status.text + workers.text
