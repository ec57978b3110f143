"""The compiled ack decoder against the canonical one (differential tests).

``decode_ack_fast`` must accept exactly what ``protocol.decode_ack`` accepts, with equal values,
and refuse with the same ProtocolError otherwise. Valid acks of every shape, the protocol fuzz
tests' mutants, and one example of each msgspec leniency that the fast path guards. Then the
Follower: the same log folded with either decoder gives the same status.
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.coordinator.follower import Follower
from controlplane.coordinator.metrics import AckLatency
from controlplane.kafka.bus import Record, collector_paused
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.wire import ack_codec
from controlplane.wire.ack_codec import MAX_RESULT_DEPTH, AckLike, FastAck, decode_ack_fast
from controlplane.wire.errors import ErrorCode, ProtocolError
from controlplane.wire.protocol import (
    MAX_MESSAGE_BYTES,
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
from tests.unit.test_protocol_fuzz import (
    Pairs,
    acks,
    containers,
    dump,
    fuzz,
    json_values,
    mutants,
    replace_node,
)
from tests.unit.test_rollout_replay import DEADLINE, HORIZON, at, scenarios

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)

# --------------------------------------------------------------------------- comparing


def same_json(a: Any, b: Any) -> bool:
    """Equal with equal types all the way down (1, 1.0 and True are == in Python; not here)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same_json(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    return bool(a == b)


def same_time(a: datetime | None, b: datetime | None) -> bool:
    if a is None or b is None:
        return a is b
    # The same instant with the same offset: the same wall-clock fields too.
    return a == b and a.utcoffset() == b.utcoffset()


def assert_same(view: AckLike, model: Ack) -> None:
    """Every field of the pydantic ack, equal in the view, with the same types."""
    assert isinstance(view, FastAck)
    assert view.schema_version == 1 and type(view.schema_version) is int
    for name in ("command_id", "rollout_id", "worker_id", "weights_version", "config_digest"):
        assert getattr(view, name) == getattr(model, name), name
        assert type(getattr(view, name)) is type(getattr(model, name)), name
    assert view.kind is model.kind
    assert view.state is model.state
    assert view.attempt == model.attempt and type(view.attempt) is int
    assert same_time(view.sent_at, model.sent_at)
    t, m = view.timings, model.timings
    assert same_time(t.received_at, m.received_at)
    assert same_time(t.started_at, m.started_at)
    assert same_time(t.finished_at, m.finished_at)
    if model.error is None:
        assert view.error is None
    else:
        assert view.error is not None
        assert (view.error.code, view.error.message, view.error.retryable) == (
            model.error.code,
            model.error.message,
            model.error.retryable,
        )
        assert type(view.error.retryable) is bool
    assert same_json(view.result, model.result)


Outcome = FastAck | Ack | tuple[ErrorCode, str, str | None, str | None]


def outcome(decode: Callable[[bytes], Any], data: bytes) -> Outcome:
    try:
        message: FastAck | Ack = decode(data)
    except ProtocolError as err:  # anything else fails the test
        return (err.code, err.message, err.command_id, err.rollout_id)
    return message


def assert_agree(data: bytes) -> FastAck | None:
    """Both decoders accept with equal values, or both refuse with the same error."""
    want = outcome(decode_ack, data)
    got = outcome(decode_ack_fast, data)
    if isinstance(want, tuple):
        assert got == want
        return None
    assert isinstance(got, FastAck), got
    assert_same(got, want)
    return got


@pytest.fixture
def no_fallback() -> Iterator[mock.MagicMock]:
    """Fails the test if the fast decoder hands the message to the canonical one."""
    with mock.patch.object(ack_codec, "decode_ack", side_effect=AssertionError("fell back")) as m:
        yield m


def counting_fallback() -> Any:
    return mock.patch.object(ack_codec, "decode_ack", wraps=decode_ack)


# --------------------------------------------------------------------------- valid acks


def wire(**fields: Any) -> dict[str, Any]:
    """A valid ack as a plain-JSON producer writes it."""
    value: dict[str, Any] = {
        "schema_version": 1,
        "command_id": "r-1.c1",
        "rollout_id": "r-1",
        "worker_id": "gpu-node-00001.pool-a",
        "kind": "reload_weights",
        "state": "succeeded",
        "weights_version": "v42",
        "config_digest": None,
        "error": None,
        "timings": {
            "received_at": "2025-06-01T12:00:00Z",
            "started_at": "2025-06-01T12:00:00.5Z",
            "finished_at": "2025-06-01T12:00:02.000001Z",
        },
        "attempt": 1,
        "sent_at": "2025-06-01T12:00:02.25Z",
        "result": {"bytes": 1023410176, "gbps": 7.97, "files": ["a", "b"], "ok": True},
    }
    value.update(fields)
    return value


def dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def stamped(field: str, stamp: str) -> bytes:
    """A valid ack with ``stamp`` as its ``sent_at`` or as one of its timings."""
    value = wire()
    if field == "sent_at":
        value["sent_at"] = stamp
    else:
        value["timings"][field] = stamp
    return dumps(value)


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


# --------------------------------------------------------------------------- the leniencies


def msgspec_accepts(data: bytes) -> bool:
    """Whether msgspec alone (without the guards) decodes it: the leniency exists."""
    try:
        ack_codec._decode(data)
    except msgspec.DecodeError:
        return False
    return True


def refused(data: bytes) -> ProtocolError:
    want = outcome(decode_ack, data)
    assert isinstance(want, tuple), "the canonical decoder accepts it"
    assert_agree(data)
    with pytest.raises(ProtocolError) as caught:
        decode_ack_fast(data)
    return caught.value


@pytest.mark.parametrize(
    "stamp",
    [
        "2025-06-01 12:00:00Z",  # space separator
        "2025-06-01 12:00:00.5+02:00",
        "2025-06-01T12:00:00+0100",  # offset without its colon
        "2025-06-01T12:00:00+0000",
        "2025-06-01T12:00:00-0000",
        "2025-06-01T12:00:00.123-0530",
    ],
)
@pytest.mark.parametrize("field", ["sent_at", "received_at", "started_at"])
def test_date_time_forms_msgspec_takes_and_we_refuse(stamp: str, field: str) -> None:
    data = stamped(field, stamp)
    assert msgspec_accepts(data)
    assert refused(data).code is ErrorCode.SCHEMA_INVALID


def test_a_space_hidden_in_an_escape_is_seen() -> None:
    data = dumps(wire()).replace(b"2025-06-01T12:00:02.25Z", b"2025-06-01\\u002012:00:02.25Z")
    assert msgspec_accepts(data)
    assert refused(data).code is ErrorCode.SCHEMA_INVALID


def test_escapes_that_both_accept_give_equal_values() -> None:
    data = dumps(wire()).replace(b"2025-06-01T12:00:02.25Z", b"2025-06-01\\u005412:00:02.25Z")
    view = assert_agree(data.replace(b'"v42"', b'"v\\u00e9\\n"'))
    assert view is not None and view.weights_version == "v\u00e9\n"


@pytest.mark.parametrize(
    ("fraction", "micros"),
    [
        ("1234564", 123456),
        ("1234565", 123457),  # half up on the 7th digit, like msgspec
        ("12345649999", 123456),
        ("9999995", 1_000_000),  # rolls over into the next second
        ("000000499", 0),
    ],
)
def test_digits_past_the_microsecond_round_alike(
    fraction: str, micros: int, no_fallback: mock.MagicMock
) -> None:
    data = dumps(wire(sent_at=f"2025-06-01T12:00:00.{fraction}Z"))
    view = decode_ack_fast(data)
    assert view.sent_at == T0 + timedelta(microseconds=micros)
    assert_same(view, decode_ack(data))


def test_rounding_past_year_9999_is_refused_by_both() -> None:
    data = dumps(wire(sent_at="9999-12-31T23:59:59.9999995Z"))
    assert refused(data).code is ErrorCode.SCHEMA_INVALID
    assert_agree(dumps(wire(sent_at="9999-12-31T23:59:59.9999994Z")))


@pytest.mark.parametrize(
    "number", [b"1e400", b"-1e400", b"1" + b"0" * 400 + b".0", b"NaN", b"Infinity", b"-Infinity"]
)
def test_non_finite_numbers_in_result_are_refused_by_both(number: bytes) -> None:
    data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + number)
    err = refused(data)
    assert err.code in (ErrorCode.SCHEMA_INVALID, ErrorCode.MALFORMED_JSON)


