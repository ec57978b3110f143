"""The HTTP API's errors and request/response models; no routes, no I/O.

Errors render as ``{"error": {code, message, retryable, details?}}``.
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Annotated

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
    TypeAdapter,
    ValidationError,
)

from controlplane.coordinator.publisher import MAX_TTL_S, PublishUnconfirmed, RolloutRequest
from controlplane.rollout.models import WorkerLevel
from controlplane.rollout.registry import WorkerView
from controlplane.wire.errors import BusError, ControlPlaneError, LocalCode, WireCode
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


# --------------------------------------------------------------------------- errors


class ApiErrorCode(StrEnum):
    """Codes of errors that exist only over HTTP; domain errors keep their WireCode or LocalCode."""

    NOT_FOUND = "NOT_FOUND"
    ROLLOUT_NOT_FOUND = "ROLLOUT_NOT_FOUND"
    WORKER_NOT_FOUND = "WORKER_NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    INVALID_REQUEST = "INVALID_REQUEST"
    UNAUTHORIZED = "UNAUTHORIZED"
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


def from_domain(exc: ControlPlaneError) -> ApiError:
    """Our error tree, translated to HTTP in this one place.

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
    if exc.code in (LocalCode.NO_MATCHING_WORKERS, LocalCode.ROLLOUT_EXISTS):
        status = 409
    elif exc.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN:
        status = 504
    elif isinstance(exc, BusError):
        status = 503
    else:
        status = 400
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


class WorkerOut(WorkerLevel):
    """A worker's level (desired against reported version) and its latest heartbeat, if any.

    ``heartbeat`` is null for a worker that a rollout expects but that was never heard from.
    """

    heartbeat: WorkerView | None


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


def parse_rollout_request(body: bytes) -> tuple[CommandSpec, RolloutOptions]:
    """Validate a POST body exactly as the wire decoder validates a command (strict JSON)."""
    if len(body) > MAX_MESSAGE_BYTES:
        raise ApiError(
            413, WireCode.MESSAGE_TOO_LARGE.value, f"body over {MAX_MESSAGE_BYTES} bytes"
        )
    try:
        request = ROLLOUT_REQUEST.validate_json(body, strict=True)
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            raise ApiError(
                400, WireCode.MALFORMED_JSON.value, "the body is not valid JSON"
            ) from None
        raise ApiError(
            422,
            WireCode.SCHEMA_INVALID.value,
            "invalid rollout request",
            details=validation_details(exc),
        ) from None
    spec_cls = SPEC_OF[type(request)]
    spec = spec_cls.model_validate(request.model_dump(include=set(spec_cls.model_fields)))
    options = RolloutOptions.model_validate(
        request.model_dump(include=set(RolloutOptions.model_fields))
    )
    return spec, options
