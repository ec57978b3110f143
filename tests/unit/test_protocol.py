"""The wire protocol's models: exact round trips, validation rules and selectors.

Pure unit tests: no Kafka, no I/O. The builders are in tests/unit/conftest.py (shared with the
schema and fuzz tests); the names test_schemas imports from here are re-exported.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Heartbeat,
    ReloadWeightsSpec,
    Selector,
    Signature,
    Timings,
    UpdateConfigSpec,
    decode_ack,
    decode_command,
    decode_heartbeat,
    encode,
)
from tests.unit.conftest import (
    DECODERS,
    MINIMAL,
    T0,
    VALID,
    VALID_IDS,
    Message,
    ack,
    command_dict,
    config_command,
    decoder_for,
    dumps,
    heartbeat,
    refusal,
    reload_command,
)

# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize(("name", "message"), VALID, ids=VALID_IDS)
def test_round_trip_is_exact(name: str, message: Message) -> None:
    data = encode(message)
    decoded = decoder_for(message)(data)
    assert type(decoded) is type(message)
    assert decoded == message
    assert encode(decoded) == data


@pytest.mark.parametrize(("name", "message"), VALID, ids=VALID_IDS)
def test_encoding_is_compact_utf8_json_with_every_field(name: str, message: Message) -> None:
    data = encode(message)
    text = data.decode("utf-8")
    assert "\n" not in text
    assert not text.startswith(" ")
    # Every field, but those a writer omits when unset (exclude_if: older readers forbid them).
    omitted = {
        name
        for name, field in type(message).model_fields.items()
        if field.exclude_if is not None and field.exclude_if(getattr(message, name))
    }
    assert set(json.loads(text)) == set(type(message).model_fields) - omitted
    assert json.loads(text)["schema_version"] == 1


def test_every_message_and_spec_kind_is_covered() -> None:
    messages = [message for _, message in VALID]
    assert {type(m) for m in messages} == {Command, Ack, Heartbeat}
    assert {m.kind for m in messages if isinstance(m, Command)} == set(CommandKind)
    assert {m.state for m in messages if isinstance(m, Ack)} == set(AckState)


def test_timestamps_keep_their_instant_and_offset() -> None:
    plus2 = timezone(timedelta(hours=2))
    command = reload_command(issued_at=datetime(2025, 6, 1, 14, 0, tzinfo=plus2))
    data = encode(command)
    assert b'"issued_at":"2025-06-01T14:00:00+02:00"' in data
    decoded = decode_command(data)
    assert decoded.issued_at == T0
    assert decoded.issued_at.utcoffset() == timedelta(hours=2)


def test_utc_is_written_as_z() -> None:
    assert b'"issued_at":"2025-06-01T12:00:00Z"' in encode(reload_command())


def test_spec_kind_selects_the_spec_model() -> None:
    assert isinstance(decode_command(encode(reload_command())).spec, ReloadWeightsSpec)
    assert isinstance(decode_command(encode(config_command())).spec, UpdateConfigSpec)
    assert reload_command().kind is CommandKind.RELOAD_WEIGHTS
    assert config_command().kind is CommandKind.UPDATE_CONFIG


# --------------------------------------------------------------------------- validation rules


@pytest.mark.parametrize("delta", [timedelta(0), timedelta(seconds=-1), timedelta(days=-365)])
def test_expiry_must_be_after_issue(delta: timedelta) -> None:
    with pytest.raises(ValidationError, match="expires_at must be after issued_at"):
        reload_command(expires_at=T0 + delta)
    data = dumps(command_dict(expires_at=(T0 + delta).isoformat()))
    err = refusal(data)
    assert err.code is WireCode.SCHEMA_INVALID
    assert "expires_at must be after issued_at" in err.message


def test_expiry_is_compared_as_instants_across_offsets() -> None:
    # 13:30+02:00 is 11:30Z, before 12:00Z issue time, though its wall clock reads later.
    with pytest.raises(ValidationError):
        reload_command(expires_at=datetime(2025, 6, 1, 13, 30, tzinfo=timezone(timedelta(hours=2))))


def test_is_expired_at_and_after_expiry() -> None:
    command = reload_command()
    assert not command.is_expired(command.expires_at - timedelta(microseconds=1))
    assert command.is_expired(command.expires_at)
    assert command.is_expired(command.expires_at + timedelta(days=1))


@pytest.mark.parametrize("state", [AckState.FAILED, AckState.REJECTED])
def test_unsuccessful_ack_must_carry_an_error(state: AckState) -> None:
    with pytest.raises(ValidationError, match="must carry an error"):
        ack(state, error=None)


def test_succeeded_ack_must_not_carry_an_error() -> None:
    with pytest.raises(ValidationError, match="must not carry an error"):
        ack(AckState.SUCCEEDED, error=AckError(code="INTERNAL", message="x"))


@pytest.mark.parametrize("state", [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED])
def test_ack_without_error(state: AckState) -> None:
    assert ack(state).error is None


def test_ack_terminal_states() -> None:
    assert {s for s in AckState if s.terminal} == {
        AckState.SUCCEEDED,
        AckState.FAILED,
        AckState.REJECTED,
    }


def test_unsuccessful_ack_without_error_is_refused_on_the_wire() -> None:
    raw = json.loads(encode(ack(AckState.FAILED)))
    raw["error"] = None
    assert refusal(dumps(raw), decode_ack).code is WireCode.SCHEMA_INVALID


def test_timings_duration() -> None:
    assert Timings(received_at=T0).duration_s is None
    assert Timings(received_at=T0, started_at=T0).duration_s is None
    timings = Timings(received_at=T0, started_at=T0, finished_at=T0 + timedelta(seconds=2.5))
    assert timings.duration_s == 2.5


VALID_IDENTIFIERS = ["a", "Z", "0", "cmd-1", "v1.2.3", "a_b", "ns/name", "pod:7@gpu", "x" * 128]
INVALID_IDENTIFIERS = [
    "",
    "-a",
    ".a",
    "_a",
    "/a",
    "a b",
    "a\n",
    "\na",
    "a\x00",
    "caf\u00e9",
    "\uff41",  # fullwidth a
    "a#1",
    "a,b",
    "x" * 129,
]


@pytest.mark.parametrize("value", VALID_IDENTIFIERS)
def test_identifier_accepted(value: str) -> None:
    command = reload_command(command_id=value, rollout_id=value)
    assert decode_command(encode(command)).command_id == value
    assert ack(worker_id=value).worker_id == value
    assert Selector(worker_ids=[value]).worker_ids == [value]


@pytest.mark.parametrize("value", INVALID_IDENTIFIERS)
@pytest.mark.parametrize("field", ["command_id", "rollout_id"])
def test_identifier_refused(field: str, value: str) -> None:
    with pytest.raises(ValidationError):
        reload_command(**{field: value})
    err = refusal(dumps(command_dict(**{field: value})))
    assert err.code is WireCode.SCHEMA_INVALID
    assert field in err.message


@pytest.mark.parametrize("value", INVALID_IDENTIFIERS)
def test_identifier_refused_in_other_places(value: str) -> None:
    with pytest.raises(ValidationError):
        ack(worker_id=value)
    with pytest.raises(ValidationError):
        heartbeat(worker_id=value)
    with pytest.raises(ValidationError):
        Selector(worker_ids=["ok", value])
    with pytest.raises(ValidationError):
        ReloadWeightsSpec(path="/p", version=value)
    with pytest.raises(ValidationError):
        Signature(key_id=value, value="sig")


@pytest.mark.parametrize("key", ["model", "app.kubernetes.io/name", "a-b_c", "x" * 63])
def test_label_key_accepted(key: str) -> None:
    assert Selector(labels={key: "v"}).labels == {key: "v"}
    assert heartbeat(labels={key: ""}).labels == {key: ""}


@pytest.mark.parametrize("key", ["", "-x", ".x", "a b", "a:b", "a@b", "x" * 64])
def test_label_key_refused(key: str) -> None:
    with pytest.raises(ValidationError):
        Selector(labels={key: "v"})
    with pytest.raises(ValidationError):
        heartbeat(labels={key: "v"})


def test_label_value_length() -> None:
    assert Selector(labels={"k": "v" * 63}).labels["k"] == "v" * 63
    with pytest.raises(ValidationError):
        Selector(labels={"k": "v" * 64})


@pytest.mark.parametrize("digest", ["AB" * 32, "ab" * 31, "ab" * 33, "g" * 64, ""])
def test_sha256_manifest_must_be_lowercase_hex(digest: str) -> None:
    with pytest.raises(ValidationError):
        ReloadWeightsSpec(path="/p", version="v", sha256={"model.safetensors": digest})


def test_reload_path_bounds() -> None:
    with pytest.raises(ValidationError):
        ReloadWeightsSpec(path="", version="v")
    with pytest.raises(ValidationError):
        ReloadWeightsSpec(path="/" + "p" * 4096, version="v")


def test_update_config_needs_at_least_one_override() -> None:
    with pytest.raises(ValidationError):
        UpdateConfigSpec(overrides={})
    with pytest.raises(ValidationError):
        UpdateConfigSpec(overrides={"": 1})


@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), [1, float("-inf")], {"a": float("nan")}]
)
def test_non_finite_numbers_are_not_json(value: Any) -> None:
    with pytest.raises(ValidationError, match=r"finite number|NaN and Infinity"):
        UpdateConfigSpec(overrides={"x": value})
    with pytest.raises(ValidationError, match=r"finite number|NaN and Infinity"):
        ack(result={"x": value})


@pytest.mark.parametrize("timeout", [0, -1, 86400.001, float("nan"), float("inf")])
def test_timeout_bounds_refused(timeout: float) -> None:
    with pytest.raises(ValidationError):
        reload_command(timeout_s=timeout)


@pytest.mark.parametrize("timeout", [None, 0.001, 1, 86400])
def test_timeout_bounds_accepted(timeout: float | None) -> None:
    assert reload_command(timeout_s=timeout).timeout_s == timeout


@pytest.mark.parametrize("interval", [0, -1, float("inf"), float("nan"), 3600.001, 1e300])
def test_heartbeat_interval_must_be_positive_finite_and_at_most_an_hour(interval: float) -> None:
    with pytest.raises(ValidationError):
        heartbeat(interval_s=interval)


def test_heartbeat_interval_bounds_accepted() -> None:
    assert heartbeat(interval_s=3600).interval_s == 3600
    assert heartbeat(interval_s=0.001).interval_s == 0.001


def test_a_huge_heartbeat_interval_is_refused_on_the_wire() -> None:
    """1e300 is valid JSON: accepted, it made timedelta() overflow in the coordinator's registry."""
    for interval in (b"1e300", b"3600.5", b"1" + b"0" * 400):
        data = encode(heartbeat()).replace(b'"interval_s":2.0', b'"interval_s":' + interval)
        err = refusal(data, decode_heartbeat)
        assert err.code is WireCode.SCHEMA_INVALID
        assert "interval_s" in err.message


