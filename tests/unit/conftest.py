"""Shared builders for the wire protocol tests (test_protocol*, test_schemas, test_protocol_fuzz).

One message of every kind (``VALID``, ``MINIMAL``), a command as a plain Kafka client writes it,
and the checks every refusal must pass (``assert_nackable``). Pure: no Kafka, no I/O.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from controlplane.wire.errors import ErrorCode, ProtocolError
from controlplane.wire.protocol import (
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
        values["error"] = AckError(code=ErrorCode.WEIGHTS_MISSING, message="no tensor 'w'")
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
                    code=ErrorCode.SCHEMA_INVALID, message="spec: missing", retryable=False
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
                    code=ErrorCode.WEIGHTS_CORRUPTED,
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


def pretty(value: Any) -> bytes:
    """JSON with a space after each colon, so that the replacements below find their key."""
    return json.dumps(value).encode()


PROTOCOL_CODES = [
    ErrorCode.MALFORMED_JSON,
    ErrorCode.SCHEMA_INVALID,
    ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
    ErrorCode.MESSAGE_TOO_LARGE,
    ErrorCode.DUPLICATE_KEY,
]
