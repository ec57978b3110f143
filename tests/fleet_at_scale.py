"""A synthetic fleet folded in memory, to measure and test the HTTP API at fleet scale (issue 18).

``build(coordinator, workers=N, rollouts=R)`` feeds a never-started Coordinator's Fleet (and its
follower listeners, as a fetch does) with N live workers' heartbeats and R reload rollouts
pinned to all N: accepted, running and succeeded acks for every worker of every rollout (3 N
acks per rollout), except that the last ``active`` rollouts are still in progress (half of their
workers running) and every 50th worker failed the oldest one. Acks are the fast decoder's
(:class:`~controlplane.wire.ack_codec.FastAck`), as the coordinator folds them.

``python -m tests.fleet_at_scale [N] [R] [ROUNDS] [ACTIVE]`` builds one (10,000 x 100, 2 of them in
progress, by default), folds every worker's heartbeat every 3 s meanwhile, and prints what the
summary, list and page endpoints cost through httpx's ASGI transport: p50 and p99 wall time and
bytes of each (tests never assert on time; tests/component/test_api_scale.py asserts on sizes
and pagination). ``python -m tests.fleet_at_scale --restart [N] [R]``: a coordinator caught up on
that history: its first summary, its first compaction (and the longest the event loop waited
meanwhile), its memory, and how soon a new rollout's 3 N acks show it succeeded.
``python -m tests.fleet_at_scale --snapshot [N] [R]``: what a snapshot of that fold costs (size,
encoding, the event loop's longest wait) and what restoring it costs, against folding it all.
``python -m tests.fleet_at_scale --start [N] [R]``: on a local broker it starts, that history
written as records, a coordinator's start to ready from a snapshot and in full (child processes).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Final

from bench.scale.probe import dashboard_paths
from controlplane.coordinator.follower import Batch
from controlplane.coordinator.service import Coordinator
from controlplane.rollout.judge import Tally
from controlplane.wire.ack_codec import FastAck, FastAckError, FastTimings
from controlplane.wire.protocol import (
    AckState,
    Command,
    CommandKind,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    WorkerStatus,
)

#: Heartbeats are sent from here on; rollouts are issued before it, 60 s apart.
NOW: Final = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
ISSUE_EVERY: Final = timedelta(seconds=60)
BATCH: Final = 5000


def worker_ids(n: int) -> list[str]:
    return [f"w{i:05d}" for i in range(n)]


def heartbeat(worker_id: str, index: int, sent: datetime, version: str) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        labels={"model": "big", "zone": f"z{index % 4}"},
        runner="fake",
        device="cpu",
        status=WorkerStatus.BUSY if index % 10 == 0 else WorkerStatus.READY,
        weights_version=version,
        config_digest=f"cfg{index % 3}",
        seq=int(sent.timestamp()),
        sent_at=sent,
        started_at=sent - timedelta(hours=1),
        interval_s=3.0,
    )


def rollout_command(index: int, rollouts: int, ids: list[str]) -> Command:
    issued = NOW - ISSUE_EVERY * (rollouts - index)
    return Command(
        command_id=f"c{index:04d}",
        rollout_id=f"r{index:04d}",
        issued_at=issued,
        expires_at=issued + timedelta(days=1),
        issuer="scale",
        selector=Selector(worker_ids=ids),
        spec=ReloadWeightsSpec(path=f"/ckpt/v{index}", version=f"v{index}"),
    )


def _acks(
    command: Command, worker_id: str, states: tuple[AckState, ...], failed: bool
) -> Iterator[FastAck]:
    t = command.issued_at + timedelta(seconds=1)
    for state in states:
        error = None
        if failed and state is AckState.SUCCEEDED:
            state, error = AckState.FAILED, FastAckError("RUNNER_FAILED", "out of memory", False)
        yield FastAck(
            schema_version=1,
            command_id=command.command_id,
            rollout_id=command.rollout_id,
            worker_id=worker_id,
            state=state,
            timings=FastTimings(t, t, t if state.terminal else None),
            sent_at=t,
            kind=CommandKind.RELOAD_WEIGHTS,
            weights_version=command.spec.version if state is AckState.SUCCEEDED else None,  # type: ignore[union-attr]
            config_digest=None,
            error=error,
            attempt=1,
            result={},
        )


def _fold(coordinator: Coordinator, batch: Batch) -> None:
    """What the follower does with one fetch: fold, then tell the listeners."""
    fleet = coordinator.fleet
    for command in batch.commands:
        fleet.observe_command(command)
    for ack in batch.acks:
        fleet.observe_ack(ack)
    for hb in batch.heartbeats:
        fleet.observe_heartbeat(hb)
    for listener in coordinator.follower.listeners:
        listener(batch)


def build(
    coordinator: Coordinator, *, workers: int, rollouts: int, active: int = 2, replay: bool = False
) -> None:
    """Fold the synthetic fleet into ``coordinator`` (see the module's docstring); ``replay``:
    as the batches of a coordinator reading the log before it caught up."""
    ids = worker_ids(workers)
    done = (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED)
    for r in range(rollouts):
        command = rollout_command(r, rollouts, ids)
        batch = Batch(replay=replay)
        batch.commands.append(command)
        in_progress = r >= rollouts - active
        for i, worker_id in enumerate(ids):
            states = (AckState.ACCEPTED, AckState.RUNNING) if in_progress and i % 2 else done
            batch.acks.extend(_acks(command, worker_id, states, failed=r == 0 and i % 50 == 0))
            if len(batch.acks) >= BATCH:
                _fold(coordinator, batch)
                batch = Batch(replay=replay)
        _fold(coordinator, batch)
    finished = max(0, rollouts - active - 1)
    batch = Batch(replay=replay)
    for i, worker_id in enumerate(ids):
        batch.heartbeats.append(heartbeat(worker_id, i, NOW, f"v{finished}"))
        if len(batch.heartbeats) >= BATCH:
            _fold(coordinator, batch)
            batch = Batch(replay=replay)
    _fold(coordinator, batch)


# --------------------------------------------------------------------------- measuring


class Served:
    """An in-memory coordinator (no Kafka) with its app and the synthetic fleet built into it,
    judged by a clock that runs with the wall clock from :data:`NOW` on once :meth:`go_live`
    is called: what the scale scripts serve and measure."""

    def __init__(self, workers: int, rollouts: int, active: int) -> None:
        from pydantic import SecretStr

        from controlplane.api.app import create_app
        from controlplane.coordinator.service import CoordinatorSettings
        from controlplane.kafka.settings import KafkaSettings

        self.workers = workers
        self._origin = time.monotonic()
        settings = CoordinatorSettings(
            kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr("x")
        )
        self.coordinator = Coordinator(settings, clock=self.clock, current_as_of=self.clock)
        self.app = create_app(self.coordinator)
        started = time.perf_counter()
        build(self.coordinator, workers=workers, rollouts=rollouts, active=active, replay=True)
        self.build_s = time.perf_counter() - started

    def clock(self) -> datetime:
        return NOW + timedelta(seconds=time.monotonic() - self._origin)

    def go_live(self) -> None:
        """The clock starts at NOW now, and the coordinator counts as caught up."""
        self._origin = time.monotonic()
        self.coordinator.follower.caught_up.set()

    async def heartbeats(self) -> None:
        """Every worker every 3 s (1,000 every 0.3 s), folded as the follower would."""
        ids, n, i = worker_ids(self.workers), self.workers, 0
        while True:
            batch = Batch()
            for _ in range(min(1000, n)):
                batch.heartbeats.append(heartbeat(ids[i % n], i % n, self.clock(), "v1"))
                i += 1
            _fold(self.coordinator, batch)
            await asyncio.sleep(0.3)


async def _measure(workers: int, rollouts: int, rounds: int, active: int) -> None:
    import httpx

    live = Served(workers, rollouts, active)
    coordinator, app = live.coordinator, live.app
    print(
        f"built {workers} workers x {rollouts} rollouts ({active} in progress) "
        f"in {live.build_s:.1f} s"
    )
    live.go_live()
    heartbeats = live.heartbeats

    health: list[float] = []

    async def probe(client: httpx.AsyncClient) -> None:
        """/healthz every 50 ms: how late its answer is (the loop busy elsewhere counts)."""
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.05)
            await client.get("/healthz")
            health.append(time.perf_counter() - t - 0.05)

    last = f"r{rollouts - 1:04d}"
    paths = [
        "/api/v1/summary",
        f"/api/v1/rollouts/{last}/summary",
        "/api/v1/rollouts?limit=50",
        "/api/v1/workers?limit=100",
        f"/api/v1/rollouts/{last}/workers?limit=100",
        f"/api/v1/rollouts/{last}?workers_limit=100",
        "/metrics",
    ]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://c", timeout=600) as client:
        feeder = asyncio.create_task(heartbeats())
        await asyncio.sleep(0)
        prober = asyncio.create_task(probe(client))
        t = time.perf_counter()
        first = await client.get("/api/v1/summary")
        print(
            f"first /api/v1/summary after ready: {time.perf_counter() - t:.2f} s "
            f"({first.status_code}); /healthz meanwhile: max {1000 * max(health or [0]):.0f} ms"
        )
        for path in paths:  # each path's first answer may judge what it shows: said apart
            t = time.perf_counter()
            response = await client.get(path)
            print(f"first {path}: {1000 * (time.perf_counter() - t):.0f} ms")
        health.clear()
        times: dict[str, list[float]] = {p: [] for p in paths}
        sizes: dict[str, int] = {}
        for _ in range(rounds):
            for path in paths:
                t = time.perf_counter()
                response = await client.get(path)
                times[path].append(time.perf_counter() - t)
                sizes[path] = len(response.content)
                assert response.status_code == 200, (path, response.text[:300])
                await asyncio.sleep(0.05)
        for path in paths:
            got = sorted(times[path])
            p99 = got[min(len(got) - 1, round(0.99 * (len(got) - 1)))]
            print(
                f"{path:48s} p50 {1000 * statistics.median(got):7.1f} ms  p99 {1000 * p99:7.1f} ms"
                f"  {sizes[path] / 1024:8.1f} KiB"
            )
        update = 0
        for path in dashboard_paths(last):
            response = await client.get(path)
            assert response.status_code == 200, (path, response.text[:300])
            update += len(response.content)
        print(f"one dashboard update: {update / 1024:.1f} KiB")
        print(
            f"/healthz while serving: p50 {1000 * statistics.median(health):.1f} ms, "
            f"max {1000 * max(health):.0f} ms ({len(health)} probes)"
        )
        feeder.cancel()
        prober.cancel()
    app.state.summaries.close()
    await coordinator.stop()


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 1e6


async def _restart(workers: int, rollouts: int) -> None:
    """A coordinator caught up on a long history: what its first reader waits for, what its
    first compaction costs the event loop, its memory, and how soon a new rollout's acks show."""
    import httpx
    from pydantic import SecretStr

    from controlplane.api.app import create_app
    from controlplane.coordinator.service import CoordinatorSettings
    from controlplane.kafka.settings import KafkaSettings

    origin = [time.monotonic()]

    def clock() -> datetime:
        return NOW + timedelta(seconds=time.monotonic() - origin[0])

    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr("x")
    )
    coordinator = Coordinator(settings, clock=clock, current_as_of=clock)
    app = create_app(coordinator)
    started = time.perf_counter()
    build(coordinator, workers=workers, rollouts=rollouts, replay=True)
    print(
        f"folded {workers} x {rollouts} in {time.perf_counter() - started:.1f} s; "
        f"RSS {_rss_mb():.0f} MB"
    )
    origin[0] = time.monotonic()
    coordinator.follower.caught_up.set()
    stalls: list[float] = []

    async def probe() -> None:  # how late a 10 ms sleep wakes: the loop busy elsewhere
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            stalls.append(time.perf_counter() - t - 0.01)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://c", timeout=600) as client:
        prober = asyncio.create_task(probe())
        t = time.perf_counter()
        await client.get("/api/v1/summary")
        print(f"first /api/v1/summary: {time.perf_counter() - t:.2f} s; RSS {_rss_mb():.0f} MB")
        stalls.clear()
        t = time.perf_counter()
        summarized = await coordinator.compact_stepwise()
        print(
            f"first compaction: {time.perf_counter() - t:.2f} s, {summarized} summarized, "
            f"longest loop stall {max(stalls, default=0.0):.2f} s; RSS {_rss_mb():.0f} MB"
        )
        ids = worker_ids(workers)
        command = rollout_command(rollouts, rollouts + 1, ids).model_copy(
            update={"issued_at": clock() - timedelta(seconds=5)}
        )
        _fold(coordinator, Batch(commands=[command]))
        path = f"/api/v1/rollouts/{command.rollout_id}/summary"
        await client.get(path)
        batch = Batch()
        done = (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED)
        for worker_id in ids:
            batch.acks.extend(_acks(command, worker_id, done, failed=False))
            if len(batch.acks) >= BATCH:
                _fold(coordinator, batch)
                batch = Batch()
                await asyncio.sleep(0)
        _fold(coordinator, batch)
        last = time.perf_counter()
        polls = 0
        while (await client.get(path)).json()["phase"] != "succeeded":
            polls += 1  # as a dashboard polls, every 50 ms
            await asyncio.sleep(0.05)
        print(
            f"{3 * workers} acks shown succeeded {time.perf_counter() - last:.2f} s after the last"
            f" ({polls} polls)"
        )
        prober.cancel()
    app.state.summaries.close()