def test_heartbeat_seq_and_ack_attempt_bounds() -> None:
    with pytest.raises(ValidationError):
        heartbeat(seq=-1)
    with pytest.raises(ValidationError):
        ack(attempt=0)


@pytest.mark.parametrize(
    ("kind", "field"), [("heartbeat", "seq"), ("heartbeat", "incarnation"), ("ack", "attempt")]
)
def test_counters_are_bounded_by_2_to_the_53(kind: str, field: str) -> None:
    raw = json.loads(encode(MINIMAL[kind]))
    raw[field] = 2**53
    assert getattr(DECODERS[kind](dumps(raw)), field) == 2**53
    for value in (2**53 + 1, 2**64, 10**4000):
        raw[field] = value
        err = refusal(dumps(raw), DECODERS[kind])
        assert err.code is WireCode.SCHEMA_INVALID
        assert field in err.message


@pytest.mark.parametrize(
    "value",
    [
        "0001-01-01T00:00:00Z",
        "1969-12-31T23:59:59.999999Z",
        "1970-01-01T00:30:00+01:00",
        "9000-01-01T00:00:00Z",
        "8999-12-31T23:00:00-01:00",
        "9999-12-31T23:59:59Z",
        "9999-12-31T23:59:59.9999995Z",
    ],
)
def test_date_times_out_of_range_are_refused(value: str) -> None:
    """A date near year 9999 plus hours overflows datetime: every date-time lies in 1970..9000."""
    if value < "2100":
        command = command_dict(issued_at=value, expires_at="2100-01-01T00:00:00Z")
    else:
        command = command_dict(issued_at="2025-06-01T12:00:00Z", expires_at=value)
    cases = [
        (decode_command, command),
        (decode_ack, {**json.loads(encode(ack())), "sent_at": value}),
        (decode_heartbeat, {**json.loads(encode(heartbeat())), "started_at": value}),
    ]
    for decoder, raw in cases:
        err = refusal(dumps(raw), decoder)
        assert err.code is WireCode.SCHEMA_INVALID
        assert "date-time out of range" in err.message
        assert "1970-01-01T00:00:00Z and 9000-01-01T00:00:00Z" in err.message
    with pytest.raises(ValidationError, match="out of range"):
        heartbeat(sent_at=datetime(9999, 12, 31, tzinfo=UTC))


