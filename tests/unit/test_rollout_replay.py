"""Unit tests for the rollout state machine: the same status whatever the replay order
(generated scenarios, shared with test_ack_codec) and compaction of ended rollouts.
Builders in tests/factories.py.
"""

from __future__ import annotations

import random
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import (
    RolloutStatus,
)
from controlplane.wire.protocol import (
    Heartbeat,
)
from tests.factories import (
    A,
    Event,
    F,
    R,
    S,
    X,
    abort_event,
    ack,
    alive,
    at,
    command,
    compacted_log,
    event_time,
    feed,
    fleet,
    full,
    heartbeat,
    nack,
)

# --------------------------------------------------------------------------- determinism

HB_EVERY = 20.0  # heartbeat period in generated scenarios: alive for 60 s after each
HORIZON = 600
DEADLINE = 120.0  # above 3 heartbeat periods, as in production (600 s against 15 s)


@st.composite
def scenarios(draw: st.DrawFn) -> list[Event]:
    """A rollout as a fleet lives it: heartbeats every period until a worker dies, acks in any
    state order (duplicates and conflicts included), heartbeats showing the command in flight
    while it runs, maybe a stranger's acks and an abort."""
    n = draw(st.integers(1, 4))
    label_only = draw(st.booleans())
    ids = [f"w{i}" for i in range(n)]
    events: list[Event] = [
        command(
            workers=None if label_only else ids,
            labels={"model": "llama"} if label_only else None,
            expires=draw(st.sampled_from([150.0, 3600.0])),
        )
    ]
    for w in ids:
        started = draw(st.sampled_from([-100.0, 30.0])) if label_only else -100.0
        labels = {"model": draw(st.sampled_from(["llama", "llama", "other"]))}
        death = draw(st.one_of(st.none(), st.integers(0, 400)))
        # An incarnation sends nothing after it died (a SIGKILLed process stamps no more acks).
        first, last = (int(started) + 1 if started > 0 else 0), 450 if death is None else death
        kinds = draw(st.lists(st.sampled_from([A, R, S, F, X]), max_size=4 if first <= last else 0))
        times = draw(
            st.lists(
                st.integers(first, max(first, last)),
                min_size=len(kinds),
                max_size=len(kinds),
            ).map(sorted)
        )
        running = next((t for k, t in zip(kinds, times, strict=True) if k is R), None)
        finish = min((t for k, t in zip(kinds, times, strict=True) if k.terminal), default=None)
        acks = [
            ack(
                w,
                k,
                t,
                started=running if k.terminal and running is not None and running <= t else None,
            )
            for k, t in zip(kinds, times, strict=True)
        ]
        if acks and draw(st.booleans()):
            acks.append(draw(st.sampled_from(acks)))  # a redelivery
        events += acks
        t = started
        while t <= HORIZON and (death is None or t <= death):
            working = running is not None and running <= t and (finish is None or t < finish)
            events.append(
                heartbeat(
                    w,
                    t,
                    started=started,
                    labels=labels,
                    interval=HB_EVERY,
                    flight=("c1", running) if working and running is not None else None,
                )
            )
            t += HB_EVERY
        if death is not None and draw(st.booleans()):
            # Restarted (a new incarnation), maybe long after; it re-applies the command.
            restart = draw(st.integers(death + 1, HORIZON))
            again = draw(st.lists(st.sampled_from([A, R, S, F]), max_size=3))
            moments = sorted(
                draw(
                    st.lists(
                        st.integers(restart, HORIZON), min_size=len(again), max_size=len(again)
                    )
                )
            )
            events += [ack(w, k, m, attempt=2) for k, m in zip(again, moments, strict=True)]
            t = float(restart)
            while t <= HORIZON:
                events.append(heartbeat(w, t, started=restart, labels=labels, interval=HB_EVERY))
                t += HB_EVERY
    if draw(st.booleans()):
        events += full("x9", 5, 50)
    if draw(st.booleans()):
        events.append(abort_event("operator", draw(st.integers(0, 500))))
    return sorted(events, key=event_time)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.integers(0, HORIZON + 100), st.randoms(use_true_random=False))
