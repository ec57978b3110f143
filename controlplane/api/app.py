"""The coordinator's HTTP surface: rollouts and workers as JSON, live status as server-sent events,
the write of a rollout (POST /rollouts, which only publishes a command to Kafka), metrics and the
dashboard; targets and progressive rollouts are in :mod:`controlplane.api.progressive`.

Reads come from the coordinator's replica of the log; nothing here holds state of its own.
Models live in models.py, serving in server.py. No signals, no process settings.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hmac
import importlib.resources
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final, TypeVar
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import (
    get_redoc_html,
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import Field, SecretStr
from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.staticfiles import StaticFiles

from controlplane.api.fleet import (
    ROLLOUTS_SHOWN,
    SEND_TIMEOUT_S,
    ETags,
    EventStream,
    FleetFeed,
    target_overview,
)
from controlplane.api.models import (
    API,
    PAGE_DEFAULT,
    PAGE_MAX,
    ROLLOUT_REQUEST,
    STATE_RANK,
    ApiError,
    ApiErrorCode,
    BearerCredentials,
    ErrorBody,
    FleetWorkerState,
    Health,
    RolloutCreated,
    RolloutOut,
    RolloutWorker,
    TargetOverview,
    WorkerOut,
    cursor_time,
    decode_cursor,
    decode_time_cursor,
    encode_cursor,
    error_response,
    from_domain,
    parse_label_selector,
    parse_rollout_request,
    validation_details,
)
from controlplane.api.progressive import BODIES, progressive_router
from controlplane.coordinator.metrics import CONTENT_TYPE, CoordinatorMetrics
from controlplane.coordinator.publisher import PublishUnconfirmed
from controlplane.coordinator.service import RESYNC, Coordinator
from controlplane.coordinator.snapshots import SnapshotInfo
from controlplane.coordinator.summary import (
    NO_DESIRE,
    Budget,
    FleetSummary,
    Levels,
    RolloutOverview,
    Summaries,
    Want,
    in_sync_with,
)
from controlplane.kafka.bus import Delivery
from controlplane.rollout.models import (
    RolloutPhase,
    RolloutStatus,
    UnverifiedCommand,
    WorkerDetail,
    WorkerState,
)
from controlplane.rollout.registry import Registry, WorkerView, is_alive
from controlplane.rollout.targets import Target
from controlplane.wire.errors import BusError, ControlPlaneError, LocalCode
from controlplane.wire.protocol import Heartbeat, WorkerStatus

log = logging.getLogger(__name__)

#: How often an SSE stream re-judges its rollout without news (deadlines pass, workers go silent).
SSE_TICK_S: Final = 1.0
SSE_PING_S: Final = 15.0
#: The fleet event stream judges the fleet at most this often (changes meanwhile are merged).
FLEET_MIN_INTERVAL_S: Final = 0.25
#: Where the API docs' assets (Swagger UI, ReDoc: the fastapi-offline package) are served from.
DOCS_ASSETS: Final = "/docs-assets"

PageSize = Annotated[
    int,
    Query(
        ge=1, le=PAGE_MAX, description=f"Page size (default {PAGE_DEFAULT}, at most {PAGE_MAX})."
    ),
]
WorkersLimit = Annotated[
    int,
    Query(
        ge=0,
        le=PAGE_MAX,
        description=f"How many of the rollout's workers to list, by id ({PAGE_MAX} unless told; "
        "0: counts only); `workers_next` names the rest.",
    ),
]
Label = Annotated[
    list[str] | None,
    Query(description="Only workers with this label, `key=value` (repeatable: every one)."),
]
WorkerStateFilter = Annotated[
    list[FleetWorkerState] | None,
    Query(
        description="Only workers in this state (repeatable): lost, failed, drifting, "
        "updating, in_sync."
    ),
]
Search = Annotated[
    str | None,
    Query(
        max_length=256,
        description="Only workers whose id, a label (`key=value`), reported version, state or "
        "target contains this text (case-insensitive).",
    ),
]


class WorkerOrder(StrEnum):
    ID = "id"
    #: Lost and failed first, then drifting, updating, in sync; by id within each.
    PROBLEMS = "problems"


Order = Annotated[
    WorkerOrder,
    Query(description="`id`, or `problems`: lost, failed, drifting, updating, then in sync."),
]


Cursor = Annotated[
    str | None,
    Query(
        description="Where the page starts: the cursor in the previous page's `Link: <...>; "
        'rel="next"` header (opaque).'
    ),
]


class WorkersQuery:
    """The filters, order and page every list of fleet workers takes (a FastAPI dependency)."""

    def __init__(
        self,
        label: Label = None,
        state: WorkerStateFilter = None,
        search: Search = None,
        order: Order = WorkerOrder.ID,
        limit: PageSize = PAGE_DEFAULT,
        cursor: Cursor = None,
    ) -> None:
        self.labels = parse_label_selector(",".join(label or ()))
        self.state = state
        self.search = search
        self.order = order
        self.limit = limit
        self.cursor = cursor


#: The cookie a browser may hold the read (or write) token in, for reads only: the dashboard
#: sets it, and a browser sends it with an EventSource, which cannot send an Authorization
#: header. Not a query parameter: URLs end up in access logs, proxies and the history.
TOKEN_COOKIE: Final = "controlplane_token"


class Scope(StrEnum):
    READ = "read"
    WRITE = "write"


def token_scope(
    given: str, write: SecretStr | None, read: SecretStr | None, unset: bytes
) -> Scope | None:
    """WRITE if ``given`` is the write token, READ if it is the read token, else None. Both are
    compared with :func:`hmac.compare_digest`, every time (an unset one as ``unset``), so the
    time taken says nothing of which matched or how much of either."""
    candidate = given.encode("utf-8", "surrogateescape")

    def secret(token: SecretStr | None) -> bytes:
        value = None if token is None else token.get_secret_value()
        return value.encode("utf-8") if value else unset

    is_write = hmac.compare_digest(candidate, secret(write))
    is_read = hmac.compare_digest(candidate, secret(read))
    return Scope.WRITE if is_write else Scope.READ if is_read else None


def unauthorized(message: str, *, invalid: bool = False) -> ApiError:
    challenge = 'Bearer realm="controlplane"' + (', error="invalid_token"' if invalid else "")
    return ApiError(
        401, ApiErrorCode.UNAUTHORIZED, message, headers={"WWW-Authenticate": challenge}
    )


# --------------------------------------------------------------------------- the app


class HealthOut(Health):
    """:class:`Health` and what this coordinator's start restored from (here: api/models.py
    is another module's this session)."""

    snapshot: SnapshotInfo = Field(
        description="What the start restored from: a snapshot (writer, offsets, age) or a full "
        "replay and why; and the snapshots this coordinator wrote since (docs/architecture.md, "
        "Snapshots)."
    )


