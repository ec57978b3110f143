"""The compiled ack decoder against the canonical one: each msgspec leniency the fast path guards
(date-time forms, escapes, digits, numbers, surrogates, duplicate keys) and what it cannot vouch
for (it falls back). Helpers in tests/unit/conftest.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.wire.ack_codec import decode_ack_fast
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import (
    decode_ack,
    encode,
)
from tests.unit.conftest import (
    T0,
    assert_agree,
    assert_same,
    counting_fallback,
    msgspec_accepts,
    refused,
    stamped,
    wire,
)
from tests.unit.conftest import compact_json as dumps  # the ack tests' JSON: compact
from tests.unit.strategies import (
    Pairs,
    acks,
    containers,
    dump,
    fuzz,
    json_values,
    replace_node,
)

# --------------------------------------------------------------------------- the leniencies


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
    assert refused(data).code is WireCode.SCHEMA_INVALID


def test_a_space_hidden_in_an_escape_is_seen() -> None:
    data = dumps(wire()).replace(b"2025-06-01T12:00:02.25Z", b"2025-06-01\\u002012:00:02.25Z")
    assert msgspec_accepts(data)
    assert refused(data).code is WireCode.SCHEMA_INVALID


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
    assert refused(data).code is WireCode.SCHEMA_INVALID
    assert_agree(dumps(wire(sent_at="9999-12-31T23:59:59.9999994Z")))


@pytest.mark.parametrize(
    "number", [b"1e400", b"-1e400", b"1" + b"0" * 400 + b".0", b"NaN", b"Infinity", b"-Infinity"]
)
def test_non_finite_numbers_in_result_are_refused_by_both(number: bytes) -> None:
    data = dumps(wire(result={"x": 0})).replace(b'"x":0', b'"x":' + number)
    err = refused(data)
    assert err.code in (WireCode.SCHEMA_INVALID, WireCode.MALFORMED_JSON)


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
    assert refused(data).code is WireCode.MALFORMED_JSON
    assert refused(data.replace(b'"v42"', text.encode())).code is WireCode.MALFORMED_JSON


def test_raw_invalid_utf8_is_refused_by_both() -> None:
    for junk in (b"\xed\xa0\x80", b"\xc0\x80", b"\xff"):
        assert refused(dumps(wire()).replace(b"v42", b"v" + junk)).code is (WireCode.MALFORMED_JSON)


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
    assert err.code is WireCode.DUPLICATE_KEY
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
    assert refused(wire_bytes).code is WireCode.DUPLICATE_KEY


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
