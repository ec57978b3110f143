"""The wire protocol's decode errors: malformed, too large, unsupported, and the ids a NACK keeps.

Pure unit tests: no Kafka, no I/O. Builders in tests/unit/conftest.py.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.protocol import (
    MAX_MESSAGE_BYTES,
    decode_command,
    encode,
)
from tests.unit.conftest import (
    DECODERS,
    MINIMAL,
    PROTOCOL_CODES,
    assert_nackable,
    command_dict,
    dumps,
    pretty,
    refusal,
    reload_command,
)

# --------------------------------------------------------------------------- decode errors


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b" ",
        b"{",
        b"{not json}",
        b"{'single': 'quotes'}",
        b'{"a": 1,}',
        b'{"a": 01}',
        b"\xff\xfe\x00\x00",
        b'{"issuer": "\xff"}',
        b'{"issuer": "\xed\xa0\x80"}',  # a UTF-8-encoded surrogate
        b'{"issuer": "\\ud800"}',  # a lone surrogate escape
        b'{"issuer": "a\x01b"}',  # raw control character
        b'{"a": NaN}',
        b'{"a": -Infinity}',
        b'{"a": 1} trailing',
        b'{"a": ' + b"9" * 5000 + b"}",
        b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        json.dumps(command_dict()).encode("utf-16"),
        json.dumps(command_dict()).encode("utf-32"),
    ],
    ids=lambda d: repr(d[:24]),
)
@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_malformed_json(kind: str, data: bytes) -> None:
    err = refusal(data, DECODERS[kind])
    assert err.code is WireCode.MALFORMED_JSON
    assert err.command_id is None
    assert_nackable(err)


def test_truncated_command_is_malformed() -> None:
    data = encode(reload_command())
    for cut in (1, len(data) // 2, len(data) - 1):
        assert refusal(data[:cut]).code is WireCode.MALFORMED_JSON


@pytest.mark.parametrize("data", [b"[]", b"[1, 2]", b"42", b"1.5", b'"text"', b"null", b"true"])
@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_not_an_object(kind: str, data: bytes) -> None:
    err = refusal(data, DECODERS[kind])
    assert err.code is WireCode.SCHEMA_INVALID
    assert "expected a JSON object" in err.message


@pytest.mark.parametrize(
    "missing", ["command_id", "rollout_id", "issued_at", "expires_at", "issuer", "spec"]
)
def test_missing_required_field(missing: str) -> None:
    raw = command_dict()
    del raw[missing]
    err = refusal(dumps(raw))
    assert err.code is WireCode.SCHEMA_INVALID
    assert missing in err.message
    assert_nackable(err)


@pytest.mark.parametrize("version", [0, 2, -1, 10**30, "1", 1.0, 1.5, True, None, [1], {"v": 1}])
@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_unsupported_schema_version(kind: str, version: Any) -> None:
    raw = json.loads(encode(MINIMAL[kind]))
    raw["schema_version"] = version
    err = refusal(dumps(raw), DECODERS[kind])
    assert err.code is WireCode.UNSUPPORTED_SCHEMA_VERSION
    assert "this build speaks 1" in err.message
    assert_nackable(err)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_missing_schema_version_is_unsupported(kind: str) -> None:
    raw = json.loads(encode(MINIMAL[kind]))
    del raw["schema_version"]
    assert refusal(dumps(raw), DECODERS[kind]).code is WireCode.UNSUPPORTED_SCHEMA_VERSION


def test_future_schema_version_is_unsupported_whatever_else_changed() -> None:
    raw = command_dict(schema_version=2, spec={"kind": "restart_engine"}, priority="high")
    err = refusal(dumps(raw))
    assert err.code is WireCode.UNSUPPORTED_SCHEMA_VERSION
    assert (err.command_id, err.rollout_id) == ("cmd-42", "rollout-42")


def test_message_too_large() -> None:
    raw = command_dict(
        spec={"kind": "update_config", "overrides": {"blob": "x" * MAX_MESSAGE_BYTES}}
    )
    data = dumps(raw)
    err = refusal(data)
    assert err.code is WireCode.MESSAGE_TOO_LARGE
    assert str(len(data)) in err.message
    assert err.command_id == "cmd-42"  # read from the head of the message, for the NACK
    assert_nackable(err)


@pytest.mark.parametrize("kind", sorted(DECODERS))
def test_message_too_large_with_a_custom_limit(kind: str) -> None:
    data = encode(MINIMAL[kind])
    assert DECODERS[kind](data, max_bytes=len(data)) is not None
    err = refusal(data, lambda d: DECODERS[kind](d, max_bytes=len(data) - 1))
    assert err.code is WireCode.MESSAGE_TOO_LARGE


def test_message_too_large_keeps_both_ids() -> None:
    raw = command_dict(spec={"kind": "update_config", "overrides": {"b": "x" * MAX_MESSAGE_BYTES}})
    err = refusal(dumps(raw))
    assert (err.code, err.command_id, err.rollout_id) == (
        WireCode.MESSAGE_TOO_LARGE,
        "cmd-42",
        "rollout-42",
    )


def test_message_too_large_checked_before_parsing() -> None:
    err = refusal(b"\xff" * (MAX_MESSAGE_BYTES + 1))
    assert err.code is WireCode.MESSAGE_TOO_LARGE
    assert err.command_id is None


def test_limit_is_inclusive() -> None:
    data = dumps(command_dict())
    padded = data + b" " * (MAX_MESSAGE_BYTES - len(data))
    assert len(padded) == MAX_MESSAGE_BYTES
    assert decode_command(padded).command_id == "cmd-42"
    assert refusal(padded + b" ").code is WireCode.MESSAGE_TOO_LARGE


# --------------------------------------------------------------------------- ids for the NACK


@pytest.mark.parametrize(
    "broken",
    [
        {"spec": {"kind": "reload_weights", "path": "/p"}},
        {"spec": {"kind": "restart"}},
        {"expires_at": "2025-06-01T11:00:00Z"},
        {"issued_at": "yesterday"},
        {"timeout_s": -5},
        {"selector": {"labels": {"-bad": "x"}}},
        {"priority": "high"},
        {"schema_version": 99},
    ],
    ids=lambda d: next(iter(d)),
)
def test_command_id_recovered_from_a_broken_but_readable_command(broken: dict[str, Any]) -> None:
    err = refusal(dumps(command_dict(**broken)))
    assert err.code in (WireCode.SCHEMA_INVALID, WireCode.UNSUPPORTED_SCHEMA_VERSION)
    assert err.command_id == "cmd-42"
    assert err.rollout_id == "rollout-42"
    assert_nackable(err)


def broken_config_command(value: bytes) -> bytes:
    """A command whose only damage is ``value`` written as an override (after both ids)."""
    raw = command_dict(spec={"kind": "update_config", "overrides": {"x": 1}})
    return pretty(raw).replace(b'"x": 1', b'"x": ' + value)


COMMAND = pretty(command_dict())
OFFSET_OF_ISSUER = COMMAND.index(b"kcat")

#: Records that are not JSON at all, but whose ids a reader can plainly see: the worker NACKs
#: them with the code so their sender does not wait for a timeout.
MALFORMED_BUT_READABLE: dict[str, tuple[bytes, str]] = {
    "truncated": (COMMAND[:-12], r"^truncated JSON: EOF while parsing a string at byte \d+$"),
    "truncated_object": (COMMAND[: COMMAND.index(b'"spec"')], r"^truncated JSON: EOF"),
    "nested_10000_arrays": (
        broken_config_command(b"[" * 10_000 + b"]" * 10_000),
        r"^nested more than 201 levels deep \(at byte \d+\)$",
    ),
    "nan": (broken_config_command(b"NaN"), r"^NaN is not a JSON number \(at byte \d+\)$"),
    "infinity": (broken_config_command(b"Infinity"), r"^Infinity is not a JSON number"),
    "minus_infinity": (broken_config_command(b"-Infinity"), r"^-Infinity is not a JSON number"),
    "nan_in_a_list": (broken_config_command(b"[1, -NaN]"), r"^-NaN is not a JSON number"),
    "invalid_utf8": (
        COMMAND.replace(b"kcat", b"kc\xffat"),
        rf"^invalid UTF-8 at byte {OFFSET_OF_ISSUER + 2}$",
    ),
    "utf8_encoded_surrogate": (
        COMMAND.replace(b"kcat", b"\xed\xa0\x80"),
        rf"^invalid UTF-8 at byte {OFFSET_OF_ISSUER}$",
    ),
    "raw_nul_in_a_string": (
        COMMAND.replace(b"kcat", b"kc\x00at"),
        rf"^raw control character U\+0000 in a string at byte {OFFSET_OF_ISSUER + 2} ",
    ),
    "raw_nul_between_members": (
        COMMAND.replace(b', "issuer"', b',\x00"issuer"'),
        r"^raw control character U\+0000 at byte \d+ ",
    ),
    "trailing_garbage": (COMMAND + b" }", r"^invalid JSON: trailing characters at byte \d+$"),
    "nan_after_a_bom": (
        b"\xef\xbb\xbf" + broken_config_command(b"NaN"),
        rf"^NaN is not a JSON number \(at byte {3 + broken_config_command(b'NaN').index(b'NaN')}\)$",
    ),
}


@pytest.mark.parametrize(
    ("data", "says"), MALFORMED_BUT_READABLE.values(), ids=list(MALFORMED_BUT_READABLE)
)
def test_malformed_but_readable_records_keep_their_ids(data: bytes, says: str) -> None:
    err = refusal(data)
    assert err.code is WireCode.MALFORMED_JSON
    assert re.search(says, err.message), err.message
    assert "UTF-8" not in err.message or "invalid UTF-8" in says
    assert (err.command_id, err.rollout_id) == ("cmd-42", "rollout-42")
    assert_nackable(err)


@pytest.mark.parametrize("kind", ["ack", "heartbeat"])
def test_malformed_acks_and_heartbeats_keep_their_ids_too(kind: str) -> None:
    data = encode(MINIMAL[kind])
    err = refusal(data[:-3], DECODERS[kind])
    assert err.code is WireCode.MALFORMED_JSON
    if kind == "ack":
        assert (err.command_id, err.rollout_id) == ("cmd-1", "rollout-1")
    else:
        assert (err.command_id, err.rollout_id) == (None, None)


UNREADABLE: dict[str, bytes] = {
    # Cut inside the id: "cmd-4" is another, valid, id.
    "cut_inside_the_id": COMMAND[: COMMAND.index(b"cmd-42") + 5],
    "cut_after_the_id_before_its_quote": COMMAND[: COMMAND.index(b"cmd-42") + 6],
    "invalid_utf8_inside_the_id": COMMAND.replace(b"cmd-42", b"cmd-\xff42"),
    "nul_inside_the_id": COMMAND.replace(b"cmd-42", b"cmd\x0042"),
    "escaped_id": COMMAND.replace(b"cmd-42", b"cmd-\\u00342")[:-3],
    "id_written_twice_differently": COMMAND.replace(
        b'"issuer"', b'"command_id": "cmd-43", "rollout_id": "r-9", "issuer"'
    )[:-3],
    "id_only_in_a_nested_object": pretty(
        {"schema_version": 1, "spec": {"command_id": "cmd-42", "rollout_id": "rollout-42"}}
    )[:-2],
    "damage_before_the_id": b'{"a": [1 2], ' + COMMAND[1:],
    "not_an_object": b'["command_id", "cmd-42", "rollout_id", "rollout-42", NaN]',
}


@pytest.mark.parametrize("data", UNREADABLE.values(), ids=list(UNREADABLE))
def test_ids_that_are_not_plainly_readable_are_not_guessed(data: bytes) -> None:
    err = refusal(data)
    assert err.code is WireCode.MALFORMED_JSON
    assert err.command_id is None
    if data.startswith(b'{"a": [1 2]'):
        assert err.rollout_id is None
    assert_nackable(err)


def test_the_damage_is_found_after_the_ids_too() -> None:
    """Ids that come after the damage are read when the rest still parses as JSON."""
    spec = {"kind": "update_config", "overrides": {"x": 1}, "note": "/ckpt"}
    raw = pretty({"spec": spec, **{k: v for k, v in command_dict().items() if k != "spec"}})
    for broken in (raw.replace(b'"x": 1', b'"x": NaN'), raw.replace(b"/ckpt", b"/\xffckpt")):
        err = refusal(broken)
        assert (err.command_id, err.rollout_id) == ("cmd-42", "rollout-42")


@pytest.mark.parametrize(
    "bad_id", ["", "bad id", "-x", "x" * 129, 42, None, ["cmd-42"], {"id": "c"}]
)
def test_ids_that_an_ack_could_not_carry_are_not_recovered(bad_id: Any) -> None:
    err = refusal(dumps(command_dict(command_id=bad_id, rollout_id=bad_id, spec={})))
    assert err.code is WireCode.SCHEMA_INVALID
    assert err.command_id is None
    assert err.rollout_id is None
    assert_nackable(err)


def test_only_the_broken_ids_are_dropped() -> None:
    err = refusal(dumps(command_dict(rollout_id="no spaces allowed")))
    assert (err.command_id, err.rollout_id) == ("cmd-42", None)


def test_ids_from_a_nested_object_are_not_recovered() -> None:
    raw = {"schema_version": 1, "spec": {"command_id": "cmd-9", "rollout_id": "r-9"}}
    err = refusal(dumps(raw))
    assert (err.command_id, err.rollout_id) == (None, None)


def test_refusal_messages_stay_small_enough_for_an_ack() -> None:
    huge = "k" * 200_000
    cases = [
        command_dict(spec={"kind": huge}),
        command_dict(selector={"labels": {huge: huge}}, issuer=huge),
        command_dict(schema_version=huge),
        command_dict(**{f"extra_{i}_{huge[:5000]}": i for i in range(50)}),
    ]
    for raw in cases:
        err = refusal(dumps(raw))
        assert len(err.message) <= 1024
        assert_nackable(err)


def test_refusal_lists_several_problems() -> None:
    raw = command_dict(issuer="", timeout_s=0, spec={"kind": "update_config", "overrides": {}})
    err = refusal(dumps(raw))
    for field in ("issuer", "timeout_s", "overrides"):
        assert field in err.message
    assert str(err).startswith("SCHEMA_INVALID: invalid Command: ")


@pytest.mark.parametrize("code", PROTOCOL_CODES)
def test_protocol_codes_are_rejections_and_not_retryable(code: WireCode) -> None:
    err = ProtocolError("x", code=code)
    assert err.is_rejection
    assert not err.retryable
