"""The HTTP API's errors and request/response models; no routes, no I/O.

Errors render as ``{"error": {code, message, retryable, details?}}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from collections.abc import Mapping
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType
from typing import Annotated, Final, TypeVar

from fastapi import Depends
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

from controlplane.coordinator.publisher import MAX_TTL_S, PublishUnconfirmed, RolloutRequest
from controlplane.rollout.desired import RolloutSummary, TargetStatus
from controlplane.rollout.models import RolloutStatus, WorkerDetail, WorkerLevel
from controlplane.rollout.registry import WorkerView
from controlplane.rollout.targets import Rollout, StableEntry
from controlplane.wire.control import (
    ActionKind,
    ControlPhase,
    Desired,
    GateResult,
    LeaderRecord,
    RolloutAction,
    RolloutId,
    RolloutSpec,
    RolloutState,
    Strategy,
    TargetSpec,
)
from controlplane.wire.errors import BusError, ControlPlaneError, LocalCode, WireCode
from controlplane.wire.exits import CONTROL_PHASE_EXITS
from controlplane.wire.messages import Labels
from controlplane.wire.protocol import (
    MAX_MESSAGE_BYTES,
    Command,
    CommandSpec,
    Identifier,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
)

log = logging.getLogger(__name__)

API: Final = "/api/v1"
Body = TypeVar("Body")

#: Items of a page of workers when the request names no ``limit``, and the most it may name.
PAGE_DEFAULT: Final = 500
PAGE_MAX: Final = 1000


# --------------------------------------------------------------------------- errors


class ApiErrorCode(StrEnum):
    """Codes of errors that exist only over HTTP; domain errors keep their WireCode or LocalCode."""

    NOT_FOUND = "NOT_FOUND"
    ROLLOUT_NOT_FOUND = "ROLLOUT_NOT_FOUND"
    WORKER_NOT_FOUND = "WORKER_NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNAUTHORIZED = "UNAUTHORIZED"
    #: A read token (api_read_token) tried to write.
    FORBIDDEN = "FORBIDDEN"
    WRITES_DISABLED = "WRITES_DISABLED"
    NOT_READY = "NOT_READY"
    ROLLOUT_EXISTS = "ROLLOUT_EXISTS"
    HTTP_ERROR = "HTTP_ERROR"


class ErrorInfo(BaseModel):
    code: str = Field(description="An ErrorCode or ApiErrorCode value; stable.")
    message: str
    retryable: bool = False
    details: list[dict[str, JsonValue]] | None = None


class ErrorBody(BaseModel):
    """Every error response: ``{"error": {"code": ..., "message": ...}}``."""

    error: ErrorInfo


class ApiError(Exception):
    """Raised by handlers; rendered as :class:`ErrorBody` with its status and headers."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        headers: dict[str, str] | None = None,
        retryable: bool = False,
        details: list[dict[str, JsonValue]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(code=code, message=message, retryable=retryable, details=details)
        self.headers = headers


def error_response(exc: ApiError) -> JSONResponse:
    body = ErrorBody(error=exc.info).model_dump(mode="json", exclude_none=True)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


#: Domain codes that are an HTTP status of their own; any other code of a refused request is 400.
STATUS_OF: Final[Mapping[WireCode | LocalCode, int]] = MappingProxyType(
    {
        # Nothing of that name in the log.
        LocalCode.TARGET_UNKNOWN: 404,
        LocalCode.ROLLOUT_UNKNOWN: 404,
        # The request is fine, the state of the log refuses it.
        LocalCode.NO_MATCHING_WORKERS: 409,
        LocalCode.ROLLOUT_EXISTS: 409,
        LocalCode.TARGET_BUSY: 409,
        LocalCode.ROLLOUT_ENDED: 409,
        LocalCode.ROLLBACK_UNAVAILABLE: 409,
        LocalCode.PUBLISH_OUTCOME_UNKNOWN: 504,
    }
)


def from_domain(exc: ControlPlaneError) -> ApiError:
    """Our error tree, translated to HTTP in this one place (:data:`STATUS_OF`).

    A publish the cluster did not confirm in time is 504 PUBLISH_OUTCOME_UNKNOWN with the
    rollout and command ids in ``details``: the command may be in the log (never a 503, which
    says "not done, try again"). Kafka unreachable (the command was not published) is 503."""
    if isinstance(exc, PublishUnconfirmed):
        return ApiError(
            504,
            exc.code.value,
            f"rollout {exc.rollout_id} (command {exc.command_id}) may have been published: "
            f"{exc.why}; check GET /api/v1/rollouts/{exc.rollout_id} (or `controlplane status "
            f"{exc.rollout_id}`) before posting it again, with the same rollout_id",
            details=[{"rollout_id": exc.rollout_id, "command_id": exc.command_id}],
        )
    status = STATUS_OF.get(exc.code)
    if status is None:
        status = 503 if isinstance(exc, BusError) else 400
    return ApiError(status, exc.code.value, exc.message, retryable=exc.retryable or status == 503)


def validation_details(
    exc: ValidationError | RequestValidationError,
) -> list[dict[str, JsonValue]]:
    out: list[dict[str, JsonValue]] = []
    for error in exc.errors()[:20]:
        out.append({"loc": [str(p) for p in error["loc"]], "msg": str(error["msg"])})
    return out


# --------------------------------------------------------------------------- models

bearer = HTTPBearer(auto_error=False, description="The coordinator's api_token setting.")
BearerCredentials = Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]


