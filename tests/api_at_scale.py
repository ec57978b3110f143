"""The coordinator's API hot paths at fleet scale, in process (issue 18): what a summary costs
while the workers pages are read, and how soon a burst of acks shows its rollout succeeded.

``python -m tests.api_at_scale [N] [R] [SECONDS]`` (10,000 x 10 and 20 s by default) builds the
synthetic fleet of :mod:`tests.fleet_at_scale` (R pinned rollouts, the last one in progress),
folds every worker's heartbeat every 3 s, and serves the API through httpx's ASGI transport
while a watcher reads, one request at a time and without pause, what ``bench/scale``'s watcher
and an open dashboard read: every page of ``/api/v1/workers?alive=true``, the in-progress
rollout (``/api/v1/rollouts/{id}``) and its workers' pages (``/rollouts/{id}/workers``, also
filtered by state). Meanwhile it times ``/api/v1/summary`` and ``/api/v1/rollouts/{id}/summary``
(one every 50 ms each) and prints their p50 and p99, and the longest the event loop was late.
Then it publishes one more rollout pinned to all N, folds its 3 N acks in batches of 5,000 (the
loop free between two, as fetches are) and polls ``/api/v1/rollouts/{id}`` every 20 ms (as
``bench/scale`` does) until it shows ``succeeded``: the seconds after the last ack.

``--help``: this text. ``--profile``: under cProfile, the 40 costliest functions (cumulative)
printed at the end.
``--timings``: the judgments and listeners that run on the event loop, timed in CPU time
(count, total, median, longest): where the loop's time goes, whatever else the machine runs.
It also prints where the loop was when it had not ticked for 200 ms (a watchdog thread's
samples of its stack) and the garbage collector's pauses by generation; ``--freeze``: the heap
built so far frozen (``gc.freeze()``) before serving, as a coordinator could once caught up.
The client runs in the same process and loop (it decodes every page it reads): its share of the
loop is in the numbers; ``--timings`` says what the coordinator's own steps cost.
Nothing here is a test: numbers only (tests never assert on time).
"""

from __future__ import annotations

import asyncio
import collections
import cProfile
import gc
import pstats
import re
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import httpx
from fastapi import FastAPI

from controlplane.coordinator.follower import Batch
from controlplane.coordinator.service import Coordinator
from controlplane.wire.protocol import AckState
from tests.fleet_at_scale import (
    BATCH,
    Served,
    _acks,
    _fold,
    rollout_command,
    worker_ids,
)

Hook = Callable[[FastAPI, Coordinator], None]
FREEZE = "--freeze" in sys.argv


def _pct(values: list[float], q: float) -> float:
    got = sorted(values)
    return got[min(len(got) - 1, round(q * (len(got) - 1)))] if got else float("nan")


async def _pages(client: httpx.AsyncClient, url: str) -> int:
    """Follow ``Link: rel=next`` from ``url``; how many items."""
    total, next_url = 0, url
    while next_url:
        response = await client.get(next_url)
        assert response.status_code == 200, (next_url, response.text[:300])
        total += len(response.json())
        found = re.search(r"<([^>]+)>", response.headers.get("link", ""))
        next_url = found.group(1) if found else ""
    return total


