"""Apply one command to the runner: in a thread, under its timeout and a stop's drain deadline.

Returns the :class:`Outcome` (and what the command applied, for the journal); writes nothing
and publishes nothing. A runner that raises, or ignores cancellation, becomes a coded error.
A reload that asks for a probe runs it once the weights are applied, within the same timeout;
whatever the probe does, the reload stays succeeded (:func:`probe_result`).

A dry run (``Command.dry_run``) runs the runner's checks only (``validate_reload`` /
``validate_config``): succeeded with their facts and ``result["dry_run"] = True``, or the code
the command would get; it applies nothing (no ``applied`` for the journal) and runs no probe.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, assert_never

from pydantic import JsonValue

from controlplane.wire.errors import ControlPlaneError, RunnerError, WireCode
from controlplane.wire.messages import ProbeSpec
from controlplane.wire.protocol import (
    AckError,
    AckState,
    Command,
    ReloadWeightsSpec,
    UpdateConfigSpec,
)
from workers.agent.durable import Applied, ConfigApplied
from workers.agent.session import AgentLog, StopSignal
from workers.runners.base import ProbeResult, ReloadResult, Runner, RunnerDescription

#: After a runner ignores cancellation this long past its deadline, we stop waiting for it.
_CANCEL_GRACE_S = 30.0
#: A probe error's message is clipped to this many characters in the ack's result.
_PROBE_MESSAGE_CHARS = 1024
#: The result member that marks every ack of a dry run (docs/wire.md, "Dry runs").
DRY_RUN: Final = "dry_run"


@dataclass
class Outcome:
    """How a command ended: its terminal state, and what it changed."""

    state: AckState
    error: AckError | None = None
    result: dict[str, Any] | None = None
    #: The runner's description after the command, when the runner returned one.
    description: RunnerDescription | None = None
    #: What the command applied, for the journal (phase 1) to re-apply after a restart.
    applied: Applied | None = None


def ack_error(exc: ControlPlaneError) -> AckError:
    return AckError(code=exc.code.value, message=exc.message[:4096], retryable=exc.retryable)


async def apply(
    runner: Runner,
    command: Command,
    path: Path | None,
    *,
    default_timeout_s: float,
    stop: StopSignal,
    log: AgentLog,
) -> Outcome:
    """Run the command in a thread under its timeout and the drain deadline.

    ``path`` is the resolved weights path of a reload (see ``commands.precheck``)."""
    spec = command.spec
    cancel = threading.Event()
    call: Callable[[], ReloadResult | RunnerDescription | dict[str, JsonValue]]
    if command.dry_run:
        call = _dry_call(runner, spec, path, cancel)
    elif isinstance(spec, ReloadWeightsSpec):
        if path is None:
            raise ValueError("a reload is applied with its resolved weights path")
        weights = path
        call = lambda: runner.reload_weights(spec, weights, cancel=cancel)  # noqa: E731
    elif isinstance(spec, UpdateConfigSpec):
        call = lambda: runner.update_config(dict(spec.overrides))  # noqa: E731
    else:  # pragma: no cover - the discriminated union has no other member
        assert_never(spec)
    timeout = command.timeout_s or default_timeout_s
    task = asyncio.ensure_future(asyncio.to_thread(call))
    deadline = time.monotonic() + timeout
    reason = await _until_done(task, deadline, stop)
    if reason is not None:
        cancel.set()
        log(
            logging.WARNING,
            "cancelling (%s)",
            reason.value,
            command_id=command.command_id,
            rollout_id=command.rollout_id,
        )
        await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
    if not task.done():
        return Outcome(
            AckState.FAILED,
            AckError(
                code=reason or WireCode.COMMAND_TIMEOUT,
                retryable=True,
                message=f"runner did not stop within {_CANCEL_GRACE_S:.0f}s of cancellation",
            ),
        )
    try:
        value = task.result()
    except ControlPlaneError as exc:
        error = ack_error(exc)
        if reason is not None and exc.code is WireCode.COMMAND_TIMEOUT:
            error = AckError(code=reason, message=exc.message, retryable=True)
        elif reason is not None:
            error = AckError(
                code=exc.code,
                retryable=exc.retryable,
                message=f"{exc.message} (after cancellation: {reason.value})",
            )
        return Outcome(AckState.REJECTED if exc.is_rejection else AckState.FAILED, error)
    except Exception as exc:  # a runner bug must not kill the agent
        log(logging.ERROR, "runner raised %r", exc, command_id=command.command_id)
        return Outcome(
            AckState.FAILED,
            AckError(code=WireCode.INTERNAL, message=f"{type(exc).__name__}: {exc}"),
        )
    if command.dry_run and isinstance(value, dict):
        return Outcome(AckState.SUCCEEDED, result={**value, DRY_RUN: True})
    if isinstance(spec, ReloadWeightsSpec) and isinstance(value, ReloadResult):
        result: dict[str, Any] = value.as_dict()
        if spec.probe is not None:
            result["probe"] = await probe_result(
                runner, spec.probe, deadline, stop=stop, log=log, command=command
            )
        return Outcome(AckState.SUCCEEDED, result=result, applied=spec)
    if isinstance(spec, UpdateConfigSpec) and isinstance(value, RunnerDescription):
        return Outcome(
            AckState.SUCCEEDED,
            result={"overrides": sorted(spec.overrides)},
            description=value,  # the runner's state after the update: no describe() call
            applied=ConfigApplied(spec.overrides),
        )
    return Outcome(  # pragma: no cover - a runner returned the wrong type
        AckState.FAILED,
        AckError(code=WireCode.INTERNAL, message=f"runner returned {type(value).__name__}"),
    )


def _dry_call(
    runner: Runner,
    spec: ReloadWeightsSpec | UpdateConfigSpec,
    path: Path | None,
    cancel: threading.Event,
) -> Callable[[], dict[str, JsonValue]]:
    """The runner's checks for ``spec``, as a call for a thread: ``validate_reload`` (given the
    command's cancel where it takes one) or ``validate_config``. A runner without them cannot
    check without applying: RUNNER_FAILED, nothing applied."""
    name = "validate_reload" if isinstance(spec, ReloadWeightsSpec) else "validate_config"
    method = getattr(runner, name, None)
    if not callable(method):

        def unsupported() -> dict[str, JsonValue]:
            raise RunnerError(
                f"runner {runner.name!r} cannot check a command without applying it (no"
                f" {name}): dry run refused, nothing applied",
                code=WireCode.RUNNER_FAILED,
            )

        return unsupported
    if isinstance(spec, UpdateConfigSpec):
        overrides = dict(spec.overrides)
        return lambda: method(overrides)
    if path is None:
        raise ValueError("a reload is checked with its resolved weights path")
    weights = path
    if _takes_cancel(method):
        return lambda: method(spec, weights, cancel=cancel)
    return lambda: method(spec, weights)


def _takes_cancel(method: Callable[..., Any]) -> bool:
    """Whether a runner's ``validate_reload`` takes the command's ``cancel`` event."""
    try:
        return "cancel" in inspect.signature(method).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def _limit(deadline: float, stop: StopSignal) -> tuple[float, WireCode]:
    """When a command's run must end (monotonic): its deadline, or a stop's drain deadline if
    earlier; and the code that says which."""
    drain = stop.drain_deadline()
    if drain is not None and drain < deadline:
        return drain, WireCode.WORKER_SHUTTING_DOWN
    return deadline, WireCode.COMMAND_TIMEOUT


async def _until_done(
    task: asyncio.Future[Any], deadline: float, stop: StopSignal
) -> WireCode | None:
    """Wait for ``task`` until ``deadline`` or a stop's drain deadline (monotonic), whichever
    comes first: None when it finished in time, else why it did not."""
    while not task.done():
        limit, reason = _limit(deadline, stop)
        if time.monotonic() >= limit:
            return reason
        await asyncio.wait({task}, timeout=min(0.2, max(0.0, limit - time.monotonic())))
    return None


def _probe_error(code: str, message: str) -> dict[str, JsonValue]:
    return {"error": {"code": code, "message": message[:_PROBE_MESSAGE_CHARS]}}


async def probe_result(
    runner: Runner,
    probe: ProbeSpec,
    deadline: float,
    *,
    stop: StopSignal,
    log: AgentLog,
    command: Command,
) -> dict[str, JsonValue]:
    """Run ``probe`` on the weights just applied, in a thread, by ``deadline`` (the command's).

    What goes into the succeeded ack as ``result["probe"]``: the :class:`ProbeResult`'s dict,
    ``{"unsupported": true}`` when the runner cannot probe, or ``{"error": {"code", "message"}}``
    when it raised or ran past the deadline or a stop's drain deadline. A probe cannot be
    cancelled: one still running when its time is up ends on its own, and the runner's lock
    keeps the next command waiting for it.
    """
    method = getattr(runner, "probe", None)  # a runner written before probes cannot probe
    if method is None:
        return {"unsupported": True}
    ids = {"command_id": command.command_id, "rollout_id": command.rollout_id}
    limit, reason = _limit(deadline, stop)
    if time.monotonic() >= limit:  # the reload took all the time there was
        log(logging.WARNING, "no time left to probe (%s)", reason.value, **ids)
        return _probe_error(reason.value, f"no time left to run the probe ({reason.value})")
    task = asyncio.ensure_future(asyncio.to_thread(method, probe.prompt, probe.max_tokens))
    late = await _until_done(task, deadline, stop)
    if late is not None:
        task.add_done_callback(_ignore_result)
        log(logging.WARNING, "probe given up (%s)", late.value, **ids)
        return _probe_error(late.value, f"the probe did not finish in time ({late.value})")
    try:
        value = task.result()
    except ControlPlaneError as exc:
        log(logging.WARNING, "probe failed: %s: %s", exc.code.value, exc.message, **ids)
        return _probe_error(exc.code.value, exc.message)
    except Exception as exc:  # a runner bug must not fail the reload it follows
        log(logging.ERROR, "probe raised %r", exc, **ids)
        return _probe_error(WireCode.INTERNAL.value, f"{type(exc).__name__}: {exc}")
    if value is None:
        return {"unsupported": True}
    if not isinstance(value, ProbeResult):
        return _probe_error(
            WireCode.INTERNAL.value, f"runner's probe returned {type(value).__name__}"
        )
    return value.as_dict()


def _ignore_result(task: asyncio.Future[Any]) -> None:
    """A probe given up on: whatever it ends with is nobody's (no "never retrieved" warning)."""
    if not task.cancelled():
        task.exception()
