"""The wire protocol: commands, acks and heartbeats as frozen pydantic models, and their codec.

Anything that produces valid JSON against the exported schemas (our CLI, kcat, a Java
producer) is a first-class client. No I/O, no torch; decoding untrusted bytes returns one of
our models or raises :class:`~controlplane.errors.ProtocolError` with a code, never anything else.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    model_validator,
)

from controlplane.errors import ErrorCode, ProtocolError

SCHEMA_VERSION: Final = 1
#: Messages above this size are refused before parsing (Kafka's default max is 1 MiB too).
MAX_MESSAGE_BYTES: Final = 1024 * 1024

Identifier = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)


# --------------------------------------------------------------------------- commands


class CommandKind(StrEnum):
    RELOAD_WEIGHTS = "reload_weights"
    UPDATE_CONFIG = "update_config"


class Selector(_Wire):
    """Which workers a command is for. Every given field must match; an empty selector matches all."""

    worker_ids: list[Identifier] | None = Field(
        default=None, description="Exact worker ids; omitted means any worker id."
    )
    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Every label must be present with this exact value."
    )

    def matches(self, worker_id: str, labels: dict[str, str]) -> bool:
        if self.worker_ids is not None and worker_id not in self.worker_ids:
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())


class ReloadWeightsSpec(_Wire):
    """Reload every weight in place from a safetensors checkpoint, as version ``version``."""

    kind: Literal[CommandKind.RELOAD_WEIGHTS] = CommandKind.RELOAD_WEIGHTS
    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)] = Field(
        description=(
            "A .safetensors file, a directory of them, or a sharded index json "
            "(model.safetensors.index.json). Resolved on the worker; must lie in an allowed root."
        )
    )
    version: Identifier = Field(description="The weights version the worker reports once applied.")
    sha256: dict[Annotated[str, StringConstraints(min_length=1, max_length=1024)], Sha256Hex] = (
        Field(
            default_factory=dict,
            description="Optional manifest: file name (relative to the checkpoint) -> sha256 hex.",
        )
    )
    strict: bool = Field(
        default=True,
        description="Strict: the checkpoint must hold exactly the model's tensors. "
        "Non-strict: a subset is allowed (names not in the model are still refused).",
    )


class UpdateConfigSpec(_Wire):
    """Apply runtime config overrides, all or nothing, checked against what the runner accepts."""

    kind: Literal[CommandKind.UPDATE_CONFIG] = CommandKind.UPDATE_CONFIG
    overrides: dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], JsonValue] = (
        Field(min_length=1, description="Config keys to JSON values.")
    )


CommandSpec = Annotated[ReloadWeightsSpec | UpdateConfigSpec, Field(discriminator="kind")]


class Signature(_Wire):
    """Detached signature over the command's canonical JSON without this field."""

    alg: Literal["ed25519"] = "ed25519"
    key_id: Identifier
    value: Annotated[str, StringConstraints(min_length=1, max_length=512)]


class Command(_Wire):
    """One instruction on the commands topic. Workers matching ``selector`` apply it once."""

    schema_version: Literal[1] = SCHEMA_VERSION
    command_id: Identifier
    rollout_id: Identifier
    issued_at: AwareDatetime
    expires_at: AwareDatetime
    issuer: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    selector: Selector = Field(default_factory=Selector)
    spec: CommandSpec
    timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = Field(
        default=None, description="How long a worker may spend applying it; worker default if omitted."
    )
    signature: Signature | None = None

    @model_validator(mode="after")
    def _expiry_after_issue(self) -> Command:
        if self.expires_at <= self.issued_at:
            raise ValueError("expires_at must be after issued_at")
        return self

    @property
    def kind(self) -> CommandKind:
        return CommandKind(self.spec.kind)

    def is_expired(self, now: datetime) -> bool:
        return now >= self.expires_at


# --------------------------------------------------------------------------- acks


class AckState(StrEnum):
    ACCEPTED = "accepted"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({AckState.SUCCEEDED, AckState.FAILED, AckState.REJECTED})


class AckError(_Wire):
    code: Annotated[str, StringConstraints(min_length=1, max_length=64)] = Field(
        description="An ErrorCode value."
    )
    message: Annotated[str, StringConstraints(max_length=4096)]
    retryable: bool = False


class Timings(_Wire):
    received_at: AwareDatetime
    started_at: AwareDatetime | None = None
    finished_at: AwareDatetime | None = None

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class Ack(_Wire):
    """A worker's report on one command: one per state change, exactly one terminal state.

    Like an xDS ACK/NACK, ``weights_version`` is the version in force *after* the command:
    a failure or rejection never advances it.
    """

    schema_version: Literal[1] = SCHEMA_VERSION
    command_id: Identifier
    rollout_id: Identifier
    worker_id: Identifier
    kind: CommandKind | None = Field(default=None, description="None when the command was unreadable.")
    state: AckState
    weights_version: str | None = None
    config_digest: str | None = None
    error: AckError | None = None
    timings: Timings
    attempt: Annotated[int, Field(ge=1)] = 1
    sent_at: AwareDatetime
    result: dict[str, JsonValue] = Field(
        default_factory=dict, description="Kind-specific facts: bytes, tensors, seconds."
    )

    @model_validator(mode="after")
    def _error_iff_unsuccessful(self) -> Ack:
        if self.state in (AckState.FAILED, AckState.REJECTED) and self.error is None:
            raise ValueError(f"a {self.state.value} ack must carry an error")
        if self.state is AckState.SUCCEEDED and self.error is not None:
            raise ValueError("a succeeded ack must not carry an error")
        return self


