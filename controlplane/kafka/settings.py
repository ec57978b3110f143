"""Settings shared by every process that talks to Kafka; each process has its own model with an env prefix.

No I/O. Security settings pass straight through to aiokafka (TLS and SASL).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings.exceptions import SettingsError

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.topics import DEFAULT_PREFIX, Topics
from controlplane.wire.validation import summarize

DEFAULT_BOOTSTRAP = "127.0.0.1:19092"

S = TypeVar("S")


class KafkaSettings(BaseModel):
    """How to reach the cluster. Nested in each process's settings (env ``<PREFIX>KAFKA__...``)."""

    bootstrap_servers: str = Field(
        default=DEFAULT_BOOTSTRAP, description="Comma-separated host:port list."
    )
    topic_prefix: str = DEFAULT_PREFIX
    replication_factor: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Replicas per partition of the topics `topics ensure` creates and checks; "
            "None: the cluster's default.replication.factor."
        ),
    )
    min_insync_replicas: int | None = Field(
        default=None,
        ge=1,
        description=(
            "min.insync.replicas of the topics; None: the replication factor minus 1 when it "
            "is 3 or more (a write survives losing a broker, and one broker may be down), else 1."
        ),
    )
    client_id: str = "fleet-controlplane"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    request_timeout_ms: int = Field(default=30_000, ge=1000)
    delivery_timeout_ms: int = Field(
        default=30_000,
        ge=1000,
        description=(
            "How long one publish may wait for the cluster to confirm it (acks=all). Past it "
            "the publish's outcome is unknown (PUBLISH_OUTCOME_UNKNOWN): the producer keeps "
            "the record and may still write it."
        ),
    )

    @model_validator(mode="after")
    def _min_insync_fits(self) -> KafkaSettings:
        rf, min_isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and min_isr is not None and min_isr > rf:
            raise ValueError(
                f"min_insync_replicas {min_isr} exceeds replication_factor {rf}: "
                "no write could ever be acknowledged"
            )
        return self

    @property
    def topics(self) -> Topics:
        return Topics(
            prefix=self.topic_prefix,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
        )


def load_settings(factory: Callable[..., S], **values: Any) -> S:
    """Build a process's settings from environment and flags; bad values are a coded error."""
    try:
        return factory(**values)
    except ValidationError as exc:
        raise ControlPlaneError(
            f"invalid settings: {summarize(exc, more=False)}", code=WireCode.SCHEMA_INVALID
        ) from None
    except SettingsError as exc:  # e.g. a JSON-valued variable that is not JSON
        raise ControlPlaneError(f"invalid settings: {exc}", code=WireCode.SCHEMA_INVALID) from None
