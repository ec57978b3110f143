"""Signed commands: Ed25519 over the RFC 8785 (JCS) canonical JSON of a command, and trust stores.

The signed bytes are the canonical JSON of the command *as written on the wire* (the JSON
object that was received, not a re-encoding of our model), less its ``signature`` member, so
any producer that writes a valid command (our CLI, kcat, a Java client) signs the same bytes a
worker verifies. A :class:`TrustStore` says which keys a worker (or a coordinator) trusts, what
each may command (kinds, the selectors it may target, the path roots of its reloads), and which
key ids are revoked. One file read (:func:`read_trust_store`, at start-up); keys are read by
their callers.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import posixpath
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Final

import rfc8785
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import AfterValidator, Field, ValidationError

from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode, WireCode
from controlplane.wire.messages import (
    Command,
    CommandKind,
    Identifier,
    Selector,
    Signature,
    WireModel,
)
from controlplane.wire.validation import summarize

#: The member that holds the signature: left out of the signed bytes.
SIGNATURE_FIELD: Final = "signature"
_UTF8_BOM: Final = b"\xef\xbb\xbf"
#: JCS numbers are IEEE doubles: integers in this range are exact.
_MAX_JCS_INT: Final = 2**53 - 1
_BMP_KEY: Final = re.compile("[\x00-\uffff]*")
#: A trust store file larger than this is refused unread.
MAX_TRUST_STORE_BYTES: Final = 4 * 1024 * 1024


# --------------------------------------------------------------------------- canonical form


def canonical_json(command: Mapping[str, Any]) -> bytes:
    """The bytes a command's signature covers: RFC 8785 JSON of ``command`` without
    ``signature``. A value JCS cannot represent exactly (an integer beyond 2**53 - 1 in
    magnitude, a non-finite float) is SIGNATURE_INVALID: such a command cannot be signed.

    ``rfc8785`` writes it, unless :func:`_plain` can give the json module an equal value to
    write: then the same bytes come 10-50x faster (a command pinned to 1,000 workers holds
    1,000 strings). The json module's string escapes are JCS's; its key order (code points)
    is JCS's (UTF-16 code units) when no key holds a character past U+FFFF; an integral float
    is written as the integer it equals, and any other float in [1e-4, 1e16) in the same
    shortest round-trip digits (Python's repr and ECMAScript's agree there).
    tests/unit/test_signing.py checks the two agree byte for byte.
    """
    unsigned = {k: v for k, v in command.items() if k != SIGNATURE_FIELD}
    try:
        plain = _plain(unsigned)
        text = json.dumps(plain, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return text.encode("utf-8")
    except (_NotPlain, UnicodeEncodeError, RecursionError):  # rfc8785 writes it, or refuses
        return jcs(unsigned)


class _NotPlain(Exception):
    """A value :func:`_plain` leaves to rfc8785."""


def _plain(value: Any) -> Any:
    """``value`` for the json module to write as JCS would, or _NotPlain."""
    kind = type(value)
    if kind is str or kind is bool or value is None:
        return value
    if kind is int:
        if -_MAX_JCS_INT <= value <= _MAX_JCS_INT:
            return value
    elif kind is float:
        if value.is_integer():
            if -_MAX_JCS_INT <= value <= _MAX_JCS_INT:
                return int(value)
        elif 1e-4 <= abs(value) < 1e16:
            return value
    elif kind is list:
        return [_plain(item) for item in value]
    elif kind is dict and all(_BMP_KEY.fullmatch(key) for key in value):
        return {key: _plain(item) for key, item in value.items()}
    raise _NotPlain


def jcs(value: Any) -> bytes:
    """RFC 8785 JSON of ``value`` by the ``rfc8785`` library; SIGNATURE_INVALID if it has none."""
    try:
        return rfc8785.dumps(value)
    except rfc8785.CanonicalizationError as exc:
        raise CommandRejected(
            f"the command has no RFC 8785 canonical form ({exc}): it cannot be signed",
            code=WireCode.SIGNATURE_INVALID,
        ) from None


def wire_object(data: bytes) -> dict[str, Any]:
    """The JSON object of a record that :func:`~controlplane.wire.codec.decode_command` has
    accepted (valid JSON, no duplicate key, at most 1 MiB), as the wire wrote it."""
    if data[:3] == _UTF8_BOM:
        data = data[3:]
    value = json.loads(data)
    if not isinstance(value, dict):  # pragma: no cover - the codec accepted an object
        raise CommandRejected("a command is a JSON object", code=WireCode.SCHEMA_INVALID)
    return value


def command_object(command: Command) -> dict[str, Any]:
    """The JSON object our encoder writes for ``command`` (what our producers sign)."""
    value: dict[str, Any] = json.loads(command.model_dump_json(exclude_none=False))
    return value


# --------------------------------------------------------------------------- keys


def _b64decode(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise ValueError(f"{what} is not base64") from None


def public_key_text(key: Ed25519PublicKey) -> str:
    """A public key as trust stores write it: base64 of its 32 raw bytes."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode("ascii")