class Health(BaseModel):
    ready: bool = Field(description="Caught up with the log: statuses are complete.")
    records: int = Field(description="Kafka records folded so far.")
    rollouts: int
    workers: int
    as_of: AwareDatetime | None = Field(
        default=None,
        description="The instant statuses are judged at: the clock, or earlier when the "
        "replica knows the log only up to then (cut off from Kafka); null before it caught up.",
    )


class FleetWorkerState(StrEnum):
    """One word for where a worker stands, what the dashboard groups and filters by (problems
    first, in this order: :data:`STATE_RANK`)."""

    #: Not alive: silent past its lease, stopped, or expected and never heard from.
    LOST = "lost"
    #: Degraded: its weights are a mix of two versions (a reload failed half way).
    FAILED = "failed"
    #: Alive and running something other than what is desired for it.
    DRIFTING = "drifting"
    #: Applying a command (in flight, or busy).
    UPDATING = "updating"
    #: Alive, running what is desired (or nothing is desired).
    IN_SYNC = "in_sync"


#: The order workers are grouped in (``order=problems``): lost and failed first.
STATE_RANK: Final[Mapping[FleetWorkerState, int]] = MappingProxyType(
    {state: rank for rank, state in enumerate(FleetWorkerState)}
)


class WorkerOut(WorkerLevel):
    """A worker's level (desired against reported version) and its latest heartbeat, if any.

    ``heartbeat`` is null for a worker that a rollout expects but that was never heard from.
    """

    heartbeat: WorkerView | None
    #: The target whose selector alone matches it: its desired version is the target's.
    target: str | None = None
    state: FleetWorkerState = Field(
        default=FleetWorkerState.IN_SYNC,
        description="lost, failed (degraded), drifting (not what is desired), updating (a "
        "command in flight) or in_sync; `GET /workers?order=problems` lists them in this order.",
    )


class RolloutOut(RolloutStatus):
    """One rollout's status with its per-worker list bounded: ``workers`` holds the first
    ``workers_limit`` expected workers by id; the rest are at ``workers_next``."""

    workers_next: str | None = Field(
        default=None,
        description="The next page of this rollout's workers (GET /rollouts/{id}/workers); "
        "absent when `workers` lists them all.",
    )


class RolloutWorker(WorkerDetail):
    """One worker's part in one rollout; ``unexpected``: it acked without being expected."""

    unexpected: bool = False


# --------------------------------------------------------------------------- pagination


