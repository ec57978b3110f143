"""The worker counts the API's summaries read (controlplane/coordinator/summary.py) against the
registry counted by hand: heartbeats in any order, restarts, stopped workers, leases, and
forgotten workers, judged at many instants."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from controlplane.coordinator.summary import Desire, WorkerIndex
from controlplane.rollout.registry import TICK, Registry, is_alive, lost_at
from controlplane.wire.protocol import WorkerStatus
from tests.factories import at, heartbeat


def by_hand(registry: Registry, now_s: float, desired: dict[str, Desire]) -> dict[str, object]:
    now = at(now_s)
    entries = list(registry.entries())
    alive = {hb.worker_id for hb, r in entries if is_alive(hb, now, r)}

    def groups(key: str) -> dict[str, tuple[int, int]]:
        out: dict[str, tuple[int, int]] = {}
        for hb, _ in entries:
            value = {"status": hb.status.value, "version": hb.weights_version or ""}[key]
            n, a = out.get(value, (0, 0))
            out[value] = (n + 1, a + (hb.worker_id in alive))
        return out

    def synced(w: str, version: str | None, degraded: bool) -> bool:
        want = desired.get(w, Desire(None, None))
        return not degraded and (want.version is None or version == want.version)

    return {
        "known": len(entries),
        "alive": len(alive),
        "status": groups("status"),
        "version": groups("version"),
        "degraded": sum(hb.degraded is not None for hb, _ in entries),
        "in_sync": sum(
            synced(hb.worker_id, hb.weights_version, hb.degraded is not None) for hb, _ in entries
        ),
    }


def counted(index: WorkerIndex, now_s: float) -> dict[str, object]:
    summary = index.summary(at(now_s), None)
    return {
        "known": summary.known,
        "alive": summary.alive,
        "status": {k: (g.workers, g.alive) for k, g in summary.by_status.items()},
        "version": {k: (g.workers, g.alive) for k, g in summary.by_version.items()},
        "degraded": summary.degraded,
        "in_sync": index.in_sync,
    }


@pytest.mark.parametrize("seed", range(5))
def test_counts_match_the_registry_whatever_the_order(seed: int) -> None:
    rng = random.Random(seed)
    registry = Registry()
    index = WorkerIndex(registry)
    desired = {f"w{i}": Desire(rng.choice(["v1", "v2", None]), None) for i in range(0, 40, 3)}
    index.set_desired(desired)
    statuses = [WorkerStatus.READY, WorkerStatus.BUSY, WorkerStatus.STOPPED]
    for step in range(600):
        worker = f"w{rng.randrange(40)}"
        sent = rng.uniform(0, 100)
        hb = heartbeat(
            worker,
            sent,
            started=rng.choice([-100.0, 50.0]),  # a restart now and then
            seq=rng.randrange(10_000),
            status=rng.choice(statuses),
            interval=rng.choice([1.0, 5.0, 30.0]),
            version=rng.choice(["v1", "v2", None]),
            degraded=rng.random() < 0.1,
        )
        received = None if rng.random() < 0.5 else at(sent + rng.uniform(0, 3))
        registry.observe(hb, received)
        index.update([worker])
        if step % 97 == 0:  # a tombstone no batch shows: the index notices by its size
            registry.forget(f"w{rng.randrange(40)}")
        if step % 50 == 0:
            for now_s in (0.0, 30.0, 60.0, 101.0, 200.0):
                assert counted(index, now_s) == by_hand(registry, now_s, desired), (step, now_s)


def test_alive_is_exact_at_the_lease_boundary() -> None:
    registry = Registry()
    index = WorkerIndex(registry)
    hb = heartbeat("w1", 10.0, interval=5.0)
    registry.observe(hb)
    index.update(["w1"])
    end = lost_at(hb)  # the first instant it no longer proves w1 alive
    assert index.alive(end - timedelta(microseconds=1)) == 1 == is_alive(hb, end - TICK)
    assert index.alive(end) == 0 == is_alive(hb, end)
    assert index.sorted_ids() == ["w1"]
