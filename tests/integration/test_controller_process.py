"""Progressive rollouts when a coordinator PROCESS dies or pauses (issue 12): coordinators
(`controlplane coordinator`) and fake-runner workers (`python -m workers run`) as separate OS
processes on the real broker.

- SIGKILL mid-wave, and between waves: a new coordinator resumes the same rollout from the log
  alone; every worker is commanded once, acks one success, and applies once (its journal).
- SIGSTOP the leading coordinator of two: the other takes over; SIGCONT: the former leader
  publishes nothing more, and the log has no duplicate command.

The test reads the log itself (a Follower folding the controller topic), and waits on what it
shows (a batch published, a worker's ``running`` ack, a phase, a leader record); never a sleep.
The in-process variants are in test_progressive.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from controlplane.coordinator.follower import Batch, Follower
from controlplane.coordinator.publisher import publish_control
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.progressive import batch_rollout_id
from controlplane.rollout.targets import ControlState, Rollout
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Desired,
    LeaderRecord,
    RolloutAction,
    RolloutSpec,
    RolloutState,
    Strategy,
    TargetSpec,
    WeightsRef,
    decode_control,
)
from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    Heartbeat,
    WorkerStatus,
    decode_ack,
    decode_command,
    utcnow,
)
from tests.factories import base_env, tail
from tests.faults.processes import WorkerProcess
from tests.faults.reading import until

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

LABELS = {"model": "tiny"}
TARGET = "tiny"
#: The broker's minimum: a dead or paused leader loses the lead after this long.
SESSION_TIMEOUT_MS = 6000


# --------------------------------------------------------------------------- processes


class CoordinatorProcess:
    """`python -m controlplane coordinator`, configured by FLEET_COORDINATOR_* as deployed."""

    def __init__(self, kafka: KafkaSettings, root: Path, name: str) -> None:
        self.name = name
        self.log = root / f"{name}.log"
        self.env = {
            **base_env(),
            "FLEET_COORDINATOR_KAFKA__BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
            "FLEET_COORDINATOR_KAFKA__TOPIC_PREFIX": kafka.topic_prefix,
            "FLEET_COORDINATOR_PORT": "0",
            "FLEET_COORDINATOR_CONTROLLER_SESSION_TIMEOUT_MS": str(SESSION_TIMEOUT_MS),
            # Its commands say who published them (the controller issues them as this).
            "FLEET_COORDINATOR_ISSUER": name,
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> CoordinatorProcess:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "controlplane", "coordinator"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self

    @property
    def member(self) -> str:
        """Its name in the controller's election, as its LeaderRecord says it."""
        assert self.proc is not None
        return f"{socket.gethostname()}-{self.proc.pid}"

    def signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None and self.proc.poll() is None, self.text()
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        assert self.proc.wait(30) == -signal.SIGKILL

    def state(self) -> str:
        """The process's state letter in /proc (``T``: stopped)."""
        assert self.proc is not None
        stat = Path(f"/proc/{self.proc.pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


# --------------------------------------------------------------------------- the test's reader


class Watch:
    """The test's own replica of the log: a Follower folding the controller topic into a
    ControlState, followed in the background, and what it read, in log order."""

    def __init__(self, kafka: KafkaSettings) -> None:
        self.control = ControlState()
        self.follower = Follower(kafka, control=self.control)
        self.commands: list[Command] = []
        self.acks: list[Any] = []
        self.leaders: list[LeaderRecord] = []
        self.heartbeats: dict[str, Heartbeat] = {}
        #: Errors of the background polls (it polls on after each).
        self.errors: list[str] = []
        self.follower.listeners.append(self._on_batch)

    def _on_batch(self, batch: Batch) -> None:
        self.commands += batch.commands
        self.acks += batch.acks
        self.leaders += [r for r in batch.control if isinstance(r, LeaderRecord)]
        for hb in batch.heartbeats:
            seen = self.heartbeats.get(hb.worker_id)
            if seen is None or hb.seq > seen.seq:
                self.heartbeats[hb.worker_id] = hb

    def rollout(self, rollout_id: str) -> Rollout | None:
        return self.control.rollout(rollout_id)

    def state(self, rollout_id: str) -> RolloutState | None:
        rollout = self.rollout(rollout_id)
        return None if rollout is None else rollout.state

    def phase(self, rollout_id: str) -> ControlPhase | None:
        rollout = self.rollout(rollout_id)
        return None if rollout is None else rollout.phase

    def published(self, batch_id: str) -> Command | None:
        return next((c for c in self.commands if c.rollout_id == batch_id), None)

    def running(self, batch_id: str) -> bool:
        """Every worker of the batch's command acked ``running`` (it is mid-apply)."""
        command = self.published(batch_id)
        if command is None:
            return False
        running = {
            a.worker_id
            for a in self.acks
            if a.rollout_id == batch_id and a.state is AckState.RUNNING
        }
        return running >= set(command.selector.worker_ids or [])

    def leads(self, coordinator: CoordinatorProcess) -> LeaderRecord | None:
        """Its latest LeaderRecord, if the latest of the log is its own."""
        leader = self.leaders[-1] if self.leaders else None
        return leader if leader is not None and leader.member == coordinator.member else None

    def ready(self, workers: Sequence[str]) -> bool:
        return all(
            (hb := self.heartbeats.get(w)) is not None and hb.status is WorkerStatus.READY
            for w in workers
        )


@contextlib.asynccontextmanager
async def watching(kafka: KafkaSettings) -> AsyncIterator[Watch]:
    watch = Watch(kafka)

    async def follow() -> None:
        while True:
            try:
                await watch.follower.poll(timeout_s=0.5)
            except Exception as exc:  # shown with the logs when a wait times out
                watch.errors.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(0.5)  # a retry delay, not a synchronization

    async with watch.follower:
        task = asyncio.create_task(follow())
        try:
            yield watch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


@dataclass
class Logged:
    """One record as a reader at an isolation level sees it."""

    offset: int
    item: Any


async def read_log(
    kafka: KafkaSettings,
    topic: str,
    decode: Callable[[bytes], Any],
    isolation: str = "read_committed",
) -> list[Logged]:
    """Every record of every partition of ``topic`` up to its end now (read_committed: the last
    stable offset), decoded, in log order per partition (offsets kept)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka.bootstrap_servers,
        isolation_level=isolation,
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic)
        while not partitions:
            await consumer._client.force_metadata_update()
            partitions = consumer.partitions_for_topic(topic)
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: dict[int, list[Logged]] = {tp.partition: [] for tp in tps}
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            fetched = await consumer.getmany(*tps, timeout_ms=200)
            for tp, records in fetched.items():
                out[tp.partition] += [
                    Logged(r.offset, decode(r.value)) for r in records if r.value is not None
                ]
        return [logged for p in sorted(out) for logged in out[p]]
    finally:
        await consumer.stop()


async def end_offset(kafka: KafkaSettings, topic: str) -> int:
    """The high watermark of ``topic``'s partition 0 now (uncommitted records included)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap_servers)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        return int((await consumer.end_offsets([tp]))[tp])
    finally:
        await consumer.stop()


# --------------------------------------------------------------------------- the fleet


@dataclass
class ProcessFleet:
    kafka: KafkaSettings
    root: Path
    workers: dict[str, WorkerProcess]
    coordinators: list[CoordinatorProcess]
    watch: Watch

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpts" / "model.safetensors"

    def weights(self, version: str) -> WeightsRef:
        return WeightsRef(path=str(self.ckpt), version=version)

    def coordinator(self, name: str) -> CoordinatorProcess:
        coordinator = CoordinatorProcess(self.kafka, self.root, name).start()
        self.coordinators.append(coordinator)
        return coordinator

    async def leading(self, coordinator: CoordinatorProcess, timeout: float = 90) -> LeaderRecord:
        """Wait until the log's latest LeaderRecord is ``coordinator``'s."""

        def leads() -> bool:
            assert coordinator.running, f"{coordinator.name} exited:\n{tail(coordinator.log)}"
            return self.watch.leads(coordinator) is not None

        await until(leads, timeout=timeout, what=f"{coordinator.name} leads\n{self.logs()}")
        leader = self.watch.leads(coordinator)
        assert leader is not None
        return leader

    async def send(self, record: Any) -> None:
        await publish_control(self.kafka, record)

    async def rollout(self, rollout_id: str, strategy: Strategy) -> None:
        """The target at v1 (where every worker starts), and a rollout of v2 to it."""
        now = utcnow()
        await self.send(
            TargetSpec(
                name=TARGET,
                selector=LABELS,
                stable=Desired(weights=self.weights("v1")),
                issued_at=now,
                issuer="tests",
            )
        )
        await self.send(
            RolloutSpec(
                rollout_id=rollout_id,
                target=TARGET,
                desired=Desired(weights=self.weights("v2")),
                strategy=strategy,
                issued_at=now,
                issuer="tests",
            )
        )

    async def promote(self, rollout_id: str) -> None:
        await self.send(
            RolloutAction(
                rollout_id=rollout_id,
                action_id="promote-1",
                action=ActionKind.PROMOTE,
                issued_at=utcnow(),
                issuer="tests",
            )
        )

    async def until_state(
        self, rollout_id: str, ok: Callable[[RolloutState], bool], what: str, timeout: float = 90
    ) -> RolloutState:
        def reached() -> bool:
            state = self.watch.state(rollout_id)
            return state is not None and ok(state)

        await until(reached, timeout=timeout, what=f"{rollout_id}: {what}\n{self.logs()}")
        state = self.watch.state(rollout_id)
        assert state is not None
        return state

    async def succeeded(self, rollout_id: str, timeout: float = 90) -> RolloutState:
        state = await self.until_state(
            rollout_id, lambda s: s.phase.terminal, "ended", timeout=timeout
        )
        assert state.phase is ControlPhase.SUCCEEDED, (state, self.logs())
        return state

    async def running(self, batch_id: str, timeout: float = 90) -> None:
        """Wait until ``batch_id`` is published and its workers ack ``running``."""
        await until(
            lambda: self.watch.running(batch_id),
            timeout=timeout,
            what=f"{batch_id} published and running\n{self.logs()}",
        )

    def logs(self) -> str:
        rollouts = self.watch.control.rollouts()
        parts = [f"==== {c.name}\n{tail(c.log, 30)}" for c in self.coordinators]
        parts += [f"==== {w.log.name}\n{tail(w.log, 10)}" for w in self.workers.values()]
        parts.append(
            f"==== the test's reader: "
            f"{[(r.rollout_id, r.phase, r.state and r.state.revision) for r in rollouts]}, "
            f"{self.watch.follower.records} records, errors {self.watch.errors[-5:]}"
        )
        return "\n".join(parts)


@contextlib.asynccontextmanager
async def process_fleet(
    kafka: KafkaSettings, root: Path, n: int, reload_delay_s: float
) -> AsyncIterator[ProcessFleet]:
    """``n`` fake-runner workers at v1, each reload taking ``reload_delay_s``; ready; no
    coordinator yet."""
    (root / "ckpts").mkdir()
    (root / "ckpts" / "model.safetensors").write_bytes(b"\0" * 64)
    options = {"initial_version": "v1", "reload_delay_s": reload_delay_s}
    workers = {
        f"w{i}": WorkerProcess(
            root, kafka.bootstrap_servers, kafka.topic_prefix, f"w{i}", options, LABELS
        )
        for i in range(1, n + 1)
    }
    fleet: ProcessFleet | None = None
    try:
        async with watching(kafka) as watch:
            for worker in workers.values():
                worker.start()
            fleet = ProcessFleet(kafka, root, workers, [], watch)

            def ready() -> bool:
                for w in workers.values():
                    assert w.running, f"{w.worker_id} exited:\n{tail(w.log)}"
                return watch.ready(list(workers))

            await until(ready, timeout=90, what="every worker is ready")
            yield fleet
    finally:
        for coordinator in fleet.coordinators if fleet is not None else []:
            coordinator.stop()
        for worker in workers.values():
            if worker.proc is not None and worker.proc.poll() is None:
                worker.proc.terminate()
        for worker in workers.values():
            worker.stop()


# --------------------------------------------------------------------------- checks

_BATCH = re.compile(r"\.w(\d+)\.b(\d+)")


async def assert_applied_once(fleet: ProcessFleet, rollout_id: str, state: RolloutState) -> None:
    """Exactly one application per worker, in the wave the rollout planned for it: one command
    of the rollout per worker on the commands topic (no rollout or command id twice), one
    succeeded ack per worker, one outcome in its journal and one ``applying`` in its log."""
    kafka = fleet.kafka
    prefix = f"{rollout_id}."
    commands = [
        c.item
        for c in await read_log(kafka, kafka.topics.commands.name, decode_command)
        if c.item.rollout_id.startswith(prefix)
    ]
    ids = [c.rollout_id for c in commands]
    assert len(ids) == len(set(ids)), f"a rollout id twice: {ids}"
    command_ids = [c.command_id for c in commands]
    assert len(command_ids) == len(set(command_ids)), f"a command id twice: {command_ids}"
    wave_of = {w: i for i, wave in enumerate(state.waves) for w in wave}
    assert sorted(wave_of) == sorted(fleet.workers)  # every worker in exactly one wave
    commanded: dict[str, list[str]] = {}
    for command in commands:
        match = _BATCH.search(command.rollout_id)
        assert match is not None, command.rollout_id
        for worker in command.selector.worker_ids or []:
            commanded.setdefault(worker, []).append(command.rollout_id)
            assert wave_of[worker] == int(match.group(1)), (worker, command.rollout_id)
    assert {w: len(ids) for w, ids in commanded.items()} == dict.fromkeys(fleet.workers, 1), (
        commanded
    )
    acks: list[Ack] = [
        a.item
        for a in await read_log(kafka, kafka.topics.acks.name, decode_ack)
        if a.item.rollout_id.startswith(prefix)
    ]
    succeeded = Counter(a.worker_id for a in acks if a.state is AckState.SUCCEEDED)
    assert succeeded == Counter(dict.fromkeys(fleet.workers, 1)), succeeded
    assert all(a.weights_version == "v2" for a in acks if a.state is AckState.SUCCEEDED)
    for worker_id, worker in fleet.workers.items():
        [command_id] = [f"{batch}.a1" for batch in commanded[worker_id]]
        outcomes = {c: n for c, n in worker.outcomes().items() if c.startswith(prefix)}
        assert outcomes == {command_id: 1}, (worker_id, worker.journal())
        applied = {c: n for c, n in worker.applied().items() if c.startswith(prefix)}
        assert applied == {command_id: 1}, (worker_id, tail(worker.log))


async def controller_log(kafka: KafkaSettings, isolation: str = "read_committed") -> list[Logged]:
    return await read_log(kafka, kafka.topics.controller.name, decode_control, isolation)


def assert_one_history(records: Sequence[Logged], rollout_id: str) -> list[RolloutState]:
    """The rollout's states in log order: one revision after another (no two controllers
    writing from the same state), the same waves throughout (never planned twice)."""
    states: list[RolloutState] = [
        r.item
        for r in records
        if isinstance(r.item, RolloutState) and r.item.rollout_id == rollout_id
    ]
    assert states, rollout_id
    revisions = [s.revision for s in states]
    assert revisions == sorted(set(revisions)), f"revisions out of order or twice: {revisions}"
    assert all(s.waves == states[0].waves for s in states), [s.waves for s in states]
    return states


# --------------------------------------------------------------------------- the tests


async def test_a_coordinator_killed_mid_wave_is_resumed_by_a_new_one_applying_each_worker_once(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """SIGKILL the coordinator while a batch of wave 1 is applying (its worker acked
    ``running``); a new coordinator process resumes the same wave from the log: the rollout
    succeeds and every worker was commanded, acked and applied exactly once."""
    async with process_fleet(kafka, tmp_path, 4, reload_delay_s=2.0) as fleet:
        first = fleet.coordinator("coord-a")
        await fleet.leading(first)
        await fleet.rollout("r-kill", Strategy(canary=1, steps=["100%"], max_unavailable=1))
        mid_wave = batch_rollout_id("r-kill", 1, 0)
        await fleet.running(mid_wave)
        before = fleet.watch.state("r-kill")
        assert before is not None and before.wave == 1
        first.kill()
        second = fleet.coordinator("coord-b")
        await fleet.leading(second)
        state = await fleet.succeeded("r-kill")
        assert state.waves == before.waves  # the same plan, resumed
        await assert_applied_once(fleet, "r-kill", state)
        history = assert_one_history(await controller_log(kafka), "r-kill")
        # The new coordinator wrote the rest: wave 1 had batches left when the first died.
        issuers = {
            c.rollout_id: c.issuer
            for c in fleet.watch.commands
            if c.rollout_id.startswith("r-kill")
        }
        assert issuers[batch_rollout_id("r-kill", 0, 0)] == "coord-a"
        assert issuers[mid_wave] == "coord-a"
        assert issuers[batch_rollout_id("r-kill", 1, 2)] == "coord-b"  # (>= 4 s after the kill)
        assert history[-1].phase is ControlPhase.SUCCEEDED


@pytest.mark.parametrize("pause", ["manual", 5.0], ids=["manual", "timed"])
async def test_a_coordinator_killed_between_waves_is_resumed_by_a_new_one_applying_each_worker_once(
    kafka: KafkaSettings, tmp_path: Path, pause: str | float
) -> None:
    """SIGKILL the coordinator in the pause after the canary's wave passed its gates (``manual``:
    waiting for promote, promoted once the new one leads; ``timed``: inside a 5 s pause); a new
    coordinator process starts the next wave, never the canary's again."""
    async with process_fleet(kafka, tmp_path, 4, reload_delay_s=0.5) as fleet:
        first = fleet.coordinator("coord-a")
        await fleet.leading(first)
        strategy = Strategy(canary=1, steps=["100%"], max_unavailable=2, pause=pause)
        await fleet.rollout("r-pause", strategy)

        def in_the_pause(s: RolloutState) -> bool:
            passed = any(g.wave == 0 and g.gate == "health" and g.passed for g in s.gates)
            return s.wave == 0 and passed and not s.phase.terminal

        before = await fleet.until_state("r-pause", in_the_pause, "wave 0 passed, pausing")
        if pause == "manual":
            before = await fleet.until_state(
                "r-pause", lambda s: s.phase is ControlPhase.PAUSED, "paused"
            )
        first.kill()
        commanded = [c.rollout_id for c in fleet.watch.commands]
        assert commanded == [batch_rollout_id("r-pause", 0, 0)]  # the canary only, so far
        second = fleet.coordinator("coord-b")
        await fleet.leading(second)
        if pause == "manual":
            await fleet.promote("r-pause")
        state = await fleet.succeeded("r-pause")
        assert state.waves == before.waves
        await assert_applied_once(fleet, "r-pause", state)
        assert_one_history(await controller_log(kafka), "r-pause")
        issuers = {c.rollout_id: c.issuer for c in fleet.watch.commands}
        assert issuers == {
            batch_rollout_id("r-pause", 0, 0): "coord-a",
            batch_rollout_id("r-pause", 1, 0): "coord-b",
            batch_rollout_id("r-pause", 1, 1): "coord-b",
        }


async def test_a_paused_leader_publishes_nothing_after_the_other_coordinator_took_over(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """Two coordinators; SIGSTOP the leading one mid-wave; the other takes over (a LeaderRecord
    of a higher generation) and drives the rollout on; SIGCONT the first: nothing of it is
    committed after that (commands and controller records, read_committed), no rollout id twice."""
    async with process_fleet(kafka, tmp_path, 4, reload_delay_s=2.0) as fleet:
        first = fleet.coordinator("coord-a")
        elected = await fleet.leading(first)
        second = fleet.coordinator("coord-b")
        # The second one joined the group: the first leads again, in a newer generation.
        await until(
            lambda: (
                (lead := fleet.watch.leads(first)) is not None
                and lead.generation > elected.generation
            ),
            timeout=90,
            what=f"coord-b joined the election\n{fleet.logs()}",
        )
        await fleet.rollout("r-zombie", Strategy(canary=1, steps=["100%"], max_unavailable=1))
        mid_wave = batch_rollout_id("r-zombie", 1, 0)
        await fleet.running(mid_wave)
        old = fleet.watch.leads(first)
        assert old is not None
        first.signal(signal.SIGSTOP)
        await until(lambda: first.state() == "T", timeout=10, what="coord-a stopped")
        # Everything coord-a wrote lies below these offsets: it cannot append after its stop.
        topics = kafka.topics
        commands_end = await end_offset(kafka, topics.commands.name)
        new = await fleet.leading(second)
        assert new.generation > old.generation
        # The new leader drives the rollout on: it publishes the wave's next batch.
        await until(
            lambda: any(c.issuer == "coord-b" for c in fleet.watch.commands),
            timeout=90,
            what=f"coord-b publishes\n{fleet.logs()}",
        )
        resumed_at = len(first.text())
        first.signal(signal.SIGCONT)
        state = await fleet.succeeded("r-zombie")
        await assert_applied_once(fleet, "r-zombie", state)
        # One leader per generation, generations in order: nothing of an older generation
        # after a newer one's LeaderRecord; one history of the rollout; no command twice.
        committed = await controller_log(kafka)
        leaders = [(r.offset, r.item) for r in committed if isinstance(r.item, LeaderRecord)]
        generations = [leader.generation for _, leader in leaders]
        assert generations == sorted(set(generations)), generations
        took_over = next(o for o, leader in leaders if leader.member == second.member)
        assert_one_history(committed, "r-zombie")
        commands = await read_log(kafka, topics.commands.name, decode_command)
        ids = [c.item.rollout_id for c in commands]
        assert len(ids) == len(set(ids)), ids
        # The group keeps the lead with the new leader (the sticky assignor knows the
        # generation: a resumed former leader's claim to the partition is older).
        elected_again = [g for o, g in leaders if o > took_over and g.member == first.member]
        assert elected_again == [], elected_again
        # It publishes nothing more: every coord-a command lies before coord-b's, below where
        # the log ended when it was stopped.
        issuers = [c.item.issuer for c in commands]
        assert set(issuers) == {"coord-a", "coord-b"}
        last_a = max(i for i, issuer in enumerate(issuers) if issuer == "coord-a")
        assert last_a < issuers.index("coord-b"), issuers
        late = [c for c in commands if c.item.issuer == "coord-a" and c.offset >= commands_end]
        assert late == [], late
        # read_uncommitted shows what was written, committed or not: what coord-a wrote after
        # its stop (a zombie's writes, aborted by the new leader's init) is never committed.
        raw = await read_log(kafka, topics.commands.name, decode_command, "read_uncommitted")
        visible = {c.offset for c in commands}
        zombie = [c for c in raw if c.item.issuer == "coord-a" and c.offset >= commands_end]
        assert not [c for c in zombie if c.offset in visible], zombie
        raw_control = await controller_log(kafka, "read_uncommitted")
        # The former leader learnt it lost (revoked, or fenced at its first write), and lives.
        await until(
            lambda: (
                re.search(
                    r"controller: generation \d+ ended|CONTROLLER_FENCED", first.text()[resumed_at:]
                )
                is not None
            ),
            timeout=60,
            what=f"coord-a steps down\n{fleet.logs()}",
        )
        assert first.running, tail(first.log)
        print(
            f"coord-a after SIGCONT: uncommitted commands {[c.item.rollout_id for c in zombie]}, "
            f"aborted controller records {len(raw_control) - len(committed)}, "
            f"fenced: {'CONTROLLER_FENCED' in first.text()[resumed_at:]}"
        )
