"""Apply one command to the runner: in a thread, under its timeout and a stop's drain deadline.

Returns the :class:`Outcome` (and what the command applied, for the journal); writes nothing
and publishes nothing. A runner that raises, or ignores cancellation, becomes a coded error.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, assert_never

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.protocol import (
    AckError,
    AckState,
    Command,
    ReloadWeightsSpec,
    UpdateConfigSpec,
)
from workers.agent.durable import Applied, ConfigApplied
from workers.agent.session import AgentLog, StopSignal
from workers.runners.base import ReloadResult, Runner, RunnerDescription

#: After a runner ignores cancellation this long past its deadline, we stop waiting for it.
_CANCEL_GRACE_S = 30.0


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
    call: Callable[[], ReloadResult | RunnerDescription]
    if isinstance(spec, ReloadWeightsSpec):
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
    reason: WireCode | None = None
    while not task.done():
        limit = deadline
        drain = stop.drain_deadline()
        if drain is not None:
            limit = min(limit, drain)
        if time.monotonic() >= limit:
            reason = WireCode.WORKER_SHUTTING_DOWN if limit < deadline else WireCode.COMMAND_TIMEOUT
            cancel.set()
            log(
                logging.WARNING,
                "cancelling (%s)",
                reason.value,
                command_id=command.command_id,
                rollout_id=command.rollout_id,
            )
            await asyncio.wait({task}, timeout=_CANCEL_GRACE_S)
            break
        await asyncio.wait({task}, timeout=min(0.2, max(0.0, limit - time.monotonic())))
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
    if isinstance(spec, ReloadWeightsSpec) and isinstance(value, ReloadResult):
        return Outcome(AckState.SUCCEEDED, result=value.as_dict(), applied=spec)
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
