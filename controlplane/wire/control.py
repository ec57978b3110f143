"""The controller topic's records: targets, progressive rollouts, operator actions, controller state.

``<prefix>.controller`` is compacted and has one partition, so every reader folds the same
records in the same order (:mod:`controlplane.rollout.targets`). Two kinds of writer:

- operators (the CLI, the API) append *requests* under keys nobody else writes: a target's spec
  (``target/<name>``), a rollout (``rollout/<id>``), an action on a rollout
  (``action/<rollout id>/<action id>``). A request is a wish: the fold decides whether it is
  accepted, in log order, the same way for everyone.
- the controller, the one elected coordinator, writes the *state* of each rollout
  (``state/<rollout id>``, a growing ``revision``) and who leads (``leader``), only through its
  transactional producer, in the same transaction as the commands they decide (docs/controller.md).

A target's stable state is never written by the controller: it is the fold's result (the
target's spec, then each rollout of it that succeeded, in log order). No I/O.
"""

from __future__ import annotations

import codecs
import re
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import (
    AfterValidator,
    Field,
    JsonValue,
    StringConstraints,
    TypeAdapter,
    model_validator,
)
from pydantic_core import from_json

from controlplane.wire.codec import decode_model
from controlplane.wire.errors import ProtocolError, WireCode
from controlplane.wire.messages import (
    MAX_MESSAGE_BYTES,
    SCHEMA_VERSION,
    DrainPolicy,
    Identifier,
    Labels,
    SchemaVersion,
    Sha256Hex,
    Timestamp,
    WireModel,
    WorkerIds,
    _finite_json,
    _is_none,
)

#: Rollout ids of progressive rollouts are shorter than identifiers: the controller derives the
#: ids of their commands from them (``<rollout>.w<wave>.b<batch>``, ``<rollout>.rb.b<batch>``).
MAX_ROLLOUT_ID: Final = 96
RolloutId = Annotated[
    str, StringConstraints(pattern=rf"^[A-Za-z0-9][A-Za-z0-9._:@/-]{{0,{MAX_ROLLOUT_ID - 1}}}$")
]
TargetName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
#: A count of workers ("3") or a share of the target's workers ("10%", rounded up).
STEP: Final = r"^(?:[0-9]{1,6}|(?:[1-9][0-9]?|100)%)$"
Step = Annotated[str, StringConstraints(pattern=STEP)]
_PERCENT_RE: Final = re.compile(r"^([0-9]+)%$")

# ------------------------------------------------------------------ desired state


class WeightsRef(WireModel):
    """A checkpoint, as a reload command names it, and how the reload treats requests in
    flight and the prefix cache (each reload made from it carries them: a wave's, a drift
    sync's, a rollback to it)."""

    path: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    version: Identifier
    sha256: dict[Annotated[str, StringConstraints(min_length=1, max_length=1024)], Sha256Hex] = (
        Field(default_factory=dict, description="Optional manifest: file name -> sha256 hex.")
    )
    strict: bool = True
    # Never written when None, as in ReloadWeightsSpec: records written before drain policies
    # read the same, and the commands made from this ref omit what was not given.
    drain: DrainPolicy | None = Field(
        default=None,
        exclude_if=_is_none,
        description="ReloadWeightsSpec.drain of every reload to these weights. Omitted: the "
        "worker's default (wait, with a deadline).",
    )
    reset_cache: bool | None = Field(
        default=None,
        exclude_if=_is_none,
        description="ReloadWeightsSpec.reset_cache of every reload to these weights. Omitted: "
        "true.",
    )


class Desired(WireModel):
    """What a target's workers should run: weights and config overrides (either may be empty)."""

    weights: WeightsRef | None = None
    config: Annotated[
        dict[Annotated[str, StringConstraints(min_length=1, max_length=256)], JsonValue],
        AfterValidator(_finite_json),
    ] = Field(default_factory=dict)
    config_digest: Annotated[str, StringConstraints(min_length=1, max_length=128)] | None = Field(
        default=None,
        description="The config digest workers report once they run this config: learnt by the "
        "controller from the config rollout that made it stable (None: not known, so config "
        "drift is not judged).",
    )

    @property
    def version(self) -> str | None:
        return None if self.weights is None else self.weights.version


