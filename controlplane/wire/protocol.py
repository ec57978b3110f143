"""The wire protocol: commands, acks and heartbeats as frozen pydantic models, and their codec.

Anything that produces valid JSON against the exported schemas (our CLI, kcat, a Java
producer) is a first-class client. No I/O, no torch; decoding untrusted bytes returns one of
our models or raises :class:`~controlplane.wire.errors.ProtocolError` with a code, never anything else.

One import for both halves: the models live in :mod:`controlplane.wire.messages`, the codec in
:mod:`controlplane.wire.codec`, the schema export in :mod:`controlplane.wire.schema_export`.
"""

from __future__ import annotations

from controlplane.wire.codec import (
    MAX_JSON_DEPTH,
    decode_ack,
    decode_command,
    decode_heartbeat,
    encode,
)
from controlplane.wire.messages import (
    EARLIEST_TIME,
    LATEST_TIME,
    MAX_COUNTER,
    MAX_HEARTBEAT_INTERVAL_S,
    MAX_LEASE_S,
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    CommandSpec,
    Degraded,
    Heartbeat,
    Identifier,
    InFlight,
    LabelKey,
    Labels,
    LabelValue,
    ReloadWeightsSpec,
    SchemaVersion,
    Selector,
    Sha256Hex,
    Signature,
    Timestamp,
    Timings,
    UpdateConfigSpec,
    WireModel,
    WorkerStatus,
    utcnow,
)
from controlplane.wire.schema_export import json_schemas

__all__ = [
    "EARLIEST_TIME",
    "LATEST_TIME",
    "MAX_COUNTER",
    "MAX_HEARTBEAT_INTERVAL_S",
    "MAX_JSON_DEPTH",
    "MAX_LEASE_S",
    "MAX_MESSAGE_BYTES",
    "SCHEMA_VERSION",
    "Ack",
    "AckError",
    "AckState",
    "Command",
    "CommandKind",
    "CommandSpec",
    "Degraded",
    "Heartbeat",
    "Identifier",
    "InFlight",
    "LabelKey",
    "LabelValue",
    "Labels",
    "ReloadWeightsSpec",
    "SchemaVersion",
    "Selector",
    "Sha256Hex",
    "Signature",
    "Timestamp",
    "Timings",
    "UpdateConfigSpec",
    "WireModel",
    "WorkerStatus",
    "decode_ack",
    "decode_command",
    "decode_heartbeat",
    "encode",
    "json_schemas",
    "utcnow",
]
