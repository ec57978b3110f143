"""Verdicts are final, on a real broker with a real worker process: the trial's SIGKILL mid-reload.

The worker is killed while it applies a command and restarted after the coordinator has shown it
lost; it applies the redelivered command. Watched at every change and every tick, the rollout is
never terminal before that success, and a coordinator started afterwards says the same.
No sleeps: every step waits on the coordinator's change feed, with a deadline.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path

import pytest

from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import RolloutPhase, RolloutStatus, WorkerState
from controlplane.wire.protocol import ReloadWeightsSpec, Selector
from tests.integration.test_worker_process import WorkerProcess

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@asynccontextmanager
async def coordinator_on(kafka: KafkaSettings) -> AsyncIterator[Coordinator]:
    async with Coordinator(CoordinatorSettings(kafka=kafka)) as coordinator:
        await coordinator.wait_ready(60)
        yield coordinator


async def until(coordinator: Coordinator, check: Callable[[], bool], what: str) -> None:
    """Wait on the coordinator's change feed (every change, and a tick) until ``check()``."""
    try:
        async with asyncio.timeout(60), aclosing(coordinator.changes(tick_s=0.1)) as feed:
            async for _ in feed:
                if check():
                    return
    except TimeoutError:
        raise AssertionError(f"never {what}") from None


class Watch:
    """Judges one rollout at every change and every tick of the coordinator's feed."""

    def __init__(self, coordinator: Coordinator, rollout_id: str) -> None:
        self.coordinator = coordinator
        self.rollout_id = rollout_id
        self.seen: list[RolloutStatus] = []

    async def until(self, check: Callable[[RolloutStatus], bool], what: str) -> RolloutStatus:
        def judged() -> bool:
            c = self.coordinator
            self.seen.append(c.fleet.status(self.rollout_id, c.now()))
            return check(self.seen[-1])

        await until(self.coordinator, judged, f"{what}; last: {self.seen[-1:]}")
        return self.seen[-1]


async def test_a_worker_killed_mid_reload_and_restarted_never_flips_the_verdict(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\0" * 32)
    worker = WorkerProcess(kafka, tmp_path, "w1", "fake", {"reload_delay_s": 3.0})
    try:
        async with coordinator_on(kafka) as coordinator:
            worker.start()
            registry = coordinator.fleet.registry
            await until(coordinator, lambda: registry.is_alive("w1", coordinator.now()), "alive")
            command = await coordinator.create_rollout(
                ReloadWeightsSpec(path=str(root / "model.safetensors"), version="v2"),
                Selector(labels={"model": "tiny"}),
            )
            watch = Watch(coordinator, command.rollout_id)

            def running(s: RolloutStatus) -> bool:
                w1 = s.worker("w1")
                return w1 is not None and w1.state is WorkerState.RUNNING

            await watch.until(running, "running")
            worker.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
            assert worker.wait(30) == -signal.SIGKILL

            def lost(s: RolloutStatus) -> bool:
                w1 = s.worker("w1")
                return w1 is not None and w1.state is WorkerState.LOST

            shown = await watch.until(lost, "shown lost (3 silent heartbeat periods)")
            assert shown.phase is RolloutPhase.PROGRESSING and shown.exit_code is None

            worker.start()  # same state directory: it reads the command again and applies it
            final = await watch.until(lambda s: s.terminal, "terminal")
            assert final.phase is RolloutPhase.SUCCEEDED, final
            assert final.finished_at is not None and final.finished_at > shown.as_of
            # Never terminal before, at any change or tick.
            assert [s for s in watch.seen[:-1] if s.terminal] == []

        async with coordinator_on(kafka) as again:
            replayed = again.fleet.status(command.rollout_id, again.now())
            assert (replayed.phase, replayed.finished_at) == (final.phase, final.finished_at)
    finally:
        worker.stop()
