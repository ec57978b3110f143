"""The controller's write path against the real broker: transactions, and the fencing of a paused
leader by the fixed transactional id with a group-elected leader (docs/controller.md)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import ProducerFenced
from aiokafka.protocol.admin import ApiVersionRequest
from aiokafka.protocol.transaction import (
    AddOffsetsToTxnRequest,
    AddPartitionsToTxnRequest,
    EndTxnRequest,
    InitProducerIdRequest,
    TxnOffsetCommitRequest,
)

from controlplane.kafka.bus import Admin
from controlplane.kafka.election import LeaderElection, LeadershipLost
from controlplane.kafka.settings import KafkaSettings
from controlplane.kafka.transactions import (
    TransactionalProducer,
    TransactionFenced,
    TransactionOutcomeUnknown,
    TxnState,
)
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.topics import Topics, TopicSpec

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[2]
#: The broker's minimum (group.min.session.timeout.ms): a paused leader is replaced after it.
SESSION_MS = 6000


class _ControllerTopic(Topics):
    """Only the controller topic, for ``ensure_topics`` (the ``kafka`` fixture makes the rest),
    whether ``ensure_topics`` takes :meth:`Topics.all` or :meth:`Topics.ensured`."""

    def all(self) -> list[TopicSpec]:
        return [self.controller]

    def ensured(self) -> list[TopicSpec]:
        return [self.controller]


async def ensure_controller_topic(settings: KafkaSettings) -> None:
    async with Admin(settings) as admin:
        await admin.ensure_topics(_ControllerTopic(prefix=settings.topic_prefix))


def raw_consumer(settings: KafkaSettings, isolation: str) -> AIOKafkaConsumer:
    return AIOKafkaConsumer(
        bootstrap_servers=settings.bootstrap_servers,
        isolation_level=isolation,
        enable_auto_commit=False,
    )


async def stable_end(settings: KafkaSettings, tp: TopicPartition) -> int:
    """The end of ``tp`` once no transaction is open on it (last stable offset = high
    watermark). A commit returns before the broker wrote its markers, and until then the last
    stable offset stays before the committed records: a reader right after would miss them."""
    committed, everything = (
        raw_consumer(settings, "read_committed"),
        raw_consumer(settings, "read_uncommitted"),
    )
    await committed.start()
    try:
        await everything.start()
        try:
            async with asyncio.timeout(30):
                while True:
                    lso = (await committed.end_offsets([tp]))[tp]
                    if lso == (await everything.end_offsets([tp]))[tp]:
                        return int(lso)
                    await asyncio.sleep(0.05)  # a poll interval, not a wait for something
        finally:
            await everything.stop()
    finally:
        await committed.stop()


async def read_values(
    settings: KafkaSettings, topic: str, isolation: str = "read_committed"
) -> list[str]:
    """Every value of ``topic`` (one partition) up to its end as ``isolation`` reads it (for
    read_committed: the last stable offset, once no transaction is open), in log order."""
    tp = TopicPartition(topic, 0)
    settled = await stable_end(settings, tp) if isolation == "read_committed" else None
    consumer = raw_consumer(settings, isolation)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp] if settled is None else settled
        values: list[str] = []
        async with asyncio.timeout(30):
            while await consumer.position(tp) < end:
                batch = await consumer.getmany(tp, timeout_ms=200)
                values += [m.value.decode() for m in batch.get(tp, []) if m.value is not None]
        return values
    finally:
        await consumer.stop()


# --------------------------------------------------------------------------- (a) transactions


async def test_a_transaction_commits_its_records_of_several_topics_together(
    kafka: KafkaSettings,
) -> None:
    await ensure_controller_topic(kafka)
    topics = kafka.topics
    async with TransactionalProducer(kafka, topics.controller_transactional_id) as producer:
        assert producer.state is TxnState.READY
        async with producer.transaction() as txn:
            for i in range(3):
                txn.send(topics.commands.name, f"cmd-{i}".encode())
            txn.send(topics.controller.name, b"leader-1", key=b"leader")
        assert [r.offset for r in txn.records[:3]] == [0, 1, 2]
        assert (txn.records[3].topic, txn.records[3].key) == (topics.controller.name, b"leader")
        # An exception in the block sends nothing, and the producer carries on.
        with pytest.raises(RuntimeError):
            async with producer.transaction() as txn:
                txn.send(topics.commands.name, b"never")
                raise RuntimeError("changed my mind")
        assert producer.state is TxnState.READY
        async with producer.transaction() as txn:
            txn.send(topics.commands.name, b"cmd-3")
    assert await read_values(kafka, topics.commands.name) == [f"cmd-{i}" for i in range(4)]
    assert await read_values(kafka, topics.controller.name) == ["leader-1"]


async def test_an_open_transaction_of_an_older_holder_is_aborted_by_the_init_and_never_seen(
    kafka: KafkaSettings,
) -> None:
    """A former holder of the id left a transaction open (records already in the log): the new
    producer's start() aborts it; a read_committed reader sees none of it, and the former
    holder's commit is refused."""
    topics = kafka.topics
    old = AIOKafkaProducer(
        bootstrap_servers=kafka.bootstrap_servers,
        transactional_id=topics.controller_transactional_id,
    )
    await old.start()
    try:
        await old.begin_transaction()
        for i in range(3):
            await (await old.send(topics.commands.name, f"old-{i}".encode()))
        assert await read_values(kafka, topics.commands.name, "read_uncommitted") == [
            "old-0",
            "old-1",
            "old-2",
        ]
        async with TransactionalProducer(kafka, topics.controller_transactional_id) as new:
            async with new.transaction() as txn:
                txn.send(topics.commands.name, b"new-0")
            with pytest.raises(ProducerFenced):
                await old.commit_transaction()
    finally:
        await old.stop()
    assert await read_values(kafka, topics.commands.name) == ["new-0"]