@pytest.mark.parametrize("digits", [19, 20, 40, 4300, 4301, 5000])
def test_big_integers_agree(digits: int) -> None:
    data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + b"9" * digits)
    accepted = assert_agree(data)
    assert (accepted is not None) == (digits <= 4300)
    assert_agree(dumps(wire(attempt=10 ** (digits - 1))) if digits <= 4300 else dumps(wire()))


def test_long_float_mantissas_agree() -> None:
    for text in (
        "0.1000000000000000055511151231257827021181583404541015625",
        "2.2250738585072011e-308",
        "4.9e-324",
        "1.7976931348623157e308",
        "9007199254740993",
        "9007199254740993.0",
        "-0.0",
        "-0",
        "1E2",
        "1e-400",
    ):
        data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + text.encode())
        assert assert_agree(data) is not None, text


@pytest.mark.parametrize("text", ['"\\ud800"', '"\\udc00"', '"a\\ud800b"', '"\\ud800\\u0041"'])
def test_lone_surrogates_are_refused_by_both(text: str) -> None:
    data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + text.encode())
    assert refused(data).code is ErrorCode.MALFORMED_JSON
    assert refused(data.replace(b'"v42"', text.encode())).code is ErrorCode.MALFORMED_JSON


def test_raw_invalid_utf8_is_refused_by_both() -> None:
    for junk in (b"\xed\xa0\x80", b"\xc0\x80", b"\xff"):
        assert refused(dumps(wire()).replace(b"v42", b"v" + junk)).code is (
            ErrorCode.MALFORMED_JSON
        )


