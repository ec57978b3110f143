"""Status aggregation: fold acks from the log into rollout status, against a bare consumer.

On a private broker, writes ``R`` rollouts' commands (each pinned to ``W`` workers, as the CLI
publishes them), ``W`` heartbeats and ``R x W x 3`` acks (accepted, running, then succeeded or,
rarely, failed; reload and config rollouts alternate) as pre-encoded bytes of real agent acks.
Then times, each reading every record of the three topics from the beginning:

* **bare**: an ``AIOKafkaConsumer`` with the Follower's fetch settings that does nothing;
* **bus**: ``controlplane.kafka.bus.Consumer.fetch`` (our Record wrapping, nothing else);
* **follower**: ``controlplane.coordinator.follower.Follower.catch_up`` (decode with the compiled
  ``ack_codec.decode_ack_fast`` + ``Fleet`` fold), followed by the status of every rollout
  (``Fleet.rollouts(now)``) and every worker's level;

plus, without Kafka, decode alone (pydantic ``protocol.decode_ack`` against ``decode_ack_fast``,
interleaved) and fold alone over the same bytes, and a cProfile (CPU time) of one Follower
catch-up. Target: follower >= 0.5x the bare consumer's rate.

    .venv/bin/python -m bench.aggregate --quick    # ~100,000 acks
    .venv/bin/python -m bench.aggregate            # ~1,000,000 acks
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import logging
import math
import pstats
import re
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench.common import (
    Broker,
    conclude,
    ensure_topics,
    envelope,
    fmt,
    mode_of,
    ratio,
    rss,
    table,
)

log = logging.getLogger("bench.aggregate")

_T = [datetime(2001, 1, 1, 1, 1, 1, i, tzinfo=UTC) for i in (1, 2, 3, 4)]
_ROLLOUT, _WORKER = "RRRRRRRRRRRRRRRRRRRR", "WWWWWWWWWWWWWW"


# --------------------------------------------------------------------------- the data set


class Template:
    """An encoded message cut at its placeholders; ``render`` joins the pieces with values."""

    def __init__(self, encoded: str, holes: dict[str, str]) -> None:
        by_sentinel = {sentinel: name for name, sentinel in holes.items()}
        pattern = (
            "(" + "|".join(re.escape(s) for s in sorted(by_sentinel, key=len, reverse=True)) + ")"
        )
        pieces = re.split(pattern, encoded)
        self.parts: list[str] = pieces[0::2]
        self.names: list[str] = [by_sentinel[s] for s in pieces[1::2]]

    def render(self, values: dict[str, str]) -> bytes:
        out = [self.parts[0]]
        for name, part in zip(self.names, self.parts[1:], strict=True):
            out.append(values[name])
            out.append(part)
        return "".join(out).encode()


def _ack_templates() -> dict[tuple[str, str], Template]:
    """(kind, state) -> template of a real agent ack, with ids and timestamps as holes."""
    from controlplane.wire.protocol import Ack, AckError, AckState, CommandKind, Timings, encode

    holes = {
        "rollout": _ROLLOUT,
        "worker": _WORKER,
        **{f"t{i}": _T[i].isoformat().replace("+00:00", "Z") for i in range(4)},
    }
    reload_result: dict[str, Any] = {
        "version": "v-20250101-0001",
        "files": 1,
        "tensors": 243,
        "bytes": 1023410176,
        "validate_s": 0.001874,
        "copy_s": 0.128402,
        "duration_s": 0.130276,
        "gbps": 7.97,
    }
    out: dict[tuple[str, str], Template] = {}
    for kind in (CommandKind.RELOAD_WEIGHTS, CommandKind.UPDATE_CONFIG):
        for state in (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED, AckState.FAILED):
            terminal = state in (AckState.SUCCEEDED, AckState.FAILED)
            result: dict[str, Any] = {}
            if state is AckState.SUCCEEDED:
                result = (
                    reload_result
                    if kind is CommandKind.RELOAD_WEIGHTS
                    else {"overrides": ["max_new_tokens", "temperature"]}
                )
            ack = Ack(
                command_id=f"{_ROLLOUT}.c1",
                rollout_id=_ROLLOUT,
                worker_id=_WORKER,
                kind=kind,
                state=state,
                weights_version="v-20250101-0001"
                if state is AckState.SUCCEEDED and kind is CommandKind.RELOAD_WEIGHTS
                else "v-20241231-0007",
                config_digest="5f1c0e2a9b7d4c31",
                error=AckError(
                    code="WEIGHTS_UNREADABLE",
                    message="cannot open 'model-00002-of-00004.safetensors': [Errno 5] I/O error",
                    retryable=False,
                )
                if state is AckState.FAILED
                else None,
                timings=Timings(
                    received_at=_T[0],
                    started_at=_T[1] if state is not AckState.ACCEPTED else None,
                    finished_at=_T[2] if terminal else None,
                ),
                sent_at=_T[3],
                result=result,
            )
            out[(kind.value, state.value)] = Template(encode(ack).decode(), holes)
    return out


def _ts(dt: datetime) -> str:
    return dt.isoformat(timespec="microseconds").replace("+00:00", "Z")


class DataSet:
    """The commands, heartbeats and acks of ``rollouts`` rollouts over ``workers`` workers."""

    def __init__(self, acks: int, workers: int) -> None:
        self.workers = workers
        self.rollouts = max(1, math.ceil(acks / (3 * workers)))
        self.acks = self.rollouts * workers * 3
        self.base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        self.worker_ids = [f"gpu-node-{w:05d}.pool-a" for w in range(workers)]
        self.rollout_ids = [f"r-20250101-{r:06d}-bench" for r in range(self.rollouts)]
        self.failures = 0

    def kind(self, r: int) -> str:
        return "reload_weights" if r % 2 == 0 else "update_config"

    def commands(self) -> list[bytes]:
        from controlplane.coordinator.publisher import build_command
        from controlplane.wire.protocol import (
            ReloadWeightsSpec,
            Selector,
            UpdateConfigSpec,
            encode,
        )

        out = []
        for r, rid in enumerate(self.rollout_ids):
            spec: ReloadWeightsSpec | UpdateConfigSpec = (
                ReloadWeightsSpec(path="/models/llm/v-20250101-0001", version="v-20250101-0001")
                if self.kind(r) == "reload_weights"
                else UpdateConfigSpec(overrides={"max_new_tokens": 256, "temperature": 0.7})
            )
            command = build_command(
                spec,
                Selector(worker_ids=self.worker_ids),
                issuer="ops@cli",
                rollout_id=rid,
                now=self.base + timedelta(seconds=10 * r),
            )
            out.append(encode(command))
        return out

    def heartbeats(self) -> list[tuple[bytes, bytes]]:
        from controlplane.wire.protocol import Heartbeat, WorkerStatus, encode, utcnow

        now = utcnow()
        return [
            (
                w.encode(),
                encode(
                    Heartbeat(
                        worker_id=w,
                        labels={"pool": "a", "model": "llm"},
                        runner="torch",
                        device="cuda:0",
                        status=WorkerStatus.READY,
                        weights_version="v-20250101-0001",
                        config_digest="5f1c0e2a9b7d4c31",
                        seq=1000,
                        sent_at=now,
                        started_at=self.base - timedelta(days=1),
                        interval_s=3.0,
                        agent_version="0.1.0",
                    )
                ),
            )
            for w in self.worker_ids
        ]

    def ack_chunks(self, chunk: int = 20_000) -> Iterator[list[tuple[bytes, bytes]]]:
        """(key, value) pairs in log order: per rollout, every worker's three acks."""
        templates = _ack_templates()
        batch: list[tuple[bytes, bytes]] = []
        ms, two_s = timedelta(milliseconds=1), timedelta(seconds=2)
        for r, rid in enumerate(self.rollout_ids):
            kind = self.kind(r)
            issued = self.base + timedelta(seconds=10 * r)
            accepted = templates[(kind, "accepted")]
            running = templates[(kind, "running")]
            for w, wid in enumerate(self.worker_ids):
                received = issued + timedelta(microseconds=40 * w + 3000)
                started = received + ms
                finished = started + two_s
                values = {
                    "rollout": rid,
                    "worker": wid,
                    "t0": _ts(received),
                    "t1": _ts(started),
                    "t2": _ts(finished),
                    "t3": _ts(received),
                }
                key = wid.encode()
                batch.append((key, accepted.render(values)))
                values["t3"] = _ts(started)
                batch.append((key, running.render(values)))
                failed = r % 10 == 3 and w == r % self.workers  # one rollout in ten fails
                self.failures += failed
                values["t3"] = _ts(finished + ms)
                batch.append(
                    (key, templates[(kind, "failed" if failed else "succeeded")].render(values))
                )
                if len(batch) >= chunk:
                    yield batch
                    batch = []
        if batch:
            yield batch


