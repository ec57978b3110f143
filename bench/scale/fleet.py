"""The synthetic fleet: N workers' heartbeats from a generator child process, and the log of R
past rollouts pinned to all N (a command and accepted, running, succeeded acks per worker),
written with the project's own models, codec and producer.

The generator (``--generator-child``) sends each worker's heartbeat (``Heartbeat``, labels
``model=big``) once per period, spread evenly over it, at that sustained rate until told to
stop; a heartbeat it could not send on time is sent as soon as it can (``behind`` says how many
were late, at most); one not confirmed within 3 periods is counted lost (``failed``) and the
generator goes on, as an agent does. Acks are rendered from templates of real encoded ``Ack`` messages
(``bench.aggregate.dataset``): producing 3N x R of them through pydantic one by one would cost
more than the readers under test.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from bench.aggregate.dataset import Template, _ack_templates, ack_times
from bench.common import cpu_seconds, say

#: The label every synthetic worker carries: the selector of the publish under test.
LABELS = {"model": "big"}
VERSION = "v-20250101-0001"
#: Pre-rendered records sent per produce call (bounded memory; the producer batches them).
CHUNK = 20_000


def worker_ids(n: int) -> list[str]:
    return [f"gpu-{w:05d}.pool-a" for w in range(n)]


def kafka_settings(bootstrap: str, prefix: str, client_id: str) -> Any:
    from controlplane.kafka.settings import KafkaSettings

    return KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix, client_id=client_id)


# --------------------------------------------------------------------------- heartbeats (child)


async def generator_host(cfg: dict[str, Any]) -> None:
    """Heartbeats of ``cfg['n']`` workers every ``cfg['period_s']`` until ``stop`` on stdin;
    ``ready`` once every worker has sent one, ``stats`` on request."""
    from controlplane.kafka.bus import Producer
    from controlplane.wire.channels import HEARTBEATS
    from controlplane.wire.errors import BusError
    from controlplane.wire.protocol import Heartbeat, WorkerStatus, utcnow

    settings = kafka_settings(cfg["bootstrap"], cfg["prefix"], "bench-heartbeats")
    n, period = int(cfg["n"]), float(cfg["period_s"])
    started_at = utcnow() - timedelta(hours=1)
    models = [
        Heartbeat(
            worker_id=w,
            labels=LABELS,
            runner="torch",
            device="cuda:0",
            status=WorkerStatus.READY,
            weights_version=VERSION,
            config_digest="5f1c0e2a9b7d4c31",
            seq=0,
            sent_at=started_at,
            started_at=started_at,
            incarnation=1,
            interval_s=period,
            agent_version="0.1.0",
        )
        for w in worker_ids(n)
    ]
    topics = settings.topics
    stats: dict[str, Any] = {
        "sent": 0,
        "behind_max": 0,
        "sends": 0,
        "send_s_max": 0.0,
        "failed": 0,  # heartbeats not confirmed within 3 periods (lost, as an agent's are)
        "failures": [],  # the first nine and the last: [epoch, heartbeats, code]
    }
    stopping = asyncio.Event()

    async def beat() -> None:
        t0 = time.monotonic()
        said_ready = False
        async with Producer(settings, linger_ms=5) as producer:
            while not stopping.is_set():
                due = int((time.monotonic() - t0) / period * n) + 1
                sent: int = stats["sent"]
                behind = due - sent
                stats["behind_max"] = max(stats["behind_max"], behind)
                if behind > 0:
                    now = utcnow()
                    items = []
                    for i in range(sent, due):
                        hb = models[i % n].model_copy(update={"seq": i // n + 1, "sent_at": now})
                        _, key, value = HEARTBEATS.record(topics, hb)
                        items.append((key, value))
                    s0 = time.monotonic()
                    try:  # an agent's limit: 3 periods at most; a lost beat is not resent
                        await producer.send_many(topics.workers.name, items, timeout_s=3 * period)
                    except BusError as exc:
                        stats["failed"] += len(items)
                        failure = [round(time.time(), 3), len(items), exc.code]
                        stats["failures"][min(len(stats["failures"]), 9) :] = [failure]
                    stats["send_s_max"] = max(stats["send_s_max"], time.monotonic() - s0)
                    stats["sent"] = due
                    stats["sends"] += 1
                if not said_ready and stats["sent"] >= n:
                    said_ready = True
                    say({"ready": True, "sent": stats["sent"]})
                await asyncio.sleep(0.05)

    task = asyncio.create_task(beat())
    loop = asyncio.get_running_loop()
    while True:
        reader = loop.run_in_executor(None, sys.stdin.readline)
        done, _ = await asyncio.wait([task, reader], return_when=asyncio.FIRST_COMPLETED)
        if task in done:  # the generator died: say why, once
            say({"error": repr(task.exception())})
            return
        line = (await reader).strip()
        if line == "stats":
            say({**stats, "cpu_s": cpu_seconds(os.getpid())})
        else:  # "stop" or EOF
            break
    stopping.set()
    await task


# --------------------------------------------------------------------------- rollouts (parent)


class _StampingProducer:
    """aiokafka's producer with the product's client options, for records stamped with a
    time of their own (the product's ``Producer`` stamps every record now)."""

    def __init__(self, settings: Any) -> None:
        from aiokafka import AIOKafkaProducer

        from controlplane.kafka.bus import client_options

        self._producer = AIOKafkaProducer(
            **client_options(settings), acks="all", linger_ms=20, max_batch_size=1 << 20
        )

    async def __aenter__(self) -> _StampingProducer:
        await self._producer.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._producer.stop()

    async def send_many(
        self, topic: str, items: list[tuple[bytes, bytes]], at_ms: int | None = None
    ) -> None:
        """Send ``items`` in chunks of :data:`CHUNK`, each record stamped ``at_ms`` (None:
        now), and wait until all are written."""
        for i in range(0, len(items), CHUNK):
            sent = [
                await self._producer.send(topic, value, key=key, timestamp_ms=at_ms)
                for key, value in items[i : i + CHUNK]
            ]
            await asyncio.gather(*sent)


class Rollouts:
    """R past rollouts over N workers, an in-progress one and a burst one, as records."""

    def __init__(self, n: int, rollouts: int) -> None:
        self.ids = worker_ids(n)
        self.r = rollouts
        self.base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        self.templates: dict[tuple[str, str], Template] = _ack_templates()
        self.past = [f"r-20250101-{r:06d}-past" for r in range(rollouts)]
        self.live = "r-20250101-live-in-progress"
        self.burst = "r-20250101-burst"
        #: When the in-progress rollout's last ack was written (epoch seconds).
        self.live_acked_at = time.time()

    def command(self, rollout_id: str, issued: datetime) -> tuple[bytes, bytes]:
        """A reload pinned to every worker (the CLI's selector after resolving)."""
        from controlplane.coordinator.publisher import build_command
        from controlplane.wire.channels import COMMANDS
        from controlplane.wire.protocol import ReloadWeightsSpec, Selector, encode

        command = build_command(
            ReloadWeightsSpec(path=f"/models/big/{VERSION}", version=VERSION),
            Selector(worker_ids=self.ids),
            issuer="ops@bench",
            rollout_id=rollout_id,
            command_id=f"{rollout_id}.c1",
            now=issued,
        )
        return COMMANDS.key(command), encode(command)

    def acks(
        self, rollout_id: str, issued: datetime, states: tuple[str, ...]
    ) -> list[tuple[bytes, bytes]]:
        """Each worker's acks of ``rollout_id`` in ``states`` order, keyed by worker id."""
        templates = [self.templates[("reload_weights", s)] for s in states]
        out: list[tuple[bytes, bytes]] = []
        for w, wid in enumerate(self.ids):
            values, sent = ack_times(rollout_id, wid, w, issued)
            key = wid.encode()
            for template, t3 in zip(templates, sent, strict=False):
                out.append((key, template.render({**values, "t3": t3})))
        return out


async def produce_history(settings: Any, rollouts: Rollouts) -> dict[str, Any]:
    """The R past rollouts (all succeeded), then the in-progress one (accepted and running acks,
    issued now): what the readers under test replay. Each past record is stamped with its own
    rollout's time (a day ago and after, as a real history's agents wrote it: the commands and
    acks topics keep the writer's CreateTime), so that a reader asking Kafka for the records
    since a time gets what a real log would give it."""
    topics = settings.topics
    started = time.perf_counter()
    render_s, records, nbytes = 0.0, 0, 0
    async with _StampingProducer(settings) as producer:
        batch: list[tuple[bytes, bytes]] = []
        for r, rid in enumerate(rollouts.past):
            issued = rollouts.base + timedelta(seconds=10 * r)
            at_ms = int(issued.timestamp() * 1000)
            await producer.send_many(topics.commands.name, [rollouts.command(rid, issued)], at_ms)
            t0 = time.perf_counter()
            batch = rollouts.acks(rid, issued, ("accepted", "running", "succeeded"))
            render_s += time.perf_counter() - t0
            records += len(batch)
            nbytes += sum(len(v) for _, v in batch)
            await producer.send_many(topics.acks.name, batch, at_ms + 3000)
        now = datetime.now(UTC)
        await producer.send_many(topics.commands.name, [rollouts.command(rollouts.live, now)])
        live = rollouts.acks(rollouts.live, now, ("accepted", "running"))
        await producer.send_many(topics.acks.name, live)
        rollouts.live_acked_at = time.time()
        records += len(live)
    elapsed = time.perf_counter() - started
    return {
        "commands": len(rollouts.past) + 1,
        "acks": records,
        "ack_bytes": nbytes,
        "command_bytes": len(rollouts.command(rollouts.live, now)[1]),
        "elapsed_s": elapsed,
        "render_s": render_s,
        "acks_per_s": records / elapsed if elapsed else None,
    }
