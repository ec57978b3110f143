"""The baselines the agents are measured against: the bare Kafka round trip and HTTP fan-outs."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path
from typing import Any

from bench.common import Child, ensure_topics, summary
from bench.fanout import OVERRIDE_KEY


async def measure_floor(bootstrap: str, repeats: int, n_workers: int) -> dict[str, Any]:
    """Bare command/ack round trips (pre-encoded bytes both ways) through the same broker."""
    from controlplane.coordinator.publisher import build_command
    from controlplane.kafka.bus import Consumer, Producer
    from controlplane.wire.protocol import Selector, UpdateConfigSpec, encode
    from controlplane.wire.topics import command_key

    settings = await ensure_topics(bootstrap, f"floor-{uuid.uuid4().hex[:8]}")
    topics = settings.topics
    ids = [f"w{i:04d}" for i in range(n_workers)]
    command = encode(
        build_command(
            UpdateConfigSpec(overrides={OVERRIDE_KEY: 8}),
            Selector(worker_ids=ids),
            issuer="bench",
        )
    )
    ack = _ack_bytes()
    times: list[float] = []
    async with (
        Producer(settings) as cmd_producer,
        Producer(settings) as ack_producer,
        Consumer(settings, group_id=f"{topics.prefix}.floor") as worker_consumer,
        Consumer(settings) as ack_consumer,
    ):
        await worker_consumer.assign(topics.commands.name, [0])
        await worker_consumer.seek_to_beginning()
        await ack_consumer.assign(topics.acks.name)
        await ack_consumer.seek_to_beginning()

        stop = asyncio.Event()

        async def responder() -> None:
            while not stop.is_set():
                for record in await worker_consumer.fetch(timeout_s=0.2, max_records=16):
                    await ack_producer.send(topics.acks.name, ack, key=b"w0000")
                    await worker_consumer.commit(record.topic, 0, record.offset + 1)

        task = asyncio.create_task(responder())
        try:
            for i in range(repeats + 5):  # five warm-up round trips
                start = time.perf_counter()
                await cmd_producer.send(topics.commands.name, command, key=command_key(f"r{i}"))
                while not await ack_consumer.fetch(timeout_s=1.0):
                    pass
                if i >= 5:
                    times.append(time.perf_counter() - start)
        finally:
            stop.set()
            await task
    return {"round_trip_s": summary(times)}


def _ack_bytes() -> bytes:
    from controlplane.wire.protocol import Ack, AckState, CommandKind, Timings, encode, utcnow

    now = utcnow()
    return encode(
        Ack(
            command_id="r-bench.c1",
            rollout_id="r-bench",
            worker_id="w0000",
            kind=CommandKind.UPDATE_CONFIG,
            state=AckState.SUCCEEDED,
            weights_version="init",
            config_digest="0123456789abcdef",
            timings=Timings(received_at=now, started_at=now, finished_at=now),
            sent_at=now,
            result={"overrides": [OVERRIDE_KEY]},
        )
    )


async def measure_http(n: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Sequential and concurrent httpx fan-outs to N endpoints of one uvicorn process."""
    import httpx

    server = await Child.start("bench.fanout", "http-child", {"n": n}, tmp / f"http-{n}.log")
    try:
        ports: list[int] = (await server.read(120))["ports"]
        urls = [f"http://127.0.0.1:{p}/config" for p in ports]
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        timeout = httpx.Timeout(60.0)

        async def sequential(client: httpx.AsyncClient, i: int) -> float:
            start = time.perf_counter()
            for url in urls:
                (await client.post(url, json={OVERRIDE_KEY: 1 + i % 64})).raise_for_status()
            return time.perf_counter() - start

        per_request: list[float] = []

        async def concurrent(client: httpx.AsyncClient, i: int) -> float:
            async def one(url: str) -> None:
                t0 = time.perf_counter()
                (await client.post(url, json={OVERRIDE_KEY: 1 + i % 64})).raise_for_status()
                per_request.append(time.perf_counter() - t0)

            start = time.perf_counter()
            await asyncio.gather(*(one(u) for u in urls))
            return time.perf_counter() - start

        # One client per mode, its connections opened by a warm-up fan-out: HTTP's best case.
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await sequential(client, 0)
            seq = [await sequential(client, i) for i in range(repeats)]
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await concurrent(client, 0)
            per_request.clear()
            conc = [await concurrent(client, i) for i in range(repeats)]
        return {
            "server": f"one uvicorn process, {n} listening ports, warm keep-alive connections",
            "sequential_s": summary(seq),
            "concurrent_s": summary(conc),
            "concurrent_request_s": summary(per_request),
        }
    finally:
        await server.stop()
