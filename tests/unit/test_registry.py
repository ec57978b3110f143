"""Unit tests for the worker registry: incarnations, out-of-order heartbeats, liveness, selection."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.rollout.registry import (
    LIVENESS_PERIODS,
    MAX_INTERVAL_S,
    Registry,
    WorkerView,
    is_alive,
    lost_at,
    silence_limit,
    was_alive_at,
)
from controlplane.wire.protocol import (
    CommandKind,
    Degraded,
    Heartbeat,
    InFlight,
    Selector,
    WorkerStatus,
)
from tests.factories import T0, at, heartbeat


def registry(*hbs: Heartbeat) -> Registry:
    reg = Registry()
    for hb in hbs:
        reg.observe(hb)
    return reg


# --------------------------------------------------------------------------- folding


def test_first_heartbeat_is_kept() -> None:
    reg = Registry()
    hb = heartbeat()
    assert reg.observe(hb) is True
    assert reg.latest("w1") is hb
    assert "w1" in reg and len(reg) == 1


def test_higher_seq_of_same_incarnation_replaces() -> None:
    new = heartbeat(sent=5, seq=2)
    reg = registry(heartbeat(sent=0, seq=1), new)
    assert reg.latest("w1") is new


def test_lower_seq_of_same_incarnation_is_ignored_as_out_of_order() -> None:
    newer = heartbeat(sent=5, seq=2)
    reg = registry(newer)
    assert reg.observe(heartbeat(sent=0, seq=1)) is False
    assert reg.latest("w1") is newer


def test_equal_seq_is_a_redelivery_and_ignored() -> None:
    first = heartbeat(sent=5, seq=2)
    reg = registry(first)
    assert reg.observe(heartbeat(sent=5, seq=2, version="other")) is False
    assert reg.latest("w1") is first


def test_newer_incarnation_replaces_even_with_a_lower_seq() -> None:
    restarted = heartbeat(sent=60, seq=0, started=55)
    reg = registry(heartbeat(sent=50, seq=999, started=-100), restarted)
    assert reg.latest("w1") is restarted


def test_older_incarnation_is_ignored() -> None:
    restarted = heartbeat(sent=60, seq=0, started=55)
    reg = registry(restarted)
    assert reg.observe(heartbeat(sent=50, seq=999, started=-100)) is False
    assert reg.latest("w1") is restarted


def test_forget_drops_a_worker() -> None:
    reg = registry(heartbeat("w1"), heartbeat("w2"))
    assert reg.forget("w1") is True
    assert reg.forget("w1") is False
    assert reg.latest("w1") is None
    assert [hb.worker_id for hb in reg.heartbeats()] == ["w2"]


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.integers(0, 20)), min_size=1, max_size=25, unique=True
    ),
    st.randoms(use_true_random=False),
)
def test_any_arrival_order_keeps_the_same_latest(
    stamps: list[tuple[int, int]], rnd: random.Random
) -> None:
    hbs = [heartbeat(sent=inc * 100 + seq, seq=seq, started=inc * 100) for inc, seq in stamps]
    shuffled = list(hbs)
    rnd.shuffle(shuffled)
    a, b = registry(*hbs), registry(*shuffled)
    want = max(stamps)
    assert a.latest("w1") == b.latest("w1")
    latest = a.latest("w1")
    assert latest is not None
    assert (latest.started_at, latest.seq) == (at(want[0] * 100), want[1])


# --------------------------------------------------------------------------- liveness


def test_alive_up_to_three_periods_then_lost() -> None:
    hb = heartbeat(sent=0, interval=5)
    limit = 5 * LIVENESS_PERIODS
    assert is_alive(hb, at(limit))
    assert not is_alive(hb, at(limit) + timedelta(microseconds=1))
    assert lost_at(hb) == at(limit) + timedelta(microseconds=1)  # the first instant not alive


def test_a_heartbeat_from_the_future_counts_as_alive() -> None:
    assert is_alive(heartbeat(sent=10), at(0))


def test_stopped_is_never_alive() -> None:
    hb = heartbeat(sent=0, status=WorkerStatus.STOPPED)
    assert not is_alive(hb, at(0))
    assert lost_at(hb) == at(0)


@pytest.mark.parametrize(
    ("started", "sent", "status", "alive_at_issue"),
    [
        (-100, -1, WorkerStatus.READY, True),  # heard from just before
        (-100, 500, WorkerStatus.READY, True),  # compacted: only a much later heartbeat survives
        (-100, -15, WorkerStatus.READY, True),  # exactly three periods before
        (-100, -16, WorkerStatus.READY, False),  # stale at issue
        (10, 20, WorkerStatus.READY, False),  # started after the command
        (-100, -1, WorkerStatus.STOPPED, False),  # had stopped before
        (-100, 30, WorkerStatus.STOPPED, True),  # stopped later: was alive then
    ],
)
def test_was_alive_at(
    started: float, sent: float, status: WorkerStatus, alive_at_issue: bool
) -> None:
    hb = heartbeat(sent=sent, started=started, status=status, interval=5)
    assert was_alive_at(hb, at(0)) is alive_at_issue


# --------------------------------------------------------------------------- views and selection


def test_views_are_sorted_and_carry_the_heartbeat() -> None:
    flight = InFlight(
        command_id="c1", rollout_id="r1", kind=CommandKind.RELOAD_WEIGHTS, since=at(1)
    )
    degraded = Degraded(
        code="WEIGHTS_CORRUPTED", message="x", from_version="v1", to_version="v2", since=at(2)
    )
    hb2 = heartbeat("w2", sent=3, version="v2").model_copy(
        update={"in_flight": flight, "degraded": degraded, "config_digest": "abc"}
    )
    reg = registry(hb2, heartbeat("w1", sent=-100))
    views = reg.workers(at(4))
    assert [v.worker_id for v in views] == ["w1", "w2"]
    w1, w2 = views
    assert w1.alive is False and w2.alive is True
    assert w2 == WorkerView(
        worker_id="w2",
        labels={"model": "llama"},
        runner="torch",
        device="cpu",
        status=WorkerStatus.READY,
        weights_version="v2",
        config_digest="abc",
        in_flight=flight,
        degraded=degraded,
        last_seen=at(3),
        sent_at=at(3),
        started_at=at(-100),
        seq=hb2.seq,
        interval_s=5.0,
        lease_s=15.0,
        agent_version="",
        alive=True,
    )
    assert reg.get("w2", at(4)) == w2
    assert reg.get("nope", at(4)) is None
    assert reg.is_alive("w2", at(4)) and not reg.is_alive("w1", at(4))
    assert not reg.is_alive("nope", at(4))
    assert WorkerView.model_validate_json(w2.model_dump_json()) == w2


def test_matching_by_labels_and_ids_alive_only_by_default() -> None:
    reg = registry(
        heartbeat("a", sent=0, labels={"model": "llama", "zone": "x"}),
        heartbeat("b", sent=0, labels={"model": "llama", "zone": "y"}),
        heartbeat("c", sent=0, labels={"model": "mistral"}),
        heartbeat("d", sent=-100, labels={"model": "llama"}),  # lost
    )
    now = at(1)

    def ids(selector: Selector, **kw: bool) -> list[str]:
        return [v.worker_id for v in reg.matching(selector, now, **kw)]

    assert ids(Selector()) == ["a", "b", "c"]
    assert ids(Selector(), alive_only=False) == ["a", "b", "c", "d"]
    assert ids(Selector(labels={"model": "llama"})) == ["a", "b"]
    assert ids(Selector(labels={"model": "llama", "zone": "y"})) == ["b"]
    assert ids(Selector(worker_ids=["c", "d", "zz"])) == ["c"]
    assert ids(Selector(worker_ids=["a", "b"], labels={"zone": "x"})) == ["a"]
    assert ids(Selector(labels={"model": "gpt"})) == []


# --------------------------------------------------------------------------- the reader's clock


def test_a_worker_whose_clock_is_behind_is_alive_by_when_the_reader_got_it() -> None:
    """Its clock is 20 s behind: by its own sent_at it looks silent for 20 s, over the 15 s that
    three 5 s periods allow, so lost; by the reader's receive time it is alive."""
    skew = 20.0
    hb = heartbeat(sent=100 - skew, started=50 - skew)
    reg = Registry()
    reg.observe(hb, received_at=at(100))
    now = at(101)
    assert not is_alive(hb, now)  # judged by its own clock: lost
    assert reg.is_alive("w1", now) and is_alive(hb, now, at(100))
    (view,) = reg.workers(now)
    assert view.alive and view.last_seen == at(100) and view.sent_at == at(100 - skew)
    assert [v.worker_id for v in reg.matching(Selector(), now)] == ["w1"]
    assert lost_at(hb, at(100)) == at(115) + timedelta(microseconds=1)
    assert not reg.is_alive("w1", at(116))
    # Alive at an instant: its incarnation started 50 s (its own clock) before it was received.
    assert was_alive_at(hb, at(60), at(100)) and not was_alive_at(hb, at(49), at(100))
    assert was_alive_at(hb, at(115), at(100)) and not was_alive_at(hb, at(116), at(100))


