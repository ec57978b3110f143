"""Shared builders for the wire protocol tests (test_protocol*, test_schemas, test_protocol_fuzz)
and the fast ack decoder's differential tests (test_ack_codec*: comparing both decoders).

One message of every kind (``VALID``, ``MINIMAL``), a command as a plain Kafka client writes it,
and the checks every refusal must pass (``assert_nackable``). Pure: no Kafka, no I/O.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta, timezone
from typing import Any
from unittest import mock

import msgspec
import pytest

from controlplane.wire import ack_codec
from controlplane.wire.ack_codec import AckLike, FastAck, decode_ack_fast
from controlplane.wire.errors import LocalCode, ProtocolError, WireCode
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


def pretty(value: Any) -> bytes:
    """JSON with a space after each colon, so that the replacements below find their key."""
    return json.dumps(value).encode()


PROTOCOL_CODES = [
    WireCode.MALFORMED_JSON,
    WireCode.SCHEMA_INVALID,
    WireCode.UNSUPPORTED_SCHEMA_VERSION,
    WireCode.MESSAGE_TOO_LARGE,
    WireCode.DUPLICATE_KEY,
]


# --------------------------------------------------------------------------- the fast ack decoder
# (test_ack_codec*.py: the compiled decoder against the canonical one)


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


Outcome = FastAck | Ack | tuple[WireCode | LocalCode, str, str | None, str | None]


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
    assert isinstance(want, Ack), want
    assert_same(got, want)
    return got


@pytest.fixture
def no_fallback() -> Iterator[mock.MagicMock]:
    """Fails the test if the fast decoder hands the message to the canonical one."""
    with mock.patch.object(ack_codec, "decode_ack", side_effect=AssertionError("fell back")) as m:
        yield m


def counting_fallback() -> Any:
    return mock.patch.object(ack_codec, "decode_ack", wraps=decode_ack)


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


def compact_json(value: Any) -> bytes:
    """Compact JSON, as the ack tests write their records."""
    return json.dumps(value, separators=(",", ":")).encode()


def stamped(field: str, stamp: str) -> bytes:
    """A valid ack with ``stamp`` as its ``sent_at`` or as one of its timings."""
    value = wire()
    if field == "sent_at":
        value["sent_at"] = stamp
    else:
        value["timings"][field] = stamp
    return compact_json(value)


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