def test_the_same_events_in_any_order_give_the_same_status(
    events: list[Event], now: int, rnd: random.Random
) -> None:
    shuffled = list(events)
    rnd.shuffle(shuffled)
    a = fleet(*events, deadline=DEADLINE).status("r1", at(now))
    b = fleet(*shuffled, deadline=DEADLINE).status("r1", at(now))
    assert a == b


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.randoms(use_true_random=False))
def test_live_feed_never_reopens_an_ended_rollout_and_a_restart_agrees(
    events: list[Event], rnd: random.Random
) -> None:
    """Fed as it happens (asked for status at every instant), a rollout that ended stays ended,
    with the same verdict; a fresh Fleet fed the compacted log, in any order, says the same.

    Events sent in the same microsecond have no order but the documented tie-breaks, so status
    is asked once all of an instant's events are in."""
    live = Fleet(progress_deadline_s=DEADLINE)
    ended: RolloutStatus | None = None
    for i, event in enumerate(events):
        feed(live, [event])
        instant = event_time(event)[0]
        if "r1" not in live or (i + 1 < len(events) and event_time(events[i + 1])[0] == instant):
            continue
        s = live.status("r1", instant)
        if ended is not None:
            assert _verdict(s) == _verdict(ended)
        elif s.terminal:
            ended = s
    end = at(HORIZON + 100)
    # A reader started later: one that reads the compacted log (only each worker's latest
    # heartbeat) says exactly the same when no worker restarted; with restarts (whose old
    # incarnation's in-flight heartbeats compaction may drop), one that reads it uncompacted.
    incarnations = {(e.worker_id, e.started_at) for e in events if isinstance(e, Heartbeat)}
    restarts = len(incarnations) > len({w for w, _ in incarnations})
    restarted = list(events) if restarts else compacted_log(events)
    rnd.shuffle(restarted)
    assert fleet(*restarted, deadline=DEADLINE).status("r1", end) == live.status("r1", end)


def _verdict(s: RolloutStatus) -> tuple[Any, ...]:
    """What never changes once a rollout ended: the phase, why, when, and what workers reported
    by then (whether an unfinished worker counts as lost or pending is knowledge, not verdict)."""
    c = s.counts
    return (s.phase, s.reason, s.finished_at, s.expected, c.succeeded, c.failed, c.rejected)


# --------------------------------------------------------------------------- memory


def test_compact_keeps_the_last_n_ended_rollouts_in_full_and_older_ones_as_a_summary() -> None:
    f = Fleet(max_ended_rollouts=2)
    f.observe_heartbeat(heartbeat("w1", 1000))
    for i in range(5):
        f.observe_command(command(f"r{i}", f"c{i}", workers=["w1"], issued=10 * i))
        f.observe_ack(ack("w1", S, 10 * i + 1, rollout_id=f"r{i}", command_id=f"c{i}"))
    f.observe_command(command("live", "cl", workers=["w1"], issued=100))
    f.observe_ack(ack("w1", R, 101, rollout_id="live", command_id="cl"))
    f.observe_ack(nack("w1", 3, "SCHEMA_INVALID", rollout_id="bad", command_id="cb"))
    now = at(200)
    before = {r.rollout_id: r for r in f.rollouts(now)}
    assert f.compact(now) == 4  # 6 ended (5 + the rejected one), 2 kept in full
    assert f.compact(now) == 0
    after = {r.rollout_id: r for r in f.rollouts(now)}
    assert after.keys() == before.keys()
    kept = {rid for rid, r in after.items() if not r.details_dropped}
    assert kept == {"r3", "r4", "live"}
    for rid, r in after.items():
        assert (r.phase, r.reason, r.finished_at, r.counts) == (
            before[rid].phase,
            before[rid].reason,
            before[rid].finished_at,
            before[rid].counts,
        )
        if r.details_dropped:
            assert r.workers == () and r.anomalies == () and r.selector.worker_ids is None
    # Later acks for a summarized rollout are dropped; the desired version it set survives.
    f.observe_ack(ack("w1", S, 150, rollout_id="r0", command_id="c0"))
    assert f.stats().dropped_acks == 1 and f.stats().compacted == 4
    assert f.status("r0", now).details_dropped
    (level,) = f.worker_levels(now)
    assert (level.desired_version, level.desired_rollout_id) == ("v2", "live")
    assert "r0" in f and f.rollout_keys()[0] == (at(0), "r0")


def test_compact_keeps_the_desired_version_of_a_summarized_rollout() -> None:
    f = Fleet(max_ended_rollouts=0)
    f.observe_heartbeat(heartbeat("w1", 1000, version="v2"))
    f.observe_command(command(workers=["w1"], version="v2"))
    f.observe_ack(ack("w1", S, 1))
    assert f.compact(at(100)) == 1
    (level,) = f.worker_levels(at(100))
    assert (level.desired_version, level.desired_rollout_id, level.in_sync) == ("v2", "r1", True)


def test_without_a_bound_compact_keeps_everything() -> None:
    f = fleet(command(), *alive("w1", "w2", sent=50), *full("w1", 1, 5), *full("w2", 1, 6))
    assert f.compact(at(100)) == 0 and not f.status("r1", at(100)).details_dropped
