"""The compiled ack decoder against the canonical one (differential tests).

``decode_ack_fast`` must accept exactly what ``protocol.decode_ack`` accepts, with equal values,
and refuse with the same ProtocolError otherwise. Here: valid acks of every shape, the protocol
fuzz tests' mutants, and the Follower (the same log folded with either decoder gives the same
status). One example of each msgspec leniency that the fast path guards is in
test_ack_codec_leniencies, the bounds and constraints in test_ack_codec_bounds; the comparing
helpers in tests/unit/conftest.py.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.coordinator.follower import Follower
from controlplane.coordinator.metrics import AckLatency
from controlplane.kafka.bus import Record, collector_paused
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.wire.ack_codec import MAX_RESULT_DEPTH, FastAck, as_model_error, decode_ack_fast
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Heartbeat,
    Timings,
    decode_ack,
    encode,
)
from tests.unit.conftest import T0, assert_agree, assert_same, counting_fallback, stamped, wire
from tests.unit.conftest import compact_json as dumps  # the ack tests' JSON: compact
from tests.unit.strategies import (
    acks,
    fuzz,
    mutants,
)
from tests.unit.test_rollout_replay import DEADLINE, HORIZON, at, scenarios

# --------------------------------------------------------------------------- valid acks


def every_kind_of_ack() -> list[Ack]:
    out = []
    for kind in (*CommandKind, None):
        for state in AckState:
            error = (
                AckError(code="WEIGHTS_UNREADABLE", message="cannot open 'x': I/O", retryable=True)
                if state in (AckState.FAILED, AckState.REJECTED)
                else None
            )
            out.append(
                Ack(
                    command_id="c-1",
                    rollout_id="r-1",
                    worker_id="w-1",
                    kind=kind,
                    state=state,
                    weights_version="v1" if state is AckState.SUCCEEDED else None,
                    config_digest="abc",
                    error=error,
                    timings=Timings(
                        received_at=T0,
                        started_at=T0 + timedelta(microseconds=1) if state.terminal else None,
                        finished_at=T0 + timedelta(seconds=2) if state.terminal else None,
                    ),
                    attempt=2,
                    sent_at=T0 + timedelta(seconds=3),
                    result={"n": 1, "x": 0.5, "nested": {"list": [1, "a", None, False]}},
                )
            )
    return out


@pytest.mark.parametrize("model", every_kind_of_ack(), ids=lambda a: f"{a.kind}-{a.state}")
def test_every_state_and_kind_decodes_to_equal_values(
    model: Ack, no_fallback: mock.MagicMock
) -> None:
    data = encode(model)
    view = decode_ack_fast(data)
    assert_same(view, model)
    assert_same(view, decode_ack(data))


def test_a_plain_json_ack_takes_the_fast_path(no_fallback: mock.MagicMock) -> None:
    view = assert_agree(dumps(wire()))
    assert view is not None
    assert view.timings.started_at == T0 + timedelta(microseconds=500_000)


@pytest.mark.parametrize(
    ("code", "typed"), [("EXPIRED", WireCode), ("KAFKA_ERROR", str), ("NOT_OURS", str)]
)
def test_an_error_code_is_a_wire_code_or_a_str_and_equal_on_both_paths(
    code: str, typed: type, no_fallback: mock.MagicMock
) -> None:
    """The canonical decoder types a code of the wire as WireCode and keeps any other (a local
    code, another producer's) a str; the fast path keeps the str it read. Equal and hash-equal,
    so the fold reads them alike, and the status models type it as the canonical decoder does."""
    data = dumps(wire(state="failed", error={"code": code, "message": "m", "retryable": False}))
    view = assert_agree(data)
    model = decode_ack(data)
    assert view is not None and view.error is not None and model.error is not None
    assert (type(view.error.code), type(model.error.code)) == (str, typed)
    assert hash(view.error.code) == hash(model.error.code)
    back = as_model_error(view.error)
    assert back == model.error and type(back.code) is typed


def result_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(result_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(result_depth, value), default=0)
    return 0


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [*value, *(s for v in value.values() for s in strings_in(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


def takes_the_fast_path(model: Ack, data: bytes) -> bool:
    """Whether an ack our producers wrote is expected to take the fast path: unless it holds an
    escape (\\" or \\n in a string), a result nested deeper than the fast path's bound, a colon
    in ``result`` (the key count cannot place it), or a date-time in the first or last year of
    the protocol's range."""
    stamps = [model.sent_at, *(t for t in model.timings.model_dump().values() if t is not None)]
    return (
        b"\\" not in data
        and max(map(result_depth, model.result.values()), default=0) < MAX_RESULT_DEPTH
        and not any(":" in text for text in strings_in(model.result))
        and all(1971 <= t.year <= 8998 for t in stamps)
    )


@fuzz(300)
@given(model=acks())
def test_valid_acks_decode_to_equal_values(model: Ack) -> None:
    data = encode(model)
    with counting_fallback() as fallback:
        view = decode_ack_fast(data)
    assert_same(view, model)
    if takes_the_fast_path(model, data):
        assert fallback.call_count == 0, data


# --------------------------------------------------------------------------- mutants


@fuzz(1500)
@given(st.data())
def test_mutated_acks_agree(data: st.DataObject) -> None:
    assert_agree(data.draw(mutants("ack")))


@fuzz(300)
@given(
    value=st.recursive(
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**80), max_value=2**80)
        | st.floats()
        | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=12,
    )
)
def test_numbers_and_values_in_result_agree(value: Any) -> None:
    # json.dumps writes NaN and Infinity as such: not JSON, refused by both.
    assert_agree(dumps(wire(result={"v": value})))


