"""The worker's gate for signed commands: its trust store, and each command checked against it.

With no trust store configured every command passes (the behaviour before signing existed).
With one, a command must carry a signature by a trusted, unrevoked key whose scope allows its
kind, its selector and its reload path; anything else is refused with its code before the
journal sees it.

The store file is read at start-up (unreadable or invalid: SETTINGS_INVALID, the worker does not
start) and again, without a restart, on :meth:`TrustGate.reload` (SIGHUP, workers/cli.py) or when
:meth:`TrustGate.refresh`, called at each command's admission, sees the file changed (its
inode, size or mtime, looked at most every ``check_every_s``). A store that no longer reads or
validates leaves the previous one in force, with one coded line: never no store.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode, WireCode
from controlplane.wire.protocol import Command, CommandKind, ReloadWeightsSpec
from controlplane.wire.signing import (
    TrustStore,
    Verifier,
    read_trust_store,
    store_digest,
    wire_object,
)
from workers.weights.paths import resolve_weights_path

_logger = logging.getLogger(__name__)

#: What identifies a version of the store file without reading it: device, inode, size, mtime.
FileStamp = tuple[int, int, int, int]


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


def _stamp(path: Path) -> FileStamp | None:
    """The file's stamp, None when it cannot be looked at (the reload then says why)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _summary(store: TrustStore) -> str:
    return f"{len(store.keys)} key(s), {len(store.revoked)} revoked, sha256 {store_digest(store)}"


def _change(old: TrustStore, new: TrustStore) -> str:
    """What a reload changed, in a few words (key ids only)."""
    parts = []
    for what, before, after in (
        ("keys", set(old.keys), set(new.keys)),
        ("revoked", set(old.revoked), set(new.revoked)),
    ):
        added, removed = sorted(after - before), sorted(before - after)
        if added:
            parts.append(f"{what} +{added}")
        if removed:
            parts.append(f"{what} -{removed}")
    changed = sorted(k for k in set(old.keys) & set(new.keys) if old.keys[k] != new.keys[k])
    if changed:
        parts.append(f"keys changed {changed}")
    return "; ".join(parts) or "no key added, removed or revoked"


