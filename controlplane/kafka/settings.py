"""Settings shared by every process that talks to Kafka; each process has its own model with an env prefix.

No I/O at validation but importing a named OAUTHBEARER token provider; the TLS files and a
password file are read when a client is made (:func:`connection_options`), so a rotated file is
read again.
Security settings pass through to aiokafka (TLS and SASL) once they make sense together: PLAIN
in the clear, a SASL mechanism without credentials and OAUTHBEARER without a token provider are
refused here, before any connection (aiokafka would send the password in the clear, fail at the
broker, or raise a ``ValueError`` from inside its bootstrap).
"""

from __future__ import annotations

import importlib
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context
from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings.exceptions import SettingsError

from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
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
    sasl_password_file: Path | None = Field(
        default=None,
        description=(
            "A file holding the SASL password (one trailing newline is dropped), read each "
            "time a client is made; instead of sasl_password, never with it."
        ),
    )
    sasl_oauth_token_provider: str | None = Field(
        default=None,
        description=(
            "OAUTHBEARER's token provider as 'module:attr': an aiokafka.abc.AbstractTokenProvider "
            "instance, or a subclass made with no arguments. Imported when the settings are read."
        ),
    )
    allow_plain_without_tls: bool = Field(
        default=False,
        description="Allow the PLAIN mechanism over SASL_PLAINTEXT (the password in the clear).",
    )
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_key_password: SecretStr | None = Field(
        default=None, description="The password of an encrypted ssl_keyfile."
    )
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

    _token_provider: AbstractTokenProvider | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _min_insync_fits(self) -> KafkaSettings:
        rf, min_isr = self.replication_factor, self.min_insync_replicas
        if rf is not None and min_isr is not None and min_isr > rf:
            raise ValueError(
                f"min_insync_replicas {min_isr} exceeds replication_factor {rf}: "
                "no write could ever be acknowledged"
            )
        return self

    @field_validator("sasl_oauth_token_provider")
    @classmethod
    def _provider_imports(cls, value: str | None) -> str | None:
        if value is not None:
            import_token_provider(value)
        return value

    @model_validator(mode="after")
    def _security_fits(self) -> KafkaSettings:
        protocol, mechanism = self.security_protocol, self.sasl_mechanism
        sasl = protocol.startswith("SASL_")
        if mechanism is not None and not sasl:
            raise ValueError(
                f"sasl_mechanism {mechanism} is set but security_protocol is {protocol}: "
                "SASL needs SASL_SSL (or SASL_PLAINTEXT)"
            )
        if sasl and mechanism is None:
            raise ValueError(f"security_protocol {protocol} needs a sasl_mechanism")
        if self.sasl_password is not None and self.sasl_password_file is not None:
            raise ValueError("give sasl_password or sasl_password_file, not both")
        if mechanism == "OAUTHBEARER":
            if self.sasl_oauth_token_provider is None:
                raise ValueError(
                    "sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider "
                    "('module:attr' naming an aiokafka.abc.AbstractTokenProvider)"
                )
        elif mechanism is not None:
            if not self.sasl_username:
                raise ValueError(f"sasl_mechanism {mechanism} needs sasl_username")
            if self.sasl_password is None and self.sasl_password_file is None:
                raise ValueError(
                    f"sasl_mechanism {mechanism} needs sasl_password or sasl_password_file"
                )
        if (
            mechanism == "PLAIN"
            and protocol == "SASL_PLAINTEXT"
            and not self.allow_plain_without_tls
        ):
            raise ValueError(
                "sasl_mechanism PLAIN over SASL_PLAINTEXT sends the password in the clear: "
                "use SASL_SSL, or set allow_plain_without_tls"
            )
        return self

    def sasl_secret(self) -> str | None:
        """The SASL password, from ``sasl_password`` or read now from ``sasl_password_file``;
        an unreadable file is SETTINGS_INVALID."""
        if self.sasl_password is not None:
            return self.sasl_password.get_secret_value()
        if self.sasl_password_file is None:
            return None
        try:
            text = self.sasl_password_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ControlPlaneError(
                f"sasl_password_file {str(self.sasl_password_file)!r} is unreadable: "
                f"{exc.strerror if isinstance(exc, OSError) else exc}",
                code=LocalCode.SETTINGS_INVALID,
            ) from None
        secret = text.removesuffix("\n").removesuffix("\r")
        if not secret:
            raise ControlPlaneError(
                f"sasl_password_file {str(self.sasl_password_file)!r} is empty",
                code=LocalCode.SETTINGS_INVALID,
            )
        return secret

    def token_provider(self) -> AbstractTokenProvider | None:
        """OAUTHBEARER's provider: the named instance, or one instance of the named subclass
        made on first use and kept (it may cache its token across connections)."""
        if self.sasl_oauth_token_provider is None:
            return None
        if self._token_provider is None:
            named = import_token_provider(self.sasl_oauth_token_provider)
            self._token_provider = named() if isinstance(named, type) else named
        return self._token_provider

    @property
    def topics(self) -> Topics:
        return Topics(
            prefix=self.topic_prefix,
            replication_factor=self.replication_factor,
            min_insync_replicas=self.min_insync_replicas,
        )