def test_a_worker_whose_clock_is_ahead_is_lost_by_the_reader_s_clock() -> None:
    hb = heartbeat(sent=1000, started=900)  # its clock is 900 s ahead
    reg = Registry()
    reg.observe(hb, received_at=at(100))
    assert is_alive(hb, at(200))  # by its own clock, alive for ever
    assert not reg.is_alive("w1", at(116))


def test_received_at_is_kept_beside_the_latest_heartbeat_only() -> None:
    reg = Registry()
    assert reg.observe(heartbeat(sent=0, seq=1), received_at=at(5))
    assert not reg.observe(heartbeat(sent=1, seq=0), received_at=at(9))  # stale: ignored
    assert reg.received_at("w1") == at(5) and reg.entry("w1") == (heartbeat(sent=0, seq=1), at(5))
    assert reg.observe(heartbeat(sent=2, seq=2))  # no receive time given: its sent_at
    assert reg.received_at("w1") is None and reg.get("w1", at(3)).last_seen == at(2)  # type: ignore[union-attr]
    assert reg.forget("w1") and reg.received_at("w1") is None


def test_incarnations_are_ordered_by_the_persisted_counter_when_both_carry_one() -> None:
    """After a clock step back the restarted worker's started_at is earlier than before."""
    old = heartbeat(sent=100, started=50, seq=500, incarnation=7)
    new = heartbeat(sent=30, started=20, seq=0, incarnation=8)
    for order in ([old, new], [new, old]):
        reg = registry(*order)
        assert reg.latest("w1") == new
    # Without a counter on either side, started_at decides, as before.
    assert registry(heartbeat(sent=100, started=50), heartbeat(sent=30, started=20)).latest(
        "w1"
    ) == heartbeat(sent=100, started=50)
    assert registry(
        heartbeat(sent=100, started=50, incarnation=3), heartbeat(sent=30, started=20)
    ).latest("w1") == heartbeat(sent=100, started=50, incarnation=3)
    # Same incarnation: seq.
    a = heartbeat(sent=1, started=0, seq=1, incarnation=2)
    b = heartbeat(sent=2, started=0, seq=2, incarnation=2)
    assert registry(b, a).latest("w1") == b


