"""The compiled ack decoder against the canonical one: bounds and constraints (attempt, date-time
range, identifiers, schema version, errors, size, nesting) agree. Helpers in tests/unit/conftest.py.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest

from controlplane.wire import ack_codec
from controlplane.wire.ack_codec import MAX_RESULT_DEPTH, decode_ack_fast
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import (
    MAX_MESSAGE_BYTES,
    decode_ack,
)
from tests.unit.conftest import (
    assert_agree,
    counting_fallback,
    msgspec_accepts,
    outcome,
    refused,
    stamped,
    wire,
)
from tests.unit.conftest import compact_json as dumps  # the ack tests' JSON: compact


def test_attempt_is_bounded_by_2_to_the_53_in_both() -> None:
    with counting_fallback() as fallback:
        view = assert_agree(dumps(wire(attempt=2**53)))
    assert view is not None and view.attempt == 2**53
    assert fallback.call_count == 0
    for attempt in (2**53 + 1, 2**64):
        assert refused(dumps(wire(attempt=attempt))).code is WireCode.SCHEMA_INVALID


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
    assert refused(data).code is WireCode.SCHEMA_INVALID


def test_identifier_edges_are_accepted(no_fallback: mock.MagicMock) -> None:
    for ident in ("a", "a" * 128, "0:@/.-_", "pod-7.us-east1:gpu@0"):
        assert assert_agree(dumps(wire(worker_id=ident))) is not None


def test_the_identifier_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ack_codec, "_MAX_VALID_IDS", 8)
    monkeypatch.setattr(ack_codec, "_valid_ids", set())
    for i in range(50):
        assert_agree(dumps(wire(worker_id=f"w-{i}", command_id=f"c-{i}")))
        assert len(ack_codec._valid_ids) <= 8
    assert refused(dumps(wire(worker_id="w-1\n"))).code is WireCode.SCHEMA_INVALID


@pytest.mark.parametrize("version", [None, True, 1.0, 1.5, 0, 2, "1", [1], -0])
def test_schema_version_must_be_the_integer_one(version: Any) -> None:
    value = wire(schema_version=version)
    err = refused(dumps(value))
    assert err.code is WireCode.UNSUPPORTED_SCHEMA_VERSION
    del value["schema_version"]
    assert refused(dumps(value)).code is WireCode.UNSUPPORTED_SCHEMA_VERSION


def test_schema_version_written_as_float_text() -> None:
    for text in (b"1.0", b"1e0", b"true"):
        data = dumps(wire()).replace(b'"schema_version":1', b'"schema_version":' + text)
        assert refused(data).code is WireCode.UNSUPPORTED_SCHEMA_VERSION


@pytest.mark.parametrize("attempt", [0, -1, True, 1.0, "1", None])
def test_attempt_must_be_a_positive_integer(attempt: Any) -> None:
    assert refused(dumps(wire(attempt=attempt))).code is WireCode.SCHEMA_INVALID


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
    assert refused(b"\xef\xbb\xbf\xef\xbb\xbf" + data).code is WireCode.MALFORMED_JSON
    big = dumps(wire(result={"pad": "x" * MAX_MESSAGE_BYTES}))
    assert refused(big).code is WireCode.MESSAGE_TOO_LARGE
    small = outcome(lambda d: decode_ack(d, max_bytes=100), data)
    assert outcome(lambda d: decode_ack_fast(d, max_bytes=100), data) == small
    assert isinstance(small, tuple) and small[0] is WireCode.MESSAGE_TOO_LARGE
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