@fuzz(300)
@given(
    text=st.from_regex(
        r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt _][0-9]{2}:[0-9]{2}(:[0-9]{2})?([.,][0-9]{0,9})?"
        r"([Zz]|[+-][0-9]{2}:?[0-9]{2}|[+-][0-9]{2})?",
        fullmatch=True,
    ),
    field=st.sampled_from(["sent_at", "received_at", "started_at", "finished_at"]),
)
def test_odd_timestamps_agree(text: str, field: str) -> None:
    assert_agree(stamped(field, text))


@fuzz(300)
@given(
    ident=st.text(alphabet="aZ09._:@/- \n\t\u00e9\u0661+", max_size=130)
    | st.text(max_size=10)
    | st.integers(1, 140).map(lambda n: "a" * n),
    field=st.sampled_from(["command_id", "rollout_id", "worker_id"]),
)
def test_odd_identifiers_agree(ident: str, field: str) -> None:
    assert_agree(dumps(wire(**{field: ident})))


# --------------------------------------------------------------------------- the fold


def records(events: list[Command | Ack | Heartbeat], topics: Any) -> list[Record]:
    out = []
    offsets: dict[str, int] = {}
    for event in events:
        topic = {Command: topics.commands, Ack: topics.acks, Heartbeat: topics.workers}[
            type(event)
        ].name
        offset = offsets[topic] = offsets.get(topic, -1) + 1
        key = event.worker_id.encode() if isinstance(event, Heartbeat) else None
        out.append(Record(topic, 0, offset, key, encode(event), 0))
    return out


async def fold_with(decoder: Callable[[bytes], Any], log: list[Record]) -> Follower:
    follower = Follower(
        KafkaSettings(bootstrap_servers="127.0.0.1:9"),
        Fleet(progress_deadline_s=DEADLINE),
        decode_ack=decoder,
    )
    await follower.stop()  # never started: the fold needs no Kafka
    for start in range(0, len(log), 7):  # several fetches
        follower.fold(log[start : start + 7])
    return follower


@fuzz(60)
@given(events=scenarios())
def test_the_follower_folds_the_same_status_with_either_decoder(events: list[Any]) -> None:
    messages = [e for e in events if isinstance(e, Command | Ack | Heartbeat)]
    topics = KafkaSettings().topics
    log = records(messages, topics)
    # A tombstone and a garbage ack: counted and skipped alike.
    log.append(Record(topics.workers.name, 0, 10**6, b"w0", None, 0))
    log.append(Record(topics.acks.name, 0, 10**6, None, b'{"schema_version":1}', 0))
    fast = asyncio.run(fold_with(decode_ack_fast, log))
    slow = asyncio.run(fold_with(decode_ack, log))
    for now in (at(0), at(200), at(HORIZON + 100)):
        assert fast.fleet.rollouts(now) == slow.fleet.rollouts(now)
        assert fast.fleet.worker_levels(now) == slow.fleet.worker_levels(now)
    assert fast.fleet.orphans() == slow.fleet.orphans()
    assert fast.fleet.stats() == slow.fleet.stats()
    assert (fast.records, fast.undecodable) == (slow.records, slow.undecodable) == (len(log), 1)
    assert fast._positions == slow._positions


async def test_batches_hold_fast_acks_and_the_metrics_take_both() -> None:
    topics = KafkaSettings().topics
    command = Command.model_validate(
        {
            "command_id": "c-1",
            "rollout_id": "r-1",
            "issued_at": T0,
            "expires_at": T0 + timedelta(hours=1),
            "issuer": "ci",
            "selector": {"worker_ids": ["w-1"]},
            "spec": {"kind": "reload_weights", "path": "/p", "version": "v1"},
        }
    )
    failed = Ack(
        command_id="c-1",
        rollout_id="r-1",
        worker_id="w-1",
        kind=CommandKind.RELOAD_WEIGHTS,
        state=AckState.FAILED,
        error=AckError(code="RUNNER_FAILED", message="boom"),
        timings=Timings(received_at=T0),
        sent_at=T0 + timedelta(seconds=3),
    )
    follower = Follower(KafkaSettings(bootstrap_servers="127.0.0.1:9"))
    await follower.stop()
    batch = follower.fold(records([command, failed], topics))
    assert [type(a) for a in batch.acks] == [FastAck]
    assert batch.rollout_ids == {"r-1"}
    status = follower.fleet.status("r-1", T0 + timedelta(seconds=5))
    worker = status.workers[0]
    assert worker.error == AckError(code="RUNNER_FAILED", message="boom")
    for ack in (batch.acks[0], failed):
        latency = AckLatency()
        assert latency.command(command) == []
        [sample] = latency.ack(ack)
        assert (sample.kind, sample.state, sample.seconds) == ("reload_weights", "failed", 3.0)


def test_the_collector_pause_is_restored_and_leaves_an_outer_pause_alone() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # someone else's pause stays
    finally:
        gc.enable()
