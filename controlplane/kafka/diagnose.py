"""Why a secured connection failed: wrong credentials, an untrusted certificate, a denying ACL.

aiokafka's bootstrap only logs why it could not connect and then raises "Unable to bootstrap"
(BROKER_UNAVAILABLE), so after such a failure on a TLS or SASL connection :func:`diagnose` makes
one connection itself, as the bootstrap does, and says what the broker or the handshake answered:

- SaslAuthenticationFailed (the broker refused the user or password): KAFKA_AUTH_FAILED;
- ssl.SSLCertVerificationError (the broker's certificate is not signed by a trusted CA, or does
  not name the host): KAFKA_TLS_UNTRUSTED;
- anything else (refused, timed out, closed): nothing to add, BROKER_UNAVAILABLE stays.

:func:`classify` is that mapping, and also turns an ACL's refusal (aiokafka's Topic, Group,
TransactionalId and Cluster authorization errors) into KAFKA_ACCESS_DENIED. Each message ends
with a one-line hint and never holds a password.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

from aiokafka.conn import collect_hosts, create_conn
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnsupportedSaslMechanismError,
)

from controlplane.kafka.health import log
from controlplane.kafka.settings import KafkaSettings, connection_options
from controlplane.wire.errors import BusError, LocalCode

#: What an ACL denied, by aiokafka's error: the resource it names.
DENIED: dict[type[Exception], str] = {
    TopicAuthorizationFailedError: "topic",
    GroupAuthorizationFailedError: "consumer group",
    TransactionalIdAuthorizationFailed: "transactional id",
    ClusterAuthorizationFailedError: "cluster operation",
}

ACL_HINT = (
    "the broker's ACLs do not allow it to this principal: grant it (kafka-acls, "
    "see docs/security.md) or use the principal meant for this process"
)


def _who(principal: str | None) -> str:
    return f"user {principal!r}" if principal else "this client"


def classify(exc: BaseException, what: str, *, principal: str | None = None) -> BusError | None:
    """``exc`` as a coded error if it is a refusal of this client's credentials, certificate or
    access; None for anything else. ``what`` says what we were doing."""
    if isinstance(exc, SaslAuthenticationFailed | UnsupportedSaslMechanismError):
        detail = exc.args[0] if exc.args and isinstance(exc.args[0], str) else type(exc).__name__
        hint = (
            "the broker does not enable this sasl_mechanism"
            if isinstance(exc, UnsupportedSaslMechanismError)
            else "check sasl_username and sasl_password (or sasl_password_file)"
        )
        return BusError(
            f"{what}: the broker refused {_who(principal)}: {detail}; {hint}",
            code=LocalCode.KAFKA_AUTH_FAILED,
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or exc.reason or str(exc)
        return BusError(
            f"{what}: the broker's TLS certificate is not trusted: {detail}; ssl_cafile must "
            "hold the CA that signed it, and it must name the host in bootstrap_servers",
            code=LocalCode.KAFKA_TLS_UNTRUSTED,
        )
    for error, resource in DENIED.items():
        if isinstance(exc, error):
            names = _names(exc.args)
            on = f"{resource} {names}" if names else f"a {resource}"
            return BusError(
                f"{what}: access denied to {_who(principal)} on {on}; {ACL_HINT}",
                code=LocalCode.KAFKA_ACCESS_DENIED,
            )
    return None


def _names(args: tuple[object, ...]) -> str:
    """What aiokafka named in an authorization error: a name, or a set of them."""
    names: list[str] = []
    for arg in args:
        if isinstance(arg, set | frozenset | list | tuple):
            names += sorted(str(name) for name in arg)
        elif arg is not None and str(arg):
            names.append(str(arg))
    return ", ".join(names)


async def diagnose(settings: KafkaSettings) -> BusError | None:
    """One connection to the first bootstrap server of ``settings``, made as aiokafka's bootstrap
    makes it: the coded reason it fails (:func:`classify`), or None when it connects or fails
    otherwise. Bounded by the request timeout. A PLAINTEXT connection has nothing to tell."""
    if settings.security_protocol == "PLAINTEXT":
        return None
    return await diagnose_connection(
        settings.bootstrap_servers, connection_options(settings), principal=settings.sasl_username
    )


async def diagnose_connection(
    bootstrap_servers: str | list[str], options: dict[str, Any], *, principal: str | None
) -> BusError | None:
    """:func:`diagnose` for a client's own connection ``options`` (``create_conn``'s)."""
    hosts = collect_hosts(bootstrap_servers)
    if not hosts:
        return None
    host, port, _ = hosts[0]
    what = f"connecting to {host}:{port} ({options.get('security_protocol')})"
    timeout_s = options.get("request_timeout_ms", 30_000) / 1000
    try:
        async with asyncio.timeout(timeout_s):
            conn = await create_conn(host, port, **options)
    except Exception as exc:
        found = classify(exc, what, principal=principal)
        if found is None:
            log.debug("%s: %s: nothing to add to BROKER_UNAVAILABLE", what, exc)
        return found
    with contextlib.suppress(Exception):
        conn.close()
    return None


async def diagnose_client(client: Any) -> BusError | None:
    """:func:`diagnose` for an aiokafka ``AIOKafkaClient`` whose bootstrap failed: its own
    servers and connection options (those its bootstrap passed to ``create_conn``)."""
    if getattr(client, "_security_protocol", "PLAINTEXT") == "PLAINTEXT":
        return None
    options = {
        "client_id": client._client_id,
        "request_timeout_ms": client._request_timeout_ms,
        "ssl_context": client._ssl_context,
        "security_protocol": client._security_protocol,
        "sasl_mechanism": client._sasl_mechanism,
        "sasl_plain_username": client._sasl_plain_username,
        "sasl_plain_password": client._sasl_plain_password,
        "sasl_oauth_token_provider": client._sasl_oauth_token_provider,
    }
    return await diagnose_connection(
        client._bootstrap_servers, options, principal=client._sasl_plain_username
    )
