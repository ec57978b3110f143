"""The wire messages: commands, acks and heartbeats as frozen pydantic models, and their types.

Anything that produces valid JSON against the exported schemas (our CLI, kcat, a Java
producer) is a first-class client. No I/O, no torch. The codec is :mod:`controlplane.wire.codec`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetPydanticSchema,
    JsonValue,
    PlainSerializer,
    StringConstraints,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import CoreSchema, core_schema

from controlplane.wire import packed
from controlplane.wire.errors import WireCode

SCHEMA_VERSION: Final = 1
#: Messages above this size are refused before parsing (Kafka's default max is 1 MiB too).
MAX_MESSAGE_BYTES: Final = 1024 * 1024

IDENTIFIER: Final = r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}"
IDENTIFIER_RE: Final = re.compile(IDENTIFIER)
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


Identifier = Annotated[str, StringConstraints(pattern=rf"^{IDENTIFIER}$")]
#: A list of worker ids that may be long (a command pinned to a fleet, a rollout's waves): on the
#: wire, more than ``packed.PACK_MIN_IDS`` of them go packed (controlplane/wire/packed.py).
WorkerIds = Annotated[
    list[Identifier],
    BeforeValidator(packed.unpack_wire),
    PlainSerializer(packed.pack_wire, return_type=Any, when_used="json"),
    WithJsonSchema(packed.json_schema({"type": "string", "pattern": rf"^{IDENTIFIER}$"})),
]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(max_length=63)]
#: pydantic renders constrained keys as patternProperties, which alone let other keys through.
Labels = Annotated[
    dict[LabelKey, LabelValue], Field(json_schema_extra={"additionalProperties": False})
]
Sha256Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
#: A weights digest: lowercase hex (16 to 128 digits), optionally after an algorithm name and a
#: colon ("sha256:…").
WEIGHTS_DIGEST_PATTERN: Final = r"^(?:[a-z0-9-]{1,16}:)?[0-9a-f]{16,128}$"
WeightsDigest = Annotated[str, StringConstraints(pattern=WEIGHTS_DIGEST_PATTERN)]
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

_WIRE_CODES: Final = {code.value: code for code in WireCode}


def _wire_code(code: str) -> WireCode | str:
    """A code this protocol defines as its :class:`WireCode`; any other stays a plain str
    (another producer's code: the coordinator shows it and its metrics fold it)."""
    known = _WIRE_CODES.get(code)
    return known if known is not None else str(code)


def _error_code_schema(_source: object, handler: GetCoreSchemaHandler) -> CoreSchema:
    """Validated as the string it is on the wire (same errors, same JSON Schema), then typed."""
    text = Annotated[str, StringConstraints(min_length=1, max_length=64)]
    return core_schema.no_info_after_validator_function(_wire_code, handler.generate_schema(text))


#: An ack's error code: a :class:`WireCode`, or the str of a code it does not define.
ErrorCodeValue = Annotated[WireCode | str, GetPydanticSchema(_error_code_schema)]


def utcnow() -> datetime:
    return datetime.now(UTC)


class WireModel(BaseModel):
    """What every wire message is: frozen, no unknown field, no NaN or Infinity."""

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


class Selector(WireModel):
    """Which workers a command is for. Every given field must match; an empty selector matches all."""

    worker_ids: WorkerIds | None = Field(
        default=None,
        description="Exact worker ids (more than 1000: packed); omitted means any worker id.",
    )
    labels: Labels = Field(
        default_factory=dict, description="Every label must be present with this exact value."
    )

    def matches(self, worker_id: str, labels: dict[str, str]) -> bool:
        if self.worker_ids is not None and worker_id not in self.worker_ids:
            return False
        return all(labels.get(k) == v for k, v in self.labels.items())


#: Bounds of a probe: its prompt's length in characters, and how many tokens it generates.
MAX_PROBE_PROMPT_CHARS: Final = 4096
MAX_PROBE_TOKENS: Final = 64


class ProbeSpec(WireModel):
    """A fixed prompt a worker runs through its model right after applying new weights: greedy
    tokens and their mean log-probability go into the succeeded ack (``result["probe"]``)."""

    prompt: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PROBE_PROMPT_CHARS)] = (
        Field(description="The prompt, as text (the runner tokenizes it).")
    )
    max_tokens: Annotated[int, Field(ge=1, le=MAX_PROBE_TOKENS)] = Field(
        default=8, description="How many tokens to generate, greedily."
    )


def _is_none(value: object) -> bool:
    return value is None


#: Bounds of a reload's drain deadline, in seconds, and its default when the spec gives none.
MAX_DRAIN_TIMEOUT_S: Final = 3600.0
DEFAULT_DRAIN_TIMEOUT_S: Final = 60.0
#: The drain modes, in the order the CLI lists them.
DRAIN_MODES: Final = ("wait", "abort", "keep")
DrainMode = Literal["wait", "abort", "keep"]