async def _snapshot(workers: int, rollouts: int) -> None:
    """What a snapshot of that fold costs and saves: folding the whole history (what a full
    replay pays beyond reading Kafka), then compacting it; encoding a snapshot stepwise (and
    the longest the event loop waited meanwhile), its size and chunks; decoding and restoring
    it into a new coordinator (what a start from a snapshot pays beyond reading the snapshot
    and the tail), and that both answer alike."""
    import gc

    from controlplane.coordinator.service import CoordinatorSettings
    from controlplane.coordinator.snapshots import chunked
    from controlplane.kafka.settings import KafkaSettings

    settings = CoordinatorSettings(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    clock = lambda: NOW  # noqa: E731
    coordinator = Coordinator(settings, clock=clock, current_as_of=clock)
    started = time.perf_counter()
    build(coordinator, workers=workers, rollouts=rollouts, replay=True)
    print(
        f"full fold of {workers} x {rollouts} ({3 * workers * rollouts:,} acks): "
        f"{time.perf_counter() - started:.1f} s; RSS {_rss_mb():.0f} MB"
    )
    coordinator.follower.caught_up.set()
    t = time.perf_counter()
    summarized = await coordinator.compact_stepwise()
    print(f"compaction: {summarized} summarized in {time.perf_counter() - t:.1f} s")
    stalls: list[float] = []

    async def probe() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            stalls.append(time.perf_counter() - t - 0.01)

    prober = asyncio.create_task(probe())
    await asyncio.sleep(0.02)
    stalls.clear()
    offsets = {("commands", 0): rollouts, ("acks", 0): 3 * workers * rollouts}
    captured = await coordinator.snapshots.capture(offsets, control=True)
    prober.cancel()
    chunks = chunked(captured.payload)
    print(
        f"snapshot: {len(captured.payload) / 1e6:.1f} MB in {len(chunks)} chunks, encoded in "
        f"{captured.encode_s:.2f} s; longest event-loop stall meanwhile "
        f"{1000 * max(stalls, default=0.0):.0f} ms"
    )
    when = NOW
    before = {r: coordinator.fleet.tally(r, when) for r in coordinator.fleet.rollout_ids()}
    with tempfile.NamedTemporaryFile(suffix=".snapshot") as file:
        file.write(captured.payload)
        file.flush()
        del coordinator, captured, chunks
        gc.collect()
        child = [sys.executable, "-m", "tests.fleet_at_scale", "--restore", file.name]
        out = subprocess.run(  # noqa: ASYNC221 - a measurement, nothing else runs
            [*child, str(workers), str(rollouts)], capture_output=True, text=True, check=True
        ).stdout
    print(out.strip().splitlines()[0])
    after = json.loads(out.strip().splitlines()[1])
    differ = [r for r, t in before.items() if after.get(r) != _tallied(t)]
    print(f"every rollout's tally equal: {not differ and after.keys() == before.keys()}")
    for r in differ[:2]:
        print(f"  {r}: {before[r]}\n  restored: {after.get(r)}")


async def _restore(path: str, workers: int, rollouts: int) -> None:
    """In a process of its own (for its memory): restore a snapshot's payload from ``path``,
    fold the workers' heartbeats, print the time and RSS, then every rollout's tally."""
    from controlplane.coordinator.service import CoordinatorSettings
    from controlplane.coordinator.snapshots import decode_payload, restore_control
    from controlplane.kafka.settings import KafkaSettings

    with open(path, "rb") as file:  # noqa: ASYNC230 - a measurement
        payload = file.read()
    rss = _rss_mb()
    t = time.perf_counter()
    settings = CoordinatorSettings(kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    clock = lambda: NOW  # noqa: E731
    again = Coordinator(settings, clock=clock, current_as_of=clock)
    decoded = decode_payload(payload)
    again.fleet.restore(decoded.fold)
    if decoded.control is not None:
        restore_control(again.control, decoded.control)
    restore_s = time.perf_counter() - t
    build_heartbeats(again, workers, rollouts)  # the workers topic, read whole
    print(
        f"restore (a fresh process): decoded and restored in {restore_s:.2f} s; RSS "
        f"{_rss_mb():.0f} MB with the {workers} heartbeats ({rss:.0f} MB before the payload "
        "was decoded)"
    )
    print(json.dumps({r: _tallied(again.fleet.tally(r, NOW)) for r in again.fleet.rollout_ids()}))


def _tallied(tally: Tally) -> list[object]:
    """A tally as JSON (compared across processes)."""
    status = tally.status.model_dump(mode="json")
    out: list[object] = json.loads(
        json.dumps([status, tally.errors, tally.versions, tally.late, tally.unexpected])
    )
    return out


def build_heartbeats(coordinator: Coordinator, workers: int, rollouts: int) -> None:
    """Only the workers' heartbeats of :func:`build` (what a restored start reads whole)."""
    finished = max(0, rollouts - 3)
    batch = Batch(replay=True)
    for i, worker_id in enumerate(worker_ids(workers)):
        batch.heartbeats.append(heartbeat(worker_id, i, NOW, f"v{finished}"))
    _fold(coordinator, batch)


def _start_on_a_broker(workers: int, rollouts: int) -> None:
    """:func:`_start` on a local broker started for it (outside the event loop)."""
    import tempfile
    from pathlib import Path

    from controlplane.kafka.broker import BrokerConfig, LocalBroker
    from controlplane.kafka.launch import free_port

    tmp = Path(tempfile.mkdtemp(prefix="snapshot-start-"))
    broker = LocalBroker(
        BrokerConfig(port=free_port(), controller_port=free_port(), data_dir=tmp / "kafka")
    )
    broker.start(timeout=120)
    try:
        asyncio.run(_start(broker.bootstrap, tmp, workers, rollouts))
    finally:
        broker.stop()


async def _start(bootstrap: str, tmp: Path, workers: int, rollouts: int) -> None:
    """A coordinator's start to ready on a real broker, replaying the log in full and from a
    snapshot: a local broker, the history of :func:`build` written as the wire's records, a
    first coordinator (child process) that writes a snapshot, then one that restores it and one
    that replays in full, each timed from its start until ``/healthz`` says ready, with its RSS
    then (``bench.scale.probe.Coordinator``)."""
    import os

    import httpx

    from bench.scale.probe import Coordinator as Child
    from controlplane.kafka.bus import Admin, Producer
    from controlplane.kafka.settings import KafkaSettings
    from controlplane.wire.channels import ACKS, COMMANDS, HEARTBEATS
    from controlplane.wire.protocol import Ack, AckError, Timings, utcnow

    settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix="snap")
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
        await admin.ensure_topics(settings.topics.snapshots_only())
    ids = worker_ids(workers)
    now = utcnow()
    t = time.perf_counter()
    async with Producer(settings, linger_ms=5) as producer:
        for r in range(rollouts):
            issued = now - ISSUE_EVERY * (rollouts - r)
            command = rollout_command(r, rollouts, ids).model_copy(
                update={"issued_at": issued, "expires_at": issued + timedelta(days=1)}
            )
            topic, key, value = COMMANDS.record(settings.topics, command)
            await producer.send(topic, value, key=key)
            records = []
            for i, fast in enumerate(
                a for w in ids for a in _acks(command, w, _states(r, rollouts), False)
            ):
                ack = Ack(
                    command_id=fast.command_id,
                    rollout_id=fast.rollout_id,
                    worker_id=fast.worker_id,
                    kind=fast.kind,
                    state=fast.state,
                    weights_version=fast.weights_version,
                    error=None
                    if fast.error is None
                    else AckError(code="RUNNER_FAILED", message="x"),
                    timings=Timings(
                        received_at=fast.timings.received_at,
                        started_at=fast.timings.started_at,
                        finished_at=fast.timings.finished_at,
                    ),
                    attempt=1,
                    sent_at=fast.sent_at,
                )
                _, key, value = ACKS.record(settings.topics, ack)
                records.append((key, value))
                if len(records) >= BATCH or i == 3 * workers - 1:
                    await producer.send_many(ACKS.topic(settings.topics), records)
                    records = []
        hbs = [
            HEARTBEATS.record(settings.topics, heartbeat(w, i, utcnow(), "v1"))[1:]
            for i, w in enumerate(ids)
        ]
        await producer.send_many(HEARTBEATS.topic(settings.topics), hbs)
    print(
        f"history written: {workers} workers x {rollouts} rollouts "
        f"({3 * workers * rollouts:,} acks) in {time.perf_counter() - t:.0f} s"
    )
    base = {
        "FLEET_COORDINATOR_MAX_ENDED_WORKERS": str(20 * workers),
        "FLEET_COORDINATOR_PROGRESS_DEADLINE_S": str(86400.0),
    }

    async def run(name: str, **env: str) -> dict[str, object]:
        os.environ.update(base | env)
        child = Child(bootstrap, "snap", tmp / f"{name}.log")
        async with httpx.AsyncClient() as client:
            ready = await child.start(client, 600)
            info = (await client.get(f"{child.url}/healthz")).json()["snapshot"]
            if name == "writer":  # until its snapshot holds what compaction summarized
                while True:
                    got = (await client.get(f"{child.url}/healthz")).json()["snapshot"]
                    text = (await client.get(f"{child.url}/metrics")).text
                    summarized = _metric(text, "controlplane_rollouts_summarized")
                    if got["written"] and summarized >= max(0, rollouts - 22):
                        info = got
                        break
                    await asyncio.sleep(0.5)
        child.stop()
        for key in env:
            os.environ.pop(key, None)
        return {"ready_s": ready.get("ready_s"), "rss": ready.get("rss_mb_at_ready")} | {
            "info": info
        }

    writer = await run(
        "writer",
        FLEET_COORDINATOR_SNAPSHOT_INTERVAL_S="1",
        FLEET_COORDINATOR_SNAPSHOT_WRITER="a",
    )
    print(f"first coordinator (full replay): ready in {writer['ready_s']:.1f} s, "
          f"RSS {writer['rss']:.0f} MB; then wrote {writer['info']}")  # fmt: skip
    for name, env in (
        ("restored", {"FLEET_COORDINATOR_SNAPSHOT_WRITER": "b"}),
        ("replayed", {"FLEET_COORDINATOR_SNAPSHOT_RESTORE": "false"}),
    ):
        got = await run(name, **env)
        info = got["info"]
        assert isinstance(info, dict)
        print(
            f"{name}: ready in {got['ready_s']:.1f} s, RSS {got['rss']:.0f} MB at ready; "
            f"started from {info['started_from']} (restore {info.get('restore_s')} s, "
            f"{info.get('bytes')} bytes)"
        )


def _states(r: int, rollouts: int) -> tuple[AckState, ...]:
    if r >= rollouts - 2:
        return (AckState.ACCEPTED, AckState.RUNNING)
    return (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


if __name__ == "__main__":
    restart = "--restart" in sys.argv
    snapshot = "--snapshot" in sys.argv
    args = [int(a) for a in sys.argv[1:] if a.isdigit()]
    n, r, rounds, active = [*args, *(10_000, 100, 40, 2)[len(args) :]]
    if "--restore" in sys.argv:
        asyncio.run(_restore(sys.argv[2], *[int(a) for a in sys.argv[3:5]]))
    elif "--start" in sys.argv:
        _start_on_a_broker(n, r)
    elif snapshot:
        asyncio.run(_snapshot(n, r))
    else:
        asyncio.run(_restart(n, r) if restart else _measure(n, r, rounds, active))