async def produce(settings: Any, data: DataSet) -> dict[str, Any]:
    from controlplane.kafka.bus import Producer

    topics = settings.topics
    started = time.perf_counter()
    generate_s = 0.0
    nbytes = 0
    sample: list[bytes] = []
    async with Producer(settings, linger_ms=20) as producer:
        commands = data.commands()
        await producer.send_many(topics.commands.name, [(None, c) for c in commands])
        await producer.send_many(topics.workers.name, data.heartbeats())
        chunks = data.ack_chunks()
        while True:
            t0 = time.perf_counter()
            batch = next(chunks, None)
            generate_s += time.perf_counter() - t0
            if batch is None:
                break
            if len(sample) < 100_000:
                sample.extend(v for _, v in batch[: 100_000 - len(sample)])
            nbytes += sum(len(v) for _, v in batch)
            await producer.send_many(topics.acks.name, batch)
    elapsed = time.perf_counter() - started
    data.sample = sample  # type: ignore[attr-defined]
    return {
        "acks": data.acks,
        "commands": len(commands),
        "heartbeats": data.workers,
        "ack_bytes": nbytes,
        "mean_ack_bytes": nbytes / data.acks,
        "command_bytes": len(commands[0]),
        "failed_terminal_acks": data.failures,
        "elapsed_s": elapsed,
        "generate_s": generate_s,
        "acks_per_s": data.acks / elapsed,
    }


