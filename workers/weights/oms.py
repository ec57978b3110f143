"""Checkpoints signed in the OpenSSF model-signing format (OMS), checked before any tensor is copied.

A signed checkpoint directory holds ``model.sig``: a Sigstore bundle whose DSSE envelope, signed
with an ECDSA (P-256/384/521) key, carries an in-toto statement listing every file of the
directory with its BLAKE3 or sha256, or every shard of every file with its sha256. Sign one with
``fleet-worker checkpoint write --sign KEY`` (BLAKE3 by default: ``--sign-hash``) or
model-signing's own ``model_signing sign key``. Any other hashing (blake2, BLAKE3 shards) is
refused, MODEL_SIGNATURE_INVALID.

Only the envelope is checked here, against the worker's trusted model keys
(``FLEET_WORKER_MODEL_TRUST``): model-signing's public ``verify()`` would re-read and re-hash the
whole directory, a second pass over the weights. The signed digests become the expected digests
of what the loader copies (``workers.weights.verify``), so each byte is read from disk once.

model-signing (the ``[verify]`` extra, pinned: the two modules used here are private) is imported
only when a signature is checked or made.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Protocol

from controlplane.wire.errors import RunnerError, WireCode
from workers.weights.paths import CheckpointFiles, check_member

#: The signature's name in a signed checkpoint directory (what model-signing's CLI writes).
SIGNATURE_NAME = "model.sig"
#: A shard size to sign with (``sign_checkpoint(shard_bytes=...)``): the loader's read chunk.
SIGN_SHARD_BYTES = 8 * 1024 * 1024
#: What a signature may hash with: (serialization method, hash_type) -> the descriptors' algorithm
#: (a prefix for shards). BLAKE3 only by whole file: model-signing signs no BLAKE3 shards.
_ACCEPTED = {
    ("files", "sha256"): "sha256",
    ("shards", "sha256"): "sha256-sharded-",
    ("files", "blake3"): "blake3",
}
#: The hashes ``sign_checkpoint`` signs with, and which one ``checkpoint write --sign`` uses:
#: BLAKE3 hashes ~5x faster than sha256 per core (docs/benchmarks.md, "Verified reload"), and
#: model-signing's own ``verify`` checks it.
SIGN_HASHES = ("blake3", "sha256")
DEFAULT_SIGN_HASH = "blake3"
_INSTALL_HINT = "install the [verify] extra: pip install 'fleet-controlplane[verify]'"


def _invalid(message: str) -> RunnerError:
    return RunnerError(message, code=WireCode.MODEL_SIGNATURE_INVALID)


@dataclass(frozen=True)
class ModelTrust:
    """The model keys a worker trusts (ECDSA public keys, PEM), and whether it loads only signed
    checkpoints. Keys are checked when the runner starts (:func:`load_model_trust`)."""

    keys: tuple[Path, ...]
    required: bool = False


@dataclass(frozen=True)
class Span:
    """A signed byte range ``[start, end)`` of one file, and the hex digest of its bytes by
    ``algorithm`` (``sha256`` or ``blake3``)."""

    start: int
    end: int
    digest: str
    algorithm: str = "sha256"


class Hasher(Protocol):
    """What hashlib's sha256 and blake3's hashers both are."""

    def update(self, data: bytes | memoryview, /) -> object: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str, *, threads: int = 1) -> Hasher:
    """A running hash for ``algorithm``; BLAKE3 on up to ``threads`` threads of its own (each
    ``update`` of a large buffer is split between them; both release the GIL)."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        from blake3 import blake3  # model-signing's own dependency

        hasher: Hasher = blake3(max_threads=max(1, threads))
        return hasher
    raise _invalid(f"cannot hash with {algorithm!r}")


@dataclass(frozen=True)
class SignedDigests:
    """What a trusted signature says a checkpoint's files hold: per file, its spans in order
    (one span for the whole file under ``files`` serialization, shards under ``shards``)."""

    files: dict[Path, tuple[Span, ...]]
    key: str  # the trusted key file that verified it
    manifest_sha256: str  # sha256 of the signed statement (the DSSE payload)


