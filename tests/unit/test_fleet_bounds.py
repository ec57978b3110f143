"""Ended rollouts kept in full within a bound on the workers' reports they hold (issue 18: at
10,000 workers, 1,000 ended rollouts in full are 10 million ledgers), not only on their count.
Builders in tests/factories.py.
"""

from __future__ import annotations

import pytest

from controlplane.rollout.fleet import Fleet
from tests.factories import Event, at, command, feed, full, heartbeat


def ended_rollouts(f: Fleet, sizes: list[int]) -> Fleet:
    """Rollouts r0, r1, .. pinned to ``sizes[i]`` workers each, all succeeded, in order."""
    for i, size in enumerate(sizes):
        ids = [f"w{j}" for j in range(size)]
        events: list[Event] = [command(f"r{i}", f"c{i}", workers=ids, issued=10.0 * i)]
        for w in ids:
            events += full(w, 10.0 * i + 1, 10.0 * i + 2, rollout_id=f"r{i}", command_id=f"c{i}")
        feed(f, events)
    feed(f, [heartbeat(f"w{j}", 100.0) for j in range(max(sizes))])
    return f


def full_ones(f: Fleet, now: float) -> list[str]:
    return [r for r in f.rollout_ids() if not f.status(r, at(now)).details_dropped]


def test_ended_rollouts_are_kept_in_full_up_to_the_workers_they_hold() -> None:
    f = ended_rollouts(Fleet(max_ended_rollouts=10, max_ended_workers=5), [2, 2, 2, 2])
    assert f.compact(at(100.0)) == 2
    assert full_ones(f, 100.0) == ["r2", "r3"]  # 4 workers' reports; with r1, 6 > 5
    assert f.excess() == []


def test_the_newest_ended_rollout_is_kept_in_full_whatever_its_size() -> None:
    f = ended_rollouts(Fleet(max_ended_rollouts=10, max_ended_workers=1), [2, 3])
    assert f.compact(at(100.0)) == 1
    assert full_ones(f, 100.0) == ["r1"]


def test_the_count_bound_still_holds_within_the_workers_bound() -> None:
    f = ended_rollouts(Fleet(max_ended_rollouts=1, max_ended_workers=100), [2, 2, 2])
    assert f.compact(at(100.0)) == 2
    assert full_ones(f, 100.0) == ["r2"]


def test_a_summary_made_in_counts_is_the_one_the_full_status_made() -> None:
    """Summaries are now made from ``Fleet.tally``: what a reader sees of a summarized
    rollout is what it saw before, details dropped."""
    f = ended_rollouts(Fleet(max_ended_rollouts=1), [3, 2])
    before = f.status("r0", at(100.0))
    assert f.compact(at(100.0)) == 1
    after = f.status("r0", at(100.0))
    assert after.details_dropped
    kept = after.model_dump(exclude={"workers", "unexpected", "anomalies", "selector", "message"})
    assert kept == before.model_dump(
        exclude={"workers", "unexpected", "anomalies", "selector", "message", "details_dropped"}
    ) | {"details_dropped": True}
    assert after.message.startswith(before.message)
    levels = {lv.worker_id: lv.desired_rollout_id for lv in f.worker_levels(at(100.0))}
    assert levels == {"w0": "r1", "w1": "r1", "w2": "r0"}  # r0 still desires v2 for w2


def test_a_negative_bound_is_refused() -> None:
    with pytest.raises(ValueError, match="max_ended_workers"):
        Fleet(max_ended_workers=-1)