# --------------------------------------------------------------------------- heartbeats


class WorkerStatus(StrEnum):
    STARTING = "starting"
    READY = "ready"
    BUSY = "busy"
    DEGRADED = "degraded"
    STOPPING = "stopping"
    STOPPED = "stopped"


class InFlight(_Wire):
    command_id: Identifier
    rollout_id: Identifier
    kind: CommandKind
    since: AwareDatetime


class Degraded(_Wire):
    """A reload that failed after copying began: the model holds a mix of two versions."""

    code: str
    message: str
    from_version: str | None
    to_version: str
    since: AwareDatetime


class Heartbeat(_Wire):
    """A worker's self-description, keyed by worker id on the compacted workers topic."""

    schema_version: Literal[1] = SCHEMA_VERSION
    worker_id: Identifier
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict)
    runner: str
    device: str
    status: WorkerStatus
    weights_version: str | None = None
    config_digest: str | None = None
    in_flight: InFlight | None = None
    degraded: Degraded | None = None
    seq: Annotated[int, Field(ge=0)]
    sent_at: AwareDatetime
    started_at: AwareDatetime
    interval_s: Annotated[float, Field(gt=0)] = Field(
        description="Heartbeat period; a worker silent for 3 periods is considered lost."
    )
    agent_version: str = ""


# --------------------------------------------------------------------------- codec

M = TypeVar("M", bound=_Wire)


def encode(message: _Wire) -> bytes:
    """Compact UTF-8 JSON, as it goes on the wire."""
    return message.model_dump_json(exclude_none=False).encode("utf-8")


def _decode(model: type[M], data: bytes, max_bytes: int) -> M:
    if len(data) > max_bytes:
        raise ProtocolError(
            f"{model.__name__} of {len(data)} bytes exceeds the {max_bytes}-byte limit",
            code=ErrorCode.MESSAGE_TOO_LARGE,
            command_id=_sniff_id(data[:4096]),
        )
    try:
        raw: Any = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ProtocolError(
            f"not valid UTF-8 JSON: {exc}", code=ErrorCode.MALFORMED_JSON
        ) from None
    if not isinstance(raw, dict):
        raise ProtocolError(
            f"expected a JSON object, got {type(raw).__name__}", code=ErrorCode.SCHEMA_INVALID
        )
    command_id = raw.get("command_id") if isinstance(raw.get("command_id"), str) else None
    version = raw.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION:
        err = ProtocolError(
            f"unsupported schema_version {version!r}; this build speaks {SCHEMA_VERSION}",
            code=ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            command_id=command_id,
        )
        err.rollout_id = _str_or_none(raw.get("rollout_id"))
        raise err
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        err = ProtocolError(
            f"invalid {model.__name__}: {_summarize(exc)}",
            code=ErrorCode.SCHEMA_INVALID,
            command_id=command_id,
        )
        err.rollout_id = _str_or_none(raw.get("rollout_id"))
        raise err from None
    except RecursionError:
        raise ProtocolError("message nested too deeply", code=ErrorCode.SCHEMA_INVALID) from None


def decode_command(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Command:
    return _decode(Command, data, max_bytes)


def decode_ack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Ack:
    return _decode(Ack, data, max_bytes)


def decode_heartbeat(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Heartbeat:
    return _decode(Heartbeat, data, max_bytes)


def _str_or_none(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= 128 else None


def _sniff_id(head: bytes) -> str | None:
    match = re.search(rb'"command_id"\s*:\s*"([A-Za-z0-9][A-Za-z0-9._:@/-]{0,127})"', head)
    return match.group(1).decode("ascii") if match else None


def _summarize(exc: ValidationError, limit: int = 5) -> str:
    parts = []
    for error in exc.errors(include_url=False)[:limit]:
        loc = ".".join(str(p) for p in error["loc"]) or "<root>"
        parts.append(f"{loc}: {error['msg']}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"... and {more} more")
    return "; ".join(parts)


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of the three wire messages, as exported to ``controlplane/schemas``."""
    out: dict[str, dict[str, Any]] = {}
    for name, model in (("command", Command), ("ack", Ack), ("heartbeat", Heartbeat)):
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://fleet-controlplane.dev/schemas/v{SCHEMA_VERSION}/{name}.json"
        out[name] = schema
    return out
