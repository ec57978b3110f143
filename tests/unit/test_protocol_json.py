"""The wire protocol read from plain JSON: what any Kafka client writes, and duplicate keys.

Pure unit tests: no Kafka, no I/O. Builders in tests/unit/conftest.py.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import (
    AckError,
    AckState,
    CommandKind,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    WorkerStatus,
    decode_ack,
    decode_command,
    decode_heartbeat,
    encode,
)
from tests.unit.conftest import (
    DECODERS,
    MINIMAL,
    SHA,
    T0,
    assert_nackable,
    command_dict,
    dumps,
    pretty,
    refusal,
)

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