class TrustGate:
    """Admits commands: all of them without a trust store, only verified ones with one.

    With a store ``path``, :meth:`reload` reads it again and :meth:`refresh` does so when the
    file changed; neither ever leaves the gate without a store (fail closed).
    """

    def __init__(
        self,
        verifier: Verifier | None,
        worker_roots: Sequence[Path],
        *,
        path: Path | None = None,
        check_every_s: float = 2.0,
        monotonic: Callable[[], float] = time.monotonic,
        log: Callable[..., None] = _logger.log,
    ) -> None:
        self.verifier = verifier
        self._worker_roots = tuple(worker_roots)
        self._path = path if verifier is not None else None
        self._check_every_s = check_every_s
        self._monotonic = monotonic
        #: ``log(level, msg, *args)``: the agent's, which names the worker.
        self._log = log
        self._stamp = None if self._path is None else _stamp(self._path)
        self._checked = monotonic()

    @classmethod
    def from_path(
        cls,
        path: Path | None,
        worker_roots: Sequence[Path],
        *,
        check_every_s: float = 2.0,
        log: Callable[..., None] = _logger.log,
    ) -> TrustGate:
        if path is None:
            return cls(None, worker_roots, log=log)
        stamp = _stamp(path)  # before reading: a change while reading is seen next time
        gate = cls(
            load_verifier(path), worker_roots, path=path, check_every_s=check_every_s, log=log
        )
        gate._stamp = stamp
        return gate

    @property
    def digest(self) -> str | None:
        """The sha256 of the store in force (RFC 8785 JSON), None without a store."""
        return None if self.verifier is None else store_digest(self.verifier.store)

    def refresh(self) -> bool:
        """Read the store again if its file changed since it was last read (looked at no more
        often than every ``check_every_s``: one ``stat``). Whether the store in force changed."""
        if self._path is None:
            return False
        now = self._monotonic()
        if now - self._checked < self._check_every_s:
            return False
        self._checked = now
        if _stamp(self._path) == self._stamp:
            return False
        return self.reload("the file changed")

    def reload(self, why: str = "asked to (SIGHUP)") -> bool:
        """Read the store file again. A store that reads and validates replaces the one in
        force (the change logged); one that does not leaves it in force (one SETTINGS_INVALID
        line). Whether the store in force changed. Never raises; without a store, does nothing."""
        path, verifier = self._path, self.verifier
        if path is None or verifier is None:
            return False
        stamp = _stamp(path)
        self._stamp = stamp  # a broken file is reported once, not at every command
        self._checked = self._monotonic()
        try:
            fresh = load_verifier(path)
        except ControlPlaneError as exc:
            self._log(
                logging.ERROR,
                "%s: %s; trust store reload (%s) refused: the previous store stays in force (%s)",
                exc.code.value,
                exc.message,
                why,
                _summary(verifier.store),
            )
            return False
        except Exception as exc:  # never a crash, never no store
            self._log(
                logging.ERROR,
                "%s: trust store %s could not be reloaded (%s): %s: %s; the previous store"
                " stays in force (%s)",
                LocalCode.SETTINGS_INVALID.value,
                path,
                why,
                type(exc).__name__,
                exc,
                _summary(verifier.store),
            )
            return False
        old = verifier.store
        if fresh.store == old:
            self._log(
                logging.INFO,
                "trust store %s read again (%s): unchanged (%s)",
                path,
                why,
                _summary(old),
            )
            return False
        self.verifier = fresh
        self._log(
            logging.WARNING,
            "trust store %s reloaded (%s): %s; now %s",
            path,
            why,
            _change(old, fresh.store),
            _summary(fresh.store),
        )
        return True

    def distrusts(
        self, key_id: str | None, kind: CommandKind, weights: str | None = None
    ) -> CommandRejected | None:
        """Why what ``key_id`` admitted (a command of ``kind``; ``weights``: a reload's path)
        must not be re-applied now (a restart): its key is revoked, or not in the store, or
        there was none (admitted without a store), or its scope no longer allows that kind or
        path (the selector is not journaled: not checked again). None when it is trusted, and
        always without a store."""
        if self.verifier is None:
            return None
        store = self.verifier.store
        if key_id is None:
            return CommandRejected(
                "applied by a command admitted without a signature", code=WireCode.SIGNATURE_MISSING
            )
        if key_id in store.revoked:
            return CommandRejected(f"key {key_id!r} is revoked", code=WireCode.KEY_REVOKED)
        entry = store.keys.get(key_id)
        if entry is None:
            return CommandRejected(
                f"key {key_id!r} is not in the trust store", code=WireCode.KEY_UNKNOWN
            )
        kinds = entry.scope.kinds
        if kinds is not None and kind not in kinds:
            return CommandRejected(
                f"key {key_id!r} may no longer sign {kind.value} commands",
                code=WireCode.SCOPE_DENIED,
            )
        roots = entry.scope.path_roots
        if weights is not None and roots is not None and self._mine(weights):
            return self._outside_scope(key_id, roots, weights)
        return None

    def _outside_scope(
        self, key_id: str, key_roots: Sequence[str], path: str
    ) -> CommandRejected | None:
        """SCOPE_DENIED when ``path``, which lies in the worker's own roots, lies outside where
        both the key and the worker allow weights."""
        try:
            resolve_weights_path(
                path, scoped_roots([Path(r) for r in key_roots], self._worker_roots)
            )
        except CommandRejected:
            return CommandRejected(
                f"key {key_id!r} may not name weights at {path!r}: its scope allows only paths"
                f" under {list(key_roots)}",
                code=WireCode.SCOPE_DENIED,
            )
        return None

    def _mine(self, path: str) -> bool:
        """Whether ``path`` lies in the worker's own roots (else PATH_NOT_ALLOWED, the worker's
        own refusal, comes first)."""
        try:
            resolve_weights_path(path, self._worker_roots)
        except CommandRejected:
            return False
        return True

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
        if not self._mine(path):
            return Admitted(verified.key_id)  # outside the worker's roots: PATH_NOT_ALLOWED later
        refused = self._outside_scope(verified.key_id, key_roots, path)
        if refused is not None:
            raise refused
        roots = scoped_roots([Path(r) for r in key_roots], self._worker_roots)
        return Admitted(verified.key_id, roots)