# --------------------------------------------------------------------------- readers


async def read_bare(settings: Any, total: int) -> dict[str, Any]:
    """aiokafka alone, with the Follower's consumer settings; counts records, nothing else."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from controlplane.kafka.bus import client_options

    consumer = AIOKafkaConsumer(
        **client_options(settings),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
        fetch_max_wait_ms=100,
        isolation_level="read_committed",
    )
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


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, bootstrap: str, result: dict[str, Any]) -> None:
    settings = await ensure_topics(bootstrap, f"agg-{uuid.uuid4().hex[:8]}")
    data = DataSet(args.acks, args.workers)
    print(
        f"producing {data.acks:,} acks ({data.rollouts} rollouts x {data.workers} workers x 3), "
        f"{data.rollouts} commands, {data.workers} heartbeats",
        flush=True,
    )
    result["produce"] = await produce(settings, data)
    total = data.acks + data.rollouts + data.workers
    print(f"  {result['produce']['elapsed_s']:.1f} s; reading {total:,} records", flush=True)

    async def best_of(name: str, fn: Callable[[], Any]) -> dict[str, Any]:
        runs = []
        for _ in range(args.repeats):
            runs.append(await fn())
            print(f"  {name}: {runs[-1]['elapsed_s']:.2f} s", flush=True)
        times = [r["elapsed_s"] for r in runs]
        out = dict(runs[int(min(range(len(times)), key=times.__getitem__))])
        out["runs_s"] = times
        out["median_s"] = statistics.median(times)
        out["records_per_s"] = total / out["median_s"]
        out["acks_per_s"] = data.acks / out["median_s"]
        return out

    result["bare"] = await best_of("bare aiokafka", lambda: read_bare(settings, total))
    result["bus"] = await best_of("bus.Consumer", lambda: read_bus(settings, total))

    async def follower_run() -> dict[str, Any]:
        out, _ = await read_follower(settings)
        return out

    result["follower"] = await best_of("Follower", follower_run)
    result["in_memory"] = in_memory(data.sample, settings)  # type: ignore[attr-defined]
    if not args.no_profile:
        print("  profiling one Follower catch-up (CPU time)", flush=True)
        prof = cProfile.Profile(time.thread_time)
        profiled, _ = await read_follower(settings, prof)
        result["profile"] = {"elapsed_s": profiled["elapsed_s"], **profile_rows(prof)}
    f, b = result["follower"], result["bare"]
    result["ratios"] = {
        "follower_over_bare": ratio(f["acks_per_s"], b["acks_per_s"]),
        "bus_over_bare": ratio(result["bus"]["acks_per_s"], b["acks_per_s"]),
        "follower_with_status_over_bare": ratio(
            data.acks / (f["median_s"] + f["status_all_s"]), b["acks_per_s"]
        ),
    }
    r = result["ratios"]["follower_over_bare"]
    result["targets"] = [
        {
            "name": "follower >= 0.5x bare consumer",
            "value": r,
            "verdict": "n/a" if r is None else "met" if r >= 0.5 else "missed",
        }
    ]


def report(result: dict[str, Any]) -> str:
    b = result["bare"]["acks_per_s"]
    rows = [
        [
            name,
            result[key]["median_s"],
            result[key]["acks_per_s"],
            ratio(result[key]["acks_per_s"], b),
        ]
        for key, name in (
            ("bare", "bare aiokafka consumer"),
            ("bus", "bus.Consumer (Record)"),
            ("follower", "Follower (decode + fold)"),
        )
    ]
    f, m = result["follower"], result["in_memory"]
    lines = [
        table(rows, ["reader", "seconds", "acks/s", "x bare"]),
        "",
        f"status of all {f['rollouts']} rollouts: {f['status_all_s']:.2f} s "
        f"({f['status_per_rollout_ms']:.1f} ms each); worker levels: {f['worker_levels_s']:.2f} s; "
        f"phases {f['phases']}; fleet memory ~{f['fleet_rss_mb']:.0f} MiB",
        f"in memory, per ack ({m['acks']:,} acks, best of {m['passes']}, interleaved): decode "
        f"pydantic (canonical) {m['decode_pydantic_us']:.2f} us, fast {m['decode_fast_us']:.2f} us "
        f"({m['decode_speedup']:.1f}x); fold {m['fold_fast_us']:.2f} us "
        f"({m['fold_pydantic_us']:.2f} us with pydantic acks)",
        f"follower incl. final status: {fmt(result['ratios']['follower_with_status_over_bare'])}x bare",
    ]
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({fmt(t['value'])}x)")
    if "profile" in result:
        lines.append("\nFollower catch-up profile (CPU time, by tottime):")
        lines.append(
            table(
                [
                    [x["function"], x["calls"], x["tottime_s"], x["cumtime_s"]]
                    for x in result["profile"]["top_tottime"]
                ],
                ["function", "calls", "tottime s", "cumtime s"],
            )
        )
    return "\n".join(lines)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="~100,000 acks.")
    p.add_argument("--tiny", action="store_true", help="~3,000 acks; for the CI smoke test.")
    p.add_argument("--acks", type=int, help="Number of acks (rounded up to whole rollouts).")
    p.add_argument("--workers", type=int, help="Workers per rollout.")
    p.add_argument("--repeats", type=int, help="Passes per reader (the median is reported).")
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    args.mode = mode_of(args.quick, args.tiny)
    acks, workers, repeats = {
        "tiny": (3_000, 100, 1),
        "quick": (100_000, 1000, 2),
        "full": (1_000_000, 1000, 3),
    }[args.mode]
    args.acks = args.acks or acks
    args.workers = args.workers or workers
    args.repeats = args.repeats or repeats
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    result = envelope("aggregate", args.mode, argv)
    result["parameters"] = {"acks": args.acks, "workers": args.workers, "repeats": args.repeats}
    started = time.perf_counter()
    with Broker() as broker:
        result["broker"] = {"start_s": broker.start_s}
        print(f"broker up at {broker.bootstrap} in {broker.start_s:.1f} s", flush=True)
        asyncio.run(run(args, broker.bootstrap, result))
    return conclude(result, report(result), args.out_dir, started)


if __name__ == "__main__":
    sys.exit(main())
