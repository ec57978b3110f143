"""The wire protocol: round trips, validation rules, plain-JSON clients and decode errors.

Pure unit tests: no Kafka, no I/O. The builders here are shared with the schema and fuzz tests.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.protocol import (
    MAX_MESSAGE_BYTES,
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Degraded,
    Heartbeat,
    InFlight,
    ReloadWeightsSpec,
    Selector,
    Signature,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
    decode_ack,
    decode_command,
    decode_heartbeat,
    encode,
)

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
SHA = "ab" * 32
IDENTIFIER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")

DECODERS: dict[str, Any] = {
    "command": decode_command,
    "ack": decode_ack,
    "heartbeat": decode_heartbeat,
}
Message = Command | Ack | Heartbeat
SCHEMA_NAME: dict[type[Message], str] = {Command: "command", Ack: "ack", Heartbeat: "heartbeat"}


# --------------------------------------------------------------------------- builders


def reload_command(**fields: Any) -> Command:
    values: dict[str, Any] = {
        "command_id": "cmd-1",
        "rollout_id": "rollout-1",
        "issued_at": T0,
        "expires_at": T0 + timedelta(hours=1),
        "issuer": "ci@example",
        "spec": ReloadWeightsSpec(path="/ckpt/v42", version="v42"),
    }
    values.update(fields)
    return Command(**values)


def config_command(**fields: Any) -> Command:
    fields.setdefault("spec", UpdateConfigSpec(overrides={"max_num_seqs": 128}))
    return reload_command(**fields)


def ack(state: AckState = AckState.SUCCEEDED, **fields: Any) -> Ack:
    values: dict[str, Any] = {
        "command_id": "cmd-1",
        "rollout_id": "rollout-1",
        "worker_id": "worker-1",
        "kind": CommandKind.RELOAD_WEIGHTS,
        "state": state,
        "timings": Timings(received_at=T0),
        "sent_at": T0 + timedelta(seconds=1),
    }
    if state in (AckState.FAILED, AckState.REJECTED):
        values["error"] = AckError(code=WireCode.WEIGHTS_MISSING, message="no tensor 'w'")
    values.update(fields)
    return Ack(**values)


def heartbeat(**fields: Any) -> Heartbeat:
    values: dict[str, Any] = {
        "worker_id": "worker-1",
        "runner": "torch",
        "device": "cpu",
        "status": WorkerStatus.READY,
        "seq": 0,
        "sent_at": T0,
        "started_at": T0 - timedelta(minutes=5),
        "interval_s": 2.0,
    }
    values.update(fields)
    return Heartbeat(**values)


def valid_messages() -> list[tuple[str, Message]]:
    """One of every message kind, spec kind and optional part, minimal and full."""
    plus2 = timezone(timedelta(hours=2))
    return [
        ("command-reload-minimal", reload_command()),
        (
            "command-reload-full",
            reload_command(
                issued_at=datetime(2025, 6, 1, 14, 0, 0, 123456, tzinfo=plus2),
                expires_at=datetime(2025, 6, 2, 14, 0, tzinfo=plus2),
                selector=Selector(
                    worker_ids=["worker-1", "pod-7.us-east1:gpu@0"],
                    labels={"model": "llama-70b", "app.kubernetes.io/name": "vllm"},
                ),
                spec=ReloadWeightsSpec(
                    path="/ckpt/v43/model.safetensors.index.json",
                    version="v43",
                    sha256={"model-00001-of-00002.safetensors": SHA},
                    strict=False,
                ),
                timeout_s=900.5,
                signature=Signature(key_id="ci-key-2025", value="c2lnbmF0dXJl"),
            ),
        ),
        ("command-config-minimal", config_command()),
        (
            "command-config-nested",
            config_command(
                spec=UpdateConfigSpec(
                    overrides={
                        "max_num_seqs": 256,
                        "gpu_memory_utilization": 0.92,
                        "enable_prefix_caching": True,
                        "served_model_name": "llama",
                        "speculative": {"method": "ngram", "tokens": [1, 2, 3], "off": None},
                    }
                ),
                selector=Selector(worker_ids=[]),
            ),
        ),
        ("ack-accepted", ack(AckState.ACCEPTED)),
        (
            "ack-running",
            ack(AckState.RUNNING, timings=Timings(received_at=T0, started_at=T0), attempt=2),
        ),
        (
            "ack-succeeded",
            ack(
                weights_version="v42",
                config_digest="sha256:" + SHA,
                timings=Timings(
                    received_at=T0, started_at=T0, finished_at=T0 + timedelta(seconds=3)
                ),
                result={"bytes": 140_000_000_000, "tensors": 723, "seconds": 2.75},
            ),
        ),
        ("ack-failed", ack(AckState.FAILED, weights_version="v41")),
        (
            "ack-rejected-unreadable",
            ack(
                AckState.REJECTED,
                kind=None,
                error=AckError(
                    code=WireCode.SCHEMA_INVALID, message="spec: missing", retryable=False
                ),
            ),
        ),
        ("heartbeat-minimal", heartbeat()),
        (
            "heartbeat-busy",
            heartbeat(
                labels={"model": "llama-70b", "zone": "us-east1-b"},
                status=WorkerStatus.BUSY,
                weights_version="v41",
                config_digest="abc123",
                in_flight=InFlight(
                    command_id="cmd-1",
                    rollout_id="rollout-1",
                    kind=CommandKind.RELOAD_WEIGHTS,
                    since=T0,
                ),
                seq=17,
                agent_version="0.1.0",
            ),
        ),
        (
            "heartbeat-degraded",
            heartbeat(
                status=WorkerStatus.DEGRADED,
                degraded=Degraded(
                    code=WireCode.WEIGHTS_CORRUPTED,
                    message="copy failed at layer 12",
                    from_version=None,
                    to_version="v42",
                    since=T0,
                ),
            ),
        ),
    ]


VALID = valid_messages()
VALID_IDS = [name for name, _ in VALID]
MINIMAL: dict[str, Message] = {"command": reload_command(), "ack": ack(), "heartbeat": heartbeat()}


def decoder_for(message: Message) -> Any:
    return DECODERS[SCHEMA_NAME[type(message)]]


def dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def command_dict(**fields: Any) -> dict[str, Any]:
    """A command as a Kafka client with no access to our code would write it."""
    value: dict[str, Any] = {
        "schema_version": 1,
        "command_id": "cmd-42",
        "rollout_id": "rollout-42",
        "issued_at": "2025-06-01T14:00:00+02:00",
        "expires_at": "2025-06-01T13:00:00Z",
        "issuer": "kcat",
        "spec": {"kind": "reload_weights", "path": "/ckpt/v42", "version": "v42"},
    }
    value.update(fields)
    return value


def refusal(data: bytes, decoder: Any = decode_command) -> ProtocolError:
    with pytest.raises(ProtocolError) as caught:
        decoder(data)
    return caught.value


def assert_nackable(err: ProtocolError) -> None:
    """A worker can always turn a refusal into a valid rejected ack."""
    assert err.command_id is None or IDENTIFIER.fullmatch(err.command_id)
    assert err.rollout_id is None or IDENTIFIER.fullmatch(err.rollout_id)
    assert err.is_rejection
    assert not err.retryable
    nack = ack(
        AckState.REJECTED,
        command_id=err.command_id or "unknown",
        rollout_id=err.rollout_id or "unknown",
        kind=None,
        error=AckError(code=err.code, message=err.message, retryable=err.retryable),
    )
    assert decode_ack(encode(nack)) == nack


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
    assert set(json.loads(text)) == set(type(message).model_fields)
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


# --------------------------------------------------------------------------- plain-JSON clients


def test_command_written_by_any_kafka_client() -> None:
    command = decode_command(dumps(command_dict()))
    assert command.command_id == "cmd-42"
    assert command.rollout_id == "rollout-42"
    assert command.issued_at == T0
    assert command.issued_at.utcoffset() == timedelta(hours=2)
    assert command.expires_at == T0 + timedelta(hours=1)
    assert command.issuer == "kcat"
    # Every omitted optional field takes its documented default.
    assert command.selector == Selector(worker_ids=None, labels={})
    assert command.timeout_s is None
    assert command.signature is None
    assert isinstance(command.spec, ReloadWeightsSpec)
    assert command.spec.sha256 == {}
    assert command.spec.strict is True
    assert command.kind is CommandKind.RELOAD_WEIGHTS


@pytest.mark.parametrize(
    ("issued", "expires"),
    [
        ("2025-06-01T14:00:00+02:00", "2025-06-01T13:00:00Z"),
        ("2025-06-01T12:00:00Z", "2025-06-01T13:00:00z"),
        ("2025-06-01t12:00:00z", "2025-06-01T08:00:00-05:00"),
        ("2025-06-01T17:30:00+05:30", "2025-06-01T13:00:00+00:00"),
        ("2025-06-01T12:00:00-00:00", "2025-06-01T13:00:00.000001Z"),
        ("2025-06-01T12:00:00.000Z", "2025-06-01T13:00:00.123456789Z"),
        ("2025-06-01T02:00:00-10:00", "2025-06-02T12:00:00+23:59"),
    ],
)
def test_rfc3339_timestamps_with_any_offset(issued: str, expires: str) -> None:
    command = decode_command(dumps(command_dict(issued_at=issued, expires_at=expires)))
    assert command.issued_at == T0
    assert command.expires_at > command.issued_at


def test_command_with_explicit_nulls_and_pretty_printing() -> None:
    raw = command_dict(
        selector={"worker_ids": None, "labels": {"model": "llama-70b"}},
        timeout_s=None,
        signature=None,
        spec={
            "kind": "reload_weights",
            "path": "/ckpt/v42",
            "version": "v42",
            "sha256": {"model.safetensors": SHA},
            "strict": False,
        },
    )
    data = (json.dumps(raw, indent=4, ensure_ascii=False) + "\n").encode()
    command = decode_command(data)
    assert command.selector.labels == {"model": "llama-70b"}
    assert command.spec == ReloadWeightsSpec(
        path="/ckpt/v42", version="v42", sha256={"model.safetensors": SHA}, strict=False
    )


def test_update_config_written_by_any_kafka_client() -> None:
    raw = command_dict(
        timeout_s=30,
        spec={"kind": "update_config", "overrides": {"max_num_seqs": 64, "x": {"y": [1, "z"]}}},
    )
    command = decode_command(dumps(raw))
    assert command.spec == UpdateConfigSpec(overrides={"max_num_seqs": 64, "x": {"y": [1, "z"]}})
    assert command.timeout_s == 30.0
    assert command.kind is CommandKind.UPDATE_CONFIG


def test_non_ascii_text_is_accepted() -> None:
    raw = command_dict(issuer="équipe-ML \u4e2d\u6587 \U0001f680")
    for data in (dumps(raw), json.dumps(raw, ensure_ascii=False).encode("utf-8")):
        assert decode_command(data).issuer == raw["issuer"]


def test_utf8_byte_order_mark_is_ignored() -> None:
    assert decode_command(b"\xef\xbb\xbf" + dumps(command_dict())).command_id == "cmd-42"


def test_ack_and_heartbeat_written_by_hand() -> None:
    received = "2025-06-01T14:00:00+02:00"
    ack_ = decode_ack(
        dumps(
            {
                "schema_version": 1,
                "command_id": "cmd-42",
                "rollout_id": "rollout-42",
                "worker_id": "worker-1",
                "state": "rejected",
                "error": {"code": "EXPIRED", "message": "expired at 13:00Z"},
                "timings": {"received_at": received},
                "sent_at": received,
            }
        )
    )
    assert ack_.state is AckState.REJECTED
    assert ack_.kind is None
    assert ack_.error == AckError(code="EXPIRED", message="expired at 13:00Z", retryable=False)
    assert ack_.attempt == 1
    assert ack_.result == {}
    beat = decode_heartbeat(
        dumps(
            {
                "schema_version": 1,
                "worker_id": "worker-1",
                "runner": "vllm",
                "device": "cuda:0",
                "status": "ready",
                "seq": 3,
                "sent_at": received,
                "started_at": received,
                "interval_s": 5,
            }
        )
    )
    assert beat.status is WorkerStatus.READY
    assert beat.interval_s == 5.0
    assert beat.labels == {}
    assert beat.agent_version == ""


# --------------------------------------------------------------------------- duplicate keys


def pretty(value: Any) -> bytes:
    """JSON with a space after each colon, so that the replacements below find their key."""
    return json.dumps(value).encode()


DUPLICATED: list[tuple[str, bytes, bytes, str]] = [
    # (kind, what to find in the message, what to write instead, the key named in the refusal)
    (
        "command",
        b'"command_id": "cmd-42"',
        b'"command_id": "cmd-1", "command_id": "cmd-42"',
        "command_id",
    ),
    ("command", b'"issuer": "kcat"', b'"issuer": "first", "issuer": "kcat"', "issuer"),
    ("command", b'"issuer": "kcat"', b'"issuer": "kcat", "issuer" : "kcat"', "issuer"),
    ("command", b'"issuer": "kcat"', b'"issuer": "kcat", "issu\\u0065r": "x"', "issuer"),
    ("command", b'"path": "/ckpt/v42"', b'"path": "/etc", "path": "/ckpt/v42"', "path"),
    ("command", b'"version": "v42"', b'"version": "v42",\n"version": "v43"', "version"),
    ("command", b'"spec": {', b'"spec": {"kind": "restart"}, "spec": {', "spec"),
    ("command", b'"issuer"', b'"selector": {"labels": {"a": "1", "a": "2"}}, "issuer"', "a"),
    ("command_config", b'"x": 1', b'"x": [{"deep": {"k": 1, "k": 1}}]', "k"),
    ("ack", b'"state": "succeeded"', b'"state": "failed", "state": "succeeded"', "state"),
    (
        "ack",
        b'"received_at"',
        b'"received_at": "2025-06-01T12:00:00Z", "received_at"',
        "received_at",
    ),
    ("ack", b'"result": {}', b'"result": {"n": 1, "n": 1}', "n"),
    ("heartbeat", b'"status": "ready"', b'"status": "ready", "status": "stopped"', "status"),
    ("heartbeat", b'"labels": {', b'"labels": {"zone": "a", "zone": "b"', "zone"),
]


def duplicated_base(kind: str) -> dict[str, Any]:
    if kind == "command":
        return command_dict()
    if kind == "command_config":
        return command_dict(spec={"kind": "update_config", "overrides": {"x": 1}})
    base: dict[str, Any] = json.loads(encode(MINIMAL[kind]))
    if kind == "heartbeat":
        base["labels"] = {}
    return base


@pytest.mark.parametrize(
    ("kind", "find", "write", "key"), DUPLICATED, ids=[f"{k}-{key}" for k, _, _, key in DUPLICATED]
)
def test_duplicate_keys_are_refused_anywhere(
    kind: str, find: bytes, write: bytes, key: str
) -> None:
    """Parsers disagree on a repeated key (first, last, refuse): whatever the level, the value
    or its spelling, a message that two readers could read differently is refused."""
    data = pretty(duplicated_base(kind))
    assert find in data
    err = refusal(data.replace(find, write.replace(b"\\n", b"\n"), 1), DECODERS[kind.split("_")[0]])
    assert err.code is WireCode.DUPLICATE_KEY
    assert f'duplicate key "{key}"' in err.message
    assert_nackable(err)


def test_a_duplicate_key_keeps_the_ids_that_are_unambiguous() -> None:
    data = pretty(command_dict())
    twice_same = data.replace(b'"issuer"', b'"command_id": "cmd-42", "issuer"')
    twice_other = data.replace(b'"issuer"', b'"command_id": "cmd-43", "issuer"')
    elsewhere = data.replace(b'"issuer": "kcat"', b'"issuer": "kcat", "issuer": "kcat"')
    assert (refusal(twice_same).command_id, refusal(twice_same).rollout_id) == (
        "cmd-42",
        "rollout-42",
    )
    assert (refusal(twice_other).command_id, refusal(twice_other).rollout_id) == (
        None,
        "rollout-42",
    )
    assert (refusal(elsewhere).command_id, refusal(elsewhere).rollout_id) == (
        "cmd-42",
        "rollout-42",
    )


def test_the_same_key_in_different_objects_is_no_duplicate() -> None:
    data = dumps(
        command_dict(
            spec={"kind": "update_config", "overrides": {"kind": 1, "spec": {"kind": 2}}},
            selector={"labels": {"issuer": "x"}},
        )
    )
    assert decode_command(data).spec == UpdateConfigSpec(overrides={"kind": 1, "spec": {"kind": 2}})


def test_a_duplicate_key_is_refused_before_the_schema_version() -> None:
    data = pretty(command_dict(schema_version=2)).replace(b'"issuer"', b'"issuer": "x", "issuer"')
    assert refusal(data).code is WireCode.DUPLICATE_KEY


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


PROTOCOL_CODES = [
    WireCode.MALFORMED_JSON,
    WireCode.SCHEMA_INVALID,
    WireCode.UNSUPPORTED_SCHEMA_VERSION,
    WireCode.MESSAGE_TOO_LARGE,
    WireCode.DUPLICATE_KEY,
]


@pytest.mark.parametrize("code", PROTOCOL_CODES)
def test_protocol_codes_are_rejections_and_not_retryable(code: WireCode) -> None:
    err = ProtocolError("x", code=code)
    assert err.is_rejection
    assert not err.retryable