def encode_cursor(*key: str) -> str:
    """An opaque cursor for the page after the item whose sort key is ``key``."""
    raw = json.dumps(list(key), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> tuple[str, ...]:
    """The sort key a cursor of :func:`encode_cursor` holds; 422 INVALID_REQUEST otherwise."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        key = json.loads(raw)
    except (binascii.Error, ValueError):
        key = None
    if not (isinstance(key, list) and len(key) == arity and all(isinstance(k, str) for k in key)):
        raise invalid_cursor()
    return tuple(key)


def cursor_time(when: str) -> datetime:
    """An aware instant a cursor holds; 422 INVALID_REQUEST otherwise."""
    try:
        instant = datetime.fromisoformat(when)
    except ValueError:
        raise invalid_cursor() from None
    if instant.tzinfo is None:
        raise invalid_cursor()
    return instant


def decode_time_cursor(cursor: str) -> tuple[datetime, str]:
    """The (instant, id) key of a cursor of :func:`encode_cursor` over a time and an id."""
    when, name = decode_cursor(cursor, 2)
    return cursor_time(when), name


def invalid_cursor() -> ApiError:
    return ApiError(
        422,
        ApiErrorCode.INVALID_REQUEST,
        "invalid cursor: pass the one a previous page's Link header (rel=next) gave",
        details=[{"loc": ["query", "cursor"], "msg": "not a cursor of this list"}],
    )


def parse_label_selector(selector: str | None) -> dict[str, str]:
    """``key=value,key2=value2`` (every label must match, as Kubernetes' equality-based
    selectors); 422 INVALID_REQUEST when a term is not ``key=value``."""
    labels: dict[str, str] = {}
    if not selector:
        return labels
    for term in selector.split(","):
        key, eq, value = term.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise ApiError(
                422,
                ApiErrorCode.INVALID_REQUEST,
                f"invalid label selector term {term!r}: expected key=value[,key=value...]",
                details=[{"loc": ["query", "selector"], "msg": "expected key=value"}],
            )
        labels[key] = value
    return labels


class RolloutOptions(BaseModel):
    selector: Selector = Field(
        default_factory=Selector,
        description="Workers to target; resolved to the live matching worker ids at publish time.",
    )
    ttl_s: float = Field(
        default=3600.0,
        gt=0,
        le=MAX_TTL_S,
        description="Seconds until it expires (at most 7 days, the workers' default max_ttl_s).",
    )
    timeout_s: float | None = Field(
        default=None,
        gt=0,
        le=86400,
        description="Per-worker apply timeout; worker default if omitted.",
    )
    rollout_id: Identifier | None = Field(default=None, description="Generated when omitted.")

    def to_request(self, spec: CommandSpec) -> RolloutRequest:
        """The rollout these options ask for, with ``spec``."""
        return RolloutRequest(spec, self.selector, self.ttl_s, self.timeout_s, self.rollout_id)


class ReloadWeightsRequest(ReloadWeightsSpec, RolloutOptions):
    """Reload weights on the selected workers: the wire spec's fields plus the rollout's options."""


class UpdateConfigRequest(UpdateConfigSpec, RolloutOptions):
    """Update runtime config on the selected workers: the wire spec's fields plus options."""


ROLLOUT_REQUEST: TypeAdapter[ReloadWeightsRequest | UpdateConfigRequest] = TypeAdapter(
    Annotated[ReloadWeightsRequest | UpdateConfigRequest, Field(discriminator="kind")]
)
SPEC_OF: dict[type[BaseModel], type[ReloadWeightsSpec] | type[UpdateConfigSpec]] = {
    ReloadWeightsRequest: ReloadWeightsSpec,
    UpdateConfigRequest: UpdateConfigSpec,
}


class RolloutCreated(BaseModel):
    model_config = ConfigDict(frozen=True)

    rollout_id: str
    command_id: str
    command: Command = Field(description="The command as published on the commands topic.")
    status_url: str
    events_url: str


def parse_body(adapter: TypeAdapter[Body], body: bytes, what: str) -> Body:
    """Validate a request body exactly as the wire decoder validates a record (strict JSON):
    413 MESSAGE_TOO_LARGE, 400 MALFORMED_JSON, 422 SCHEMA_INVALID saying where."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ApiError(
            413, WireCode.MESSAGE_TOO_LARGE.value, f"body over {MAX_MESSAGE_BYTES} bytes"
        )
    try:
        return adapter.validate_json(body, strict=True)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise ApiError(
                400, WireCode.MALFORMED_JSON.value, "the body is not valid JSON"
            ) from None
        raise ApiError(
            422, WireCode.SCHEMA_INVALID.value, f"invalid {what}", details=validation_details(exc)
        ) from None


def parse_rollout_request(body: bytes) -> tuple[CommandSpec, RolloutOptions]:
    """Validate a POST body exactly as the wire decoder validates a command (strict JSON)."""
    request = parse_body(ROLLOUT_REQUEST, body, "rollout request")
    spec_cls = SPEC_OF[type(request)]
    spec = spec_cls.model_validate(request.model_dump(include=set(spec_cls.model_fields)))
    options = RolloutOptions.model_validate(
        request.model_dump(include=set(RolloutOptions.model_fields))
    )
    return spec, options


# --------------------------------------------------------------------------- targets, progressive rollouts
# Bodies of the writes (strict, as the controller topic's records are) and views of the fold.


class _Request(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TargetRequest(_Request):
    """PUT /targets/{name}: the target's selector and, optionally, its stable state."""

    selector: Labels = Field(min_length=1, description="Every label must match.")
    stable: Desired | None = Field(
        default=None,
        description="Declare the stable state directly (no rollout): the controller converges "
        "the workers that run something else. Omitted: the stable state stays as it is.",
    )


class RolloutStartRequest(_Request):
    """POST /targets/{name}/rollouts: a progressive rollout of ``desired`` to the target."""

    desired: Desired
    strategy: Strategy = Field(default_factory=Strategy)
    rollback: bool = Field(
        default=True, description="On abort, put every updated worker back on the stable state."
    )
    rollout_id: RolloutId | None = Field(default=None, description="Generated when omitted.")


class UndoRequest(_Request):
    """POST /targets/{name}/undo: optional; a rollout back to the previous stable state."""

    rollout_id: RolloutId | None = Field(default=None, description="Generated when omitted.")


class ActionRequest(_Request):
    """POST /progressive-rollouts/{id}/pause|resume|promote: optional body."""

    action_id: Identifier | None = Field(
        default=None,
        description="Generated when omitted. Give one to retry safely after a 504: the log "
        "keeps one action per id (a promote sent twice would release two manual pauses).",
    )
    reason: Annotated[str, StringConstraints(max_length=1024)] = ""


class AbortRequest(ActionRequest):
    """POST /progressive-rollouts/{id}/abort: optional body."""

    rollback: bool | None = Field(
        default=None,
        description="Put updated workers back on the stable state; null keeps the rollout's own.",
    )


TARGET_REQUEST: Final = TypeAdapter(TargetRequest)
ROLLOUT_START_REQUEST: Final = TypeAdapter(RolloutStartRequest)
UNDO_REQUEST: Final = TypeAdapter(UndoRequest)
ACTION_REQUEST: Final = TypeAdapter(ActionRequest)
ABORT_REQUEST: Final = TypeAdapter(AbortRequest)


class StableOut(BaseModel):
    """One stable state a target had: set by its spec (``rollout_id`` null) or a rollout."""

    desired: Desired
    rollout_id: str | None
    since: AwareDatetime


class TargetDetail(TargetStatus):
    """A target's desired against actual, its stable history (oldest first) and its rollouts."""

    history: list[StableOut]
    rollouts: list[RolloutSummary]


class TargetWritten(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str
    created: bool = Field(description="No target of that name was in the log before.")
    spec: TargetSpec = Field(description="The record as appended to the controller topic.")
    offset: int
    url: str


class WaveOut(BaseModel):
    index: int
    workers: list[str]
    passed: bool = Field(
        description="It passed its gates (a wave waiting at its boundary, for a pause or a "
        "promote, has passed)."
    )
    current: bool = Field(description="The wave in progress (false once the rollout ended).")
    gates: list[GateResult]


class ProgressiveRolloutOut(BaseModel):
    """A progressive rollout as the controller topic says: the request, the controller's
    latest state (null until a controller starts it), the operators' actions, and its waves."""

    rollout_id: str
    target: str
    phase: ControlPhase | None = Field(description="null: not started by a controller yet.")
    ended: bool
    exit_code: int | None = Field(
        description="What `controlplane rollout status` exits with once ended: 0 succeeded, "
        "7 aborted, 8 rolled back, 3 rejected; null before."
    )
    code: str | None
    message: str
    waves: list[WaveOut]
    spec: RolloutSpec
    state: RolloutState | None
    actions: list[RolloutAction]


class ProgressiveRolloutCreated(BaseModel):
    model_config = ConfigDict(frozen=True)

    rollout_id: str
    target: str
    spec: RolloutSpec = Field(description="The request as appended to the controller topic.")
    offset: int
    status_url: str
    events_url: str


class ActionAccepted(BaseModel):
    model_config = ConfigDict(frozen=True)

    rollout_id: str
    action_id: str
    action: ActionKind
    offset: int
    status_url: str


class ControllerOut(BaseModel):
    enabled: bool = Field(description="This coordinator campaigns for the controller.")
    leading: bool
    generation: int | None = Field(description="The generation this coordinator leads in.")
    member: str | None
    fenced: int = Field(description="Times this coordinator was fenced and stepped down.")
    decisions: int
    commands_published: int
    last_error: str | None
    leader: LeaderRecord | None = Field(
        description="Who leads, as the log says (the same on every coordinator)."
    )


def stable_out(entry: StableEntry) -> StableOut:
    return StableOut(desired=entry.desired, rollout_id=entry.rollout_id, since=entry.since)


def rollout_out(rollout: Rollout) -> ProgressiveRolloutOut:
    state = rollout.state
    waves: list[WaveOut] = []
    if state is not None:
        for index, workers in enumerate(state.waves):
            gates = [g for g in state.gates if g.wave == index]
            waves.append(
                WaveOut(
                    index=index,
                    workers=list(workers),
                    passed=index < state.wave or (bool(gates) and all(g.passed for g in gates)),
                    current=index == state.wave and not state.phase.terminal,
                    gates=gates,
                )
            )
    phase = None if state is None else state.phase
    exit_code = CONTROL_PHASE_EXITS.get(phase.value) if phase is not None else None
    return ProgressiveRolloutOut(
        rollout_id=rollout.rollout_id,
        target=rollout.spec.target,
        phase=phase,
        ended=rollout.ended,
        exit_code=None if exit_code is None else int(exit_code),
        code=None if state is None else state.code,
        message="waiting for a controller" if state is None else state.message,
        waves=waves,
        spec=rollout.spec,
        state=state,
        actions=list(rollout.actions),
    )


# --------------------------------------------------------------------------- the dashboard's views
# What the fleet event stream (GET /events) sends: everything in counts, no per-worker lists.

#: A target's workers by state, in the order the dashboard shows them.
TARGET_STATES: Final = ("succeeded", "running", "failed", "drifting", "lost", "conflict")


class TargetOverview(BaseModel):
    """A target in counts: :class:`TargetStatus` without its per-worker ``members``.

    ``by_state`` counts every member once: ``succeeded`` (in sync), ``running`` (updating),
    ``failed`` (degraded), ``drifting`` (alive, not what the target says), ``lost`` and
    ``conflict`` (two targets match it); ``by_version``: the live members by the weights
    version they report (``""``: none)."""

    name: str
    selector: dict[str, str]
    stable_version: str | None
    rollout: RolloutSummary | None
    workers: int = Field(description="Live members (conflicts aside).")
    at_stable: int
    at_new: int
    by_state: dict[str, int]
    by_version: dict[str, int]
    digests_disagree: int
    undo_available: bool = Field(description="It has a previous stable state to go back to.")
    as_of: AwareDatetime

    @classmethod
    def of(cls, status: TargetStatus, *, undo_available: bool) -> TargetOverview:
        states = dict.fromkeys(TARGET_STATES, 0)
        versions: dict[str, int] = {}
        for m in status.members:
            alignment = m.alignment.value
            if alignment == "in_sync":
                state = "succeeded"
            elif alignment == "updating":
                state = "running"
            elif alignment == "drifting":
                state = "failed" if m.degraded else "drifting"
            else:
                state = alignment
            states[state] += 1
            if m.alive and alignment != "conflict":
                version = m.reported_version or ""
                versions[version] = versions.get(version, 0) + 1
        return cls(
            name=status.name,
            selector=status.selector,
            stable_version=status.stable_version,
            rollout=status.rollout,
            workers=status.workers,
            at_stable=status.at_stable,
            at_new=status.at_new,
            by_state=states,
            by_version=dict(sorted(versions.items(), key=lambda kv: (-kv[1], kv[0]))),
            digests_disagree=status.digests_disagree,
            undo_available=undo_available,
            as_of=status.as_of,
        )


class WaveOverview(BaseModel):
    index: int
    size: int
    passed: bool
    current: bool
    gates: list[GateResult]


class ProgressiveOverview(BaseModel):
    """A progressive rollout in counts: :class:`ProgressiveRolloutOut` with its waves' sizes
    instead of their worker ids, and without the request's and state's records."""

    rollout_id: str
    target: str
    phase: ControlPhase | None
    ended: bool
    exit_code: int | None
    code: str | None
    message: str
    version: str | None = Field(description="The weights version it rolls out (null: config).")
    config_keys: list[str]
    undo_of: str | None
    issued_at: AwareDatetime
    issuer: str
    wave: int
    waves: list[WaveOverview]
    failed: int = Field(description="Workers the controller counted failed.")
    actions: int

    @classmethod
    def of(cls, shown: ProgressiveRolloutOut) -> ProgressiveOverview:
        spec = shown.spec
        return cls(
            rollout_id=shown.rollout_id,
            target=shown.target,
            phase=shown.phase,
            ended=shown.ended,
            exit_code=shown.exit_code,
            code=shown.code,
            message=shown.message,
            version=spec.desired.version,
            config_keys=sorted(spec.desired.config),
            undo_of=spec.undo_of,
            issued_at=spec.issued_at,
            issuer=spec.issuer,
            wave=0 if shown.state is None else shown.state.wave,
            waves=[
                WaveOverview(
                    index=w.index,
                    size=len(w.workers),
                    passed=w.passed,
                    current=w.current,
                    gates=w.gates,
                )
                for w in shown.waves
            ],
            failed=0 if shown.state is None else len(shown.state.failed),
            actions=len(shown.actions),
        )