def parse_public_key(text: str) -> Ed25519PublicKey:
    raw = _b64decode(text, "public_key")
    if len(raw) != 32:
        raise ValueError(f"an Ed25519 public key is 32 bytes, this one {len(raw)}")
    return Ed25519PublicKey.from_public_bytes(raw)


def fingerprint(key: Ed25519PublicKey) -> str:
    """A default key id: ``ed25519-`` and 16 hex digits of the sha256 of the raw public key."""
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"ed25519-{hashlib.sha256(raw).hexdigest()[:16]}"


def private_key_pem(key: Ed25519PrivateKey) -> bytes:
    """A private key as its file holds it: unencrypted PKCS#8 PEM (``openssl pkey`` reads it)."""
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def load_private_key(pem: bytes, *, source: str) -> Ed25519PrivateKey:
    """An Ed25519 private key from PKCS#8 PEM; anything else is SETTINGS_INVALID."""
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ControlPlaneError(
            f"{source}: not an unencrypted PEM private key ({exc})",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ControlPlaneError(
            f"{source}: not an Ed25519 key ({type(key).__name__})",
            code=LocalCode.SETTINGS_INVALID,
        )
    return key


@dataclass(frozen=True)
class Signer:
    """A private key and the id it signs under."""

    key: Ed25519PrivateKey
    key_id: str

    def signature(self, command: Mapping[str, Any]) -> Signature:
        value = self.key.sign(canonical_json(command))
        return Signature(key_id=self.key_id, value=base64.b64encode(value).decode("ascii"))

    def sign(self, command: Command) -> Command:
        """``command`` with this signer's signature (any signature it had is replaced)."""
        return command.model_copy(update={"signature": self.signature(command_object(command))})

    def sign_object(self, command: dict[str, Any]) -> dict[str, Any]:
        """A command's JSON object (as a producer wrote it), signed: its members unchanged, in
        their order, and ``signature`` last."""
        signature = self.signature(command)
        signed = {k: v for k, v in command.items() if k != SIGNATURE_FIELD}
        signed[SIGNATURE_FIELD] = json.loads(signature.model_dump_json())
        return signed


# --------------------------------------------------------------------------- trust stores


def _valid_public_key(text: str) -> str:
    parse_public_key(text)
    return text


class KeyScope(WireModel):
    """What commands signed by one key may do. Each omitted field allows everything."""

    kinds: list[CommandKind] | None = Field(
        default=None, description="The command kinds the key may sign."
    )
    selectors: list[Selector] | None = Field(
        default=None,
        description=(
            "A command's selector must be at least as narrow as one of these: it requires every"
            " label the allowed selector requires (same value), and if the allowed selector"
            " names worker ids, the command names only workers among them."
        ),
    )
    path_roots: list[Annotated[str, Field(min_length=1, max_length=4096)]] | None = Field(
        default=None,
        description="Absolute directories a reload's path (resolved on the worker) must lie in.",
    )


class TrustedKey(WireModel):
    public_key: Annotated[str, AfterValidator(_valid_public_key)] = Field(
        description="base64 of the 32 raw bytes of an Ed25519 public key."
    )
    scope: KeyScope = Field(default_factory=KeyScope)
    comment: str = ""


class TrustStore(WireModel):
    """Key id -> public key and scope, and the key ids no longer trusted."""

    keys: dict[Identifier, TrustedKey] = Field(default_factory=dict)
    revoked: list[Identifier] = Field(
        default_factory=list, description="Key ids refused (KEY_REVOKED) whatever ``keys`` says."
    )


def parse_trust_store(data: bytes, *, source: str) -> TrustStore:
    """A trust store from its JSON; a store that does not validate is SETTINGS_INVALID."""
    if len(data) > MAX_TRUST_STORE_BYTES:
        raise ControlPlaneError(
            f"{source}: a trust store of {len(data)} bytes (at most {MAX_TRUST_STORE_BYTES})",
            code=LocalCode.SETTINGS_INVALID,
        )
    try:
        return TrustStore.model_validate_json(data)
    except ValidationError as exc:
        raise ControlPlaneError(
            f"{source}: not a valid trust store: {summarize(exc, limit=5)}",
            code=LocalCode.SETTINGS_INVALID,
        ) from None


def read_trust_store(path: Path) -> TrustStore:
    """The trust store at ``path`` (read once, at most :data:`MAX_TRUST_STORE_BYTES` + 1 bytes);
    unreadable or invalid is SETTINGS_INVALID."""
    try:
        with path.open("rb") as handle:
            data = handle.read(MAX_TRUST_STORE_BYTES + 1)
    except OSError as exc:
        raise ControlPlaneError(
            f"trust store {str(path)!r} cannot be read: {exc.strerror or exc}",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    return parse_trust_store(data, source=f"trust store {str(path)!r}")


def store_digest(store: TrustStore) -> str:
    """The sha256 (hex) of a store's RFC 8785 JSON: equal for equal stores, however written."""
    return hashlib.sha256(jcs(store.model_dump(mode="json"))).hexdigest()


def lexically_within(path: str, roots: Iterable[str]) -> bool:
    """Whether ``path``, ``..`` and ``.`` folded away without the filesystem, lies in one of
    ``roots`` (absolute directories). A reader with no filesystem (the coordinator) checks a
    key's ``path_roots`` so; a worker also resolves symlinks (workers/agent/trust.py)."""
    if "\x00" in path or not posixpath.isabs(path):
        return False
    folded = posixpath.normpath(path)
    for root in roots:
        base = posixpath.normpath(root)
        if posixpath.isabs(base) and (folded == base or folded.startswith(base.rstrip("/") + "/")):
            return True
    return False


def narrower(selector: Selector, allowed: Selector) -> bool:
    """Whether every worker ``selector`` can match is one ``allowed`` matches."""
    if any(selector.labels.get(k) != v for k, v in allowed.labels.items()):
        return False
    if allowed.worker_ids is None:
        return True
    return selector.worker_ids is not None and set(selector.worker_ids) <= set(allowed.worker_ids)


@dataclass(frozen=True)
class Verified:
    """A command whose signature holds, by a trusted key whose scope allows its kind and
    selector (its reload path is the caller's to check against ``scope.path_roots``)."""

    key_id: str
    scope: KeyScope


class Verifier:
    """Checks commands against one trust store (public keys parsed once)."""

    def __init__(self, store: TrustStore) -> None:
        self.store = store
        self._keys = {kid: parse_public_key(k.public_key) for kid, k in store.keys.items()}
        self._revoked = frozenset(store.revoked)

    def verify(self, command: Command, wire: Mapping[str, Any]) -> Verified:
        """``command`` as decoded from ``wire`` (its JSON object): verified, or refused with
        SIGNATURE_MISSING, KEY_REVOKED, KEY_UNKNOWN, SIGNATURE_INVALID or SCOPE_DENIED."""
        signature = command.signature
        if signature is None:
            raise CommandRejected(
                "unsigned command refused: its reader takes signed commands only (a trust store)",
                code=WireCode.SIGNATURE_MISSING,
            )
        key_id = signature.key_id
        if key_id in self._revoked:
            raise CommandRejected(f"key {key_id!r} is revoked", code=WireCode.KEY_REVOKED)
        key = self._keys.get(key_id)
        if key is None:
            raise CommandRejected(
                f"key {key_id!r} is not in the trust store", code=WireCode.KEY_UNKNOWN
            )
        try:
            value = _b64decode(signature.value, "signature")
            key.verify(value, canonical_json(wire))
        except (InvalidSignature, ValueError):
            raise CommandRejected(
                f"the signature by key {key_id!r} does not verify (the command was changed"
                " after signing, or signed by another key)",
                code=WireCode.SIGNATURE_INVALID,
            ) from None
        scope = self.store.keys[key_id].scope
        if scope.kinds is not None and command.kind not in scope.kinds:
            raise CommandRejected(
                f"key {key_id!r} may not sign {command.kind.value} commands"
                f" (its scope: {', '.join(k.value for k in scope.kinds) or 'none'})",
                code=WireCode.SCOPE_DENIED,
            )
        if scope.selectors is not None and not any(
            narrower(command.selector, allowed) for allowed in scope.selectors
        ):
            raise CommandRejected(
                f"key {key_id!r} may not target {_shown(command.selector)} (its scope: selectors"
                f" at least as narrow as one of {[_shown(s) for s in scope.selectors]})",
                code=WireCode.SCOPE_DENIED,
            )
        return Verified(key_id=key_id, scope=scope)


def _shown(selector: Selector) -> str:
    """A selector in a few words (a pinned one may name 50,000 workers)."""
    ids = selector.worker_ids
    workers = "any worker" if ids is None else f"{len(ids)} named worker(s)"
    return f"labels {selector.labels} and {workers}"
