"""The API's hot paths judge only what a response shows (issue 18): a page of a rollout's workers
judges that page's workers, not the rollout's every worker; the cached answers stay right.

No Kafka: a Coordinator that is never started, fed directly (fixtures in tests/component/
conftest.py). Nothing here asserts on time: what was judged, and what the answers say.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import httpx
import pytest

from controlplane.coordinator.service import Coordinator
from controlplane.coordinator.summary import (
    NO_DESIRE,
    Desire,
    Summaries,
    Want,
    WorkerIndex,
    in_sync_with,
)
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutPhase, RolloutStatus, WorkerDetail, WorkerState
from controlplane.wire.protocol import Ack, AckState, Command
from tests import fleet_at_scale
from tests.component.conftest import Clock, ack, at, command, feed, heartbeat, succeeded

# --------------------------------------------------------------------------- never seen


async def test_never_seen_follows_a_heartbeat_that_comes_alone(
    coordinator: Coordinator, clock: Clock, client: httpx.AsyncClient
) -> None:
    """A worker a rollout expects but never heard from is counted ``never_seen``; its first
    heartbeat, in a fetch with no command or ack, makes the count fall at once (the desired
    levels were settled: nothing else would judge them again)."""
    r1 = command("r1", workers=["w1", "w2"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.0), r1)
    feed(coordinator, *succeeded(r1, "w1", "w2", sent=4.0))  # w2 acked, never heartbeated
    workers = (await client.get("/api/v1/summary")).json()["workers"]
    assert (workers["known"], workers["never_seen"]) == (1, 1)

    feed(coordinator, heartbeat("w2", 9.0))  # a heartbeat alone
    workers = (await client.get("/api/v1/summary")).json()["workers"]
    assert (workers["known"], workers["never_seen"]) == (2, 0)
    listed = (await client.get("/api/v1/workers")).json()
    assert [w["worker_id"] for w in listed] == ["w1", "w2"]
    assert listed[1]["heartbeat"] is not None


# --------------------------------------------------------------------------- a rollout's workers


def _rows(status: RolloutStatus) -> list[tuple[WorkerDetail, bool]]:
    rows = [(w, False) for w in status.workers] + [(w, True) for w in status.unexpected]
    return sorted(rows, key=lambda r: r[0].worker_id)


async def _every_page(
    summaries: Summaries, rollout_id: str, limit: int, **filters: Any
) -> list[tuple[WorkerDetail, bool]]:
    rows: list[tuple[WorkerDetail, bool]] = []
    after: str | None = None
    while True:
        page, more = await summaries.workers_page(
            rollout_id, after=after, limit=limit, want=Want.FRESH, **filters
        )
        assert len(page) <= limit and (not more or len(page) == limit)
        rows.extend(page)
        if not more:
            return rows
        after = page[-1][0].worker_id


@pytest.fixture
def mixed(coordinator: Coordinator, clock: Clock) -> Iterator[dict[str, Command]]:
    """30 workers; r-live in progress (succeeded, failed, running, accepted, silent, never
    seen, an unexpected one); r-expired ended at its expiry with one worker running then,
    which succeeded later (a late state)."""
    ids = [f"w{i:02d}" for i in range(30)]
    live = command("r-live", workers=[*ids, "wnever"], issued=1.0)
    expired = command("r-expired", workers=ids[:4], issued=1.0).model_copy(
        update={"expires_at": at(6.0)}
    )
    feed(coordinator, *(heartbeat(w, 2.0 if w in ids[25:] else 9.0) for w in ids), live, expired)
    events: list[Ack] = []
    for i, w in enumerate(ids[:25]):
        events.append(ack(live, w, AckState.ACCEPTED, 2.0))
        if i % 5 == 0:
            events.append(ack(live, w, AckState.SUCCEEDED, 3.0))
        elif i % 5 == 1:
            events.append(ack(live, w, AckState.FAILED, 3.0, code=f"E{i % 2}"))
        elif i % 5 == 2:
            events.append(ack(live, w, AckState.RUNNING, 3.0))
    events.append(ack(live, "wstray", AckState.SUCCEEDED, 3.0))  # not pinned: unexpected
    events.extend(succeeded(expired, *ids[:3], sent=4.0))
    events.append(ack(expired, ids[3], AckState.RUNNING, 4.0))
    events.append(ack(expired, ids[3], AckState.SUCCEEDED, 7.0))  # after the expiry
    feed(coordinator, *events)
    yield {"live": live, "expired": expired}


FILTERS: list[dict[str, Any]] = [
    {},
    {"unexpected": False},
    {"unexpected": True},
    {"states": {WorkerState.LOST}},
    {"states": {WorkerState.RUNNING, WorkerState.ACCEPTED}},
    {"states": {WorkerState.SUCCEEDED}, "unexpected": False},
    {"codes": {"E1"}},
    {"codes": {"E0", "E1"}, "states": {WorkerState.FAILED}},
]


@pytest.mark.parametrize("rollout", ["live", "expired"])
@pytest.mark.parametrize("limit", [1, 4, 1000])
async def test_a_page_of_a_pinned_rollout_lists_what_its_full_status_lists(
    coordinator: Coordinator, mixed: dict[str, Command], rollout: str, limit: int
) -> None:
    summaries = Summaries(coordinator)
    try:
        rollout_id = mixed[rollout].rollout_id
        full = await summaries.status(rollout_id)  # judged now, in full
        assert full.phase is (
            RolloutPhase.PROGRESSING if rollout == "live" else RolloutPhase.TIMED_OUT
        )
        for filters in FILTERS:
            want = [
                row
                for row in _rows(full)
                if (filters.get("unexpected") is None or row[1] is filters["unexpected"])
                and ("states" not in filters or row[0].state in filters["states"])
                and (
                    "codes" not in filters
                    or (row[0].error is not None and row[0].error.code in filters["codes"])
                )
            ]
            assert await _every_page(summaries, rollout_id, limit, **filters) == want, filters
        shown = await summaries.status(rollout_id, want=Want.FRESH, workers_limit=limit)
        assert shown.workers == full.workers[: limit + 1]
        assert shown.model_copy(update={"workers": full.workers}) == full
    finally:
        summaries.close()


async def test_a_page_judges_the_workers_it_lists_not_the_rollout(
    coordinator: Coordinator, clock: Clock
) -> None:
    """A page of a rollout pinned to 1,500 workers judges its rows (and, filtered, the
    workers it passes over), never all 1,500: the rollout is judged in counts."""
    clock.now = fleet_at_scale.NOW + timedelta(seconds=1)  # every worker alive
    fleet_at_scale.build(coordinator, workers=1500, rollouts=3, active=1)
    summaries = Summaries(coordinator)
    try:
        made = summaries.judged_workers
        page, more = await summaries.workers_page("r0002", limit=50)
        assert len(page) == 50 and more
        assert summaries.judged_workers - made == 50
        made = summaries.judged_workers
        page, more = await summaries.workers_page(
            "r0002", after=page[-1][0].worker_id, limit=50, states={WorkerState.RUNNING}
        )
        assert [d.state for d, _ in page] == [WorkerState.RUNNING] * 50 and more
        assert summaries.judged_workers - made <= 2 * 51  # every other worker is running
        made = summaries.judged_workers
        shown = await summaries.status("r0002", want=Want.BOUNDED, workers_limit=100)
        assert (len(shown.workers), shown.expected) == (101, 1500)
        assert summaries.judged_workers - made == 101
    finally:
        summaries.close()


# --------------------------------------------------------------------------- desired levels


async def test_desired_levels_of_pinned_rollouts_judge_no_rollout_in_full(
    coordinator: Coordinator,
    clock: Clock,
    mixed: dict[str, Command],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What each worker should run, when every reload rollout is pinned to worker ids, is
    what ``Fleet.worker_levels`` says, found without it (no Track per worker of a rollout in
    progress, no level per known worker) and without a full status."""
    failed = command("r-failed", workers=["w00", "w01"], issued=2.0, version="v9")
    newer = command("r-newer", workers=["w05", "w29"], issued=3.0, version="v7")
    feed(coordinator, failed, newer, ack(failed, "w00", AckState.FAILED, 4.0))
    feed(coordinator, ack(failed, "w01", AckState.SUCCEEDED, 4.0))
    feed(coordinator, *succeeded(newer, "w05", "w29", sent=4.5))
    summaries = Summaries(coordinator)
    try:
        await summaries.overview("r-failed")  # ended: its judgment is trusted from now on
        levels = coordinator.fleet.worker_levels(coordinator.now())
        want = {lv.worker_id: (lv.desired_version, lv.desired_rollout_id) for lv in levels}

        def judged_in_full(*args: object) -> None:
            raise AssertionError("judged in full")

        monkeypatch.setattr(Fleet, "worker_levels", judged_in_full)
        monkeypatch.setattr(Fleet, "status", judged_in_full)
        got = (await summaries.levels()).desired
        assert {w: (d.version, d.rollout_id) for w, d in got.items() if d.version} == {
            w: v for w, v in want.items() if v[0] is not None
        }
        assert got["w00"] == Desire("v2", "r-live")  # r-failed desires nothing
        assert got["w29"] == Desire("v7", "r-newer")
        assert "wnever" in got and "wstray" not in got
    finally:
        summaries.close()