@pytest.mark.parametrize(
    "value", ["1970-01-01T00:00:00Z", "1970-01-01T01:00:00+01:00", "8999-12-31T23:59:59.999999Z"]
)
def test_date_times_at_the_edges_of_the_range_are_accepted(value: str) -> None:
    raw = {**json.loads(encode(heartbeat())), "sent_at": value, "started_at": value}
    beat = decode_heartbeat(dumps(raw))
    assert beat.sent_at == datetime.fromisoformat(value)


def test_discriminator_on_spec_kind() -> None:
    refused = [
        {"kind": "reload_weights", "overrides": {"a": 1}},
        {"kind": "update_config", "path": "/p", "version": "v"},
        {"kind": "restart", "path": "/p", "version": "v"},
        {"kind": None, "path": "/p", "version": "v"},
        {"path": "/p", "version": "v"},
        {"overrides": {"a": 1}},
        {},
        [],
        "reload_weights",
    ]
    for spec in refused:
        err = refusal(dumps(command_dict(spec=spec)))
        assert err.code is WireCode.SCHEMA_INVALID, spec
        assert "spec" in err.message
    with pytest.raises(ValidationError):
        Command.model_validate({**command_dict(), "spec": {"kind": "restart"}})


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(priority=1),
        lambda d: d["spec"].update(dtype="bf16"),
        lambda d: d.update(selector={"labels": {}, "namespaces": ["a"]}),
        lambda d: d.update(signature={"alg": "ed25519", "key_id": "k", "value": "v", "x": 1}),
    ],
    ids=["top", "spec", "selector", "signature"],
)
def test_extra_fields_are_forbidden(mutate: Any) -> None:
    raw = command_dict()
    mutate(raw)
    err = refusal(dumps(raw))
    assert err.code is WireCode.SCHEMA_INVALID
    assert "Extra inputs are not permitted" in err.message


