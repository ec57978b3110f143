"""A rollout judged in counts (``Fleet.tally``, what the coordinator's summaries read) says
exactly what its full status counted says, and the cheap end check compaction makes
(``Fleet.check_ended``) agrees with the full status: generated scenarios (heartbeats, deaths,
restarts, conflicting acks, strangers, aborts) fed in any order and judged at every instant,
as liveness changes (tests/unit/test_rollout_replay.py's scenarios).
"""

from __future__ import annotations

import random
from datetime import timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.judge import Tally
from controlplane.wire.protocol import Ack, Command, Heartbeat
from tests.factories import (
    A,
    Event,
    F,
    R,
    S,
    X,
    abort_event,
    ack,
    at,
    command,
    event_time,
    feed,
    fleet,
    full,
    heartbeat,
    nack,
)
from tests.unit.test_rollout_replay import DEADLINE, HORIZON, scenarios


def assert_tally_is_status(f: Fleet, rollout_id: str, now: int) -> None:
    when = at(now)
    assert f.tally(rollout_id, when) == Tally.of(f.status(rollout_id, when))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.lists(st.integers(0, HORIZON + 100), min_size=1, max_size=6))
def test_a_tally_is_the_full_status_counted_at_any_instant(
    events: list[Event], instants: list[int]
) -> None:
    f = fleet(*events, deadline=DEADLINE)
    for now in instants:
        assert_tally_is_status(f, "r1", now)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_fed_live_the_tally_and_the_end_check_agree_with_the_status_at_every_instant(
    events: list[Event], rnd: random.Random
) -> None:
    """Fed as it happens and judged after each instant's events (liveness moving with time);
    then a reader fed the same log in another order."""
    live = Fleet(progress_deadline_s=DEADLINE)
    for i, event in enumerate(events):
        feed(live, [event])
        instant = event_time(event)[0]
        if "r1" not in live or (i + 1 < len(events) and event_time(events[i + 1])[0] == instant):
            continue
        status = live.status("r1", instant)
        assert live.tally("r1", instant) == Tally.of(status)
        ended = live.check_ended("r1", instant)
        assert ended == (status.finished_at if status.terminal else None)
    shuffled = list(events)
    rnd.shuffle(shuffled)
    assert_tally_is_status(fleet(*shuffled, deadline=DEADLINE), "r1", HORIZON + 100)


@st.composite
def settled(draw: st.DrawFn) -> list[Event]:
    """A rollout pinned to workers that all report a terminal state (what the summaries judge
    from the acks alone), at any times: before or after expiry, an abort or a long silence;
    with redeliveries, conflicting terminals, a wrong version, workers that died or stopped,
    a stranger's acks and in-flight heartbeats."""
    ids = [f"w{i}" for i in range(draw(st.integers(1, 4)))]
    events: list[Event] = [command(workers=ids, expires=draw(st.sampled_from([150.0, 3600.0])))]
    for w in ids:
        times = sorted(draw(st.lists(st.integers(0, 500), min_size=1, max_size=3)))
        kinds = draw(st.lists(st.sampled_from([A, R]), max_size=len(times) - 1))
        terminal = draw(st.sampled_from([S, S, F, X]))
        version = draw(st.sampled_from(["v2", "v2", "v1"]))
        acks = [ack(w, k, t) for k, t in zip(kinds, times, strict=False)]
        acks.append(ack(w, terminal, times[-1], version=version if terminal is S else None))
        if draw(st.booleans()):
            other = draw(st.sampled_from([S, F]))
            acks.append(ack(w, other, draw(st.integers(0, 500))))  # a conflict (or a repeat)
        if draw(st.booleans()):
            acks.append(draw(st.sampled_from(acks)))  # a redelivery
        events += acks
        death = draw(st.one_of(st.none(), st.integers(0, 500)))
        t = -100.0
        while t <= 600 and (death is None or t <= death):
            flight = ("c1", times[0]) if kinds and times[0] <= t < times[-1] else None
            events.append(heartbeat(w, t, started=-100.0, interval=20.0, flight=flight))
            t += 20.0
    if draw(st.booleans()):
        events += full("x9", 5, 50)
    if draw(st.booleans()):
        events.append(abort_event("operator", draw(st.integers(0, 500))))
    return sorted(events, key=event_time)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(settled(), st.lists(st.integers(0, 700), min_size=1, max_size=6))