def connection_options(settings: KafkaSettings) -> dict[str, Any]:
    """What one connection to a broker of ``settings`` takes (aiokafka's ``create_conn``, and
    every client with ``bootstrap_servers`` added): TLS and SASL pass through. Reads the TLS
    files and the password file now; one that cannot be read is SETTINGS_INVALID."""
    opts: dict[str, Any] = {
        "client_id": settings.client_id,
        "request_timeout_ms": settings.request_timeout_ms,
        "security_protocol": settings.security_protocol,
    }
    if settings.security_protocol in ("SSL", "SASL_SSL"):
        opts["ssl_context"] = ssl_context(settings)
    if settings.sasl_mechanism is not None:
        opts["sasl_mechanism"] = settings.sasl_mechanism
        if settings.sasl_mechanism == "OAUTHBEARER":
            opts["sasl_oauth_token_provider"] = settings.token_provider()
        else:
            opts["sasl_plain_username"] = settings.sasl_username
            opts["sasl_plain_password"] = settings.sasl_secret()
    return opts


def ssl_context(settings: KafkaSettings) -> ssl.SSLContext:
    """The TLS context of ``settings``; a CA, certificate or key that cannot be loaded (missing,
    not PEM, a wrong key password) is SETTINGS_INVALID naming the files."""
    password = settings.ssl_key_password
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=settings.ssl_cafile,
            certfile=settings.ssl_certfile,
            keyfile=settings.ssl_keyfile,
            password=None if password is None else password.get_secret_value(),
        )
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        files = ", ".join(
            f"{name}={value!r}"
            for name, value in (
                ("ssl_cafile", settings.ssl_cafile),
                ("ssl_certfile", settings.ssl_certfile),
                ("ssl_keyfile", settings.ssl_keyfile),
            )
            if value is not None
        )
        raise ControlPlaneError(
            f"cannot load the TLS files ({files or 'the system CAs'}): {exc}",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    return context


def import_token_provider(
    spec: str,
) -> AbstractTokenProvider | type[AbstractTokenProvider]:
    """What ``module:attr`` names, if it is a token provider (an instance, or a subclass);
    anything else is a ``ValueError`` saying what it found."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{spec!r} is not 'module:attr'")
    try:
        named: object = importlib.import_module(module_name)
    except Exception as exc:  # an import runs the module's code: anything may fail
        raise ValueError(f"cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        try:
            named = getattr(named, part)
        except AttributeError:
            raise ValueError(f"{module_name!r} has no attribute {attr!r}") from None
    if isinstance(named, AbstractTokenProvider):
        return named
    if isinstance(named, type) and issubclass(named, AbstractTokenProvider):
        return named
    raise ValueError(
        f"{spec!r} is a {type(named).__name__}, not an aiokafka.abc.AbstractTokenProvider "
        "(an instance, or a subclass made with no arguments)"
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