def test_extra_fields_are_forbidden_in_acks_and_heartbeats() -> None:
    raw = json.loads(encode(ack()))
    raw["timings"]["queued_at"] = "2025-06-01T12:00:00Z"
    assert refusal(dumps(raw), decode_ack).code is WireCode.SCHEMA_INVALID
    raw = json.loads(encode(heartbeat()))
    raw["gpu_count"] = 8
    assert refusal(dumps(raw), decode_heartbeat).code is WireCode.SCHEMA_INVALID
    with pytest.raises(ValidationError):
        Heartbeat.model_validate({**raw})


@pytest.mark.parametrize(
    "value",
    [
        "2025-06-01T12:00:00",
        "2025-06-01T12:00:00.5",
        "2025-06-01",
        "2025-06-01 12:00:00Z",
        "2025-06-01T12:00Z",
        "20250601T120000Z",
        "2025-06-01T12:00:00+0200",
        "2025-06-01T12:00:00 +02:00",
        "1748779200",
        "0",
        "now",
        "",
        "2025-13-01T12:00:00Z",
        "2025-02-30T12:00:00Z",
        "2025-06-01T24:00:00Z",
        "2025-06-01T12:00:00+24:00",
        "\u0662\u0660\u0662\u0665-06-01T12:00:00Z",  # Arabic-Indic digits
    ],
)
def test_naive_or_non_rfc3339_datetimes_are_refused(value: str) -> None:
    err = refusal(dumps(command_dict(issued_at=value, expires_at="2100-01-01T00:00:00Z")))
    assert err.code is WireCode.SCHEMA_INVALID
    assert "issued_at" in err.message


