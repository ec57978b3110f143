"""Helpers for the fault suite on the local 3-node cluster (tests/integration/test_cluster_faults.py).

Real processes only: fake-runner worker agents (`python -m workers run`) and the `controlplane`
CLI, each with its output in a file; the topics are read back with a plain consumer, to their
end, to count what the fault left in the log. No sleeps to synchronize: every wait polls a
condition until a deadline.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError
from aiokafka.partitioner import DefaultPartitioner

from controlplane.coordinator.follower import PROBE_KEY
from controlplane.kafka.broker import LocalCluster
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    Heartbeat,
    WorkerStatus,
    decode_ack,
    decode_command,
    decode_heartbeat,
)
from controlplane.wire.topics import worker_key
from tests.factories import base_env, tail, worker_argv

JSON = dict[str, Any]
NODES = 3


async def until(
    predicate: Callable[[], Awaitable[bool] | bool], *, timeout: float, what: str
) -> None:
    """Poll ``predicate`` until it holds; AssertionError naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f}s: {what}")
        await asyncio.sleep(0.25)


# --------------------------------------------------------------------------- processes


class WorkerProcess:
    """`python -m workers run` with the fake runner; its log and journal in ``root``."""

    def __init__(
        self,
        root: Path,
        bootstrap: str,
        prefix: str,
        worker_id: str,
        options: JSON,
        labels: dict[str, str],
    ) -> None:
        self.worker_id = worker_id
        self.root = root
        self.log = root / f"{worker_id}.log"
        # The product's default heartbeat period: the liveness it gives is what is tested.
        self.argv = worker_argv(
            worker_id,
            bootstrap=bootstrap,
            prefix=prefix,
            state_dir=root / "state",
            options=options,
            allow_root=root / "ckpts",
            labels=labels,
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=base_env(), stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL if it does not exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def journal(self) -> list[JSON]:
        path = self.root / "state" / self.worker_id / "state.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out: list[JSON] = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a torn last line while it is being written
                    continue
        return out

    def outcomes(self) -> Counter[str]:
        """How many outcomes the journal recorded per command id (1 = applied once)."""
        return Counter(e["ack"]["command_id"] for e in self.journal() if e.get("t") == "outcome")

    def published(self) -> set[str]:
        """Command ids whose terminal ack the journal marks as published (or compacted so)."""
        marks = {e["id"] for e in self.journal() if e.get("t") == "published"}
        marks |= {
            e["ack"]["command_id"]
            for e in self.journal()
            if e.get("t") == "outcome" and e.get("published") is True
        }
        return marks

    def applied(self) -> Counter[str]:
        """How many times the agent started applying each command (its "applying" log lines)."""
        counts: Counter[str] = Counter()
        pattern = re.compile(r"\[worker=\S+ command=(\S+) rollout=\S+\] applying ")
        for line in self.log.read_text(errors="replace").splitlines():
            match = pattern.search(line)
            if match:
                counts[match.group(1)] += 1
        return counts


@dataclass
class CliRun:
    """One `python -m controlplane ...` process; stdout and stderr in files."""

    name: str
    argv: list[str]
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    rc: int | None = None

    @property
    def out(self) -> Path:
        return self.root / f"{self.name}.out"

    @property
    def err(self) -> Path:
        return self.root / f"{self.name}.err"

    def start(self) -> CliRun:
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(self.argv, env=base_env(), stdout=out, stderr=err)
        return self

    def poll(self) -> int | None:
        assert self.proc is not None
        self.rc = self.proc.poll()
        return self.rc

    def wait(self, timeout: float) -> int | None:
        """Its exit status, or None when it had not exited after ``timeout`` (then it is killed:
        a hang)."""
        assert self.proc is not None
        try:
            self.rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            self.rc = None
        return self.rc

    async def wait_async(self, timeout: float) -> int | None:
        return await asyncio.to_thread(self.wait, timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError as exc:
            raise AssertionError(f"not JSON from {self.name}: {self}") from exc

    def __str__(self) -> str:
        return (
            f"{self.name}: rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}"
            f"\n--- stderr\n{self.stderr[-3000:]}"
        )


@dataclass
class Fleet:
    """Three fake-runner workers on fresh RF-3 topics of the cluster, and the CLI against them."""

    cluster: LocalCluster
    root: Path
    prefix: str
    reload_delay_s: float
    size: int = 3
    labels: dict[str, str] = field(default_factory=lambda: {"suite": "faults"})
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    clis: list[CliRun] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpts" / "model.safetensors"

    def topic(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def cli(self, name: str, *args: str) -> CliRun:
        """Start ``controlplane ARGS --bootstrap ... --topic-prefix ...`` (not waited for)."""
        argv = [sys.executable, "-m", "controlplane", *args]
        argv += ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]
        run = CliRun(name, argv, self.root).start()
        self.clis.append(run)
        return run

    async def cli_done(self, name: str, *args: str, timeout: float = 300.0) -> CliRun:
        run = self.cli(name, *args)
        await run.wait_async(timeout)
        return run

    def reload(
        self,
        name: str,
        version: str,
        rollout_id: str,
        *extra: str,
        wait: bool = True,
        as_json: bool = True,
    ) -> CliRun:
        """`controlplane reload-weights` to every worker of the fleet (by its label); without
        ``as_json`` it prints what a person sees (progress lines on stderr, the table)."""
        args = [
            "reload-weights",
            str(self.ckpt),
            "--version",
            version,
            "--rollout-id",
            rollout_id,
            *[a for k, v in self.labels.items() for a in ("-s", f"{k}={v}")],
            "--ttl",
            "1800",
            *(["--json"] if as_json else []),
            *extra,
        ]
        if wait and "--wait" not in extra:
            args += ["--wait", "--wait-timeout", "600"]
        return self.cli(name, *args)

    async def setup(self) -> None:
        """`topics ensure` with RF 3 and min ISR 2, then the workers, until all are ready."""
        (self.root / "ckpts").mkdir(parents=True, exist_ok=True)
        self.ckpt.write_bytes(b"\0" * 64)
        ensured = await self.cli_done(
            "topics-ensure", "topics", "ensure", "--replication-factor", "3",
            "--min-insync-replicas", "2",
        )  # fmt: skip
        assert ensured.rc == 0, str(ensured)
        assert "replication factor 3, min.insync.replicas 2" in ensured.stdout, str(ensured)
        for i in range(1, self.size + 1):
            wid = f"w{i}"
            self.workers[wid] = WorkerProcess(
                self.root,
                self.bootstrap,
                self.prefix,
                wid,
                {"reload_delay_s": self.reload_delay_s},
                self.labels,
            )
            self.workers[wid].start()
        await self.wait_ready()

    async def wait_ready(self, timeout: float = 180.0) -> None:
        """Every worker's latest heartbeat in the log is ``ready`` (and no process exited)."""

        async def ready() -> bool:
            for w in self.workers.values():
                if not w.running:
                    raise AssertionError(f"worker {w.worker_id} exited:\n{tail(w.log)}")
            beats = await read_topic(self.bootstrap, self.topic("workers"), decode_heartbeat)
            latest: dict[str, Heartbeat] = {}
            for hb in beats:
                if hb.worker_id not in latest or hb.seq > latest[hb.worker_id].seq:
                    latest[hb.worker_id] = hb
            return all(
                wid in latest and latest[wid].status is WorkerStatus.READY for wid in self.workers
            )

        await until(ready, timeout=timeout, what="every worker is ready")

    async def wait_running(self, command_id: str, timeout: float = 120.0) -> None:
        """Every worker has acked ``running`` for ``command_id``: it is mid-apply."""

        async def running() -> bool:
            acks = await read_topic(self.bootstrap, self.topic("acks"), decode_ack)
            seen = {
                a.worker_id
                for a in acks
                if a.command_id == command_id and a.state is AckState.RUNNING
            }
            return seen >= set(self.workers)

        await until(running, timeout=timeout, what=f"every worker runs {command_id}")

    async def wait_published(self, command_ids: Iterable[str], timeout: float = 180.0) -> None:
        """Every worker's journal marks each command's terminal ack published (all in the log)."""
        wanted = set(command_ids)

        def published() -> bool:
            return all(wanted <= w.published() for w in self.workers.values())

        await until(published, timeout=timeout, what="every terminal ack is marked published")

    def stop(self) -> None:
        for run in self.clis:
            run.kill()
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers.values():
            w.stop()

    def logs(self) -> str:
        parts = [f"==== {w.log.name}\n{tail(w.log)}" for w in self.workers.values()]
        parts += [str(run) for run in self.clis[-6:]]
        return "\n".join(parts)


# --------------------------------------------------------------------------- reading the log


async def read_topic(
    bootstrap: str, topic: str, decode: Callable[[bytes], Any], timeout: float = 60.0
) -> list[Any]:
    """Every record of ``topic`` from the beginning to its end now, decoded (but the probe
    records readers append to the workers topic)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        async with asyncio.timeout(timeout):
            partitions: set[int] | None = None
            while not partitions:
                partitions = consumer.partitions_for_topic(topic)
                if not partitions:
                    await consumer._client.force_metadata_update()
            tps = [TopicPartition(topic, p) for p in sorted(partitions)]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            ends = await consumer.end_offsets(tps)
            items: list[Any] = []

            async def behind() -> bool:
                return any([await consumer.position(tp) < ends[tp] for tp in tps])

            while await behind():
                batch = await consumer.getmany(*tps, timeout_ms=500)
                for records in batch.values():
                    items += [
                        decode(r.value)
                        for r in records
                        if r.value is not None and r.key != PROBE_KEY  # readers' probes
                    ]
            return items
    finally:
        await consumer.stop()


async def readable(bootstrap: str, topics: Iterable[str], timeout: float = 15.0) -> bool:
    """Whether every partition of ``topics`` answers a read to its end now (after a failover a
    new leader answers for its end offset only once its high watermark is established)."""
    try:
        for topic in topics:
            await read_topic(bootstrap, topic, lambda value: value, timeout=timeout)
    except (KafkaError, TimeoutError):
        return False
    return True


async def partition_leaders(bootstrap: str, topic: str) -> dict[int, int]:
    """partition -> leader node id, for partitions that have a leader now ({} on an error)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        [described] = await admin.describe_topics([topic])
    except KafkaError:
        return {}
    finally:
        await admin.close()
    if described["error_code"] != 0:
        return {}
    return {
        int(p["partition"]): int(p["leader"])
        for p in described["partitions"]
        if p["error_code"] == 0 and p["leader"] >= 0
    }


def ack_partition(worker_id: str, partitions: int) -> int:
    """The acks partition a worker's acks go to (keyed by worker id, the default partitioner)."""
    every = list(range(partitions))
    return int(DefaultPartitioner()(worker_key(worker_id), every, every))


async def fully_replicated(bootstrap: str, topics: Iterable[str]) -> bool:
    """Every partition of ``topics`` has a leader and all three replicas in sync."""
    return await in_sync_everywhere(bootstrap, topics, NODES)


async def in_sync_everywhere(bootstrap: str, topics: Iterable[str], replicas: int) -> bool:
    """Every partition of ``topics`` has a leader and exactly ``replicas`` replicas in sync."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        described = await admin.describe_topics(list(topics))
    except KafkaError:
        return False
    finally:
        await admin.close()
    for topic in described:
        if topic["error_code"] != 0 or not topic["partitions"]:
            return False
        for p in topic["partitions"]:
            if p["error_code"] != 0 or p["leader"] < 0 or len(p["isr"]) != replicas:
                return False
    return True


async def set_min_insync(fleet: Fleet, value: int, timeout: float = 120.0) -> None:
    """Set ``min.insync.replicas`` of the fleet's three topics, keeping their other configs
    (AlterConfigs replaces a topic's whole config: the product's own is sent with it), and
    wait until the cluster describes the new value."""
    settings = KafkaSettings(
        bootstrap_servers=fleet.bootstrap,
        topic_prefix=fleet.prefix,
        replication_factor=NODES,
        min_insync_replicas=2,
    )
    specs = settings.topics.all()
    wanted = {spec.name: {**spec.config, "min.insync.replicas": str(value)} for spec in specs}
    admin = AIOKafkaAdminClient(bootstrap_servers=fleet.bootstrap)
    await admin.start()
    try:
        responses = await admin.alter_configs(
            [ConfigResource(ConfigResourceType.TOPIC, n, c) for n, c in wanted.items()]
        )
        for response in responses:
            for resource in response.resources:
                assert resource[0] == 0, f"alter configs: {resource}"

        async def described() -> bool:
            responses = await admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, n, None) for n in wanted]
            )
            got = {
                resource[3]: {entry[0]: entry[1] for entry in resource[4]}
                for response in responses
                for resource in response.resources
            }
            return all(got.get(n, {}).items() >= c.items() for n, c in wanted.items())

        await until(described, timeout=timeout, what=f"min.insync.replicas {value} described")
    finally:
        await admin.close()


async def whole(cluster: LocalCluster, topics: Iterable[str], timeout: float = 240.0) -> None:
    """Three brokers, and every partition of ``topics`` (and of the consumer offsets) led and
    with three in-sync replicas: the next node can be crashed without going below min ISR."""
    await asyncio.to_thread(cluster.wait_for_brokers, NODES, timeout=timeout)
    names = [*topics, "__consumer_offsets"]
    await until(
        lambda: fully_replicated(cluster.bootstrap, names),
        timeout=timeout,
        what=f"every partition of {names} has 3 in-sync replicas",
    )


# --------------------------------------------------------------------------- counting


@dataclass
class Tally:
    """What one test's log says: pairs, terminal acks, outcomes per pair, verdicts."""

    test: str
    pairs: int = 0
    terminal_acks: int = 0
    pairs_with_one_outcome: int = 0
    pairs_succeeded: int = 0
    pairs_applied_once: int = 0
    runs: int = 0
    true_verdicts: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"[faults] {self.test}: {self.pairs} (command, worker) pairs, "
            f"{self.terminal_acks} terminal acks, {self.pairs_with_one_outcome}/{self.pairs} "
            f"pairs with exactly one terminal outcome, {self.pairs_applied_once}/{self.pairs} "
            f"applied once, true verdicts {self.true_verdicts}/{self.runs} runs"
            + (f"; {'; '.join(self.notes)}" if self.notes else "")
        )

    def as_json(self) -> JSON:
        return {
            "test": self.test,
            "pairs": self.pairs,
            "terminal_acks": self.terminal_acks,
            "pairs_with_one_terminal_outcome": self.pairs_with_one_outcome,
            "pairs_succeeded": self.pairs_succeeded,
            "pairs_applied_once": self.pairs_applied_once,
            "runs": self.runs,
            "true_verdicts": self.true_verdicts,
            "notes": self.notes,
            "problems": self.problems,
        }


async def count_log(fleet: Fleet, tally: Tally) -> tuple[list[Command], list[Ack]]:
    """Fill ``tally`` from the topics and the journals: for every command in the log and every
    worker it pinned, its terminal acks, distinct terminal outcomes, and applications."""
    commands: list[Command] = await read_topic(
        fleet.bootstrap, fleet.topic("commands"), decode_command
    )
    acks: list[Ack] = await read_topic(fleet.bootstrap, fleet.topic("acks"), decode_ack)
    terminal: dict[tuple[str, str], list[Ack]] = defaultdict(list)
    for a in acks:
        if a.state.terminal:
            terminal[(a.command_id, a.worker_id)].append(a)
    journals = {wid: w.outcomes() for wid, w in fleet.workers.items()}
    applied = {wid: w.applied() for wid, w in fleet.workers.items()}
    for command in commands:
        for wid in command.selector.worker_ids or []:
            pair = (command.command_id, wid)
            tally.pairs += 1
            finals = terminal.get(pair, [])
            tally.terminal_acks += len(finals)
            states = {a.state for a in finals}
            if len(states) == 1:
                tally.pairs_with_one_outcome += 1
            else:
                tally.problems.append(
                    f"{pair}: terminal outcomes {sorted(s.value for s in states)}"
                )
            if states == {AckState.SUCCEEDED}:
                tally.pairs_succeeded += 1
            else:
                tally.problems.append(f"{pair}: not succeeded: {sorted(s.value for s in states)}")
            recorded = journals.get(wid, Counter())[command.command_id]
            started = applied.get(wid, Counter())[command.command_id]
            if recorded == 1 and started == 1:
                tally.pairs_applied_once += 1
            else:
                tally.problems.append(
                    f"{pair}: {recorded} journal outcomes, {started} 'applying' log lines"
                )
    return commands, acks


def report(tally: Tally, out_dir: Path, basetemp: Path) -> Path:
    """Write the tally to ``out_dir/fault-counts.json`` and append it to the session's
    ``basetemp/cluster-fault-counts.jsonl``; returns the first."""
    path = out_dir / "fault-counts.json"
    path.write_text(json.dumps(tally.as_json(), indent=2) + "\n")
    with open(basetemp / "cluster-fault-counts.jsonl", "a") as all_tests:
        all_tests.write(json.dumps(tally.as_json()) + "\n")
    return path