async def test_a_fenced_producer_is_closed_and_its_records_never_committed(
    kafka: KafkaSettings,
) -> None:
    topics = kafka.topics
    tid = topics.controller_transactional_id
    first = TransactionalProducer(kafka, tid)
    await first.start()
    try:
        async with first.transaction() as txn:
            txn.send(topics.commands.name, b"first-0")
        async with TransactionalProducer(kafka, tid) as second:
            assert second.producer_epoch > first.producer_epoch
            with pytest.raises(TransactionFenced) as info:
                async with first.transaction() as txn:
                    txn.send(topics.commands.name, b"first-1")
            assert info.value.code is LocalCode.CONTROLLER_FENCED
            assert "fenced" in info.value.message
            assert first.state is TxnState.FENCED
            with pytest.raises(BusError, match="fenced: a new one must be started"):
                async with first.transaction() as txn:
                    txn.send(topics.commands.name, b"first-2")
            async with second.transaction() as txn:
                txn.send(topics.commands.name, b"second-0")
    finally:
        await first.stop()
    assert first.state is TxnState.FENCED
    assert await read_values(kafka, topics.commands.name) == ["first-0", "second-0"]


async def test_a_transaction_past_its_timeout_has_an_unknown_outcome_that_the_next_init_settles(
    kafka: KafkaSettings,
) -> None:
    topics = kafka.topics
    tid = topics.controller_transactional_id
    producer = TransactionalProducer(kafka, tid, timeout_s=0.0001)
    await producer.start()
    try:
        with pytest.raises(TransactionOutcomeUnknown) as info:
            async with producer.transaction() as txn:
                for i in range(50):
                    txn.send(topics.commands.name, f"maybe-{i}".encode())
    finally:
        await producer.stop()
    assert info.value.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN
    assert "read the log again before deciding" in info.value.message
    assert producer.state is TxnState.UNKNOWN
    async with TransactionalProducer(kafka, tid) as successor, successor.transaction() as txn:
        txn.send(topics.commands.name, b"after")
    values = await read_values(kafka, topics.commands.name)
    assert values[-1] == "after"
    assert values[:-1] in ([], [f"maybe-{i}" for i in range(50)])  # all or nothing


# --------------------------------------------------------------------------- the election