DUPLICATES: dict[str, tuple[bytes, bytes]] = {
    # name: (what to find in wire(), what to write instead)
    "state": (b'"state":"succeeded"', b'"state":"running","state":"succeeded"'),
    "worker_id": (b'"worker_id":', b'"worker_id":"w-2","worker_id":'),
    "attempt": (b'"attempt":1', b'"attempt":1,"attempt":3'),
    "sent_at": (b'"sent_at":', b'"sent_at":"2025-06-01T12:00:09Z","sent_at":'),
    "result": (b'"result":', b'"result":{"y":2},"result":'),
    "an_invalid_first_value": (b'"state":', b'"state":[],"state":'),
    "a_space_before_the_colon": (b'"attempt":1', b'"attempt":1,"attempt" :1'),
    "a_newline_before_the_colon": (b'"attempt":1', b'"attempt":1,"attempt"\n:1'),
    "a_missing_field_and_a_repeated_one": (b'"kind":"reload_weights"', b'"command_id":"r-1.c1"'),
    "in_timings": (b'"received_at":', b'"received_at":"2025-06-01T11:00:00Z","received_at":'),
    "in_result": (b'"ok":true', b'"ok":true,"ok":false'),
    "in_a_nested_result": (b'"ok":true', b'"ok":true,"n":{"a":1,"a":1}'),
    "in_a_list_in_result": (b'"ok":true', b'"ok":true,"n":[{"a":1,"a":1}]'),
    "error_then_null": (
        b'"error":null',
        b'"error":{"code":"X","message":"m","retryable":false},"error":null',
    ),
    "in_error": (
        b'"error":null',
        b'"error":{"code":"X","code":"X","message":"m","retryable":false}',
    ),
    "a_colon_string_hiding_a_repeat": (b'"ok":true', b'"ok":true,"ok":":"'),
    "with_colons_in_the_ids": (b'"worker_id":', b'"worker_id":"a:b","worker_id":'),
    "with_an_offset": (
        b'"sent_at":"2025-06-01T12:00:02.25Z"',
        b'"sent_at":"2025-06-01T14:00:02.25+02:00","attempt":1',
    ),
    "with_a_colonless_offset": (
        b'"sent_at":"2025-06-01T12:00:02.25Z"',
        b'"sent_at":"2025-06-01T14:00:02.25+0200","attempt":1',
    ),
    "with_a_nested_result": (b'"ok":true', b'"ok":true,"n":{"m":[{"k":1}]},"n":1'),
}