async def measure(workers: int, rollouts: int, seconds: float, hook: Hook | None = None) -> None:
    served = Served(workers, rollouts, active=1)
    coordinator, app, clock = served.coordinator, served.app, served.clock
    if hook is not None:  # after the build: what serving costs
        hook(app, coordinator)
    if FREEZE:
        gc.freeze()
    print(f"built {workers} workers x {rollouts} rollouts in {served.build_s:.1f} s")
    served.go_live()
    ids = worker_ids(workers)
    live = f"r{rollouts - 1:04d}"
    heartbeats = served.heartbeats

    stalls: list[float] = []
    collected: dict[int, list[float]] = {}
    collecting: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:  # full collections stall the loop
        if phase == "start":
            collecting[:] = [time.perf_counter()]
        elif collecting:
            took = time.perf_counter() - collecting[0]
            collected.setdefault(info["generation"], []).append(took)

    gc.callbacks.append(on_gc)

    ticked = [time.perf_counter()]
    stuck: collections.Counter[str] = collections.Counter()

    async def lateness() -> None:  # how late a 10 ms sleep wakes: the loop busy elsewhere
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            ticked[0] = time.perf_counter()
            stalls.append(ticked[0] - t - 0.01)

    main_thread = threading.get_ident()

    def watchdog() -> None:  # what the loop runs when it has not ticked for 200 ms
        while not quit_watch.is_set():
            time.sleep(0.05)
            if time.perf_counter() - ticked[0] > 0.2:
                frame = sys._current_frames().get(main_thread)
                stack = traceback.extract_stack(frame)[-14:] if frame is not None else []
                stuck[" < ".join(f"{f.name}:{f.lineno}" for f in reversed(stack))] += 1

    quit_watch = threading.Event()
    threading.Thread(target=watchdog, daemon=True).start()

    watched: dict[str, list[float]] = {}

    async def timed(path: str, call: Awaitable[Any]) -> None:
        t = time.perf_counter()
        await call
        watched.setdefault(path, []).append(time.perf_counter() - t)

    async def watcher(client: httpx.AsyncClient) -> None:
        while True:
            await timed(
                "workers?alive=true (every page)", _pages(client, "/api/v1/workers?alive=true")
            )
            await timed(f"rollouts/{live}", client.get(f"/api/v1/rollouts/{live}"))
            await timed(
                f"rollouts/{live}/workers (every page)",
                _pages(client, f"/api/v1/rollouts/{live}/workers"),
            )
            await timed(
                f"rollouts/{live}/workers?state=running&limit=50",
                client.get(f"/api/v1/rollouts/{live}/workers?state=running&limit=50"),
            )
            await timed(
                f"rollouts/{live}/workers?limit=50",
                client.get(f"/api/v1/rollouts/{live}/workers?limit=50"),
            )

    times: dict[str, list[float]] = {}

    async def summaries(client: httpx.AsyncClient, path: str) -> None:
        while True:
            t = time.perf_counter()
            response = await client.get(path)
            times.setdefault(path, []).append(time.perf_counter() - t)
            assert response.status_code == 200, (path, response.text[:300])
            await asyncio.sleep(0.05)

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://c", timeout=600) as client:
        tasks = [asyncio.create_task(heartbeats()), asyncio.create_task(lateness())]
        for path in ("/api/v1/summary", f"/api/v1/rollouts/{live}/summary"):
            await client.get(path)  # the first answer may judge what it shows
        tasks.append(asyncio.create_task(watcher(client)))
        for path in ("/api/v1/summary", f"/api/v1/rollouts/{live}/summary"):
            tasks.append(asyncio.create_task(summaries(client, path)))
        stalls.clear()
        await asyncio.sleep(seconds)
        for task in tasks:
            if task.done():  # a reader failed: its answers would be missing, say why
                raise RuntimeError(f"{task.get_name()} ended early") from task.exception()
        for task in tasks[2:]:
            task.cancel()
        for path, got in times.items():
            print(
                f"{path:40s} p50 {1000 * statistics.median(got):6.1f} ms  "
                f"p99 {1000 * _pct(got, 0.99):6.1f} ms  max {1000 * max(got):6.1f} ms  n={len(got)}"
            )
        for path, got in watched.items():
            print(f"  watcher {path:48s} p50 {1000 * statistics.median(got):7.1f} ms  n={len(got)}")
        print(
            f"event loop late: p99 {1000 * _pct(stalls, 0.99):.0f} ms, max {1000 * max(stalls):.0f} ms"
        )
        for stack, samples in stuck.most_common(4):
            print(f"loop stuck ({samples} samples of 50 ms): {stack}")
        for generation, took in sorted(collected.items()):
            print(
                f"gc generation {generation}: {len(took)} collections, "
                f"longest {1000 * max(took):.0f} ms, total {sum(took):.2f} s"
            )

        # One more rollout pinned to all N: its 3 N acks in a burst, until shown succeeded.
        watcher_task = asyncio.create_task(watcher(client))
        command = rollout_command(rollouts, rollouts + 1, ids).model_copy(
            update={
                "issued_at": clock() - timedelta(seconds=5),
                "expires_at": clock() + timedelta(days=1),
            }
        )
        _fold(coordinator, Batch(commands=[command]))
        url = f"/api/v1/rollouts/{command.rollout_id}"
        assert (await client.get(url)).status_code == 200  # folded above: known at once
        done = (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED)
        batch, t0 = Batch(), time.perf_counter()
        for worker_id in ids:
            batch.acks.extend(_acks(command, worker_id, done, failed=False))
            if len(batch.acks) >= BATCH:
                _fold(coordinator, batch)
                batch = Batch()
                await asyncio.sleep(0)
        _fold(coordinator, batch)
        last = time.perf_counter()
        polls = 0
        while (await client.get(url)).json()["phase"] != "succeeded":
            polls += 1
            await asyncio.sleep(0.02)
        print(
            f"{3 * workers} acks folded in {last - t0:.2f} s; shown succeeded "
            f"{time.perf_counter() - last:.2f} s after the last ({polls} polls)"
        )
        watcher_task.cancel()
        for task in tasks[:2]:
            task.cancel()
    app.state.summaries.close()
    gc.callbacks.remove(on_gc)
    quit_watch.set()


