"""Arguments, the run (produce, then each reader), and the report."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import logging
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import bench.aggregate as package
from bench.aggregate.dataset import DataSet, produce
from bench.aggregate.readers import in_memory, profile_rows, read_bare, read_bus, read_follower
from bench.common import (
    Broker,
    conclude,
    ensure_topics,
    envelope,
    fmt,
    mode_of,
    ratio,
    table,
)

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
    p = argparse.ArgumentParser(
        prog=f"python -m {package.__name__}", description=(package.__doc__ or "").splitlines()[0]
    )
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