# --------------------------------------------------------------------------- hostile numbers


@pytest.mark.parametrize(
    "interval", [1e300, float("inf"), float("nan"), -1.0, 0.0, 1e-300, 2.0**63, 10.0**20]
)
@pytest.mark.parametrize(
    "sent", [datetime.min.replace(tzinfo=UTC), datetime.max.replace(tzinfo=UTC), T0]
)
def test_any_decoded_heartbeat_folds_without_raising(interval: float, sent: datetime) -> None:
    """model_construct skips validation: whatever got through the decoder, nothing overflows."""
    hb = Heartbeat.model_construct(
        worker_id="w1",
        labels={"model": "llama"},
        runner="torch",
        device="cpu",
        status=WorkerStatus.READY,
        weights_version=None,
        config_digest=None,
        in_flight=None,
        degraded=None,
        seq=2**63,
        sent_at=sent,
        started_at=datetime.min.replace(tzinfo=UTC),
        incarnation=2**53,
        interval_s=interval,
        agent_version="",
    )
    assert silence_limit(hb) <= timedelta(seconds=LIVENESS_PERIODS * MAX_INTERVAL_S)
    reg = Registry()
    for received in (None, sent, at(0)):
        reg.observe(hb.model_copy(update={"seq": hb.seq + 1 if received else hb.seq}), received)
        for now in (at(0), sent, datetime.max.replace(tzinfo=UTC)):
            reg.workers(now)
            reg.matching(Selector(), now)
            lost_at(hb, received)
            was_alive_at(hb, now, received)
            is_alive(hb, now, received)


def test_the_incarnation_before_the_latest_still_says_when_the_worker_was_alive() -> None:
    """Restarted after a command was issued: its previous incarnation was alive then, in any
    arrival order (a label-only rollout keeps expecting it)."""
    before = [heartbeat(sent=t, started=-100) for t in (-10, -5, 0, 5)]
    after = [heartbeat(sent=t, started=50) for t in (50, 55)]
    for order in (before + after, after + before, list(reversed(before + after))):
        reg = registry(*order)
        assert reg.latest("w1") == after[-1]
        assert reg.was_alive_at("w1", at(0)) and reg.was_alive_at("w1", at(52))
        assert not reg.was_alive_at("w1", at(30))  # dead between its incarnations
    assert not Registry().was_alive_at("w1", at(0))
