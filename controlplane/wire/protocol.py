"""The wire protocol: commands, acks and heartbeats as frozen pydantic models, and their codec.

Anything that produces valid JSON against the exported schemas (our CLI, kcat, a Java
producer) is a first-class client. No I/O, no torch; decoding untrusted bytes returns one of
our models or raises :class:`~controlplane.wire.errors.ProtocolError` with a code, never anything else.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    ValidationError,
    model_validator,
)
from pydantic_core import from_json

from controlplane.wire.errors import ErrorCode, ProtocolError
from controlplane.wire.validation import Location, clip_text, dotted, summarize

SCHEMA_VERSION: Final = 1
#: Messages above this size are refused before parsing (Kafka's default max is 1 MiB too).
MAX_MESSAGE_BYTES: Final = 1024 * 1024

_IDENTIFIER: Final = r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}"
_IDENTIFIER_RE: Final = re.compile(_IDENTIFIER)
#: RFC 3339 date-time with an offset, as JSON Schema's "date-time" format means it (no unix
#: timestamps, no space separator, no naive times). Group 1: the fraction's digits.
_RFC3339_RE: Final = re.compile(
    r"[0-9]{4}-[0-9]{2}-[0-9]{2}[Tt][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.([0-9]+))?(?:[Zz]|[+-][0-9]{2}:[0-9]{2})"
)
_MICROSECOND: Final = timedelta(microseconds=1)
#: Every date-time on the wire lies in [EARLIEST_TIME, LATEST_TIME): far enough from datetime's
#: limits (years 1 and 9999) that adding any duration the control plane uses cannot overflow.
EARLIEST_TIME: Final = datetime(1970, 1, 1, tzinfo=UTC)
LATEST_TIME: Final = datetime(9000, 1, 1, tzinfo=UTC)
#: Upper bound of counters on the wire (seq, attempt, incarnation): exact in a double, so any
#: JSON client reads them back unchanged.
MAX_COUNTER: Final = 2**53
#: Upper bound of a heartbeat period, in seconds.
MAX_HEARTBEAT_INTERVAL_S: Final = 3600
#: The longest lease a heartbeat may ask for (three of the longest periods).
MAX_LEASE_S: Final = 3 * MAX_HEARTBEAT_INTERVAL_S


def _rfc3339_only(value: object) -> object:
    """Parse a wire date-time ourselves: strict JSON validation takes no str after a validator.

    Digits past the microsecond round to the nearest microsecond, half up on the 7th digit:
    exactly what msgspec does, so that the coordinator's compiled ack decoder
    (:mod:`controlplane.wire.ack_codec`) and this one give equal values.
    """
    if not isinstance(value, str):
        return value
    match = _RFC3339_RE.fullmatch(value)
    if match is None:
        raise ValueError("expected an RFC 3339 date-time with an offset, like 2025-01-01T12:00:00Z")
    parsed = datetime.fromisoformat(value.upper())  # keeps the first 6 fraction digits
    fraction = match.group(1)
    if fraction is not None and len(fraction) > 6 and fraction[6] >= "5":
        try:
            parsed += _MICROSECOND
        except OverflowError:
            raise ValueError(_OUT_OF_RANGE) from None
    return parsed


_OUT_OF_RANGE: Final = (
    f"date-time out of range: must lie between {EARLIEST_TIME:%Y-%m-%dT%H:%M:%SZ} "
    f"and {LATEST_TIME:%Y-%m-%dT%H:%M:%SZ}"
)


def _in_time_range(value: datetime) -> datetime:
    if not EARLIEST_TIME <= value < LATEST_TIME:
        raise ValueError(_OUT_OF_RANGE)
    return value


def _exact_int(value: object) -> object:
    """pydantic matches Literal[1] by equality, so true and 1.0 would pass even in strict mode."""
    if isinstance(value, bool | float):
        raise ValueError("expected the integer 1")
    return value


def _finite_json(value: dict[str, Any]) -> dict[str, Any]:
    """JSON-mode JsonValue ignores allow_inf_nan: NaN, Infinity or 1e400 would encode as null."""
    stack: list[object] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN and Infinity are not JSON numbers")
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


Identifier = Annotated[str, StringConstraints(pattern=rf"^{_IDENTIFIER}$")]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
#: pydantic renders constrained keys as patternProperties, which alone let other keys through.
Labels = Annotated[
    dict[LabelKey, LabelValue], Field(json_schema_extra={"additionalProperties": False})
]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Timestamp = Annotated[
    AwareDatetime,
    BeforeValidator(_rfc3339_only),
    AfterValidator(_in_time_range),
    Field(
        description="RFC 3339 date-time with an offset, from 1970-01-01T00:00:00Z "
        "up to (excluding) 9000-01-01T00:00:00Z."
    ),
]
SchemaVersion = Annotated[Literal[1], BeforeValidator(_exact_int)]


def utcnow() -> datetime:
    return datetime.now(UTC)


class _Wire(BaseModel):
    model_config = ConfigDict(
        frozen=True, extra="forbid", use_enum_values=False, allow_inf_nan=False
    )


def _required_on_wire(*names: str) -> Callable[[dict[str, Any]], None]:
    """Fields with a Python default that every producer must still write (the decoder needs them)."""

    def extra(schema: dict[str, Any]) -> None:
        required: list[str] = schema.setdefault("required", [])
        for name in names:
            schema["properties"][name].pop("default", None)
            if name not in required:
                required.insert(0, name)

    return extra


# --------------------------------------------------------------------------- commands


class CommandKind(StrEnum):
    RELOAD_WEIGHTS = "reload_weights"
    UPDATE_CONFIG = "update_config"


class Selector(_Wire):
    """Which workers a command is for. Every given field must match; an empty selector matches all."""

    worker_ids: list[Identifier] | None = Field(
        default=None, description="Exact worker ids; omitted means any worker id."
    )
    labels: Labels = Field(
        default_factory=dict, description="Every label must be present with this exact value."
    )

    def matches(self, worker_id: str, labels: dict[str, str]) -> bool:
        if self.worker_ids is not None and worker_id not in self.worker_ids:
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())


class ReloadWeightsSpec(_Wire):
    """Reload every weight in place from a safetensors checkpoint, as version ``version``."""

    model_config = ConfigDict(json_schema_extra=_required_on_wire("kind"))

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

    model_config = ConfigDict(json_schema_extra=_required_on_wire("kind"))

    kind: Literal[CommandKind.UPDATE_CONFIG] = CommandKind.UPDATE_CONFIG
    overrides: Annotated[
        dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], JsonValue],
        AfterValidator(_finite_json),
    ] = Field(min_length=1, description="Config keys to JSON values.")


CommandSpec = Annotated[ReloadWeightsSpec | UpdateConfigSpec, Field(discriminator="kind")]


class Signature(_Wire):
    """Detached signature over the command's canonical JSON without this field."""

    alg: Literal["ed25519"] = "ed25519"
    key_id: Identifier
    value: Annotated[str, StringConstraints(min_length=1, max_length=512)]


