"""`controlplane keys generate|show` and `controlplane sign`: signing keys for commands, and
signing any producer's command JSON (stdin to stdout), so kcat or a Java client can sign.

A private key is a PKCS#8 PEM file written with mode 0600; its public half is printed as a
trust store document (``{"keys": {ID: {"public_key": ..., "scope": {...}}}}``) that workers load
with ``--trust-store`` / FLEET_WORKER_TRUST_STORE. Entry point only: signing itself is
controlplane/wire/signing.py.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.cli.common import app, fail
from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode, ProtocolError
from controlplane.wire.exits import CliExit, error_line
from controlplane.wire.protocol import CommandKind, Selector, decode_command
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    fingerprint,
    load_private_key,
    private_key_pem,
    public_key_text,
    wire_object,
)

keys_app = typer.Typer(help="Signing keys for commands (Ed25519).", no_args_is_help=True)
app.add_typer(keys_app, name="keys")

SigningKeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--signing-key",
        envvar="FLEET_SIGNING_KEY",
        help="Sign the command with this private key (PEM, from `controlplane keys generate`).",
    ),
]
KeyIdOpt = Annotated[
    str | None,
    typer.Option(
        "--key-id",
        envvar="FLEET_SIGNING_KEY_ID",
        help="The key id the workers' trust store knows the key by (default: its fingerprint).",
    ),
]


def read_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        pem = path.read_bytes()
    except OSError as exc:
        raise ControlPlaneError(
            f"signing key {str(path)!r} cannot be read: {exc.strerror or exc}",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    return load_private_key(pem, source=f"signing key {str(path)!r}")


def signer_from(path: Path | None, key_id: str | None) -> Signer | None:
    """The signer that ``--signing-key`` and ``--key-id`` name (None without a key)."""
    if path is None:
        if key_id is not None:
            raise ControlPlaneError(
                "--key-id without --signing-key: give the private key to sign with",
                code=LocalCode.SETTINGS_INVALID,
            )
        return None
    key = read_private_key(path)
    return Signer(key, _key_id(key, key_id))


def _key_id(key: Ed25519PrivateKey, key_id: str | None) -> str:
    chosen = key_id or fingerprint(key.public_key())
    try:
        Selector(worker_ids=[chosen])  # an Identifier, as a Signature's key_id must be
    except ValueError:
        raise ControlPlaneError(
            f"key id {chosen!r} is not an identifier ([A-Za-z0-9][A-Za-z0-9._:@/-]{{0,127}})",
            code=LocalCode.SETTINGS_INVALID,
        ) from None
    return chosen


def _store_entry(key: Ed25519PrivateKey, key_id: str, scope: KeyScope) -> str:
    entry = TrustedKey(public_key=public_key_text(key.public_key()), scope=scope)
    store = TrustStore(keys={key_id: entry})
    shown: dict[str, Any] = json.loads(store.model_dump_json(exclude_none=True))
    shown.pop("revoked", None)
    shown["keys"][key_id].pop("comment", None)
    return json.dumps(shown, indent=2)


def _scope(
    kinds: list[str] | None, selectors: list[str] | None, roots: list[str] | None
) -> KeyScope:
    try:
        labels: dict[str, str] = {}
        for item in selectors or []:
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"--selector {item!r} must look like key=value")
            labels[key] = value
        return KeyScope(
            kinds=[CommandKind(k) for k in kinds] if kinds else None,
            selectors=[Selector(labels=labels)] if selectors else None,
            path_roots=roots or None,
        )
    except ValueError as exc:
        raise fail(ControlPlaneError(str(exc), code=LocalCode.SETTINGS_INVALID)) from None


KindScopeOpt = Annotated[
    list[str] | None,
    typer.Option("--kind", help="Scope: a command kind the key may sign, repeatable."),
]
SelectorScopeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--selector",
        "-s",
        help="Scope: key=value every command's selector must require, repeatable.",
    ),
]
RootScopeOpt = Annotated[
    list[str] | None,
    typer.Option("--path-root", help="Scope: a directory reloads must name, repeatable."),
]


@keys_app.command("generate")
def generate(
    path: Annotated[Path, typer.Argument(help="Where to write the private key (mode 0600).")],
    key_id: KeyIdOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    kind: KindScopeOpt = None,
    selector: SelectorScopeOpt = None,
    path_root: RootScopeOpt = None,
) -> None:
    """Make an Ed25519 key pair: the private key to PATH, its trust store entry to stdout."""
    scope = _scope(kind, selector, path_root)
    key = Ed25519PrivateKey.generate()
    try:
        chosen = _key_id(key, key_id)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            raise ControlPlaneError(
                f"cannot write {str(path)!r}: {exc.strerror or exc}"
                + (" (use --force to replace it)" if isinstance(exc, FileExistsError) else ""),
                code=LocalCode.SETTINGS_INVALID,
            ) from None
        with os.fdopen(fd, "wb") as handle:
            os.fchmod(handle.fileno(), 0o600)  # also when --force replaced a laxer file
            handle.write(private_key_pem(key))
    except ControlPlaneError as exc:
        raise fail(exc) from None
    typer.echo(_store_entry(key, chosen, scope))
    typer.echo(f"private key {path} (key id {chosen}): keep it secret", err=True)


@keys_app.command("show")
def show(
    path: Annotated[Path, typer.Argument(help="A private key file.")],
    key_id: KeyIdOpt = None,
    kind: KindScopeOpt = None,
    selector: SelectorScopeOpt = None,
    path_root: RootScopeOpt = None,
) -> None:
    """Print the trust store entry (public key, scope) of a private key file."""
    scope = _scope(kind, selector, path_root)
    try:
        key = read_private_key(path)
        typer.echo(_store_entry(key, _key_id(key, key_id), scope))
    except ControlPlaneError as exc:
        raise fail(exc) from None


@app.command("sign")
def sign(
    signing_key: Annotated[
        Path,
        typer.Option(
            "--signing-key", envvar="FLEET_SIGNING_KEY", help="The private key (PEM) to sign with."
        ),
    ],
    key_id: KeyIdOpt = None,
) -> None:
    """Sign a command: its JSON on stdin, the same command signed on stdout (one line).

    The command is checked as a worker checks it first (valid JSON, no duplicate key, the
    schema); its members are kept as written and ``signature`` is set (replaced if present).
    """
    data = sys.stdin.buffer.read()
    try:
        key = read_private_key(signing_key)
        signer = Signer(key, _key_id(key, key_id))
    except ControlPlaneError as exc:
        raise fail(exc) from None
    try:
        decode_command(data)
        signed = signer.sign_object(wire_object(data))
    except (ProtocolError, CommandRejected) as exc:  # the input: exit 3, as for any invalid input
        typer.echo(error_line(exc), err=True)
        raise typer.Exit(CliExit.INVALID) from None
    typer.echo(json.dumps(signed, ensure_ascii=False, separators=(",", ":")))
