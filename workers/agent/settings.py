"""The worker agent's settings: environment (FLEET_WORKER_*, nested with "__") and CLI flags.

Everything is checked when the settings are built (by the wire's own rules for what goes into a
heartbeat), so a bad label or id stops the worker before it connects to Kafka, with
SETTINGS_INVALID. No I/O beyond reading the environment; passed explicitly to the agent.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from controlplane.kafka.settings import KafkaSettings, load_settings
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.protocol import (
    MAX_LEASE_S,
    MAX_MESSAGE_BYTES,
    Heartbeat,
    Identifier,
    Labels,
    WorkerStatus,
    utcnow,
)
from controlplane.wire.validation import Location, summarize
from workers.runners.base import RUNNERS

ENV_PREFIX = "FLEET_WORKER_"
#: The runners whose loader checks model signatures (workers/weights/oms.py).
_SIGNATURE_RUNNERS = ("torch", "xla")
#: Heartbeat periods a heartbeat vouches for the worker when ``lease_s`` is not set.
LEASE_PERIODS = 10


def _default_worker_id() -> str:
    return socket.gethostname().split(".")[0] or "worker"


class WorkerSettings(BaseSettings):
    """Everything one worker agent needs. Example: FLEET_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    worker_id: Identifier = Field(
        default_factory=_default_worker_id,
        description="Unique in the fleet; also names this worker's journal under state_dir.",
    )
    labels: Labels = Field(
        default_factory=dict,
        description="JSON object in env; keys and values follow the heartbeat's label rules.",
    )
    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    runner: str = "torch"
    runner_options: dict[str, Any] = Field(default_factory=dict, description="JSON object in env.")
    allowed_roots: list[Path] = Field(
        default_factory=list,
        description="Weights may only be loaded from inside these directories.",
    )
    state_dir: Path = Field(
        default=Path(".fleet/workers"),
        description="Local state (applied command ids, position, current weights); one subdir per worker.",
    )
    heartbeat_interval_s: float = Field(default=3.0, gt=0)
    lease_s: float | None = Field(
        default=None,
        gt=0,
        description=(
            "How long each heartbeat vouches for this worker: readers count it lost when no"
            " newer heartbeat arrived within this many seconds. None: LEASE_PERIODS heartbeat"
            " periods (30 s with the default 3 s period), longer than Kafka takes to fence a"
            " dead broker and elect new leaders (broker.session.timeout.ms, 9 s by default),"
            " so a broker failover never makes a live worker look lost. At least one period."
        ),
    )
    command_timeout_s: float = Field(
        default=900.0, gt=0, description="Default per-command timeout."
    )
    drain_timeout_s: float = Field(
        default=60.0, ge=0, description="On SIGTERM, how long the command in flight may still run."
    )
    progress_grace_s: float = Field(
        default=0.25,
        ge=0,
        description=(
            "How long a command's accepted and running acks are held (like a producer's linger) and"
            " its busy heartbeat waits, at most one heartbeat period. A command done within it"
            " publishes its three acks in one request; 0 releases them as soon as it starts."
        ),
    )
    max_message_bytes: int = Field(default=MAX_MESSAGE_BYTES, gt=0)
    max_ttl_s: float = Field(
        default=7 * 24 * 3600,
        gt=0,
        description=(
            "The longest lifetime (expires_at - issued_at) a command may have; a longer one is"
            " rejected with TTL_TOO_LONG."
        ),
    )
    max_clock_skew_s: float = Field(
        default=300.0,
        ge=0,
        description=(
            "How far in this worker's future a command's issued_at may be (clocks differ); a"
            " command issued later than that is rejected with ISSUED_IN_FUTURE."
        ),
    )
    trust_store: Path | None = Field(
        default=None,
        description=(
            "A trust store (JSON, controlplane/wire/signing.py: key id -> public key and scope,"
            " revoked key ids). Set: only commands signed by a trusted key within its scope are"
            " applied. Unset: unsigned commands are accepted (said loudly at start-up)."
        ),
    )
    trust_store_check_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "How often, at most, a command's admission looks whether the trust store file changed"
            " (one stat); a changed file is read again without a restart (so does SIGHUP). 0: at"
            " every command."
        ),
    )
    model_trust: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description=(
            "Trusted model keys: ECDSA public keys (PEM files; in env one path or a JSON list). A"
            " checkpoint with a model.sig (OpenSSF model signing) loads only if it verifies with one"
            " of them and every byte copied matches it (workers/weights/oms.py); torch and xla."
        ),
    )
    require_model_signature: bool = Field(
        default=False,
        description="Load only signed checkpoints (MODEL_SIGNATURE_MISSING otherwise).",
    )
    restore_on_start: bool = Field(
        default=True, description="Re-apply the last applied weights and config after a restart."
    )

    @field_validator("runner")
    @classmethod
    def _known_runner(cls, name: str) -> str:
        if name not in RUNNERS:
            raise ValueError(
                f"unknown runner {name!r}; choose one of: {', '.join(sorted(RUNNERS))}"
            )
        return name

    @field_validator("model_trust", mode="before")
    @classmethod
    def _one_key_or_many(cls, value: Any) -> Any:
        if isinstance(value, str) and value.lstrip().startswith("["):
            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not a JSON list: {exc}") from None
        return [value] if isinstance(value, str | Path) else value

    @model_validator(mode="after")
    def _model_trust_reaches_the_runner(self) -> WorkerSettings:
        """The model keys go to the runner with its options (its own check reads them)."""
        if not self.model_trust and not self.require_model_signature:
            return self
        if self.runner not in _SIGNATURE_RUNNERS:
            raise ValueError(
                f"model_trust / require_model_signature: runner {self.runner!r} does not check"
                f" model signatures (only {', '.join(_SIGNATURE_RUNNERS)})"
            )
        if self.require_model_signature and not self.model_trust:
            raise ValueError("require_model_signature is set but model_trust names no key")
        self.runner_options = {
            **self.runner_options,
            "model_trust": [str(p.expanduser().resolve()) for p in self.model_trust],
            "require_model_signature": self.require_model_signature,
        }
        return self

    @model_validator(mode="after")
    def _lease_covers_a_period(self) -> WorkerSettings:
        if self.lease_s is not None and self.lease_s < self.heartbeat_interval_s:
            raise ValueError(
                f"lease_s {self.lease_s:g} is shorter than heartbeat_interval_s"
                f" {self.heartbeat_interval_s:g}: a heartbeat must vouch for the worker at"
                " least until the next one is due"
            )
        return self

    @model_validator(mode="after")
    def _fits_a_heartbeat(self) -> WorkerSettings:
        """What every heartbeat carries from here must pass the wire's rules now, not when the
        first heartbeat is built (after Kafka connects)."""
        now = utcnow()
        try:
            Heartbeat(
                worker_id=self.worker_id,
                labels=self.labels,
                runner=self.runner,
                device="unknown",
                status=WorkerStatus.STARTING,
                seq=0,
                sent_at=now,
                started_at=now,
                interval_s=self.heartbeat_interval_s,
                lease_s=self.effective_lease_s,
            )
        except ValidationError as exc:
            problems = summarize(exc, limit=5, more=False, name=_setting_name)
            raise ValueError(f"not valid in a heartbeat: {problems}") from None
        return self

    @field_validator("allowed_roots")
    @classmethod
    def _absolute(cls, roots: list[Path]) -> list[Path]:
        return [r.expanduser().resolve() for r in roots]

    @property
    def effective_lease_s(self) -> float:
        """The lease every heartbeat carries: ``lease_s``, else :data:`LEASE_PERIODS` periods
        (at most the longest lease the wire allows)."""
        if self.lease_s is not None:
            return self.lease_s
        return min(LEASE_PERIODS * self.heartbeat_interval_s, MAX_LEASE_S)

    @property
    def worker_state_dir(self) -> Path:
        """This worker's journal directory: one per worker id (see :func:`worker_dir_name`)."""
        return self.state_dir / worker_dir_name(self.worker_id)


#: Heartbeat field -> the setting it comes from.
_HEARTBEAT_FIELDS = {
    "worker_id": "worker_id",
    "labels": "labels",
    "runner": "runner",
    "interval_s": "heartbeat_interval_s",
    "lease_s": "lease_s",
}


def _setting_name(loc: Location) -> str:
    """The setting a heartbeat field comes from (the field itself if none; ``heartbeat``)."""
    if not loc:
        return "heartbeat"
    return _HEARTBEAT_FIELDS.get(str(loc[0]), str(loc[0]))


def worker_dir_name(worker_id: str) -> str:
    """The directory name of a worker's state: the id, with "/" written "%2F".

    One directory per id ('%' cannot occur in an id, so no two ids share a name), and an id
    without "/" keeps its name as it is.
    """
    return worker_id.replace("/", "%2F")


def load_worker_settings(**values: Any) -> WorkerSettings:
    """Settings from the environment and ``values`` (flags); bad ones are SETTINGS_INVALID."""
    try:
        return load_settings(WorkerSettings, **values)
    except ControlPlaneError as exc:
        raise ControlPlaneError(exc.message, code=LocalCode.SETTINGS_INVALID) from None