class Command(_Wire):
    """One instruction on the commands topic. Workers matching ``selector`` apply it once."""

    model_config = ConfigDict(json_schema_extra=_required_on_wire("schema_version"))

    schema_version: SchemaVersion = SCHEMA_VERSION
    command_id: Identifier
    rollout_id: Identifier
    issued_at: Timestamp
    expires_at: Timestamp
    issuer: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    selector: Selector = Field(default_factory=Selector)
    spec: CommandSpec
    timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = Field(
        default=None,
        description="How long a worker may spend applying it; worker default if omitted.",
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
    received_at: Timestamp
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None

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

    model_config = ConfigDict(json_schema_extra=_required_on_wire("schema_version"))

    schema_version: SchemaVersion = SCHEMA_VERSION
    command_id: Identifier
    rollout_id: Identifier
    worker_id: Identifier
    kind: CommandKind | None = Field(
        default=None, description="None when the command was unreadable."
    )
    state: AckState
    weights_version: str | None = None
    config_digest: str | None = None
    error: AckError | None = None
    timings: Timings
    attempt: Annotated[int, Field(ge=1, le=MAX_COUNTER)] = 1
    sent_at: Timestamp
    result: Annotated[dict[str, JsonValue], AfterValidator(_finite_json)] = Field(
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
    since: Timestamp


class Degraded(_Wire):
    """Why a worker cannot serve as it should: a reload that failed after copying began (the
    model holds a mix of ``from_version`` and ``to_version``), a runner that failed to load, a
    journal that cannot be written. ``code`` is an ErrorCode value."""

    code: str
    message: str
    from_version: str | None = None
    to_version: str | None = None
    since: Timestamp


class Heartbeat(_Wire):
    """A worker's self-description, keyed by worker id on the compacted workers topic."""

    model_config = ConfigDict(json_schema_extra=_required_on_wire("schema_version"))

    schema_version: SchemaVersion = SCHEMA_VERSION
    worker_id: Identifier
    labels: Labels = Field(default_factory=dict)
    runner: str
    device: str
    status: WorkerStatus
    weights_version: str | None = None
    config_digest: str | None = None
    in_flight: InFlight | None = None
    degraded: Degraded | None = None
    seq: Annotated[int, Field(ge=0, le=MAX_COUNTER)]
    sent_at: Timestamp
    started_at: Timestamp
    incarnation: Annotated[int, Field(ge=0, le=MAX_COUNTER)] = Field(
        default=0,
        description="A counter the worker persists and increments at every start: it orders "
        "incarnations whatever the worker's clock says (0: not reported).",
    )
    interval_s: Annotated[float, Field(gt=0, le=MAX_HEARTBEAT_INTERVAL_S)] = Field(
        description="Heartbeat period (at most an hour); a worker silent for 3 periods is "
        "considered lost."
    )
    lease_s: Annotated[float, Field(gt=0, le=MAX_LEASE_S)] | None = Field(
        default=None,
        description="How long this heartbeat vouches for the worker: readers consider it lost "
        "when no newer heartbeat was appended within this many seconds (None: 3 periods). "
        "At least one period.",
    )
    acks_unpublished: Annotated[int, Field(ge=0, le=MAX_COUNTER)] = Field(
        default=0,
        description="Acks the worker has journaled that Kafka has not confirmed yet.",
    )
    publish_failing_since: Timestamp | None = Field(
        default=None,
        description="Since when the worker's publishes to Kafka go unconfirmed (None: they go "
        "through). A heartbeat carrying it was itself published late.",
    )
    agent_version: str = ""

    @model_validator(mode="after")
    def _lease_covers_a_period(self) -> Heartbeat:
        if self.lease_s is not None and self.lease_s < self.interval_s:
            raise ValueError(
                f"lease_s {self.lease_s:g} is shorter than the heartbeat period {self.interval_s:g}"
            )
        return self


# --------------------------------------------------------------------------- codec

M = TypeVar("M", bound=_Wire)

_UTF8_BOM: Final = b"\xef\xbb\xbf"
#: A ProtocolError's message fits in an ack's error message (AckError allows 4096 characters).
_MAX_ERROR_CHARS: Final = 1024
#: How much of a message too large to decode is read for its ids.
_SNIFF_BYTES: Final = 4096
#: Containers nest at most this deep in a message (the limit of pydantic's JSON parser).
MAX_JSON_DEPTH: Final = 201
_JSON_ERROR_AT: Final = re.compile(r"(.*) at line ([0-9]+) column ([0-9]+)", re.DOTALL)
_NON_FINITE: Final = re.compile(rb"-?(?:NaN|Infinity)")
#: Raw control characters (JSON whitespace aside) become U+FFFD when reading ids from a broken
#: message: a string holding one still parses, and is no identifier.
_CONTROLS_TO_REPLACEMENT: Final = {c: "\ufffd" for c in range(0x20) if chr(c) not in "\t\n\r"}


def encode(message: _Wire) -> bytes:
    """Compact UTF-8 JSON, as it goes on the wire."""
    return message.model_dump_json(exclude_none=False).encode("utf-8")


def _decode(model: type[M], data: bytes, max_bytes: int) -> M:
    if len(data) > max_bytes:
        command_id, rollout_id = _readable_ids(data[:_SNIFF_BYTES])
        raise _error(
            f"{model.__name__} of {len(data)} bytes exceeds the {max_bytes}-byte limit",
            ErrorCode.MESSAGE_TOO_LARGE,
            command_id,
            rollout_id,
        )
    offset = 0
    if data[:3] == _UTF8_BOM:  # RFC 8259 section 8.1: a parser may ignore it.
        data, offset = data[3:], 3
    # Strict JSON-mode validation accepts exactly what the exported schemas describe: no "true"
    # for a bool, no "30" for a number, no unix time for a date-time. One parse on the happy path,
    # then a scan for duplicate keys (pydantic's parser keeps the last value of a duplicate key).
    invalid: ValidationError | None = None
    try:
        message = model.model_validate_json(data, strict=True)
    except ValidationError as exc:
        invalid = exc
    except RecursionError:
        raise _error(
            "message nested too deeply", ErrorCode.SCHEMA_INVALID, *_readable_ids(data)
        ) from None
    else:
        # schema_version has a Python default for our own producers, but the wire requires it.
        if "schema_version" in message.model_fields_set:
            duplicate = _duplicate_key_refusal(model, data)
            if duplicate is not None:
                raise duplicate
            return message
    raise _refusal(model, data, invalid, offset)


def _refusal(
    model: type[_Wire], data: bytes, invalid: ValidationError | None, offset: int
) -> ProtocolError:
    """Why ``data`` was refused, with the ids a worker needs to NACK it where they are readable."""
    try:
        raw: Any = from_json(data, allow_inf_nan=False)
    except ValueError as exc:
        return _malformed(data, str(exc), offset)
    if invalid is not None:
        first = invalid.errors(include_url=False)[0]
        if first["type"] == "json_invalid":  # pragma: no cover - both are pydantic's parser
            return _malformed(data, first["msg"].removeprefix("Invalid JSON: "), offset)
    if not isinstance(raw, dict):
        return ProtocolError(
            f"expected a JSON object, got {type(raw).__name__}", code=ErrorCode.SCHEMA_INVALID
        )
    duplicate = _duplicate_key_refusal(model, data)
    if duplicate is not None:
        return duplicate
    version = raw.get("schema_version")
    if type(version) is not int or version != SCHEMA_VERSION or invalid is None:
        code = ErrorCode.UNSUPPORTED_SCHEMA_VERSION
        shown = _clip(repr(version), 64)
        text = f"unsupported schema_version {shown}; this build speaks {SCHEMA_VERSION}"
    else:
        code = ErrorCode.SCHEMA_INVALID
        text = f"invalid {model.__name__}: {_summarize(invalid)}"
    return _error(
        text,
        code,
        _identifier_or_none(raw.get("command_id")),
        _identifier_or_none(raw.get("rollout_id")),
    )


def decode_command(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Command:
    return _decode(Command, data, max_bytes)


def decode_ack(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Ack:
    return _decode(Ack, data, max_bytes)


def decode_heartbeat(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Heartbeat:
    return _decode(Heartbeat, data, max_bytes)


def _error(
    text: str, code: ErrorCode, command_id: str | None, rollout_id: str | None
) -> ProtocolError:
    err = ProtocolError(_clip(text), code=code, command_id=command_id)
    err.rollout_id = rollout_id
    return err


# ---------------------------------------------------------------- duplicate keys


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


class _Pairs(list[tuple[str, Any]]):
    """An object's members in order, duplicates kept (what the JSON text says, not a parser)."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    if len(pairs) > 1 and len(dict(pairs)) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return pairs


def _parse_pairs(data: bytes, hook: Callable[[list[tuple[str, Any]]], Any]) -> Any:
    """Parse JSON that pydantic's parser accepted, numbers left as text (no digit limit)."""
    return json.loads(
        data.decode("utf-8"),
        object_pairs_hook=hook,
        parse_int=str,
        parse_float=str,
        parse_constant=str,
    )


def _duplicate_key_refusal(model: type[_Wire], data: bytes) -> ProtocolError | None:
    """DUPLICATE_KEY when an object anywhere in ``data`` (valid JSON) repeats a key.

    Parsers disagree on which value a repeated key means (pydantic, msgspec and Python keep the
    last, others the first or refuse): a message that two readers could read differently is
    refused. Its ids are kept only where every occurrence of them agrees.
    """
    try:
        _parse_pairs(data, _unique_pairs)
    except _DuplicateKey as dup:
        key = dup.key
    except (ValueError, RecursionError) as exc:  # pragma: no cover - pydantic's parser accepted
        return _error(f"not valid JSON: {exc}", ErrorCode.MALFORMED_JSON, None, None)
    else:
        return None
    top = _parse_pairs(data, _Pairs)
    ids: dict[str, str | None] = {"command_id": None, "rollout_id": None}
    if isinstance(top, _Pairs):
        for name in ids:
            values = {json.dumps(v) for k, v in top if k == name}
            if len(values) == 1:
                ids[name] = _identifier_or_none(json.loads(values.pop()))
    return _error(
        f"duplicate key {_clip(json.dumps(key, ensure_ascii=False), 80)} in a {model.__name__}: "
        "every key may appear once per object",
        ErrorCode.DUPLICATE_KEY,
        ids["command_id"],
        ids["rollout_id"],
    )


# ---------------------------------------------------------------- malformed JSON


def _malformed(data: bytes, detail: str, offset: int) -> ProtocolError:
    """MALFORMED_JSON saying what is wrong and where (byte offsets count from the message's
    first byte), with the ids where they are readable despite the damage."""
    match = _JSON_ERROR_AT.fullmatch(detail)
    position = None if match is None else _byte_offset(data, int(match[2]), int(match[3]))
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if position is None or exc.start <= position:
            position, text = exc.start, f"invalid UTF-8 at byte {offset + exc.start}"
        else:
            text = _describe(data, match[1] if match else detail, position, offset)
    else:
        text = _describe(data, match[1] if match else detail, position, offset)
    return _error(text, ErrorCode.MALFORMED_JSON, *_readable_ids(data))


def _describe(data: bytes, what: str, position: int | None, offset: int) -> str:
    if position is None:
        return f"invalid JSON: {what}"
    at = f"at byte {offset + position}"
    if what in ("expected value", "invalid number"):
        start = position - 1 if data[position - 1 : position] == b"-" else position
        literal = _NON_FINITE.match(data, start)
        if literal is not None:
            return f"{literal[0].decode()} is not a JSON number ({at})"
    if what.startswith("EOF while parsing"):
        return f"truncated JSON: {what} {at}"
    if what.startswith("recursion limit exceeded"):
        return f"nested more than {MAX_JSON_DEPTH} levels deep ({at})"
    if position < len(data) and data[position] < 0x20:
        where = "in a string " if what.startswith("control character") else ""
        return (
            f"raw control character U+{data[position]:04X} {where}{at} (JSON requires it escaped)"
        )
    return f"invalid JSON: {what} {at}"


def _byte_offset(data: bytes, line: int, column: int) -> int:
    """The offset of pydantic's "line L column C" (1-based, columns in bytes)."""
    start = 0 if line <= 1 else len(data) - len(data.split(b"\n", line - 1)[-1])
    return max(0, min(len(data), start + column - 1))


def _readable_ids(data: bytes) -> tuple[str | None, str | None]:
    """The top-level command_id and rollout_id of a message that did not decode, where they are
    plainly readable: whole strings that are identifiers, in the part of the message before the
    damage (bytes that are not UTF-8 and raw control characters count as damage inside a string
    only), each the same as the first such member written in the bytes.

    Never a guess: a cut-off value, a value with a broken byte, or an id written twice with two
    values gives None.
    """
    repaired = data.decode("utf-8", "replace").translate(_CONTROLS_TO_REPLACEMENT).encode()
    try:
        raw: Any = from_json(repaired, allow_inf_nan=True, allow_partial=True)
    except ValueError as exc:
        match = _JSON_ERROR_AT.fullmatch(str(exc))
        if match is None:
            return None, None
        prefix = repaired[: _byte_offset(repaired, int(match[2]), int(match[3]))]
        try:
            raw = from_json(prefix, allow_inf_nan=True, allow_partial=True)
        except ValueError:
            return None, None
    if not isinstance(raw, dict):
        return None, None
    return _first_id(data, raw, "command_id"), _first_id(data, raw, "rollout_id")


def _first_id(data: bytes, raw: dict[str, Any], name: str) -> str | None:
    value = _identifier_or_none(raw.get(name))
    if value is None:
        return None
    first = re.search(rb'"%s"\s*:\s*"([^"\\]*)"' % name.encode(), data)
    return value if first is not None and first[1] == value.encode() else None


def _identifier_or_none(value: object) -> str | None:
    """Only an id that an ack could carry: anything else would make the NACK itself invalid."""
    return value if isinstance(value, str) and _IDENTIFIER_RE.fullmatch(value) else None


def _clip(text: str, limit: int = _MAX_ERROR_CHARS) -> str:
    return clip_text(text, limit)


def _summarize(exc: ValidationError, limit: int = 5) -> str:
    return summarize(exc, limit=limit, clip=192, name=_short_location)


def _short_location(loc: Location) -> str:
    return dotted(loc, part_clip=64)


def json_schemas() -> dict[str, dict[str, Any]]:
    """The JSON Schemas of the three wire messages, as exported to ``controlplane/wire/schemas``."""
    out: dict[str, dict[str, Any]] = {}
    for name, model in (("command", Command), ("ack", Ack), ("heartbeat", Heartbeat)):
        schema = model.model_json_schema(mode="validation")
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["$id"] = f"https://fleet-controlplane.dev/schemas/v{SCHEMA_VERSION}/{name}.json"
        out[name] = schema
    return out