async def until(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` passes (False)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)  # a poll interval, not a wait for something
    return True


def election(settings: KafkaSettings) -> LeaderElection:
    return LeaderElection(settings, session_timeout_ms=SESSION_MS, heartbeat_interval_ms=1000)


async def test_one_of_two_candidates_leads_and_the_other_takes_over_when_it_leaves(
    kafka: KafkaSettings,
) -> None:
    await ensure_controller_topic(kafka)
    first, second = election(kafka), election(kafka)
    async with first:
        generation = await asyncio.wait_for(first.wait_leader(), 30)
        assert first.is_leader(generation) and not first.is_leader(generation + 1)
        async with second:
            assert await until(lambda: second.member_generation is not None)
            joined = second.member_generation
            assert joined is not None and joined > generation
            # Exactly one of them leads the generation both are in.
            assert await until(
                lambda: (
                    (first.leader_generation, second.leader_generation)
                    in ((joined, None), (None, joined))
                )
            )
            leader, other = (first, second) if first.is_leader(joined) else (second, first)
            with pytest.raises(LeadershipLost):
                async with other.leading(joined):
                    pass
            await leader.stop()  # leaves the group: the other is elected at once
            took_over = await asyncio.wait_for(other.wait_leader(), 30)
            assert took_over > joined
            assert leader.leader_generation is None


async def test_a_revoke_waits_for_the_transaction_in_flight(kafka: KafkaSettings) -> None:
    """While the leader holds the lock (a transaction in flight), a rebalance takes its
    leadership at once (no new transaction may start) but the group waits for it (up to the
    rebalance timeout: after that it moves on, and the fencing protects the log)."""
    await ensure_controller_topic(kafka)
    first, second = election(kafka), election(kafka)
    async with first:
        generation = await asyncio.wait_for(first.wait_leader(), 30)
        try:
            async with first.leading(generation):
                joining = asyncio.create_task(second.start())  # returns once it has joined
                assert await until(lambda: first.leader_generation is None)
                assert not first.is_leader(generation)
                assert not await until(lambda: second.member_generation is not None, 1.0)
            await asyncio.wait_for(joining, 30)
            # The group waited for the first member: both are in the next generation.
            assert await until(
                lambda: first.member_generation == second.member_generation != generation
            )
        finally:
            await second.stop()


async def test_rejoin_forces_a_new_generation_only_from_the_one_still_led(
    kafka: KafkaSettings,
) -> None:
    """Fenced while the group still says "you lead" (the broker aborted a transaction that
    outlived its timeout): without a new generation nobody would init again."""
    await ensure_controller_topic(kafka)
    async with election(kafka) as candidate:
        generation = await asyncio.wait_for(candidate.wait_leader(), 30)
        assert not await candidate.rejoin(generation - 1)  # not the generation it sits in
        assert candidate.is_leader(generation)
        assert await candidate.rejoin(generation)
        assert not candidate.is_leader(generation)
        again = await asyncio.wait_for(candidate.wait_leader(), 30)
        assert again > generation


# --------------------------------------------------------------------------- (c) the broker's APIs


async def test_the_broker_still_offers_the_transaction_requests_aiokafka_sends(
    kafka: KafkaSettings,
) -> None:
    """aiokafka 0.14 speaks only v0 of the transaction requests; a Kafka that drops v0 (as
    KIP-896 did for other old versions) would break the controller: fail here first."""
    used = {
        InitProducerIdRequest.API_KEY: InitProducerIdRequest,
        AddPartitionsToTxnRequest.API_KEY: AddPartitionsToTxnRequest,
        AddOffsetsToTxnRequest.API_KEY: AddOffsetsToTxnRequest,
        EndTxnRequest.API_KEY: EndTxnRequest,
        TxnOffsetCommitRequest.API_KEY: TxnOffsetCommitRequest,
    }
    assert sorted(used) == [22, 24, 25, 26, 28]
    client = AIOKafkaClient(bootstrap_servers=kafka.bootstrap_servers)
    await client.bootstrap()
    try:
        ranges = {}
        for broker in client.cluster.brokers():
            response = await client.send(broker.nodeId, ApiVersionRequest())
            for key, low, high, *_ in response.api_versions:
                if key in used:
                    ranges[(broker.nodeId, key)] = (low, high)
    finally:
        await client.close()
    for key, request in used.items():
        versions = [cls.API_VERSION for cls in request._CLASSES]  # today [0] for each
        for (node, k), (low, high) in ranges.items():
            if k == key:
                assert any(low <= v <= high for v in versions), (
                    f"broker {node} offers API key {key} v{low}..v{high}; aiokafka sends {versions}"
                )
    nodes = {node for node, _ in ranges}
    assert nodes and all((node, key) in ranges for node in nodes for key in used), ranges


# --------------------------------------------------------------------------- (b) the zombie


class Member:
    """One controller process (tests/controller_member.py) and the lines it printed."""

    def __init__(self, settings: KafkaSettings, name: str) -> None:
        self.settings, self.name = settings, name
        self.lines: list[str] = []
        self.proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._new_line = asyncio.Event()

    async def start(self) -> None:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.controller_member",
            self.settings.bootstrap_servers,
            self.settings.topic_prefix,
            self.name,
            str(SESSION_MS),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        async for raw in self.proc.stdout:
            self.lines.append(raw.decode(errors="replace").rstrip())
            self._new_line.set()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.returncode is None:
            os.kill(self.proc.pid, sig)

    async def wait_line(
        self, predicate: Callable[[str], bool], *, start: int = 0, timeout: float = 60.0
    ) -> tuple[int, str]:
        """The first line from index ``start`` on that satisfies ``predicate``: (index, line)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    for i in range(start, len(self.lines)):
                        if predicate(self.lines[i]):
                            return i, self.lines[i]
                    start = len(self.lines)
                    self._new_line.clear()
                    await self._new_line.wait()
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: no such line within {timeout} s; it printed:\n"
                + "\n".join(self.lines[-60:])
            ) from None

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(20):
                await self.proc.wait()
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            await self._reader


def generation_of(value: str) -> int:
    return int(value.rsplit("-g", 1)[1])


def written(line: str) -> bool:
    return line.startswith("WROTE ")


async def test_a_paused_leader_is_fenced_and_nothing_it_tries_after_the_takeover_commits(
    kafka: KafkaSettings,
) -> None:
    """Two controller processes; SIGSTOP the leader, the other takes over; SIGCONT the first:
    its next write is refused (FENCED), and in the committed log no record of an older
    generation follows one of a newer generation (exp 3 of the research, as a test)."""
    await ensure_controller_topic(kafka)
    members = {name: Member(kafka, name) for name in ("A", "B")}
    try:
        await members["A"].start()
        await members["A"].wait_line(written)
        await members["B"].start()
        _, joined = await members["B"].wait_line(lambda line: line.startswith("MEMBER "))
        joined_generation = int(joined.split()[1])
        # Whoever leads the generation B joined in (or a later one) writes: that is the leader.
        leader_name = await first_writer(members, lambda g: g >= joined_generation)
        leader = members[leader_name]
        other = members["B" if leader_name == "A" else "A"]

        leader.signal(signal.SIGSTOP)
        _, took_over = await other.wait_line(
            lambda line: written(line) and generation_of(line.split()[1]) >= joined_generation,
            start=len(other.lines),
        )
        new_generation = generation_of(took_over.split()[1])
        resumed_at = len(leader.lines)  # all it printed before the stop has been read by now
        paused_generation = max(
            generation_of(line.split()[1]) for line in leader.lines if written(line)
        )
        leader.signal(signal.SIGCONT)

        # The zombie still believes it leads: its next write is refused by the fencing.
        _, fenced = await leader.wait_line(
            lambda line: line.startswith(("FENCED ", "LOST ")), start=resumed_at
        )
        assert fenced.startswith(f"FENCED {paused_generation} "), leader.lines[resumed_at:]
        # The group recovers: someone writes in a generation after the takeover.
        await first_writer(members, lambda g: g > new_generation, timeout=45)
    finally:
        for member in members.values():
            await member.stop()
            print(f"--- {member.name}:", *member.lines, sep="\n")  # shown when the test fails

    committed = await read_values(kafka, kafka.topics.commands.name)
    generations = [generation_of(v) for v in committed]
    later_than_newer = [
        committed[i] for i in range(1, len(committed)) if generations[i] < max(generations[:i])
    ]
    assert later_than_newer == [], committed
    tried_after_resume = [
        line.split()[1]
        for line in leader.lines[resumed_at:]
        if line.startswith("TRY ") and generation_of(line.split()[1]) == paused_generation
    ]
    assert tried_after_resume, leader.lines[resumed_at:]
    assert not set(tried_after_resume) & set(committed), (tried_after_resume, committed)
    first_of_other = next(i for i, v in enumerate(committed) if v.startswith(f"{other.name}-"))
    assert not [
        v
        for v in committed[first_of_other:]
        if v.startswith(f"{leader.name}-") and generation_of(v) <= paused_generation
    ], committed
    # Every write a member saw committed is in the log, and nothing is there that was not tried;
    # the fence is reported once, as a coded error (no traceback of aiokafka's own futures).
    for member in members.values():
        assert not [line for line in member.lines if "never retrieved" in line], member.lines
        wrote = {line.split()[1] for line in member.lines if written(line)}
        tried = {line.split()[1] for line in member.lines if line.startswith("TRY ")}
        mine = {v for v in committed if v.startswith(f"{member.name}-")}
        assert wrote <= mine <= tried, (member.name, wrote - mine, mine - tried)


async def first_writer(
    members: dict[str, Member], generation_ok: Callable[[int], bool], timeout: float = 60.0
) -> str:
    """The name of the first member (from now on) to write in a generation ``generation_ok``
    accepts."""
    starts = {name: len(m.lines) for name, m in members.items()}
    waits = {
        asyncio.ensure_future(
            m.wait_line(
                lambda line: written(line) and generation_ok(generation_of(line.split()[1])),
                start=starts[name],
                timeout=timeout,
            )
        ): name
        for name, m in members.items()
    }
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    finished = [t for t in done if t.exception() is None]
    if not finished:
        raise next(iter(done)).exception()  # type: ignore[misc]
    return waits[finished[0]]