async def test_desired_levels_judged_again_unchanged_leave_the_index_as_it_is(
    coordinator: Coordinator,
    clock: Clock,
    mixed: dict[str, Command],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Levels judged again as they age (a rollout in progress) while no rollout changed what
    it desires keep what each worker should run as it was: the index's in-sync workers are
    not judged again, worker by worker; a change is judged at once."""
    summaries = Summaries(coordinator)
    try:
        first = await summaries.levels()
        calls: list[int] = []
        judge_sync = WorkerIndex.set_desired

        def counted(index: WorkerIndex, desired: Any) -> None:
            calls.append(len(desired))
            judge_sync(index, desired)

        monkeypatch.setattr(WorkerIndex, "set_desired", counted)
        clock.advance(2)  # past max_age: judged again
        again = await summaries.levels()
        assert again.as_of > first.as_of and again.desired == first.desired
        assert calls == []
        newer = command("r-newer", workers=["w05"], issued=9.0, version="v7")
        feed(coordinator, newer, *succeeded(newer, "w05", sent=11.0))
        changed = await summaries.levels()
        assert changed.desired["w05"] == Desire("v7", "r-newer") and len(calls) == 1
        assert summaries.workers.in_sync == sum(
            in_sync_with(changed.desired.get(w, NO_DESIRE), coordinator.fleet.registry.latest(w))
            for w in summaries.workers.sorted_ids()
        )
    finally:
        summaries.close()