def load_model_trust(keys: Iterable[str | Path], *, required: bool) -> ModelTrust | None:
    """The trusted model keys, each read and checked now (a readable ECDSA public key on a curve
    model-signing supports), and model-signing importable; ValueError otherwise.

    None when there is no key and no requirement (signatures are then not checked).
    """
    paths = tuple(Path(k).expanduser() for k in keys)
    if not paths:
        if required:
            raise ValueError("require_model_signature is set but no model key is trusted")
        return None
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    for path in paths:
        try:
            key = serialization.load_pem_public_key(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"model key {str(path)!r}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in (
            "secp256r1",
            "secp384r1",
            "secp521r1",
        ):
            raise ValueError(
                f"model key {str(path)!r} is not an ECDSA P-256, P-384 or P-521 public key"
            )
    try:
        _model_signing()
    except ImportError as exc:
        raise ValueError(
            f"model keys are set but model-signing is missing ({exc}); {_INSTALL_HINT}"
        ) from None
    return ModelTrust(keys=paths, required=required)


def _model_signing() -> tuple[Any, Any]:
    """model-signing's private signature reader and ECDSA verifier (pinned ==1.1.1)."""
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    return sign_sigstore_pb.Signature, sign_ec_key.Verifier


def signed_digests(files: CheckpointFiles, trust: ModelTrust | None) -> SignedDigests | None:
    """The digests a trusted signature gives the checkpoint's files; None when it is unsigned
    and no signature is required (or no key is trusted).

    Raises RunnerError MODEL_SIGNATURE_MISSING (required, none there), MODEL_SIGNATURE_INVALID
    (not signed by a trusted key, hashed other than with sha256 by file or shard or BLAKE3 by
    file, or a file the
    loader reads that the signature does not name), CHECKSUM_MISMATCH (a file's size differs
    from the signed one).
    """
    if trust is None:
        return None
    sig_path = files.base_dir / SIGNATURE_NAME
    member = check_member(sig_path, files.within)
    if member is None:
        if trust.required:
            raise RunnerError(
                f"checkpoint {str(files.base_dir)!r} has no {SIGNATURE_NAME} and this worker"
                " loads only signed checkpoints",
                code=WireCode.MODEL_SIGNATURE_MISSING,
            )
        return None
    try:
        signature_type, verifier_type = _model_signing()
    except ImportError as exc:
        raise _invalid(f"cannot check {SIGNATURE_NAME}: {exc}; {_INSTALL_HINT}") from None
    try:
        signature = signature_type.read(member.real)
    except Exception as exc:  # any malformed bundle is refused the same way
        raise _invalid(f"{SIGNATURE_NAME} is not a model signature: {exc}") from None
    manifest, key = None, None
    failures: list[str] = []
    for key_path in trust.keys:
        try:
            manifest = verifier_type(key_path).verify(signature)
        except Exception as exc:  # a wrong key, a bad signature: try the next
            failures.append(f"{key_path.name}: {type(exc).__name__}")
            continue
        key = str(key_path)
        break
    if manifest is None or key is None:
        raise _invalid(
            f"{SIGNATURE_NAME} of {str(files.base_dir)!r} is not signed by a trusted model key"
            f" ({', '.join(failures)})"
        )
    spans = _spans(manifest)
    payload = signature.bundle.dsse_envelope.payload
    return SignedDigests(
        files=_required_files(files, spans),
        key=key,
        manifest_sha256=hashlib.sha256(payload).hexdigest(),
    )


def _spans(manifest: Any) -> dict[PurePosixPath, list[Span]]:
    params = manifest.serialization_type
    method, hash_type = params.get("method"), params.get("hash_type")
    expected = _ACCEPTED.get((method, hash_type))
    if expected is None:
        raise _invalid(
            f"the signature hashes with {method!r}/{hash_type!r}; this worker accepts only"
            f" sha256 by file or by shard, or blake3 by file"
        )
    spans: dict[PurePosixPath, list[Span]] = {}
    for rd in manifest.resource_descriptors():
        algorithm = rd.digest.algorithm
        if not (algorithm == expected or (method == "shards" and algorithm.startswith(expected))):
            raise _invalid(f"{rd.identifier!r} is hashed with {algorithm!r}, not {hash_type}")
        name, start, end = rd.identifier, 0, -1
        if method == "shards":
            name, _, rest = rd.identifier.rpartition(":")
            name, _, first = name.rpartition(":")
            try:
                start, end = int(first), int(rest)
            except ValueError:
                raise _invalid(f"signed shard {rd.identifier!r} is malformed") from None
        span = Span(start, end, rd.digest.digest_hex, hash_type)
        spans.setdefault(PurePosixPath(name), []).append(span)
    return spans


