"""What is timed: rounds of reloads on one engine, each round one idle reload and one reload
per drain policy under load, the version alternating v1 <-> v2 from one reload to the next."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from bench.drain.engines import Engine
from bench.drain.load import CLOCK, Clients, Outcome, gaps_outside, longest_gap

IDLE = "idle"
POLICIES = ("wait", "abort", "keep")


def _describe(
    engine: Engine, outcomes: Sequence[Outcome], start: float, end: float
) -> dict[str, Any]:
    """Counts of a load window's requests: completed, failed by cause, mixed, in the reload."""
    failed: dict[str, int] = {}
    examples: dict[str, str] = {}
    mixed = 0
    for out in outcomes:
        if not out.ok:
            failed[out.why] = failed.get(out.why, 0) + 1
            examples.setdefault(out.why, out.detail)
            continue
        by_tokens = engine.version_of(out.tokens)
        if by_tokens is None or (out.versions is not None and len(out.versions) > 1):
            mixed += 1
    latencies = [
        o.end - o.start for o in outcomes if o.ok and not (o.start < end and o.end > start)
    ]
    queued = [o.end - o.start for o in outcomes if o.ok and start <= o.start <= end]
    return {
        "completed": sum(1 for o in outcomes if o.ok),
        "failed": sum(failed.values()),
        "failed_by": failed,
        "failed_examples": examples,
        "mixed": mixed,
        "overlapping": sum(1 for o in outcomes if o.start < end and o.end > start),
        "latencies_s": latencies,
        "queued_latencies_s": queued,
    }


def one_reload(engine: Engine, version: str, mode: str, clients: int) -> dict[str, Any]:
    """One reload to ``version``: idle, or with ``clients`` requests kept going (each client has
    had a response before it, and has one after it, so the reload surely ran under load)."""
    if mode == IDLE:
        start = time.monotonic()
        result = engine.reload(version, None)
        end = time.monotonic()
        return {"mode": mode, "version": version, "wall_s": end - start, "result": result}
    CLOCK.times = []
    load = Clients(engine.send, clients)
    try:
        load.wait_for(clients)
        start = time.monotonic()
        result = engine.reload(version, mode)
        end = time.monotonic()
        load.wait_for(len(load.outcomes) + clients)
    finally:
        outcomes = load.finish()
    ticks = list(CLOCK.times)
    return {
        "mode": mode,
        "version": version,
        "wall_s": end - start,
        "result": result,
        "gap_s": longest_gap(ticks, start, end),
        "normal_gaps_s": gaps_outside(ticks, [(start, end)]),
        **_describe(engine, outcomes, start, end),
    }


def measure(
    engine: Engine, rounds: int, clients: int, modes: Sequence[str]
) -> list[dict[str, Any]]:
    """``rounds`` x (idle + each of ``modes``), starting from v1."""
    runs: list[dict[str, Any]] = []
    version = "v1"
    for rnd in range(rounds):
        order = (IDLE, *modes)
        # Odd rounds in reverse: each mode reloads to both versions, and goes first and last.
        for mode in order if rnd % 2 == 0 else order[::-1]:
            version = "v2" if version == "v1" else "v1"
            run = one_reload(engine, version, mode, clients)
            run["round"] = rnd
            runs.append(run)
            print(
                f"  {engine.name} round {rnd} {mode:5} -> {version}: "
                f"{run['wall_s'] * 1e3:.1f} ms"
                + (f", gap {run['gap_s'] * 1e3:.1f} ms" if run.get("gap_s") is not None else "")
                + (f", failed {run['failed']}" if "failed" in run else ""),
                flush=True,
            )
    return runs