@pytest.mark.parametrize(("find", "write"), DUPLICATES.values(), ids=list(DUPLICATES))
def test_duplicate_keys_are_refused_by_both(find: bytes, write: bytes) -> None:
    """msgspec keeps the last value: the fast path must see the repeat and leave it to the
    canonical decoder, which refuses it, however the repeat is written."""
    data = dumps(wire())
    assert find in data
    err = refused(data.replace(find, write, 1))
    assert err.code is ErrorCode.DUPLICATE_KEY
    assert err.rollout_id == "r-1"


@fuzz(300)
@given(st.data())
def test_a_repeated_key_anywhere_is_refused_by_both(data: st.DataObject) -> None:
    """Our producers' acks with one key of one object written twice, the same value or another."""
    tree: Any = json.loads(encode(data.draw(acks())))
    objects = [node for node in containers(tree) if isinstance(node, dict) and node]
    target = data.draw(st.sampled_from(objects))
    key = data.draw(st.sampled_from(sorted(target)))
    items = [*target.items(), (key, data.draw(st.just(target[key]) | json_values))]
    if data.draw(st.booleans()):
        items.reverse()
    wire_bytes = dump(replace_node(tree, target, Pairs(tuple(items)))).encode()
    assert refused(wire_bytes).code is ErrorCode.DUPLICATE_KEY


def test_the_same_key_in_different_objects_takes_the_fast_path(no_fallback: mock.MagicMock) -> None:
    result = {"n": {"code": 1, "n": [{"n": 2}, {"n": 3}]}, "state": "x", "sent_at": None}
    view = assert_agree(dumps(wire(result=result)))
    assert view is not None and view.result == result


@pytest.mark.parametrize(
    "data",
    [
        json.dumps(wire(), indent=2).encode(),  # pretty-printed
        json.dumps(wire()).encode(),  # a space after each colon and comma
        dumps(wire(weights_version="v 42", result={"note": "a b"})),
        dumps(wire(weights_version="v:42", config_digest=":", worker_id="pod-7:gpu@0")),
        dumps(wire(sent_at="2025-06-01T14:00:02.25+02:00", result={"n": {"m": [{}]}})),
    ],
)
def test_whitespace_colons_and_offsets_take_the_fast_path(
    data: bytes, no_fallback: mock.MagicMock
) -> None:
    assert assert_agree(data) is not None


def test_an_error_message_with_spaces_and_colons_takes_the_fast_path(
    no_fallback: mock.MagicMock,
) -> None:
    error = {"code": "RUNNER:FAILED", "message": "cannot open 'x': I/O error: 5", "retryable": True}
    view = assert_agree(dumps(wire(state="failed", error=error)))
    assert view is not None and view.error is not None
    assert view.error.message == error["message"]


@pytest.mark.parametrize(
    "data",
    [
        dumps(wire(result={"note": "a:b"})),  # a colon the count cannot place
        dumps(wire(result={":": 1})),
        dumps(wire(kind=None) | {"kind": None}).replace(b'"kind":null,', b""),  # field omitted
        dumps(wire()).replace(b',"attempt":1', b""),
        dumps(wire()).replace(b',"started_at":"2025-06-01T12:00:00.5Z"', b""),
        dumps(wire(state="failed", error={"code": "X", "message": "m"})),
    ],
)
def test_what_the_fast_path_cannot_vouch_for_falls_back_and_agrees(data: bytes) -> None:
    with counting_fallback() as fallback:
        assert assert_agree(data) is not None
    assert fallback.call_count == 1


