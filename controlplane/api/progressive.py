"""The HTTP routes of targets and progressive rollouts: what `controlplane targets` and
`controlplane rollout ...` do, over HTTP (issue 12).

Reads come from the coordinator's fold of the controller topic; a write only appends an
operator's request to that topic (the elected controller acts on it), after the same checks as
the CLI's, then waits, briefly, until this coordinator has read it back (so a GET right after
shows it). No state of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from datetime import datetime
from typing import Annotated, Any, Final, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends
from fastapi.responses import JSONResponse
from pydantic import BaseModel, TypeAdapter, ValidationError
from sse_starlette import EventSourceResponse, ServerSentEvent

from controlplane.api.fleet import EventStream
from controlplane.api.models import (
    ABORT_REQUEST,
    ACTION_REQUEST,
    API,
    ROLLOUT_START_REQUEST,
    TARGET_REQUEST,
    UNDO_REQUEST,
    AbortRequest,
    ActionAccepted,
    ActionRequest,
    ApiError,
    ControllerOut,
    ErrorBody,
    ProgressiveRolloutCreated,
    ProgressiveRolloutOut,
    TargetDetail,
    TargetWritten,
    parse_body,
    rollout_out,
    stable_out,
    validation_details,
)
from controlplane.coordinator.publisher import new_id
from controlplane.coordinator.service import RESYNC, Coordinator
from controlplane.rollout.desired import TargetStatus, summary, target_status, targets_status
from controlplane.rollout.targets import Rollout
from controlplane.wire.control import (
    ActionKind,
    RolloutAction,
    RolloutSpec,
    TargetSpec,
)
from controlplane.wire.errors import BusError, LocalCode, WireCode
from controlplane.wire.messages import WireModel

log = logging.getLogger(__name__)

Record = TypeVar("Record", bound=WireModel)

#: How long a write waits for this coordinator to read its record back before answering anyway.
READ_BACK_S: Final = 5.0
TARGETS: Final = f"{API}/targets"
ROLLOUTS: Final = f"{API}/progressive-rollouts"

#: Request bodies parsed by hand (strict, after auth): their schemas, for the OpenAPI document.
BODIES: Final[dict[str, TypeAdapter[Any]]] = {
    "TargetRequest": TARGET_REQUEST,
    "RolloutStartRequest": ROLLOUT_START_REQUEST,
    "UndoRequest": UNDO_REQUEST,
    "ActionRequest": ACTION_REQUEST,
    "AbortRequest": ABORT_REQUEST,
}


def _body(name: str, *, required: bool = True) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{name}"}
    return {
        "requestBody": {
            "required": required,
            "content": {"application/json": {"schema": ref}},
        }
    }


def _errors(*statuses: int, **described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for ErrorBody answers: bare statuses, and ``e404="..."`` ones
    with a description (the codes they carry)."""
    out: dict[int | str, dict[str, Any]] = {s: {"model": ErrorBody} for s in (*statuses, 503)}
    for status, text in described.items():
        out[int(status.removeprefix("e"))] = {"model": ErrorBody, "description": text}
    return out


_WRITE_ERRORS: Final = {
    "e400": "MALFORMED_JSON",
    "e401": "UNAUTHORIZED: missing or wrong bearer token",
    "e403": "WRITES_DISABLED: this coordinator has no API token; FORBIDDEN: the read token",
    "e413": "MESSAGE_TOO_LARGE",
    "e422": "SCHEMA_INVALID: the body, with where (details)",
    "e503": "NOT_READY, or BROKER_UNAVAILABLE: nothing was written",
    "e504": "PUBLISH_OUTCOME_UNKNOWN: the request may be in the log (details: its ids); "
    "GET it before sending it again, with the same id",
}


# --------------------------------------------------------------------------- the checks


def _record(model: type[Record], **fields: Any) -> Record:
    """A controller-topic record; what the body could not say (the path's name) is 422 too."""
    try:
        return model(**fields)
    except ValidationError as exc:
        raise ApiError(
            422,
            WireCode.SCHEMA_INVALID.value,
            f"invalid {model.__name__}",
            details=validation_details(exc),
        ) from None


# --------------------------------------------------------------------------- the routes