def _timed(owner: Any, name: str, out: dict[str, list[float]]) -> None:
    inner = getattr(owner, name, None)
    if inner is None:  # not in this version of the product
        return

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.thread_time()  # CPU time: what the step costs, however busy the machine is
        try:
            return inner(*args, **kwargs)
        finally:
            out.setdefault(f"{getattr(owner, '__name__', owner)}.{name}", []).append(
                time.thread_time() - t
            )

    setattr(owner, name, wrapper)


def timings(out: dict[str, list[float]]) -> Hook:
    """Time what runs on the loop for the API: judgments, levels, the listeners of a batch."""
    from controlplane.coordinator import summary
    from controlplane.coordinator.metrics import CoordinatorMetrics
    from controlplane.rollout.fleet import Fleet

    for owner, name in (
        (Fleet, "status"),
        (Fleet, "tally"),
        (Fleet, "worker_levels"),
        (summary.Summaries, "_judge"),
        (summary.Summaries, "_details"),
        (summary, "targets_status"),
        (summary.WorkerIndex, "update"),
        (summary.WorkerIndex, "set_desired"),
        (summary.Summaries, "on_batch"),
        (summary.Summaries, "_judge_levels"),
        (CoordinatorMetrics, "on_batch"),
    ):
        _timed(owner, name, out)

    def hook(app: FastAPI, coordinator: Coordinator) -> None:
        out.clear()  # the build's own calls are not counted

    return hook


def main(argv: list[str], hook: Hook | None = None) -> None:
    if "--help" in argv or "-h" in argv:
        print(__doc__)
        return
    profile = "--profile" in argv
    if "--timings" in argv and hook is None:
        spent: dict[str, list[float]] = {}
        hook = timings(spent)
        try:
            main([a for a in argv if a != "--timings"], hook)
        finally:
            for name, got in sorted(spent.items(), key=lambda kv: -sum(kv[1])):
                print(
                    f"  {name:45s} n={len(got):5d} CPU total {sum(got):6.2f} s  "
                    f"p50 {1000 * statistics.median(got):6.1f} ms  max {1000 * max(got):6.1f} ms"
                )
        return
    args = [float(a) for a in argv if not a.startswith("--")]
    defaults: tuple[float, ...] = (10_000, 10, 20.0)
    n, r, seconds = [*args, *defaults[len(args) :]]
    run = measure(int(n), int(r), seconds, hook)
    if not profile:
        asyncio.run(run)
        return
    profiler = cProfile.Profile()
    profiler.enable()
    asyncio.run(run)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)


if __name__ == "__main__":
    main(sys.argv[1:])