def test_attempt_is_bounded_by_2_to_the_53_in_both() -> None:
    with counting_fallback() as fallback:
        view = assert_agree(dumps(wire(attempt=2**53)))
    assert view is not None and view.attempt == 2**53
    assert fallback.call_count == 0
    for attempt in (2**53 + 1, 2**64):
        assert refused(dumps(wire(attempt=attempt))).code is ErrorCode.SCHEMA_INVALID


@pytest.mark.parametrize(
    ("stamp", "ok"),
    [
        ("1969-12-31T23:59:59.999999Z", False),
        ("1970-01-01T00:00:00Z", True),
        ("1970-01-01T00:30:00+01:00", False),
        ("1970-12-31T23:59:59-23:59", True),
        ("1971-01-01T00:00:00Z", True),
        ("8998-12-31T23:59:59Z", True),
        ("8999-12-31T23:59:59.999999Z", True),
        ("8999-12-31T23:30:00-01:00", False),
        ("9000-01-01T00:00:00Z", False),
        ("9999-12-31T23:59:59Z", False),
        ("0001-01-01T00:00:00Z", False),
    ],
)
@pytest.mark.parametrize("field", ["sent_at", "received_at", "started_at", "finished_at"])
def test_date_times_out_of_range_are_refused_by_both(stamp: str, field: str, ok: bool) -> None:
    data = stamped(field, stamp)
    assert msgspec_accepts(data)
    if ok:
        assert assert_agree(data) is not None
    else:
        assert "date-time out of range" in refused(data).message


@pytest.mark.parametrize(
    "ident",
    [
        "abc\n",  # Python's $ matches before a trailing newline; fullmatch does not
        "abc\r",
        "\nabc",
        "",
        ".abc",
        "-abc",
        "a" * 129,
        "a b",
        "\u0661\u0662",  # Unicode digits are not [0-9]
        "caf\u00e9",
        "a+b",
        "a\u0000",
    ],
)
@pytest.mark.parametrize("field", ["command_id", "rollout_id", "worker_id"])
def test_identifiers_must_fullmatch(ident: str, field: str) -> None:
    data = dumps(wire(**{field: ident}))
    assert msgspec_accepts(data)
    assert refused(data).code is ErrorCode.SCHEMA_INVALID


def test_identifier_edges_are_accepted(no_fallback: mock.MagicMock) -> None:
    for ident in ("a", "a" * 128, "0:@/.-_", "pod-7.us-east1:gpu@0"):
        assert assert_agree(dumps(wire(worker_id=ident))) is not None


def test_the_identifier_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ack_codec, "_MAX_VALID_IDS", 8)
    monkeypatch.setattr(ack_codec, "_valid_ids", set())
    for i in range(50):
        assert_agree(dumps(wire(worker_id=f"w-{i}", command_id=f"c-{i}")))
        assert len(ack_codec._valid_ids) <= 8
    assert refused(dumps(wire(worker_id="w-1\n"))).code is ErrorCode.SCHEMA_INVALID


@pytest.mark.parametrize("version", [None, True, 1.0, 1.5, 0, 2, "1", [1], -0])
def test_schema_version_must_be_the_integer_one(version: Any) -> None:
    value = wire(schema_version=version)
    err = refused(dumps(value))
    assert err.code is ErrorCode.UNSUPPORTED_SCHEMA_VERSION
    del value["schema_version"]
    assert refused(dumps(value)).code is ErrorCode.UNSUPPORTED_SCHEMA_VERSION


def test_schema_version_written_as_float_text() -> None:
    for text in (b"1.0", b"1e0", b"true"):
        data = dumps(wire()).replace(b'"schema_version":1', b'"schema_version":' + text)
        assert refused(data).code is ErrorCode.UNSUPPORTED_SCHEMA_VERSION


@pytest.mark.parametrize("attempt", [0, -1, True, 1.0, "1", None])
def test_attempt_must_be_a_positive_integer(attempt: Any) -> None:
    assert refused(dumps(wire(attempt=attempt))).code is ErrorCode.SCHEMA_INVALID


