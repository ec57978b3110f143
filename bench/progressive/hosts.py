"""The coordinator's child process (``--coordinator-child``) and the parent's handle on it.

The child runs one ``Coordinator`` (follower, probes, controller) until told to stop on stdin,
and answers on stdout, one JSON line each: ``ready`` once its controller leads; ``stats``
(decisions written, commands published, and the trace since the last ``stats``; ``stats
profile-on`` profiles decide() from then on, until the next ``stats``);
``wait-target <name> <selector JSON>`` once its own fold of the controller topic holds that
selector for the target.

The trace (wall-clock times, comparable with the parent's on one machine): every ``decide()``
call (its start, duration, CPU time, the commands and states it returned), every write of a decision (its
transaction, then the wait until the follower read it back), wrapped around the controller's
own functions in this process only; and when its follower folded terminal acks (per rollout id). With ``profile`` (a path) in its config, decide() runs under
cProfile after a ``stats profile-on``, and the profile is written there when the child stops.
"""

from __future__ import annotations

import asyncio
import cProfile
import json
import sys
import time
from typing import Any


async def coordinator_host(cfg: dict[str, Any]) -> None:
    from controlplane.coordinator.service import Coordinator, CoordinatorSettings
    from controlplane.kafka.settings import KafkaSettings

    kafka = KafkaSettings(
        bootstrap_servers=cfg["bootstrap"], topic_prefix=cfg["prefix"], client_id="bench-coord"
    )
    settings = CoordinatorSettings(kafka=kafka, issuer="bench-controller")
    trace: list[dict[str, Any]] = []
    profiler = cProfile.Profile(time.thread_time) if cfg.get("profile") else None
    profiling = [False]
    started = time.perf_counter()
    async with Coordinator(settings) as coordinator:
        await coordinator.wait_ready(120)
        controller = coordinator.controller
        assert controller is not None
        writing = [0]  # writes in progress: a stats answer waits for them to be traced
        _trace(controller, trace, profiler, profiling, writing)
        await _until(lambda: controller.leading is not None, 120, "the controller to lead")
        _say({"ready": True, "start_s": round(time.perf_counter() - started, 3)})
        loop = asyncio.get_running_loop()
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line.startswith("stats"):
                await _until(lambda: writing[0] == 0, 30, "the controller's write to end")
                _say(
                    {
                        "decisions": controller.decisions,
                        "commands_published": controller.commands_published,
                        "leading": controller.leading,
                        "fenced": controller.fenced,
                        "last_error": controller.last_error,
                        "trace": trace[:],
                    }
                )
                trace.clear()
                profiling[0] = line.endswith(" profile-on")
            elif line.startswith("wait-target "):
                _, name, selector = line.split(" ", 2)
                wanted = json.loads(selector)

                def holds(name: str = name, wanted: dict[str, str] = wanted) -> bool:
                    target = coordinator.control.target(name)
                    return target is not None and dict(target.spec.selector) == wanted

                await _until(holds, 60, f"target {name} to select {wanted}")
                _say({"ok": line})
            else:  # "stop" or EOF
                break
    if profiler is not None:
        profiler.dump_stats(cfg["profile"])


def _trace(
    controller: Any,
    trace: list[dict[str, Any]],
    profiler: cProfile.Profile | None,
    profiling: list[bool],
    writing: list[int],
) -> None:
    """Record the controller's decide() calls and writes (see the module's docstring); with a
    profiler, profile decide() alone (CPU time of the thread) while ``profiling[0]``."""
    import controlplane.coordinator.controller as module

    decide = module.decide  # type: ignore[attr-defined]

    def timed_decide(*args: Any, **kwargs: Any) -> Any:
        at, t0, c0 = time.time(), time.perf_counter(), time.thread_time()
        if profiler is None or not profiling[0]:
            decision = decide(*args, **kwargs)
        else:
            decision = profiler.runcall(decide, *args, **kwargs)
        trace.append(
            {
                "decide": at,
                "s": time.perf_counter() - t0,
                "cpu_s": time.thread_time() - c0,
                "commands": [c.rollout_id for c in decision.commands],
                "states": [[s.phase.value, s.wave, s.message[:80]] for s in decision.states],
            }
        )
        return decision

    write = controller._write
    wait_reached = controller.follower.wait_reached

    async def timed_write(*args: Any, **kwargs: Any) -> None:
        at, t0 = time.time(), time.perf_counter()
        writing[0] += 1
        try:
            await write(*args, **kwargs)
        finally:
            writing[0] -= 1
        trace.append({"write": at, "s": time.perf_counter() - t0})

    async def timed_wait_reached(ends: Any) -> None:
        at, t0 = time.time(), time.perf_counter()
        await wait_reached(ends)
        trace.append({"read_back": at, "s": time.perf_counter() - t0})

    def on_batch(batch: Any) -> None:
        acked: dict[str, int] = {}
        for ack in batch.acks:
            if ack.state.terminal:
                acked[ack.rollout_id] = acked.get(ack.rollout_id, 0) + 1
        if acked:
            trace.append({"acks": time.time(), "terminal": acked})

    controller.follower.listeners.append(on_batch)
    module.decide = timed_decide  # type: ignore[attr-defined]
    controller._write = timed_write
    controller.follower.wait_reached = timed_wait_reached


async def _until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)  # the coordinator offers no event for these


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()