@pytest.mark.parametrize("value", [1748779200, 1748779200.5, True, None, [], {}])
def test_datetimes_must_be_strings(value: Any) -> None:
    err = refusal(dumps(command_dict(issued_at=value, expires_at="2100-01-01T00:00:00Z")))
    assert err.code is WireCode.SCHEMA_INVALID


def test_naive_datetimes_are_refused_in_python() -> None:
    naive = datetime(2025, 6, 1, 12, 0)
    with pytest.raises(ValidationError, match="timezone"):
        reload_command(issued_at=naive)
    with pytest.raises(ValidationError, match="timezone"):
        Timings(received_at=naive)
    with pytest.raises(ValidationError, match="timezone"):
        heartbeat(sent_at=naive)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("timeout_s", "30"),
        ("timeout_s", True),
        ("issuer", 7),
        ("selector", {"worker_ids": "worker-1"}),
        ("selector", {"labels": {"model": 70}}),
        ("spec", {"kind": "reload_weights", "path": "/p", "version": "v", "strict": "false"}),
        ("spec", {"kind": "reload_weights", "path": "/p", "version": "v", "strict": 0}),
        ("spec", {"kind": "reload_weights", "path": "/p", "version": 42}),
    ],
)
def test_no_lax_type_coercion_on_the_wire(field: str, value: Any) -> None:
    """The decoder is as strict as the published schema: "30" is not a number, 0 is not false."""
    assert refusal(dumps(command_dict(**{field: value}))).code is WireCode.SCHEMA_INVALID


def test_messages_are_frozen() -> None:
    command = reload_command()
    with pytest.raises(ValidationError):
        command.command_id = "other"  # type: ignore[misc]
    with pytest.raises(ValidationError):
        command.selector.worker_ids = None  # type: ignore[misc]


# --------------------------------------------------------------------------- selector


@pytest.mark.parametrize(
    ("selector", "worker_id", "labels", "expected"),
    [
        (Selector(), "w1", {}, True),
        (Selector(), "w1", {"model": "a"}, True),
        (Selector(worker_ids=["w1", "w2"]), "w2", {}, True),
        (Selector(worker_ids=["w1", "w2"]), "w3", {}, False),
        (Selector(worker_ids=[]), "w1", {}, False),
        (Selector(labels={"model": "a"}), "w1", {"model": "a", "zone": "z"}, True),
        (Selector(labels={"model": "a"}), "w1", {"model": "b"}, False),
        (Selector(labels={"model": "a"}), "w1", {}, False),
        (Selector(labels={"model": ""}), "w1", {}, False),
        (Selector(labels={"model": ""}), "w1", {"model": ""}, True),
        (Selector(labels={"model": "a", "zone": "z"}), "w1", {"model": "a"}, False),
        (Selector(labels={"model": "a", "zone": "z"}), "w1", {"model": "a", "zone": "z"}, True),
        (Selector(worker_ids=["w1"], labels={"model": "a"}), "w1", {"model": "a"}, True),
        (Selector(worker_ids=["w1"], labels={"model": "a"}), "w1", {"model": "b"}, False),
        (Selector(worker_ids=["w1"], labels={"model": "a"}), "w2", {"model": "a"}, False),
        (Selector(worker_ids=["W1"]), "w1", {}, False),
        (Selector(labels={"Model": "a"}), "w1", {"model": "a"}, False),
    ],
)
def test_selector_matching(
    selector: Selector, worker_id: str, labels: dict[str, str], expected: bool
) -> None:
    """Every given field must match; omitted worker_ids means any; [] means none."""
    assert selector.matches(worker_id, labels) is expected
    wire = decode_command(encode(reload_command(selector=selector))).selector
    assert wire.matches(worker_id, labels) is expected


def test_selector_defaults_to_everyone() -> None:
    command = decode_command(dumps(command_dict()))
    assert command.selector == Selector()
    assert command.selector.matches("anyone", {"any": "label"})