def test_a_rollout_settled_by_its_acks_is_tallied_and_ended_as_its_full_status_says(
    events: list[Event], instants: list[int]
) -> None:
    f = fleet(*events, deadline=DEADLINE)
    for now in instants:
        assert_tally_is_status(f, "r1", now)
    for now in sorted(instants):
        status = f.status("r1", at(now))
        assert fleet(*events, deadline=DEADLINE).check_ended("r1", at(now)) == (
            status.finished_at if status.terminal else None
        )


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(settled(), min_size=1, max_size=3), st.integers(0, 700))
def test_desired_versions_from_rollouts_settled_by_their_acks_are_those_judged_in_full(
    rollouts: list[list[Event]], now: int
) -> None:
    events: list[Event] = []
    for i, rollout in enumerate(rollouts):  # r0, r1, ..: the same workers, later and later
        for event in rollout:
            if isinstance(event, Command):
                event = event.model_copy(
                    update={
                        "rollout_id": f"r{i}",
                        "command_id": f"c{i}",
                        "issued_at": event.issued_at + timedelta(seconds=i),
                        "spec": event.spec.model_copy(update={"version": f"v{i}"}),
                    }
                )
            elif isinstance(event, Ack) and event.rollout_id == "r1" and event.command_id == "c1":
                event = event.model_copy(update={"rollout_id": f"r{i}", "command_id": f"c{i}"})
            elif not isinstance(event, (Command, Ack, Heartbeat)):
                event = (f"r{i}", *event[1:])
            events.append(event)
    f = fleet(*events, deadline=DEADLINE)
    fast = f.worker_levels(at(now))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Fleet, "_settled_end", lambda *args, **kwargs: None)
        assert f.worker_levels(at(now)) == fast


def test_a_rollout_settled_by_its_acks_is_tallied_without_judging_each_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet(
        command(workers=["w1", "w2"]),
        heartbeat("w1", 0.0),
        *full("w1", 1.0, 3.0),
        *full("w2", 1.0, 4.0, F),
    )
    expected = Tally.of(f.status("r1", at(10.0)))

    def judged_in_full(*args: object, **kwargs: object) -> None:
        raise AssertionError("judged worker by worker")

    monkeypatch.setattr(Fleet, "_evaluate", judged_in_full)
    assert f.tally("r1", at(10.0)) == expected
    assert f.check_ended("r1", at(10.0)) == at(4.0)
    assert expected.status.phase.value == "failed"


def test_a_tally_of_a_summarized_rollout_and_of_one_known_only_from_nacks() -> None:
    f = Fleet(progress_deadline_s=DEADLINE, max_ended_rollouts=0)
    feed(
        f,
        [
            command(workers=["w1", "w2"]),
            heartbeat("w1", 0.0),
            heartbeat("w2", 0.0),
            *full("w1", 1.0, 3.0),
            *full("w2", 1.0, 4.0),
        ],
    )
    bad = nack("w1", 5.0, "SCHEMA_INVALID").model_copy(
        update={"rollout_id": "r9", "command_id": "c9"}
    )
    feed(f, [bad])
    assert f.compact(at(10.0)) == 2  # r1 summarized; r9 (refused by all) ended too
    for rollout_id in ("r1", "r9"):
        assert_tally_is_status(f, rollout_id, 10)
        assert f.ended(rollout_id) == f.status(rollout_id, at(10.0)).finished_at


def test_a_rollout_in_progress_is_found_unended_without_judging_each_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What compaction asks of every rollout in progress every 10 s, and what its summary
    counts, from the acks alone (and the heartbeats of the workers not terminal)."""
    f = fleet(
        command(workers=["w1", "w2"]),
        heartbeat("w1", 0.0),
        heartbeat("w2", 0.0),
        *full("w1", 1.0, 3.0),
        ack("w2", R, 2.0),
    )
    assert f.status("r1", at(10.0)).phase.value == "progressing"
    expected = [Tally.of(f.status("r1", at(t))) for t in (10.0, 100.0)]  # w2 lost at 100 s

    def judged_in_full(*args: object, **kwargs: object) -> None:
        raise AssertionError("judged worker by worker")

    monkeypatch.setattr(Fleet, "_evaluate", judged_in_full)
    assert f.check_ended("r1", at(10.0)) is None
    assert [f.tally("r1", at(t)) for t in (10.0, 100.0)] == expected
    assert expected[1].status.counts.lost == 1
