"""Unit tests for the worker registry: incarnations, out-of-order heartbeats, liveness, selection."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.protocol import (
    CommandKind,
    Degraded,
    Heartbeat,
    InFlight,
    Selector,
    WorkerStatus,
)
from controlplane.registry import (
    LIVENESS_PERIODS,
    Registry,
    WorkerView,
    is_alive,
    lost_at,
    was_alive_at,
)

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def heartbeat(
    worker_id: str = "w1",
    sent: float = 0.0,
    *,
    seq: int | None = None,
    started: float = -100.0,
    labels: dict[str, str] | None = None,
    status: WorkerStatus = WorkerStatus.READY,
    interval: float = 5.0,
    version: str | None = "v1",
) -> Heartbeat:
    return Heartbeat(
        worker_id=worker_id,
        labels=labels if labels is not None else {"model": "llama"},
        runner="torch",
        device="cpu",
        status=status,
        weights_version=version,
        seq=seq if seq is not None else max(0, round((sent - started) * 1000)),
        sent_at=at(sent),
        started_at=at(started),
        interval_s=interval,
    )


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
        started_at=at(-100),
        seq=hb2.seq,
        interval_s=5.0,
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