def progressive_router(
    coordinator: Coordinator,
    *,
    ready: Sequence[Depends],
    token: Depends,
    read: Depends,
    closing: asyncio.Event,
    sse_tick_s: float,
    sse_ping_s: float,
    sse_send_timeout_s: float,
) -> APIRouter:
    """Targets, progressive rollouts and the controller. ``ready`` guards every route,
    ``token`` every write and ``read`` every read (first: nothing is said to a caller without
    it)."""
    router = APIRouter()
    control = coordinator.control
    reads = [read, *ready]
    writes = [token, *ready]
    issuer = f"{coordinator.settings.issuer}@api"

    async def append(record: WireModel, **about: str) -> int:
        """Append ``record`` to the controller topic, then wait (up to READ_BACK_S) until this
        coordinator has folded it. PUBLISH_OUTCOME_UNKNOWN: 504 with what to look for."""
        settings = coordinator.settings.kafka
        try:
            offset = await coordinator.publish_control(record)
        except BusError as exc:
            if exc.code is not LocalCode.PUBLISH_OUTCOME_UNKNOWN:
                raise
            raise ApiError(
                504,
                exc.code.value,
                f"{exc.message}; the request may be in the log: GET it before sending it "
                "again (with the same id)",
                details=[dict(about)],
            ) from None
        ends = {(settings.topics.controller.name, 0): offset + 1}
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(READ_BACK_S):
                await coordinator.follower.wait_reached(ends)
        return offset

    async def start(spec: RolloutSpec) -> JSONResponse:
        control.check_start(spec)
        offset = await append(spec, rollout_id=spec.rollout_id)
        log.info(
            "progressive rollout %s of target %s requested over HTTP (offset %d)",
            spec.rollout_id,
            spec.target,
            offset,
            extra={"rollout_id": spec.rollout_id},
        )
        url = f"{ROLLOUTS}/{spec.rollout_id}"
        created = ProgressiveRolloutCreated(
            rollout_id=spec.rollout_id,
            target=spec.target,
            spec=spec,
            offset=offset,
            status_url=url,
            events_url=f"{url}/events",
        )
        return JSONResponse(
            created.model_dump(mode="json"), status_code=201, headers={"Location": url}
        )

    def now() -> datetime:
        return coordinator.now()

    # ------------------------------------------------------------------ targets

    @router.get(
        TARGETS,
        summary="Targets: desired against actual (workers at stable, at new, ...), weights digests",
        responses=_errors(),
        dependencies=reads,
    )
    async def list_targets() -> list[TargetStatus]:
        return targets_status(control, coordinator.fleet, now())

    @router.get(
        f"{TARGETS}/{{name}}",
        summary="One target: desired against actual per worker, stable history, rollouts",
        responses=_errors(404),
        dependencies=reads,
    )
    async def get_target(name: str) -> TargetDetail:
        target = control.known_target(name, create=f"PUT {TARGETS}/{name}")
        status = target_status(control, coordinator.fleet, target, now())
        return TargetDetail(
            **dict(status),
            history=[stable_out(e) for e in target.history],
            rollouts=[
                summary(r.state, r.rollout_id, r.spec.desired.version)
                for r in control.rollouts(name)
            ],
        )

    @router.put(
        f"{TARGETS}/{{name}}",
        summary="Create a target or change its selector (and, optionally, its stable state)",
        status_code=200,
        responses={
            200: {"model": TargetWritten, "description": "The target existed: replaced."},
            201: {"model": TargetWritten, "description": "A new target."},
            **_errors(**_WRITE_ERRORS),
        },
        dependencies=writes,
        openapi_extra=_body("TargetRequest"),
    )
    async def put_target(name: str, request: Request) -> JSONResponse:
        body = parse_body(TARGET_REQUEST, await request.body(), "target")
        created = control.target(name) is None
        spec = _record(
            TargetSpec,
            name=name,
            selector=body.selector,
            stable=body.stable,
            issued_at=coordinator.clock(),
            issuer=issuer,
        )
        offset = await append(spec, target=name)
        log.info(
            "target %s %s over HTTP (offset %d)", name, "created" if created else "set", offset
        )
        url = f"{TARGETS}/{name}"
        out = TargetWritten(name=name, created=created, spec=spec, offset=offset, url=url)
        return JSONResponse(
            out.model_dump(mode="json"),
            status_code=201 if created else 200,
            headers={"Location": url} if created else None,
        )

    @router.post(
        f"{TARGETS}/{{name}}/rollouts",
        summary="Start a progressive rollout of the target (needs the bearer token)",
        status_code=201,
        responses={
            201: {"model": ProgressiveRolloutCreated},
            **_errors(
                e404="TARGET_UNKNOWN",
                e409="TARGET_BUSY (another rollout in progress) or ROLLOUT_EXISTS",
                **_WRITE_ERRORS,
            ),
        },
        dependencies=writes,
        openapi_extra=_body("RolloutStartRequest"),
    )
    async def start_rollout(name: str, request: Request) -> JSONResponse:
        body = parse_body(ROLLOUT_START_REQUEST, await request.body(), "rollout request")
        spec = _record(
            RolloutSpec,
            rollout_id=body.rollout_id or new_id("r"),
            target=name,
            desired=body.desired,
            strategy=body.strategy,
            rollback=body.rollback,
            issued_at=coordinator.clock(),
            issuer=issuer,
        )
        return await start(spec)

    @router.post(
        f"{TARGETS}/{{name}}/undo",
        summary="Roll the target back to its previous stable state (a new rollout, all at once)",
        status_code=201,
        responses={
            201: {"model": ProgressiveRolloutCreated},
            **_errors(
                e404="TARGET_UNKNOWN",
                e409="ROLLBACK_UNAVAILABLE (no previous stable state), TARGET_BUSY or "
                "ROLLOUT_EXISTS",
                **_WRITE_ERRORS,
            ),
        },
        dependencies=writes,
        openapi_extra=_body("UndoRequest", required=False),
    )
    async def undo(name: str, request: Request) -> JSONResponse:
        raw = await request.body()
        body = parse_body(UNDO_REQUEST, raw or b"{}", "undo request")
        change, undo_of = control.known_target(name, create=f"PUT {TARGETS}/{name}").undo()
        spec = _record(
            RolloutSpec,
            rollout_id=body.rollout_id or new_id("undo"),
            target=name,
            desired=change,
            undo_of=undo_of,
            issued_at=coordinator.clock(),
            issuer=issuer,
        )
        return await start(spec)

    # ------------------------------------------------------------------ progressive rollouts

    @router.get(
        ROLLOUTS,
        summary="Progressive rollouts, newest first",
        responses=_errors(),
        dependencies=reads,
    )
    async def list_rollouts(
        target: Annotated[str | None, Query(description="Only this target's.")] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[ProgressiveRolloutOut]:
        return [rollout_out(r) for r in reversed(control.rollouts(target))][:limit]

    @router.get(
        f"{ROLLOUTS}/{{rollout_id}}",
        summary="One progressive rollout: request, phase, waves with gate results, actions",
        responses=_errors(404),
        dependencies=reads,
    )
    async def get_rollout(rollout_id: str) -> ProgressiveRolloutOut:
        return rollout_out(control.known_rollout(rollout_id))

    def act(kind: ActionKind) -> Callable[..., Any]:
        adapter: TypeAdapter[ActionRequest] = (
            ABORT_REQUEST if kind is ActionKind.ABORT else ACTION_REQUEST  # type: ignore[assignment]
        )

        async def handler(rollout_id: str, request: Request) -> JSONResponse:
            raw = await request.body()
            body = parse_body(adapter, raw or b"{}", f"{kind.value} request")
            rollout = control.actionable(rollout_id, kind.value)
            action_id = body.action_id or f"{kind.value}-{uuid.uuid4().hex[:12]}"
            record = _record(
                RolloutAction,
                rollout_id=rollout_id,
                action_id=action_id,
                action=kind,
                rollback=body.rollback if isinstance(body, AbortRequest) else None,
                wave=rollout.action_wave(kind),
                reason=body.reason,
                issued_at=coordinator.clock(),
                issuer=issuer,
            )
            offset = await append(record, rollout_id=rollout_id, action_id=action_id)
            log.info(
                "%s of rollout %s requested over HTTP (offset %d)",
                kind.value,
                rollout_id,
                offset,
                extra={"rollout_id": rollout_id},
            )
            url = f"{ROLLOUTS}/{rollout_id}"
            out = ActionAccepted(
                rollout_id=rollout_id,
                action_id=action_id,
                action=kind,
                offset=offset,
                status_url=url,
            )
            return JSONResponse(out.model_dump(mode="json"), status_code=202)

        return handler

    what = {
        ActionKind.PAUSE: "Hold the rollout before its next batch (commands handed out finish)",
        ActionKind.RESUME: "Release an operator's pause",
        ActionKind.PROMOTE: "Start the next wave of a rollout waiting at a manual pause",
        ActionKind.ABORT: "Abort: no further wave starts; then, unless rollback is false, "
        "every updated worker gets the stable state back",
    }
    for kind, text in what.items():
        router.add_api_route(
            f"{ROLLOUTS}/{{rollout_id}}/{kind.value}",
            act(kind),
            methods=["POST"],
            summary=f"{text} (needs the bearer token)",
            status_code=202,
            responses={
                202: {"model": ActionAccepted},
                **_errors(e404="ROLLOUT_UNKNOWN", e409="ROLLOUT_ENDED", **_WRITE_ERRORS),
            },
            dependencies=writes,
            openapi_extra=_body(
                "AbortRequest" if kind is ActionKind.ABORT else "ActionRequest", required=False
            ),
            name=f"{kind.value}_rollout",
        )

    @router.get(
        f"{ROLLOUTS}/{{rollout_id}}/events",
        summary="Server-sent events: `state` on every change, `wave` at wave transitions and "
        "gate results, then `end`",
        description=(
            "Each `state` event carries the rollout (as GET returns it) whenever it changed; "
            "a `wave` event `{rollout_id, wave, waves, phase, gates}` when the stream opens on "
            "a started rollout, then whenever the wave in progress changes or a gate result is "
            "added (`gates`: every result so far); once the rollout ended, a final `end` event "
            "`{rollout_id, phase, code, exit_code}` and the stream closes. A client too slow "
            "for the change feed gets `resync`, then the full state again. `wait_s` waits that "
            "long for a rollout just requested to appear in the log."
        ),
        response_class=EventSourceResponse,
        responses=_errors(404),
        dependencies=reads,
    )
    async def rollout_events(
        rollout_id: str,
        wait_s: Annotated[float, Query(ge=0, le=60)] = 0.0,
    ) -> EventSourceResponse:
        if control.rollout(rollout_id) is None and wait_s > 0:
            await _wait_for(coordinator, lambda: control.rollout(rollout_id) is not None, wait_s)
        control.known_rollout(rollout_id)
        return EventStream(
            rollout_events_of(coordinator, rollout_id, closing, sse_tick_s),
            ping=sse_ping_s,
            send_timeout=sse_send_timeout_s,
        )

    # ------------------------------------------------------------------ the controller

    @router.get(
        f"{API}/controller",
        summary="The controller: whether this coordinator leads, and who leads as the log says",
        responses=_errors(),
        dependencies=reads,
    )
    async def controller() -> ControllerOut:
        mine = coordinator.controller
        if mine is None:
            return ControllerOut(
                enabled=False,
                leading=False,
                generation=None,
                member=None,
                fenced=0,
                decisions=0,
                commands_published=0,
                last_error=None,
                leader=control.leader,
            )
        return ControllerOut(
            enabled=True,
            leading=mine.leading is not None,
            generation=mine.leading,
            member=mine.member,
            fenced=mine.fenced,
            decisions=mine.decisions,
            commands_published=mine.commands_published,
            last_error=mine.last_error,
            leader=control.leader,
        )

    return router


# --------------------------------------------------------------------------- SSE


async def _wait_for(coordinator: Coordinator, done: Callable[[], bool], wait_s: float) -> None:
    """Until ``done()`` (checked on every change of the log), at most ``wait_s``."""
    with contextlib.suppress(TimeoutError):
        async with (
            asyncio.timeout(wait_s),
            contextlib.aclosing(coordinator.changes(0.25)) as feed,
        ):
            async for _ in feed:
                if done():
                    return


def _event(name: str, body: BaseModel | dict[str, Any], sent: int) -> ServerSentEvent:
    data = body.model_dump_json() if isinstance(body, BaseModel) else json.dumps(body)
    return ServerSentEvent(data=data, event=name, id=str(sent))


def wave_event(rollout: Rollout) -> dict[str, Any] | None:
    """The `wave` event's data for where the rollout stands (None: not started)."""
    state = rollout.state
    if state is None:
        return None
    return {
        "rollout_id": rollout.rollout_id,
        "wave": state.wave,
        "waves": len(state.waves),
        "phase": state.phase.value,
        "gates": [json.loads(g.model_dump_json()) for g in state.gates],
    }


async def rollout_events_of(
    coordinator: Coordinator, rollout_id: str, closing: asyncio.Event, tick_s: float
) -> AsyncIterator[ServerSentEvent]:
    """The rollout whenever it differs, its wave transitions, then ``end`` once it ended;
    re-read on every change of the log or tick. A client too slow for the change feed gets
    ``resync`` (the changes it missed were dropped), then the full state again."""
    last: str | None = None
    mark: tuple[int, int] | None = None
    sent = 0
    resync = False
    async with contextlib.aclosing(coordinator.changes(tick_s)) as feed:
        while True:
            rollout = coordinator.control.rollout(rollout_id)
            if rollout is None:  # checked before the stream opened, and a fold forgets none
                return
            if resync:
                sent += 1
                yield _event("resync", {"rollout_id": rollout_id}, sent)
                resync = False
                last = None
            view = rollout_out(rollout)
            seen = view.model_dump_json()
            if seen != last:
                last = seen
                sent += 1
                yield _event("state", view, sent)
            state = rollout.state
            wave = wave_event(rollout)
            if wave is not None and (wave["wave"], len(wave["gates"])) != mark:
                mark = (wave["wave"], len(wave["gates"]))
                sent += 1
                yield _event("wave", wave, sent)
            if rollout.ended and state is not None:
                end = {
                    "rollout_id": rollout_id,
                    "phase": state.phase.value,
                    "code": state.code,
                    "exit_code": view.exit_code,
                }
                yield _event("end", end, sent + 1)
                return
            if closing.is_set():
                return
            try:
                changed = await anext(feed)
            except StopAsyncIteration:  # the coordinator stopped
                return
            resync = RESYNC in changed