def create_app(
    coordinator: Coordinator,
    *,
    metrics: CoordinatorMetrics | None = None,
    sse_tick_s: float = SSE_TICK_S,
    sse_ping_s: float = SSE_PING_S,
    sse_send_timeout_s: float = SEND_TIMEOUT_S,
    fleet_min_interval_s: float = FLEET_MIN_INTERVAL_S,
) -> FastAPI:
    """The ASGI app over ``coordinator``. Create it before the coordinator starts, so the metrics
    listener sees the replay (see :class:`~controlplane.coordinator.metrics.CoordinatorMetrics`).

    ``app.state.closing`` (an asyncio.Event) ends every SSE stream when set; :class:`ApiServer` sets it.
    A stream whose client reads nothing for ``sse_send_timeout_s`` (a send blocked) is dropped.
    """
    if metrics is None:
        if coordinator.follower.records:
            log.warning(
                "metrics attached after %d records were folded: counters miss them",
                coordinator.follower.records,
            )
        metrics = CoordinatorMetrics(coordinator)
    summaries = metrics.summaries
    app = FastAPI(
        title="Fleet control plane: coordinator",
        version="1",
        description=(
            "Rollout status and workers, rebuilt from the Kafka log. The writes only append "
            "to Kafka (POST /api/v1/rollouts a command; targets and progressive rollouts an "
            "operator's request on the controller topic); status follows from the log."
        ),
        # Served below from the package's own assets: the docs work without internet.
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(ETags)
    app.state.coordinator = coordinator
    app.state.metrics = metrics
    app.state.summaries = summaries
    app.state.closing = asyncio.Event()
    closing: asyncio.Event = app.state.closing
    static = importlib.resources.files("controlplane.api").joinpath("static")
    dashboard = static.joinpath("dashboard.html")
    favicon = static.joinpath("favicon.svg")
    feed = FleetFeed(
        coordinator, summaries, closing, tick_s=sse_tick_s, min_interval_s=fleet_min_interval_s
    )
    app.state.fleet_feed = feed

    # ------------------------------------------------------------------ error rendering

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(ControlPlaneError)
    async def _domain_error(request: Request, exc: ControlPlaneError) -> JSONResponse:
        return error_response(from_domain(exc))

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        details = validation_details(exc)
        return error_response(
            ApiError(422, ApiErrorCode.INVALID_REQUEST, "invalid request", details=details)
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: ApiErrorCode.NOT_FOUND, 405: ApiErrorCode.METHOD_NOT_ALLOWED}.get(
            exc.status_code, ApiErrorCode.HTTP_ERROR
        )
        headers = dict(exc.headers) if exc.headers else None
        return error_response(ApiError(exc.status_code, code, str(exc.detail), headers=headers))

    # ------------------------------------------------------------------ dependencies

    def require_ready() -> None:
        if not coordinator.ready:
            raise ApiError(
                503,
                ApiErrorCode.NOT_READY,
                "the coordinator is still reading the log; statuses would be incomplete",
                headers={"Retry-After": "1"},
                retryable=True,
            )

    def scope(given: str) -> Scope | None:
        """Which token ``given`` is, compared in constant time against both, always."""
        return token_scope(
            given, coordinator.settings.api_token, coordinator.settings.api_read_token, unset
        )

    def require_token(credentials: BearerCredentials) -> None:
        token = coordinator.settings.api_token
        if token is None or not token.get_secret_value():
            raise ApiError(
                403,
                ApiErrorCode.WRITES_DISABLED,
                "writes disabled: this coordinator has no API token (FLEET_COORDINATOR_API_TOKEN)",
            )
        if credentials is None:
            raise unauthorized("missing bearer token")
        given = scope(credentials.credentials)
        if given is None:
            raise unauthorized("invalid bearer token", invalid=True)
        if given is not Scope.WRITE:
            raise ApiError(
                403,
                ApiErrorCode.FORBIDDEN,
                "the read token cannot write: this needs the write token "
                "(FLEET_COORDINATOR_API_TOKEN)",
                headers={
                    "WWW-Authenticate": 'Bearer realm="controlplane", error="insufficient_scope"'
                },
            )

    def require_read(request: Request, credentials: BearerCredentials) -> None:
        """With a read token configured, every read needs it or the write token: in the
        Authorization header, or (for a browser's EventSource, which cannot send headers) in
        the :data:`TOKEN_COOKIE` cookie, which nothing but a read accepts."""
        read = coordinator.settings.api_read_token
        if read is None or not read.get_secret_value():
            return
        if credentials is not None:
            given: str | None = credentials.credentials
        else:
            cookie = request.cookies.get(TOKEN_COOKIE)
            given = None if cookie is None else unquote(cookie)
        if given is None:
            raise unauthorized("missing bearer token: this coordinator's reads need a token")
        if scope(given) is None:
            raise unauthorized("invalid bearer token", invalid=True)

    #: What an unset token is compared with: nothing anyone can send.
    unset = secrets.token_bytes(32)
    ready = [Depends(require_ready)]
    #: Every GET under /api/v1: the read token first (nothing is said without it), then ready.
    reads = [Depends(require_read), *ready]
    #: Publishes answered 504 whose record this coordinator's producer still retries, by rollout
    #: id: posting the same rollout_id again meanwhile is refused (it could land twice).
    unconfirmed: dict[str, PublishUnconfirmed] = {}
    not_found: dict[int | str, dict[str, Any]] = {
        404: {"model": ErrorBody},
        503: {"model": ErrorBody},
    }

    def no_rollout(rollout_id: str) -> ApiError:
        return ApiError(
            404, ApiErrorCode.ROLLOUT_NOT_FOUND, f"no rollout {rollout_id!r} in the log"
        )

    async def status_or_404(
        rollout_id: str, want: Want = Want.FRESH, workers_limit: int | None = None
    ) -> RolloutStatus:
        try:
            return await summaries.status(rollout_id, want=want, workers_limit=workers_limit)
        except KeyError:
            raise no_rollout(rollout_id) from None

    # ------------------------------------------------------------------ health

    @app.get("/healthz", summary="Liveness; says whether the log has been read up to its end")
    async def healthz() -> HealthOut:
        return HealthOut(
            ready=coordinator.ready,
            records=coordinator.follower.records,
            rollouts=len(coordinator.fleet.rollout_ids()),
            workers=len(coordinator.fleet.registry),
            as_of=coordinator.judge_time(),
            snapshot=coordinator.snapshots.info,
        )

    @app.get(
        "/readyz",
        summary="Readiness: 200 once caught up with the log, 503 before",
        responses={503: {"model": ErrorBody}},
        dependencies=ready,
    )
    async def readyz() -> HealthOut:
        return await healthz()

    # ------------------------------------------------------------------ rollouts

    @app.get(
        f"{API}/summary",
        summary="The fleet in counts: workers by status, version and config digest, alive and "
        "lost; rollouts by phase",
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def fleet_summary() -> FleetSummary:
        await summaries.prepare()
        return summaries.fleet()

    @app.get(
        f"{API}/summary/targets",
        summary="Every target in counts: workers by state and by reported version, no worker list",
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def targets_summary() -> list[TargetOverview]:
        now = coordinator.now()
        return [target_overview(coordinator, t, now) for t in coordinator.control.targets()]

    @app.get(
        f"{API}/targets/{{name}}/summary",
        summary="One target in counts: workers by state and by reported version",
        responses=not_found,
        dependencies=reads,
    )
    async def target_summary(name: str) -> TargetOverview:
        target = coordinator.control.known_target(name, create=f"PUT {API}/targets/{name}")
        return target_overview(coordinator, target, coordinator.now())

    @app.get(
        f"{API}/events",
        summary="Server-sent events: the fleet in counts (`snapshot`), then only what changed "
        "(`delta`)",
        description=(
            "The first event, `snapshot`, carries `summary` (as GET /summary), `rollouts` (the "
            f"newest {ROLLOUTS_SHOWN} command rollouts, as GET /rollouts lists them), "
            "`progressive` (the newest progressive rollouts, their waves in counts) and "
            "`targets` (as GET /summary/targets). Each `delta` then carries only what changed "
            "(`as_of` aside): `summary` when it did, and per section the items new or changed "
            "plus `<section>_order` (the ids, in order) when the items or their order changed. "
            "Worker rows are not streamed: read a page of GET /workers when the counts change. "
            "Event ids grow monotonically; reconnecting with `Last-Event-ID` replays the deltas "
            "missed while they are held, else starts with a fresh `snapshot`."
        ),
        response_class=EventSourceResponse,
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def fleet_events(
        request: Request,
        once: Annotated[
            bool, Query(description="Send the `snapshot` and close (a one-off read).")
        ] = False,
    ) -> EventSourceResponse:
        last = None if once else request.headers.get("last-event-id")
        return EventStream(
            feed.events(last, once=once), ping=sse_ping_s, send_timeout=sse_send_timeout_s
        )

    @app.get(
        f"{API}/rollouts",
        summary="Rollouts, newest first, in counts (no per-worker lists); paginated",
        description=(
            "Each item is the rollout's overview: its status without `workers`, `unexpected` "
            "and the selector's `worker_ids`. The next page, if any, is in the `Link` header "
            '(`rel="next"`).'
        ),
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def list_rollouts(
        request: Request,
        response: Response,
        phase: Annotated[
            list[RolloutPhase] | None, Query(description="Only these phases (repeatable).")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000, description="Page size.")] = 100,
        cursor: Cursor = None,
    ) -> list[RolloutOverview]:
        wanted = set(phase) if phase else None
        keys = coordinator.fleet.rollout_keys()  # oldest first
        end = len(keys)
        if cursor is not None:
            end = bisect.bisect_left(keys, decode_time_cursor(cursor))
        summaries.check_compaction()
        budget = Budget()
        out: list[RolloutOverview] = []
        for index in range(end - 1, -1, -1):  # judged lazily: as the page needs
            rollout_id = keys[index][1]
            overview = await summaries.overview(rollout_id, budget=budget, checked=True)
            if wanted is not None and overview.phase not in wanted:
                continue
            if len(out) == limit:
                last = out[-1]
                _link_next(request, response, last.issued_at.isoformat(), last.rollout_id)
                break
            out.append(overview)
        return out

    @app.get(
        f"{API}/rollouts/{{rollout_id}}",
        summary="One rollout's status; its workers by id, the first `workers_limit` of them",
        description=(
            "The rollout's status as `controlplane status --json` prints it. Beyond "
            "`workers_limit` workers (1000 unless told), `workers` lists the first ones and "
            "`workers_next` says where the others are (absent when `workers` lists them all)."
        ),
        response_model=RolloutOut,
        responses=not_found,
        dependencies=reads,
    )
    async def get_rollout(
        rollout_id: str,
        workers_limit: WorkersLimit = PAGE_MAX,
    ) -> Response:
        status = await status_or_404(rollout_id, Want.BOUNDED, workers_limit)
        shown = rollout_out(status, workers_limit)
        return Response(rollout_json(shown), media_type="application/json")

    @app.get(
        f"{API}/rollouts/{{rollout_id}}/summary",
        summary="One rollout in counts: by worker state, error code and version; no worker list",
        responses=not_found,
        dependencies=reads,
    )
    async def rollout_summary(rollout_id: str) -> RolloutOverview:
        try:
            return await summaries.overview(rollout_id)
        except KeyError:
            raise no_rollout(rollout_id) from None

    @app.get(
        f"{API}/rollouts/{{rollout_id}}/workers",
        summary="One rollout's workers (expected, then unexpected ones flagged), by id; paginated",
        responses=not_found,
        dependencies=reads,
    )
    async def rollout_workers(
        request: Request,
        response: Response,
        rollout_id: str,
        state: Annotated[
            list[WorkerState] | None, Query(description="Only these states (repeatable).")
        ] = None,
        code: Annotated[
            list[str] | None, Query(description="Only workers whose error has this code.")
        ] = None,
        unexpected: Annotated[
            bool | None, Query(description="Only unexpected (or only expected) workers.")
        ] = None,
        version: Annotated[
            list[str] | None,
            Query(description="Only workers whose acks reported this weights version."),
        ] = None,
        label: Label = None,
        search: Annotated[
            str | None,
            Query(
                max_length=256,
                description="Only workers whose id, state, error code, version or a label "
                "(`key=value`) contains this text (case-insensitive).",
            ),
        ] = None,
        limit: PageSize = PAGE_DEFAULT,
        cursor: Cursor = None,
    ) -> list[RolloutWorker]:
        after = None if cursor is None else decode_cursor(cursor, 1)[0]
        labels = parse_label_selector(",".join(label or ()))
        versions = set(version) if version else None
        needle = search.strip().lower() if search else ""
        registry = coordinator.fleet.registry

        def keep(detail: WorkerDetail) -> bool:
            if versions is not None and detail.weights_version not in versions:
                return False
            if not labels and not needle:
                return True
            entry = registry.entry(detail.worker_id)
            worker_labels = {} if entry is None else entry[0].labels
            if any(worker_labels.get(k) != v for k, v in labels.items()):
                return False
            return not needle or needle in _detail_searchable(detail, worker_labels)

        filtered = versions is not None or bool(labels) or bool(needle)
        out: list[tuple[WorkerDetail, bool]] = []
        more = True
        while more and len(out) <= limit:
            try:  # a rollout pinned to worker ids: judged for this page only
                page, more = await summaries.workers_page(
                    rollout_id,
                    after=after,
                    limit=limit if not filtered else PAGE_MAX,
                    states=set(state) if state else None,
                    codes=set(code) if code else None,
                    unexpected=unexpected,
                )
            except KeyError:
                raise no_rollout(rollout_id) from None
            out += [row for row in page if keep(row[0])]
            if not filtered or not page:
                break
            after = page[-1][0].worker_id
        if len(out) > limit:
            out, more = out[:limit], True
        if more and out:
            _link_next(request, response, out[-1][0].worker_id)
        return [RolloutWorker(**dict(detail), unexpected=flagged) for detail, flagged in out]

    @app.get(
        f"{API}/rollouts/{{rollout_id}}/events",
        summary="Server-sent events: the rollout's status on every change, then `end` once terminal",
        description=(
            "Each `status` event carries the RolloutStatus JSON (its first `workers_limit` "
            "workers, as GET /rollouts/{id}); when the phase is terminal a "
            "final `end` event carries `{rollout_id, phase, reason, exit_code}` (and `dry_run: true` for a dry run) and the stream "
            "closes. A client too slow for the change feed gets a `resync` event, then the "
            "full status again. `wait_s` waits that long for a rollout just published to "
            "appear in the log."
        ),
        response_class=EventSourceResponse,
        responses=not_found,
        dependencies=reads,
    )
    async def rollout_events(
        rollout_id: str,
        wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0,
        workers_limit: WorkersLimit = PAGE_MAX,
    ) -> EventSourceResponse:
        if rollout_id not in coordinator.fleet and wait_s > 0:
            await _wait_for_rollout(coordinator, rollout_id, wait_s)
        if rollout_id not in coordinator.fleet:
            raise no_rollout(rollout_id)
        return EventStream(
            _status_events(coordinator, summaries, rollout_id, closing, sse_tick_s, workers_limit),
            ping=sse_ping_s,
            send_timeout=sse_send_timeout_s,
        )

    @app.post(
        f"{API}/rollouts",
        summary="Start a rollout: publish one command to Kafka (needs the bearer token)",
        status_code=201,
        responses={
            201: {"model": RolloutCreated},
            400: {"model": ErrorBody},
            401: {"model": ErrorBody},
            403: {
                "model": ErrorBody,
                "description": "WRITES_DISABLED (no write token configured) or FORBIDDEN (the "
                "read token)",
            },
            409: {"model": ErrorBody, "description": "NO_MATCHING_WORKERS or ROLLOUT_EXISTS"},
            422: {"model": ErrorBody},
            503: {
                "model": ErrorBody,
                "description": "NOT_READY, or BROKER_UNAVAILABLE: the command was not published",
            },
            504: {
                "model": ErrorBody,
                "description": "PUBLISH_OUTCOME_UNKNOWN: not confirmed within the delivery "
                "timeout, the command may be in the log (details: rollout_id, command_id); "
                "GET the rollout before posting it again, with the same rollout_id",
            },
        },
        dependencies=[Depends(require_token), *ready],
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": "#/components/schemas/RolloutRequest"}}
                },
            }
        },
    )
    async def create_rollout(request: Request) -> JSONResponse:
        spec, options = parse_rollout_request(await request.body())
        await _refuse_unconfirmed(coordinator, unconfirmed, options.rollout_id)
        try:
            command = await coordinator.publish_rollout(options.to_request(spec))
        except PublishUnconfirmed as exc:
            unconfirmed[exc.rollout_id] = exc
            log.warning(
                "rollout %s (command %s) not confirmed within %g s; the producer keeps trying it",
                exc.rollout_id,
                exc.command_id,
                exc.timeout_s,
                extra={"rollout_id": exc.rollout_id, "command_id": exc.command_id},
            )
            raise
        log.info(
            "rollout %s published over HTTP as command %s for %d worker(s)",
            command.rollout_id,
            command.command_id,
            len(command.selector.worker_ids or ()),
            extra={"rollout_id": command.rollout_id, "command_id": command.command_id},
        )
        url = f"{API}/rollouts/{command.rollout_id}"
        created = RolloutCreated(
            rollout_id=command.rollout_id,
            command_id=command.command_id,
            command=command,
            status_url=url,
            events_url=f"{url}/events",
        )
        return JSONResponse(
            created.model_dump(mode="json"), status_code=201, headers={"Location": url}
        )

    # ------------------------------------------------------------------ workers

    @app.get(
        f"{API}/workers",
        summary="Workers by id: latest heartbeat, liveness, desired against reported weights "
        "version; paginated",
        description=(
            'The next page, if any, is in the `Link` header (`rel="next"`): follow it until '
            "there is none to get every worker. Liveness is judged as the page is built; the "
            "desired versions as last judged (at most a few seconds before)."
        ),
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def list_workers(
        request: Request,
        response: Response,
        query: Annotated[WorkersQuery, Depends()],
        alive: Annotated[
            bool | None, Query(description="Only alive (or only not alive) workers.")
        ] = None,
        status: Annotated[
            list[WorkerStatus] | None,
            Query(description="Only workers whose latest heartbeat has this status (repeatable)."),
        ] = None,
        version: Annotated[
            list[str] | None,
            Query(description="Only workers reporting this weights version (repeatable)."),
        ] = None,
        in_sync: Annotated[
            bool | None, Query(description="Only workers in sync (or only out of sync).")
        ] = None,
        selector: Annotated[
            str | None,
            Query(
                description="Label selector: `key=value[,key=value...]`, every label must match."
            ),
        ] = None,
    ) -> list[WorkerOut]:
        return await workers_of(
            request,
            response,
            None,
            query,
            alive=alive,
            status=status,
            version=version,
            in_sync=in_sync,
            labels=parse_label_selector(selector),
        )

    @app.get(
        f"{API}/targets/{{name}}/workers",
        summary="A target's workers (those its selector matches); filtered and paginated as "
        "GET /workers",
        responses=not_found,
        dependencies=reads,
    )
    async def target_workers(
        request: Request,
        response: Response,
        name: str,
        query: Annotated[WorkersQuery, Depends()],
        version: Annotated[
            list[str] | None,
            Query(description="Only workers reporting this weights version (repeatable)."),
        ] = None,
    ) -> list[WorkerOut]:
        target = coordinator.control.known_target(name, create=f"PUT {API}/targets/{name}")
        return await workers_of(request, response, target, query, version=version)

    async def workers_of(
        request: Request,
        response: Response,
        target: Target | None,
        query: WorkersQuery,
        *,
        alive: bool | None = None,
        status: list[WorkerStatus] | None = None,
        version: list[str] | None = None,
        in_sync: bool | None = None,
        labels: dict[str, str] | None = None,
    ) -> list[WorkerOut]:
        """A page of the workers (of ``target``, if given) the filters keep, by id or, with
        ``order=problems``, by :data:`STATE_RANK` then id."""
        labels = {**(labels or {}), **query.labels}
        state, search, order, limit = query.state, query.search, query.order, query.limit
        after = None if query.cursor is None else decode_cursor(query.cursor, 1)[0]
        levels = await summaries.levels()
        now = coordinator.now()
        registry = coordinator.fleet.registry
        statuses = set(status) if status else None
        versions = set(version) if version else None
        states = set(state) if state else None
        needle = search.strip().lower() if search else ""
        ids = summaries.workers.sorted_ids()
        if levels.never_seen and target is None:
            ids = sorted({*ids, *levels.never_seen})

        def keep(worker_id: str) -> bool:
            hb, received = registry.entry(worker_id) or (None, None)
            if target is not None and (hb is None or not target.matches(hb.labels)):
                return False
            if alive is not None and (hb is not None and is_alive(hb, now, received)) is not alive:
                return False
            if statuses is not None and (hb is None or hb.status not in statuses):
                return False
            if versions is not None and (hb is None or hb.weights_version not in versions):
                return False
            if labels and (hb is None or any(hb.labels.get(k) != v for k, v in labels.items())):
                return False
            want = levels.desired.get(worker_id, NO_DESIRE)
            synced = in_sync_with(want, hb)
            if in_sync is not None and synced is not in_sync:
                return False
            if states is None and not needle:
                return True
            fleet_state = _fleet_state(hb, hb is not None and is_alive(hb, now, received), synced)
            if states is not None and fleet_state not in states:
                return False
            return not needle or needle in _searchable(worker_id, hb, fleet_state, want.target)

        if order is WorkerOrder.PROBLEMS:
            ranked = sorted(_ranked(worker_id, levels, registry, now) for worker_id in ids)
            page = _page(request, response, ranked, after, limit, lambda r: keep(_unranked(r)), str)
            ids_shown = [_unranked(r) for r in page]
        else:
            ids_shown = _page(request, response, ids, after, limit, keep, str)
        return [_worker_out(worker_id, levels, registry, now) for worker_id in ids_shown]

    @app.get(
        f"{API}/workers/{{worker_id}}",
        summary="One worker",
        responses=not_found,
        dependencies=reads,
    )
    async def get_worker(worker_id: str) -> WorkerOut:
        levels = await summaries.levels()
        registry = coordinator.fleet.registry
        if worker_id not in registry and worker_id not in levels.desired:
            raise ApiError(404, ApiErrorCode.WORKER_NOT_FOUND, f"no worker {worker_id!r} is known")
        return _worker_out(worker_id, levels, registry, coordinator.now())

    # ------------------------------------------------------------------ commands

    @app.get(
        f"{API}/commands/unverified",
        summary="Commands the coordinator's trust store did not verify: never part of a rollout",
        description=(
            "Unsigned commands, bad signatures, unknown or revoked keys, commands out of their "
            "key's scope or with a ttl beyond max_ttl_s, oldest issued first, each with why "
            "(`code`) and how many workers NACKed it (once it expired, NACKs read later are "
            "not counted). The newest issued 1000 are kept. Empty without a trust store. The "
            'next page, if any, is in the `Link` header (`rel="next"`).'
        ),
        responses={503: {"model": ErrorBody}},
        dependencies=reads,
    )
    async def unverified_commands(
        request: Request, response: Response, limit: PageSize = PAGE_DEFAULT, cursor: Cursor = None
    ) -> list[UnverifiedCommand]:
        listed = coordinator.fleet.unverified()  # oldest issued first
        start = 0
        if cursor is not None:
            after = _unverified_key(decode_cursor(cursor, 3))
            start = bisect.bisect_right(
                listed, after, key=lambda e: (e.issued_at, e.rollout_id, e.command_id)
            )
        page = listed[start : start + limit]
        if start + limit < len(listed):
            last = page[-1]
            _link_next(
                request, response, last.issued_at.isoformat(), last.rollout_id, last.command_id
            )
        return page

    # ------------------------------------------------------------------ metrics, dashboard

    @app.get(
        "/metrics",
        summary="Prometheus metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE: {}}}},
    )
    async def prometheus() -> Response:
        if coordinator.judge_time() is not None:
            await summaries.prepare()  # judge what is stale now, the loop free between two
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(dashboard.read_text("utf-8"), headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    @app.get("/favicon.svg", include_in_schema=False)
    async def icon() -> Response:
        return Response(
            favicon.read_bytes(),
            media_type="image/svg+xml",
            headers={"Cache-Control": "max-age=86400"},
        )

    # ------------------------------------------------------------------ API docs, offline

    app.mount(
        DOCS_ASSETS, StaticFiles(packages=[("fastapi_offline", "static")]), name="docs-assets"
    )

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=str(app.openapi_url),
            title=f"{app.title}: API",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_js_url=f"{DOCS_ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{DOCS_ASSETS}/swagger-ui.css",
            swagger_favicon_url="/favicon.ico",
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    async def swagger_ui_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()

    @app.get("/redoc", include_in_schema=False)
    async def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url=str(app.openapi_url),
            title=f"{app.title}: API",
            redoc_js_url=f"{DOCS_ASSETS}/redoc.standalone.js",
            redoc_favicon_url="/favicon.ico",
            with_google_fonts=False,
        )

    # ------------------------------------------------------------------ targets, progressive rollouts

    app.include_router(
        progressive_router(
            coordinator,
            ready=ready,
            token=Depends(require_token),
            read=Depends(require_read),
            closing=closing,
            sse_tick_s=sse_tick_s,
            sse_ping_s=sse_ping_s,
            sse_send_timeout_s=sse_send_timeout_s,
        )
    )

    _document_request_body(app)
    return app


async def _refuse_unconfirmed(
    coordinator: Coordinator, unconfirmed: dict[str, PublishUnconfirmed], rollout_id: str | None
) -> None:
    """ROLLOUT_EXISTS (409) while an earlier, unconfirmed publish of ``rollout_id`` may still
    land; entries end once their rollout is in the log or the producer gave up on the record."""
    for rid, earlier in list(unconfirmed.items()):
        if rid in coordinator.fleet or (earlier.delivery.done and await _failed(earlier.delivery)):
            del unconfirmed[rid]
    pending = unconfirmed.get(rollout_id) if rollout_id is not None else None
    if pending is not None:
        raise ApiError(
            409,
            LocalCode.ROLLOUT_EXISTS.value,
            f"rollout {rollout_id!r} was posted before (command {pending.command_id}) and its "
            "publish is not confirmed yet; this coordinator is still trying it: GET "
            f"/api/v1/rollouts/{rollout_id} until it shows",
        )


async def _failed(delivery: Delivery) -> bool:
    """Whether a finished delivery failed (the record was not written)."""
    try:
        await delivery.wait(0)
    except BusError:
        return True
    return False


Item = TypeVar("Item")


def _page(
    request: Request,
    response: Response,
    items: Sequence[Item],
    after: str | None,
    limit: int,
    keep: Callable[[Item], bool],
    key: Callable[[Item], str],
) -> list[Item]:
    """The first ``limit`` of ``items`` (sorted by ``key``) after the key ``after`` that
    ``keep`` keeps; a ``Link: <...>; rel="next"`` header when more would follow. Keyset
    pagination: every item present all along is on exactly one page, in order, whatever
    was added or removed meanwhile."""
    start = 0 if after is None else bisect.bisect_right(items, after, key=key)
    out: list[Item] = []
    for index in range(start, len(items)):
        item = items[index]
        if not keep(item):
            continue
        if len(out) == limit:
            _link_next(request, response, key(out[-1]))
            break
        out.append(item)
    return out


def _unverified_key(key: tuple[str, ...]) -> tuple[datetime, str, str]:
    """The (issued_at, rollout id, command id) an unverified commands cursor holds."""
    when, rollout_id, command_id = key
    return cursor_time(when), rollout_id, command_id


def _link_next(request: Request, response: Response, *key: str) -> None:
    """Say where the next page starts: after the item whose sort key is ``key``."""
    url = request.url.include_query_params(cursor=encode_cursor(*key))
    response.headers["Link"] = f'<{url.path}?{url.query}>; rel="next"'


def _fleet_state(hb: Heartbeat | None, alive: bool, in_sync: bool) -> FleetWorkerState:
    """Where a worker stands, in one word (:class:`FleetWorkerState`)."""
    if hb is None or not alive:
        return FleetWorkerState.LOST
    if hb.degraded is not None:
        return FleetWorkerState.FAILED
    if hb.in_flight is not None or hb.status is WorkerStatus.BUSY:
        return FleetWorkerState.UPDATING
    return FleetWorkerState.IN_SYNC if in_sync else FleetWorkerState.DRIFTING


def _searchable(
    worker_id: str, hb: Heartbeat | None, state: FleetWorkerState, target: str | None
) -> str:
    """What ``search`` looks in: the id, labels, reported version, state and target."""
    parts = [worker_id, state.value, target or ""]
    if hb is not None:
        parts += [f"{k}={v}" for k, v in hb.labels.items()]
        parts.append(hb.weights_version or "")
    return "\n".join(parts).lower()


def _detail_searchable(detail: WorkerDetail, labels: dict[str, str]) -> str:
    parts = [detail.worker_id, detail.state.value, detail.weights_version or ""]
    if detail.error is not None:
        parts.append(detail.error.code)
    parts += [f"{k}={v}" for k, v in labels.items()]
    return "\n".join(parts).lower()


def _ranked(worker_id: str, levels: Levels, registry: Registry, now: datetime) -> str:
    """The key ``order=problems`` sorts (and its cursors page) by: the state's rank, then id."""
    hb, received = registry.entry(worker_id) or (None, None)
    want = levels.desired.get(worker_id, NO_DESIRE)
    state = _fleet_state(hb, hb is not None and is_alive(hb, now, received), in_sync_with(want, hb))
    return f"{STATE_RANK[state]}/{worker_id}"


def _unranked(key: str) -> str:
    return key.partition("/")[2]


def _worker_out(worker_id: str, levels: Levels, registry: Registry, now: datetime) -> WorkerOut:
    """A worker's level: a worker of a target is judged against what the target says it
    should run (docs/progressive.md); any other, against the latest reload rollout for it."""
    want = levels.desired.get(worker_id, NO_DESIRE)
    hb, received = registry.entry(worker_id) or (None, None)
    alive = hb is not None and is_alive(hb, now, received)
    in_sync = in_sync_with(want, hb)
    return WorkerOut(
        worker_id=worker_id,
        alive=alive,
        reported_version=None if hb is None else hb.weights_version,
        desired_version=want.version,
        desired_rollout_id=want.rollout_id,
        degraded=hb is not None and hb.degraded is not None,
        in_sync=in_sync,
        heartbeat=None if hb is None else WorkerView.of(hb, now, received),
        target=want.target,
        state=_fleet_state(hb, alive, in_sync),
    )


def rollout_json(shown: RolloutOut, *, exclude: set[str] | None = None) -> str:
    """``shown`` as JSON; without ``workers_next`` when every worker is listed: exactly the
    RolloutStatus that ``controlplane status --json`` prints."""
    skip = set(exclude or ())
    if shown.workers_next is None:
        skip.add("workers_next")
    return shown.model_dump_json(exclude=skip)


def rollout_out(status: RolloutStatus, workers_limit: int) -> RolloutOut:
    """``status`` with its first ``workers_limit`` workers (by id) and a link to the rest."""
    workers = status.workers
    more = None
    if len(workers) > workers_limit:
        workers = workers[:workers_limit]
        after = workers[-1].worker_id if workers else None
        cursor = "" if after is None else f"&cursor={encode_cursor(after)}"
        more = f"{API}/rollouts/{status.rollout_id}/workers?unexpected=false{cursor}"
    return RolloutOut.model_construct(**{**dict(status), "workers": workers, "workers_next": more})


_ERROR_REF: Final = "#/components/schemas/ErrorBody"


def _document_request_body(app: FastAPI) -> None:
    """The POST body is parsed by hand (strict, after auth), so describe it in OpenAPI ourselves."""
    schema = ROLLOUT_REQUEST.json_schema(ref_template="#/components/schemas/{model}")
    defs: dict[str, Any] = schema.pop("$defs", {})

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, definition in defs.items():
                schemas.setdefault(name, definition)
            schemas["RolloutRequest"] = schema
            for name, adapter in BODIES.items():
                body = adapter.json_schema(ref_template="#/components/schemas/{model}")
                for inner, definition in body.pop("$defs", {}).items():
                    schemas.setdefault(inner, definition)
                schemas.setdefault(name, body)
            # Our 422s are ErrorBody too, not FastAPI's default HTTPValidationError.
            for operation in (op for path in doc["paths"].values() for op in path.values()):
                invalid = operation.get("responses", {}).get("422")
                if invalid is not None:
                    invalid["content"] = {"application/json": {"schema": {"$ref": _ERROR_REF}}}
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# --------------------------------------------------------------------------- SSE


def _changes(coordinator: Coordinator, tick_s: float) -> AsyncGenerator[set[str], None]:
    return coordinator.changes(tick_s)


async def _wait_for_rollout(coordinator: Coordinator, rollout_id: str, wait_s: float) -> None:
    with contextlib.suppress(TimeoutError):
        async with (
            asyncio.timeout(wait_s),
            contextlib.aclosing(_changes(coordinator, 0.25)) as feed,
        ):
            async for _ in feed:
                if rollout_id in coordinator.fleet:
                    return


async def _status_events(
    coordinator: Coordinator,
    summaries: Summaries,
    rollout_id: str,
    closing: asyncio.Event,
    tick_s: float,
    workers_limit: int = PAGE_MAX,
) -> AsyncIterator[ServerSentEvent]:
    """The rollout's status whenever it differs (``as_of`` aside), judged again on every
    change or tick (one judgment shared by every stream and reader: :class:`Summaries`).

    Each ``status`` carries what GET /rollouts/{id} returns (its first workers, by id).
    A client too slow for the change feed gets a ``resync`` event (the changes it missed were
    dropped), then the full status again, even if unchanged."""
    last: str | None = None
    held: RolloutStatus | None = None
    sent = 0
    resync = False
    async with contextlib.aclosing(_changes(coordinator, tick_s)) as feed:
        while True:
            status = await summaries.status(rollout_id, workers_limit=workers_limit)
            if resync:
                sent += 1
                yield ServerSentEvent(
                    data=json.dumps({"rollout_id": rollout_id}), event="resync", id=str(sent)
                )
                resync = False
                last = held = None
            if status is not held:  # the same judgment again: nothing to compare
                held = status
                shown = rollout_out(status, workers_limit)
                seen = rollout_json(shown, exclude={"as_of"})
                if seen != last:
                    last = seen
                    sent += 1
                    yield ServerSentEvent(data=rollout_json(shown), event="status", id=str(sent))
            if status.terminal:
                end = {
                    "rollout_id": rollout_id,
                    "phase": status.phase.value,
                    "reason": status.reason.value if status.reason else None,
                    "exit_code": status.exit_code,
                    **({"dry_run": True} if status.dry_run else {}),  # said only of a dry run
                }
                yield ServerSentEvent(data=json.dumps(end), event="end", id=str(sent + 1))
                return
            if closing.is_set():
                return
            try:
                changed = await anext(feed)
            except StopAsyncIteration:  # the coordinator stopped
                return
            resync = RESYNC in changed