class DrainPolicy(WireModel):
    """What a reload does with generation requests in flight on the worker (docs/wire.md,
    "Drain and cache policy"). With wait and abort no request is generated partly with each
    version; with keep on vLLM a paused request continues on the new weights (its tokens span
    both versions), while torch and XLA treat keep as wait."""

    mode: DrainMode = Field(
        default="wait",
        description="wait: admit no new request, let those running finish (up to timeout_s), "
        "reload, then serve again; past the deadline the reload NACKs COMMAND_TIMEOUT with the "
        "weights untouched. abort: fail the requests in flight and reload at once. keep: "
        "requests in flight are paused and carry on after the reload on the new weights (vLLM: "
        "such a response is generated partly with each version); a runner that cannot pause a "
        "request mid-generation (torch, XLA) waits as for wait.",
    )
    timeout_s: Annotated[float, Field(gt=0, le=MAX_DRAIN_TIMEOUT_S)] = Field(
        default=DEFAULT_DRAIN_TIMEOUT_S,
        description="How long wait (and keep where it waits) lets requests in flight run "
        "before the reload gives up with COMMAND_TIMEOUT, weights untouched.",
    )


class ReloadWeightsSpec(WireModel):
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
    # Never written when None: a worker built before probes (whose schema forbids unknown
    # fields) still reads every command that asks for none.
    probe: ProbeSpec | None = Field(
        default=None,
        exclude_if=_is_none,
        description="Run this probe after the weights are applied; its result goes into the "
        "succeeded ack. Omitted: no probe.",
    )
    # Never written when None either (workers built before drain policies read the rest):
    # omitted means DrainPolicy() -- wait, up to DEFAULT_DRAIN_TIMEOUT_S -- and reset on.
    drain: DrainPolicy | None = Field(
        default=None,
        exclude_if=_is_none,
        description="What happens to generation requests in flight during the reload. "
        f"Omitted: wait for them, up to {DEFAULT_DRAIN_TIMEOUT_S:g} s.",
    )
    reset_cache: bool | None = Field(
        default=None,
        exclude_if=_is_none,
        description="Reset the server's prefix (KV) cache after the weights change, so no "
        "cached KV of the old weights is served. Omitted: true.",
    )

    @property
    def drain_policy(self) -> DrainPolicy:
        """The drain policy in force: the one given, or the default (wait, with a deadline)."""
        return self.drain if self.drain is not None else DrainPolicy()

    @property
    def resets_cache(self) -> bool:
        """Whether the prefix cache is reset: as given, true when omitted."""
        return self.reset_cache is not False


class UpdateConfigSpec(WireModel):
    """Apply runtime config overrides, all or nothing, checked against what the runner accepts."""

    model_config = ConfigDict(json_schema_extra=_required_on_wire("kind"))

    kind: Literal[CommandKind.UPDATE_CONFIG] = CommandKind.UPDATE_CONFIG
    overrides: Annotated[
        dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], JsonValue],
        AfterValidator(_finite_json),
    ] = Field(min_length=1, description="Config keys to JSON values.")


CommandSpec = Annotated[ReloadWeightsSpec | UpdateConfigSpec, Field(discriminator="kind")]


class Signature(WireModel):
    """Ed25519 signature over the RFC 8785 (JCS) canonical JSON of the command as written,
    without its ``signature`` member (docs/signing.md; controlplane sign makes one)."""

    alg: Literal["ed25519"] = "ed25519"
    key_id: Identifier = Field(description="The key's id in the workers' trust store.")
    value: Annotated[str, StringConstraints(min_length=1, max_length=512)] = Field(
        description="base64 (RFC 4648, padded) of the 64-byte signature."
    )


class Command(WireModel):
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
    # Never written when None: a worker built before dry runs (whose schema forbids unknown
    # fields) reads every real command, and rejects a dry run (SCHEMA_INVALID) -- never applies it.
    dry_run: bool | None = Field(
        default=None,
        exclude_if=_is_none,
        description="A dry run (preflight): the worker checks everything the command would check "
        "and changes nothing; it acks succeeded with result.dry_run true, or rejected with the "
        "code the command would get. Omitted: a real command.",
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


class AckError(WireModel):
    code: ErrorCodeValue = Field(description="An ErrorCode value.")
    message: Annotated[str, StringConstraints(max_length=4096)]
    retryable: bool = False


class Timings(WireModel):
    received_at: Timestamp
    started_at: Timestamp | None = None
    finished_at: Timestamp | None = None

    @property
    def duration_s(self) -> float | None:
        if self.started_at is None or self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()


class Ack(WireModel):
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


class InFlight(WireModel):
    command_id: Identifier
    rollout_id: Identifier
    kind: CommandKind
    since: Timestamp


class Degraded(WireModel):
    """Why a worker cannot serve as it should: a reload that failed after copying began (the
    model holds a mix of ``from_version`` and ``to_version``), a runner that failed to load, a
    journal that cannot be written. ``code`` is an ErrorCode value."""

    code: str
    message: str
    from_version: str | None = None
    to_version: str | None = None
    since: Timestamp


class Heartbeat(WireModel):
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
    weights_digest: WeightsDigest | None = Field(
        default=None,
        description="A digest of the weights the worker's model holds now (the runner's, as in "
        "a succeeded reload ack's result.weights_digest: workers on one version should agree); "
        "None: not known (degraded, not loaded, or a runner that cannot tell). Readers older "
        "than this field refuse it: upgrade coordinators before workers.",
    )
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
