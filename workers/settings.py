"""The worker agent's settings: environment (FLEET_WORKER_*, nested with "__") and CLI flags.

No I/O beyond reading the environment; passed explicitly to the agent.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from controlplane.protocol import MAX_MESSAGE_BYTES
from controlplane.settings import KafkaSettings

ENV_PREFIX = "FLEET_WORKER_"


def _default_worker_id() -> str:
    return socket.gethostname().split(".")[0] or "worker"


class WorkerSettings(BaseSettings):
    """Everything one worker agent needs. Example: FLEET_WORKER_KAFKA__BOOTSTRAP_SERVERS=kafka:9092."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="forbid"
    )

    worker_id: str = Field(
        default_factory=_default_worker_id, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$"
    )
    labels: dict[str, str] = Field(default_factory=dict, description="JSON object in env.")
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
    restore_on_start: bool = Field(
        default=True, description="Re-apply the last applied weights and config after a restart."
    )

    @field_validator("allowed_roots")
    @classmethod
    def _absolute(cls, roots: list[Path]) -> list[Path]:
        return [r.expanduser().resolve() for r in roots]

    @property
    def worker_state_dir(self) -> Path:
        return self.state_dir / self.worker_id.replace("/", "_")