# ------------------------------------------------------------------ strategy


def step_count(step: str, total: int) -> int:
    """Workers a step stands for out of ``total``: a count (capped at ``total``) or a share,
    rounded up (Kubernetes' ``maxSurge`` rounding: "10%" of 5 is 1, never 0)."""
    match = _PERCENT_RE.match(step)
    if match is None:
        return min(int(step), total)
    return min(total, -(-total * int(match.group(1)) // 100))


class ProbeGate(WireModel):
    """A fixed prompt every updated worker runs after it applied the new weights; the answers
    must agree with each other and with what is given here."""

    prompt: Annotated[str, StringConstraints(min_length=1, max_length=4096)]
    max_tokens: Annotated[int, Field(ge=1, le=64)] = 8
    expect_tokens: list[Annotated[int, Field(ge=0)]] | None = Field(
        default=None, description="The greedy tokens every updated worker must produce."
    )
    min_mean_logprob: float | None = Field(
        default=None, description="The mean log-probability of those tokens must be at least this."
    )


class Strategy(WireModel):
    """How a rollout proceeds. The default is one wave of every worker at once."""

    canary: Annotated[int, Field(ge=0, le=100_000)] = Field(
        default=0, description="Workers of the first wave, before the steps (0: no canary)."
    )
    steps: list[Step] = Field(
        default_factory=lambda: ["100%"],
        min_length=1,
        max_length=100,
        description="Cumulative wave sizes after the canary; the last must reach every worker.",
    )
    max_unavailable: Annotated[int, Field(ge=1, le=1_000_000)] | None = Field(
        default=None,
        description="How many workers may be applying at once (batches within a wave); "
        "None: a wave at once.",
    )
    pause: Literal["manual"] | Annotated[float, Field(ge=0, le=7 * 86400)] = Field(
        default=0.0,
        description="Between waves: seconds, or 'manual' (until `rollout promote`).",
    )
    max_failures: Step = Field(
        default="0", description="Failed workers the rollout tolerates before it aborts."
    )
    bake_s: Annotated[float, Field(ge=0, le=86400)] = Field(
        default=0.0,
        description="After a wave, how long its workers must stay healthy before the next.",
    )
    progress_deadline_s: Annotated[float, Field(gt=0, le=7 * 86400)] = Field(
        default=600.0, description="How long one wave may take to apply and bake."
    )
    command_timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    probe: ProbeGate | None = None

    @model_validator(mode="after")
    def _last_step_reaches_everyone(self) -> Strategy:
        if self.steps[-1] != "100%":
            raise ValueError("the last step must be 100% (every worker of the target)")
        if self.bake_s >= self.progress_deadline_s:
            raise ValueError(
                f"bake_s {self.bake_s:g} must be shorter than progress_deadline_s "
                f"{self.progress_deadline_s:g} (a wave's deadline covers its bake)"
            )
        return self

    @property
    def manual(self) -> bool:
        return self.pause == "manual"

    @property
    def pause_s(self) -> float:
        return 0.0 if isinstance(self.pause, str) else self.pause


# ------------------------------------------------------------------ operator requests


class TargetSpec(WireModel):
    """A group of workers and, optionally, the state they should run (key ``target/<name>``).
    Written again, it replaces the selector; a ``stable`` given replaces the stable state."""

    type: Literal["target"] = "target"
    schema_version: SchemaVersion = SCHEMA_VERSION
    name: TargetName
    selector: Labels = Field(min_length=1, description="Every label must match.")
    stable: Desired | None = None
    issued_at: Timestamp
    issuer: Annotated[str, StringConstraints(min_length=1, max_length=256)]


class RolloutSpec(WireModel):
    """Start a progressive rollout of ``desired`` to a target (key ``rollout/<id>``)."""

    type: Literal["rollout"] = "rollout"
    schema_version: SchemaVersion = SCHEMA_VERSION
    rollout_id: RolloutId
    target: TargetName
    desired: Desired
    strategy: Strategy = Field(default_factory=Strategy)
    rollback: bool = Field(
        default=True, description="On abort, put every updated worker back on the stable state."
    )
    #: Set by `rollout undo`: the rollout whose change this one reverts.
    undo_of: RolloutId | None = None
    issued_at: Timestamp
    issuer: Annotated[str, StringConstraints(min_length=1, max_length=256)]

    @model_validator(mode="after")
    def _changes_something(self) -> RolloutSpec:
        if self.desired.weights is None and not self.desired.config:
            raise ValueError("a rollout must change the weights or the config")
        if self.desired.weights is not None and self.desired.config:
            raise ValueError(
                "a rollout changes the weights or the config, not both (roll them out one "
                "after the other: each is gated, and undone, on its own)"
            )
        if self.desired.weights is None and self.strategy.probe is not None:
            # Only a reload asks the workers for the probe (ReloadWeightsSpec.probe).
            raise ValueError(
                "a probe gate needs a rollout of weights (a config change is not probed)"
            )
        return self


class ActionKind(StrEnum):
    PAUSE = "pause"
    RESUME = "resume"
    PROMOTE = "promote"
    ABORT = "abort"


class RolloutAction(WireModel):
    """An operator's action on a running rollout (key ``action/<rollout id>/<action id>``)."""

    type: Literal["action"] = "action"
    schema_version: SchemaVersion = SCHEMA_VERSION
    rollout_id: RolloutId
    action_id: Identifier
    action: ActionKind
    #: For abort: None keeps the rollout's own ``rollback``.
    rollback: bool | None = None
    #: For promote: the wave whose pause it releases (the CLI and API say which; None: the
    #: next pause not released yet, so a repeated one may release a later pause).
    wave: Annotated[int, Field(ge=0)] | None = None
    reason: Annotated[str, StringConstraints(max_length=1024)] = ""
    issued_at: Timestamp
    issuer: Annotated[str, StringConstraints(min_length=1, max_length=256)]


# ------------------------------------------------------------------ controller records


class ControlPhase(StrEnum):
    PROGRESSING = "progressing"
    #: Waiting at a wave boundary: for ``promote`` (manual pause), or paused by an operator.
    PAUSED = "paused"
    #: Aborted; putting the updated workers back on the stable state.
    ROLLING_BACK = "rolling_back"
    SUCCEEDED = "succeeded"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"
    #: Never started (unknown target, another rollout in progress, no worker).
    REJECTED = "rejected"

    @property
    def terminal(self) -> bool:
        return self in _ENDED


_ENDED: Final = frozenset(
    {ControlPhase.SUCCEEDED, ControlPhase.ABORTED, ControlPhase.ROLLED_BACK, ControlPhase.REJECTED}
)


class GateResult(WireModel):
    wave: Annotated[int, Field(ge=0)]
    gate: Literal["health", "agreement", "probe"]
    passed: bool
    message: Annotated[str, StringConstraints(max_length=4096)] = ""
    #: Once passed: what the wave agreed on (with the earlier ones), so later waves are judged
    #: against it without the earlier acks: the weights digest (agreement), the probe's tokens
    #: as a JSON list (probe). None when no worker said (a runner that cannot).
    value: Annotated[str, StringConstraints(max_length=4096)] | None = None


class RolloutState(WireModel):
    """Where a rollout stands, as its controller decided (key ``state/<rollout id>``)."""

    type: Literal["state"] = "state"
    schema_version: SchemaVersion = SCHEMA_VERSION
    rollout_id: RolloutId
    target: TargetName
    #: Grows by one with every state written; a reader keeps the highest.
    revision: Annotated[int, Field(ge=0)]
    phase: ControlPhase
    #: The waves, planned once when the rollout started: worker ids, canary first.
    waves: list[WorkerIds] = Field(default_factory=list)
    #: The wave in progress (``len(waves)`` once every wave passed).
    wave: Annotated[int, Field(ge=0)] = 0
    #: The batch in progress within the wave (batches of ``max_unavailable``).
    batch: Annotated[int, Field(ge=0)] = 0
    #: When the current wave's last batch ended (bake and pause count from here).
    wave_done_at: Timestamp | None = None
    #: When the current wave started (its progress deadline counts from here).
    wave_started_at: Timestamp | None = None
    #: When the current wave, applied, was first seen healthy: its bake counts from here, and
    #: from here on any of its workers unhealthy fails the health gate.
    healthy_at: Timestamp | None = None
    #: Promote actions consumed (each one releases one manual pause).
    promoted: Annotated[int, Field(ge=0)] = 0
    failed: WorkerIds = Field(default_factory=list)
    gates: list[GateResult] = Field(default_factory=list)
    #: The target's stable state when the rollout started: what a rollback reloads.
    previous: Desired | None = None
    #: Workers to put back on ``previous``, in batches, once aborted with rollback.
    rollback: list[WorkerIds] = Field(default_factory=list)
    rollback_batch: Annotated[int, Field(ge=0)] = 0
    code: str | None = None
    message: Annotated[str, StringConstraints(max_length=4096)] = ""
    #: Once ``succeeded``: the target's stable state it made (read by the fold, so the
    #: result does not depend on records compaction may have removed).
    result: Desired | None = None
    started_at: Timestamp
    updated_at: Timestamp
    ended_at: Timestamp | None = None


class LeaderRecord(WireModel):
    """Who controls (key ``leader``): written by each new leader in its first transaction."""

    type: Literal["leader"] = "leader"
    schema_version: SchemaVersion = SCHEMA_VERSION
    member: Annotated[str, StringConstraints(min_length=1, max_length=256)]
    generation: int
    producer_epoch: int
    since: Timestamp


ControlRecord = Annotated[
    TargetSpec | RolloutSpec | RolloutAction | RolloutState | LeaderRecord,
    Field(discriminator="type"),
]
CONTROL_RECORD: Final[TypeAdapter[ControlRecord]] = TypeAdapter(ControlRecord)


def control_key(record: WireModel) -> bytes:
    """The compaction key: one per target spec, rollout, action, rollout state; one leader."""
    match record:
        case TargetSpec() if record.stable is not None:
            # A key of its own per declared stable state: a later spec that only changes the
            # selector must not let compaction remove it (the stable state would go back).
            key = f"target/{record.name}/stable@{record.issued_at.isoformat()}"
        case TargetSpec():
            key = f"target/{record.name}"
        case RolloutSpec():
            key = f"rollout/{record.rollout_id}"
        case RolloutAction():
            key = f"action/{record.rollout_id}/{record.action_id}"
        case RolloutState():
            key = f"state/{record.rollout_id}"
        case LeaderRecord():
            key = "leader"
        case _:
            raise TypeError(f"not a controller record: {type(record).__name__}")
    return key.encode("utf-8")


_BY_TYPE: Final[dict[str, type[WireModel]]] = {
    "target": TargetSpec,
    "rollout": RolloutSpec,
    "action": RolloutAction,
    "state": RolloutState,
    "leader": LeaderRecord,
}


def decode_control(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> ControlRecord:
    """A controller-topic record, or a coded ProtocolError (SCHEMA_INVALID for an unknown
    ``type``; the refusals of :func:`~controlplane.wire.codec.decode_model` otherwise)."""
    kind: object = None
    if len(data) <= max_bytes:
        body = data[3:] if data[:3] == codecs.BOM_UTF8 else data  # as the codec ignores it
        try:
            raw = from_json(body, allow_inf_nan=False)
        except ValueError:
            raw = None  # decode_model says why, below
        else:
            if isinstance(raw, dict):
                kind = raw.get("type")
                if not isinstance(kind, str) or kind not in _BY_TYPE:
                    shown = repr(kind)[:64]
                    raise ProtocolError(
                        f"unknown controller record type {shown}; expected one of "
                        f"{', '.join(_BY_TYPE)}",
                        code=WireCode.SCHEMA_INVALID,
                    )
    model = _BY_TYPE.get(kind, TargetSpec) if isinstance(kind, str) else TargetSpec
    record: ControlRecord = decode_model(model, data, max_bytes=max_bytes)  # type: ignore[assignment]
    return record