def _required_files(
    files: CheckpointFiles, spans: dict[PurePosixPath, list[Span]]
) -> dict[Path, tuple[Span, ...]]:
    """The signed spans of every file the loader reads, each file covered exactly once."""
    base = files.base_dir
    reads = list(files.files) + ([files.index] if files.index is not None else [])
    unsigned = [f.name for f in reads if _relative(base, f) not in spans]
    if unsigned:
        raise _invalid(f"the signature does not name checkpoint file(s) {unsigned[:5]}")
    out: dict[Path, tuple[Span, ...]] = {}
    for file in reads:
        size = os.stat(files.members[file].real if file in files.members else file).st_size
        ordered = sorted(spans[_relative(base, file)], key=lambda s: s.start)
        if ordered[0].end == -1:  # files serialization: one digest for the whole file
            ordered = [Span(0, size, ordered[0].digest, ordered[0].algorithm)]
        covered = 0
        for span in ordered:
            if span.start != covered or span.end < span.start:
                raise _invalid(f"the signed shards of {file.name!r} do not tile the file")
            covered = span.end
        if covered != size:
            raise RunnerError(
                f"{file.name!r} has {size} bytes, the signature says {covered}",
                code=WireCode.CHECKSUM_MISMATCH,
            )
        out[file] = tuple(ordered)
    return out


def _relative(base: Path, file: Path) -> PurePosixPath:
    return PurePosixPath(file.relative_to(base).as_posix())


def check_index_digest(files: CheckpointFiles, signed: SignedDigests) -> None:
    """The index json hashes to its signed digest: the very bytes the tensor -> file map was
    parsed from (``files.index_bytes``), not a second read a writer could have restored."""
    if files.index is None:
        return
    index, data = files.index, files.index_bytes
    spans = signed.files.get(index)
    if spans is None:
        raise _invalid(f"the signature does not name index {index.name!r}")
    if data is None or len(data) != spans[-1].end:
        raise RunnerError(
            f"index {index.name!r} differs from the signed one (its size)",
            code=WireCode.CHECKSUM_MISMATCH,
        )
    view = memoryview(data)
    for span in spans:
        hasher = new_hasher(span.algorithm)
        hasher.update(view[span.start : span.end])
        if hasher.hexdigest() != span.digest:
            raise RunnerError(
                f"index {index.name!r} differs from the signed one",
                code=WireCode.CHECKSUM_MISMATCH,
            )


def sign_checkpoint(
    directory: Path,
    private_key: Path,
    *,
    shard_bytes: int | None = None,
    algorithm: str = "sha256",
) -> Path:
    """Sign every file of ``directory`` with an ECDSA private key (PEM), by whole file
    (``shard_bytes`` None) or, sha256 only, by shards of ``shard_bytes``; ``algorithm``:
    ``sha256`` or ``blake3``. The signature is written to ``directory/model.sig``, which is
    returned. ValueError for another algorithm or BLAKE3 shards.

    Whole files are what model-signing's own ``verify`` (and its CLI) can check: its 1.1.1 reads
    a shard size back as a float and fails on any sharded signature. sha256 shards let a worker
    hash one file on several threads; a whole file's sha256 is hashed on one thread, as it is
    copied, and its BLAKE3 on several (BLAKE3 splits each buffer itself).
    """
    if algorithm not in SIGN_HASHES:
        raise ValueError(f"cannot sign with {algorithm!r}; choose from {', '.join(SIGN_HASHES)}")
    if algorithm == "blake3" and shard_bytes is not None:
        raise ValueError("blake3 signs whole files (it hashes each on several threads); no shards")
    from model_signing import hashing, signing

    target = directory / SIGNATURE_NAME
    config = hashing.Config()  # type: ignore[no-untyped-call]
    if shard_bytes is None:
        config.use_file_serialization(hashing_algorithm=algorithm)  # type: ignore[arg-type]
    else:
        config.use_shard_serialization(hashing_algorithm="sha256", shard_size=shard_bytes)
    config.set_ignored_paths(paths=[SIGNATURE_NAME])
    signer = signing.Config().use_elliptic_key_signer(  # type: ignore[no-untyped-call]
        private_key=private_key
    )
    signer.set_hashing_config(config).sign(directory, target)
    return target


__all__ = [
    "DEFAULT_SIGN_HASH",
    "SIGNATURE_NAME",
    "SIGN_HASHES",
    "Hasher",
    "ModelTrust",
    "SignedDigests",
    "Span",
    "check_index_digest",
    "load_model_trust",
    "new_hasher",
    "sign_checkpoint",
    "signed_digests",
]