@pytest.mark.parametrize(
    ("error", "ok"),
    [
        ({"code": "X", "message": ""}, True),
        ({"code": "X" * 64, "message": "m" * 4096, "retryable": True}, True),
        ({"code": "\U0001f680" * 64, "message": "\U0001f680" * 4096}, True),  # code points
        ({"code": "", "message": "m"}, False),
        ({"code": "X" * 65, "message": "m"}, False),
        ({"code": "X", "message": "m" * 4097}, False),
        ({"code": "X", "message": "\U0001f680" * 4097}, False),
        ({"code": "X", "message": "m", "retryable": 1}, False),
        ({"code": "X", "message": "m", "extra": 1}, False),
        ({"code": "X"}, False),
    ],
)
def test_error_constraints(error: dict[str, Any], ok: bool) -> None:
    data = dumps(wire(state="failed", error=error))
    assert (assert_agree(data) is not None) is ok


@pytest.mark.parametrize(
    ("state", "error", "ok"),
    [
        ("failed", None, False),
        ("rejected", None, False),
        ("succeeded", {"code": "X", "message": "m", "retryable": False}, False),
        ("accepted", {"code": "X", "message": "m", "retryable": False}, True),
        ("running", {"code": "X", "message": "m", "retryable": False}, True),
        ("failed", {"code": "X", "message": "m", "retryable": False}, True),
        ("succeeded", None, True),
    ],
)
def test_an_unsuccessful_ack_carries_an_error_and_only_it(
    state: str, error: dict[str, Any] | None, ok: bool
) -> None:
    data = dumps(wire(state=state, error=error))
    assert msgspec_accepts(data)
    assert (assert_agree(data) is not None) is ok


def test_bom_and_size_limit_behave_as_the_canonical_decoder() -> None:
    data = dumps(wire())
    view = assert_agree(b"\xef\xbb\xbf" + data)
    assert view is not None
    assert refused(b"\xef\xbb\xbf\xef\xbb\xbf" + data).code is ErrorCode.MALFORMED_JSON
    big = dumps(wire(result={"pad": "x" * MAX_MESSAGE_BYTES}))
    assert refused(big).code is ErrorCode.MESSAGE_TOO_LARGE
    small = outcome(lambda d: decode_ack(d, max_bytes=100), data)
    assert outcome(lambda d: decode_ack_fast(d, max_bytes=100), data) == small
    assert isinstance(small, tuple) and small[0] is ErrorCode.MESSAGE_TOO_LARGE
    assert small[2] == "r-1.c1"  # sniffed for the NACK


def test_nesting_depth_in_result() -> None:
    for depth in (MAX_RESULT_DEPTH - 1, MAX_RESULT_DEPTH, MAX_RESULT_DEPTH + 1, 150, 250, 1200):
        data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + b"[" * depth + b"]" * depth)
        with counting_fallback() as fallback:
            view = assert_agree(data)
        assert (view is not None) == (depth < 190)
        if depth > MAX_RESULT_DEPTH:
            assert fallback.call_count == 1


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"{}",
        b"[]",
        b"null",
        b"{" + b'"a":' * 3,
        dumps(wire())[:-1],
        dumps(wire()) + b"x",
        dumps(wire()) + b" \n\t\r",
        b" \n" + dumps(wire()),
        b"\x0c" + dumps(wire()),
        dumps(wire()).replace(b'"result"', b'"extra":1,"result"'),
        dumps(wire()).replace(b'"received_at"', b'"extra":1,"received_at"'),
        dumps(wire(kind="RELOAD_WEIGHTS")),
        dumps(wire(state="SUCCEEDED")),
        dumps(wire(kind=None)),
        dumps(wire(sent_at="2025-06-01T12:00:00")),  # naive
        dumps(wire(sent_at=1748779200)),
        dumps(wire(timings={"received_at": None})),
        dumps(wire(timings={})),
        dumps(wire(result=[])),
        dumps(wire(result=None)),
        dumps(wire(weights_version=42)),
        dumps(wire()).decode().encode("utf-16"),
    ],
)
def test_assorted_messages_agree(data: bytes) -> None:
    assert_agree(data)


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
