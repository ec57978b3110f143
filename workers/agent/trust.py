"""The worker's gate for signed commands: its trust store, and each command checked against it.

With no trust store configured every command passes (the behaviour before signing existed).
With one, a command must carry a signature by a trusted, unrevoked key whose scope allows its
kind, its selector and its reload path; anything else is refused with its code before the
journal sees it. Reads the store file once, at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.wire.errors import CommandRejected, WireCode
from controlplane.wire.protocol import Command, ReloadWeightsSpec
from controlplane.wire.signing import Verifier, read_trust_store, wire_object
from workers.weights.paths import resolve_weights_path


@dataclass(frozen=True)
class Admitted:
    """A command the gate lets through, and the roots its reload path is checked against
    (None: the worker's own ``allowed_roots``)."""

    key_id: str | None
    roots: tuple[Path, ...] | None = None


def load_verifier(path: Path) -> Verifier:
    """The trust store at ``path``; unreadable or invalid is SETTINGS_INVALID."""
    return Verifier(read_trust_store(path))


def scoped_roots(key_roots: Sequence[Path], worker_roots: Sequence[Path]) -> tuple[Path, ...]:
    """Where both the key and the worker allow weights: each root of one that lies inside a
    root of the other (two directory trees meet only where one holds the other)."""
    keys = [Path(r).resolve(strict=False) for r in key_roots]
    mine = [Path(r).resolve(strict=False) for r in worker_roots]
    both = {k for k in keys if any(k.is_relative_to(w) for w in mine)}
    both |= {w for w in mine if any(w.is_relative_to(k) for k in keys)}
    return tuple(sorted(both))


class TrustGate:
    """Admits commands: all of them without a trust store, only verified ones with one."""

    def __init__(self, verifier: Verifier | None, worker_roots: Sequence[Path]) -> None:
        self.verifier = verifier
        self._worker_roots = tuple(worker_roots)

    @classmethod
    def from_path(cls, path: Path | None, worker_roots: Sequence[Path]) -> TrustGate:
        return cls(None if path is None else load_verifier(path), worker_roots)

    def describe(self, path: Path | None) -> str:
        """For the start-up log: whether unsigned commands are taken."""
        if self.verifier is None:
            return (
                "UNSIGNED COMMANDS ACCEPTED: no trust store (FLEET_WORKER_TRUST_STORE), so anyone"
                " who can write to the commands topic controls this worker"
            )
        store = self.verifier.store
        return (
            f"signed commands only: trust store {path} ({len(store.keys)} key(s),"
            f" {len(store.revoked)} revoked)"
        )

    def admit(self, command: Command, data: bytes) -> Admitted:
        """``command``, decoded from the record ``data``: admitted, or CommandRejected with
        SIGNATURE_MISSING, SIGNATURE_INVALID, KEY_UNKNOWN, KEY_REVOKED or SCOPE_DENIED."""
        if self.verifier is None:
            return Admitted(key_id=None)
        verified = self.verifier.verify(command, wire_object(data))
        key_roots = verified.scope.path_roots
        if key_roots is None or not isinstance(command.spec, ReloadWeightsSpec):
            return Admitted(verified.key_id)
        path = command.spec.path
        try:
            resolve_weights_path(path, self._worker_roots)
        except CommandRejected:
            return Admitted(verified.key_id)  # outside the worker's roots: PATH_NOT_ALLOWED later
        roots = scoped_roots([Path(r) for r in key_roots], self._worker_roots)
        try:
            resolve_weights_path(path, roots)
        except CommandRejected:
            raise CommandRejected(
                f"key {verified.key_id!r} may not name weights at {path!r}: its scope allows"
                f" only paths under {key_roots}",
                code=WireCode.SCOPE_DENIED,
            ) from None
        return Admitted(verified.key_id, roots)
