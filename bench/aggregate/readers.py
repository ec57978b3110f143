"""The readers timed over the same log: a bare consumer, ``bus.Consumer``, the ``Follower`` (then
every rollout's status), decode and fold in memory, and a cProfile of one catch-up.
"""

from __future__ import annotations

import cProfile
import gc
import io
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import bare_consumer, rss

# --------------------------------------------------------------------------- readers


async def read_bare(settings: Any, total: int) -> dict[str, Any]:
    """aiokafka alone, with the Follower's consumer settings; counts records, nothing else."""
    from aiokafka import TopicPartition

    consumer = bare_consumer(settings)
    await consumer.start()
    try:
        tps = [
            TopicPartition(t.name, p) for t in settings.topics.all() for p in range(t.partitions)
        ]
        consumer.assign(tps)
        await consumer.seek_to_beginning()
        count = 0
        start = time.perf_counter()
        while count < total:
            batches = await consumer.getmany(timeout_ms=1000)
            for msgs in batches.values():
                count += len(msgs)
        elapsed = time.perf_counter() - start
    finally:
        await consumer.stop()
    return {"records": count, "elapsed_s": elapsed}


async def read_bus(settings: Any, total: int) -> dict[str, Any]:
    """controlplane.kafka.bus.Consumer.fetch: our Record wrapping, nothing else."""
    from controlplane.kafka.bus import Consumer

    async with Consumer(settings, max_partition_fetch_bytes=4 * 1024 * 1024) as consumer:
        await consumer.assign_many([t.name for t in settings.topics.all()])
        await consumer.seek_to_beginning()
        count = 0
        start = time.perf_counter()
        while count < total:
            count += len(await consumer.fetch(timeout_s=1.0))
        elapsed = time.perf_counter() - start
    return {"records": count, "elapsed_s": elapsed}


async def read_follower(
    settings: Any, profile: cProfile.Profile | None = None
) -> tuple[dict[str, Any], Any]:
    """Follower.catch_up (decode + fold), then every rollout's status and every worker's level."""
    from controlplane.coordinator.follower import Follower
    from controlplane.wire.protocol import utcnow

    gc.collect()
    rss0 = sum(rss())
    follower = Follower(settings)
    await follower.start()
    try:
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        await follower.catch_up()
        if profile is not None:
            profile.disable()
        elapsed = time.perf_counter() - start
        fleet = follower.fleet
        now = utcnow()
        t0 = time.perf_counter()
        statuses = fleet.rollouts(now)
        status_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        levels = fleet.worker_levels(now)
        levels_s = time.perf_counter() - t0
        phases: dict[str, int] = {}
        for st in statuses:
            phases[st.phase.value] = phases.get(st.phase.value, 0) + 1
        out = {
            "records": follower.records,
            "undecodable": follower.undecodable,
            "elapsed_s": elapsed,
            "status_all_s": status_s,
            "status_per_rollout_ms": 1e3 * status_s / max(1, len(statuses)),
            "worker_levels_s": levels_s,
            "rollouts": len(statuses),
            "phases": phases,
            "workers": len(levels),
            "fleet_rss_mb": (sum(rss()) - rss0) / 2**20,
        }
    finally:
        await follower.stop()
    return out, fleet


def in_memory(sample: list[bytes], settings: Any, passes: int = 2) -> dict[str, Any]:
    """Decode alone and fold alone over the same ack bytes: the Follower's CPU floor per ack.

    Both decoders, interleaved (the machine is shared): "pydantic" is the canonical
    ``protocol.decode_ack``, "fast" the compiled ``ack_codec.decode_ack_fast`` the Follower uses.
    The best of ``passes`` passes each; fold is into a fresh ``Fleet`` per pass.
    """
    from controlplane.rollout.fleet import Fleet
    from controlplane.wire.ack_codec import decode_ack_fast
    from controlplane.wire.protocol import decode_ack

    decoders: dict[str, Callable[[bytes], Any]] = {
        "pydantic": decode_ack,
        "fast": decode_ack_fast,
    }
    decode_s: dict[str, list[float]] = {name: [] for name in decoders}
    fold_s: dict[str, list[float]] = {name: [] for name in decoders}
    for _ in range(passes):
        for name, decode in decoders.items():
            gc.collect()
            t0 = time.perf_counter()
            acks = [decode(v) for v in sample]
            decode_s[name].append(time.perf_counter() - t0)
            fleet = Fleet()
            observe = fleet.observe_ack
            t0 = time.perf_counter()
            for ack in acks:
                observe(ack)
            fold_s[name].append(time.perf_counter() - t0)
            del acks, fleet, observe
    n = len(sample)
    us = {name: 1e6 * min(times) / n for name, times in decode_s.items()}
    fold_us = {name: 1e6 * min(times) / n for name, times in fold_s.items()}
    return {
        "acks": n,
        "passes": passes,
        "decode_pydantic_us": us["pydantic"],
        "decode_fast_us": us["fast"],
        "decode_speedup": us["pydantic"] / us["fast"],
        "fold_pydantic_us": fold_us["pydantic"],
        "fold_fast_us": fold_us["fast"],
        # What the Follower uses (the fast decoder), under the names earlier results used.
        "decode_us": us["fast"],
        "decode_per_s": 1e6 / us["fast"],
        "fold_us": fold_us["fast"],
        "fold_per_s": 1e6 / fold_us["fast"],
    }


def profile_rows(prof: cProfile.Profile, top: int = 20) -> dict[str, list[dict[str, Any]]]:
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = [
        {
            "function": f"{Path(file).name}:{line}({func})",
            "calls": nc,
            "tottime_s": round(tt, 4),
            "cumtime_s": round(ct, 4),
        }
        for (file, line, func), (_, nc, tt, ct, _) in stats.stats.items()  # type: ignore[attr-defined]
    ]
    return {
        "top_tottime": sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:top],
        "top_cumtime": sorted(rows, key=lambda r: r["cumtime_s"], reverse=True)[:top],
    }
