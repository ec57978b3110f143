"""Verified checkpoints: OpenSSF model signatures (workers/weights/oms.py) checked before any copy,
the copied bytes hashed against the signed digests (workers/weights/verify.py), and the previous
checkpoint restored when they differ. Real torch modules, checkpoints written by the project.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from typer.testing import CliRunner

from controlplane.wire.errors import RunnerError, WeightsCorrupted, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY
from workers.agent.settings import load_worker_settings
from workers.demo.checkpoints import checkpoint_app, write_checkpoint
from workers.runners.torch_runner import TorchRunner
from workers.weights.loaders import CopiedBytesMismatch, load_checkpoint, module_targets
from workers.weights.oms import SIGNATURE_NAME, load_model_trust, sign_checkpoint

pytest.importorskip("model_signing", reason="the [verify] extra is not installed")

#: Small shards, so that each tiny checkpoint file is signed as several of them.
SHARD = 4096
#: How a checkpoint is signed: sha256 by shards of this many bytes, sha256 by whole file (None),
#: or BLAKE3 by whole file (what ``checkpoint write --sign`` does by default).
By = int | None | Literal["blake3"]


def _key_pair(where: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = where / f"{name}.pem", where / f"{name}.pub.pem"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    where = tmp_path / "keys"
    where.mkdir()
    return {name: _key_pair(where, name) for name in ("trusted", "stranger")}


def checkpoint(tmp_path: Path, name: str, seed: int, *, shards: int = 1) -> Path:
    return write_checkpoint(tmp_path / name, model_kwargs=TINY, seed=seed, shards=shards)


def signed(
    tmp_path: Path,
    name: str,
    seed: int,
    key: Path,
    *,
    shards: int = 1,
    shard_bytes: By = SHARD,
) -> Path:
    path = checkpoint(tmp_path, name, seed, shards=shards)
    if shard_bytes == "blake3":
        sign_checkpoint(tmp_path / name, key, algorithm="blake3")
    else:
        sign_checkpoint(tmp_path / name, key, shard_bytes=shard_bytes)
    return path


#: Signed by sha256 shards (several per file), or by whole file with sha256 or BLAKE3 (what
#: model-signing's CLI does).
SERIALIZATIONS = pytest.mark.parametrize(
    "by", [SHARD, None, "blake3"], ids=["shards", "files", "blake3"]
)


def runner(
    initial: Path | None, public: Path, *, required: bool = True, **more: Any
) -> TorchRunner:
    options: dict[str, Any] = {
        "model_kwargs": TINY,
        "seed": 0,
        # One reader: each tensor is in before the next is read, so a progress callback that
        # changes a later tensor's bytes runs before that tensor is copied.
        "read_threads": 1,
        "model_trust": [str(public)],
        "require_model_signature": required,
    }
    if initial is not None:
        options |= {"initial_checkpoint": str(initial), "initial_version": "v1"}
    made = TorchRunner(options | more)
    made.load()
    return made


def reload(made: TorchRunner, path: Path, version: str) -> None:
    made.reload_weights(ReloadWeightsSpec(path=str(path), version=version), path)


def weights(made: TorchRunner) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in made._targets.items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def state(made: TorchRunner) -> tuple[str | None, object, Any]:
    d = made.describe()
    return d.weights_version, d.degraded, d.extra["weights_digest"]


def tensor_offset(path: Path, index: int) -> int:
    """The absolute offset of the ``index``-th tensor's data (in file order) in ``path``."""
    import struct

    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return int(8 + length + spans[index][0])


@SERIALIZATIONS
@pytest.mark.parametrize("readers", [1, 3])
@pytest.mark.usefixtures("segment_bytes")
def test_signed_checkpoint_loads(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], readers: int, by: By
) -> None:
    """Hashed while copied, shard by shard (a whole file in segments, in order), from one
    reader or several (small read chunks)."""
    private, public = keys["trusted"]
    v1 = signed(tmp_path, "v1", 1, private, shard_bytes=by)
    v2 = signed(tmp_path, "v2", 2, private, shards=3, shard_bytes=by)
    made = runner(v1, public, read_threads=readers)
    reload(made, v2, "v2")
    assert made.describe().weights_version == "v2"
    expected = TorchRunner({"model_kwargs": TINY, "seed": 2})
    expected.load()
    assert same(weights(made), weights(expected))


def test_unsigned_refused_when_required(tmp_path: Path, keys: dict[str, tuple[Path, Path]]) -> None:
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    before = weights(made)
    unsigned = checkpoint(tmp_path, "v2", 2)
    with pytest.raises(RunnerError) as caught:
        reload(made, unsigned, "v2")
    assert caught.value.code == WireCode.MODEL_SIGNATURE_MISSING
    assert same(weights(made), before)
    assert made.describe().weights_version == "v1"


def test_unsigned_loads_when_not_required(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    made = runner(None, keys["trusted"][1], required=False)
    reload(made, checkpoint(tmp_path, "v2", 2), "v2")
    assert made.describe().weights_version == "v2"


def test_untrusted_key_is_invalid(tmp_path: Path, keys: dict[str, tuple[Path, Path]]) -> None:
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    before = weights(made)
    foreign = signed(tmp_path, "v2", 2, keys["stranger"][0])
    with pytest.raises(RunnerError) as caught:
        reload(made, foreign, "v2")
    assert caught.value.code == WireCode.MODEL_SIGNATURE_INVALID
    assert "not signed by a trusted model key" in caught.value.message
    assert same(weights(made), before)
    assert made.describe().degraded is None


def test_unlisted_file_is_invalid(tmp_path: Path, keys: dict[str, tuple[Path, Path]]) -> None:
    """A shard added after signing (here: a whole checkpoint's file, so headers agree) is not
    named by the signature: refused before anything is copied."""
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    before = weights(made)
    v2 = signed(tmp_path, "v2", 2, private)
    # The signed directory now holds a second data file the loader would read.
    shutil.copy(v2, v2.parent / "extra.safetensors")
    with pytest.raises(RunnerError) as caught:
        load_checkpoint(
            v2.parent / "extra.safetensors",
            module_targets(torch.nn.Linear(1, 1))[0],
            version="x",
            from_version=None,
            model_trust=load_model_trust([public], required=True),
        )
    assert caught.value.code == WireCode.MODEL_SIGNATURE_INVALID
    assert "does not name" in caught.value.message
    # The directory as a whole, through the runner: refused the same way, nothing copied.
    with pytest.raises(RunnerError) as caught:
        reload(made, v2.parent, "v2")
    assert caught.value.code == WireCode.MODEL_SIGNATURE_INVALID
    assert same(weights(made), before)


def test_other_hashing_than_sha256_is_invalid(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    from model_signing import hashing, signing

    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    v2 = checkpoint(tmp_path, "v2", 2)
    config = hashing.Config().use_file_serialization(  # type: ignore[no-untyped-call]
        hashing_algorithm="blake2"
    )
    config.set_ignored_paths(paths=[SIGNATURE_NAME])
    signer = signing.Config().use_elliptic_key_signer(  # type: ignore[no-untyped-call]
        private_key=private
    )
    signer.set_hashing_config(config).sign(v2.parent, v2.parent / SIGNATURE_NAME)
    with pytest.raises(RunnerError) as caught:
        reload(made, v2, "v2")
    assert caught.value.code == WireCode.MODEL_SIGNATURE_INVALID
    assert "sha256" in caught.value.message


@SERIALIZATIONS
def test_tampered_shard_after_signing_is_nacked_and_previous_restored(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], by: By
) -> None:
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private, shard_bytes=by), public)
    before, v1_state = weights(made), state(made)
    v2 = signed(tmp_path, "v2", 2, private, shards=3, shard_bytes=by)
    shard = sorted(v2.parent.glob("*.safetensors"))[1]
    with open(shard, "r+b") as fh:  # one byte inside a tensor: sizes and headers still agree
        offset = tensor_offset(shard, 0) + 5
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(RunnerError) as caught:
        reload(made, v2, "v2")
    assert caught.value.code in (WireCode.CHECKSUM_MISMATCH, WireCode.MODEL_SIGNATURE_INVALID)
    assert not isinstance(caught.value, WeightsCorrupted)
    assert state(made) == v1_state
    assert same(weights(made), before)


@SERIALIZATIONS
def test_bytes_changed_during_copy_restore_previous_version(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], by: By
) -> None:
    """The file changes after its signature was checked, while it is being copied: the bytes
    copied are hashed, the difference found, v1 restored, and the reload NACKed."""
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private, shard_bytes=by), public)
    before, v1_state = weights(made), state(made)
    v2 = signed(tmp_path, "v2", 2, private, shard_bytes=by)
    later = tensor_offset(v2, -1) + 3  # inside the last tensor, copied after the first
    fd = os.open(v2, os.O_RDWR)
    calls: list[tuple[int, int]] = []
    copy_progress = made._on_copy_progress

    def progress(done: int, total: int, cancel: Any) -> None:
        calls.append((done, total))
        if done == 1:
            os.pwrite(fd, b"\xde\xad", later)
        copy_progress(done, total, cancel)

    made._on_copy_progress = progress  # type: ignore[method-assign]
    try:
        with pytest.raises(RunnerError) as caught:
            reload(made, v2, "v2")
    finally:
        os.close(fd)
    assert any(done == 1 for done, _ in calls), "the copy never reached its first tensor"
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert isinstance(caught.value.__cause__, CopiedBytesMismatch)
    assert "'v1' was restored" in caught.value.message
    assert state(made) == v1_state
    assert same(weights(made), before)
    made._on_copy_progress = copy_progress  # type: ignore[method-assign]
    # The runner still serves and reloads: a good v3 goes in.
    reload(made, signed(tmp_path, "v3", 3, private), "v3")
    assert made.describe().weights_version == "v3"


def test_restore_failure_reports_degraded(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    """Seeded weights (no initial checkpoint) cannot be restored: the runner is degraded."""
    private, public = keys["trusted"]
    made = runner(None, public)
    v2 = signed(tmp_path, "v2", 2, private)
    later = tensor_offset(v2, -1)
    fd = os.open(v2, os.O_RDWR)
    copy_progress = made._on_copy_progress

    def progress(done: int, total: int, cancel: Any) -> None:
        if done == 1:
            os.pwrite(fd, b"\x01\x02\x03", later)
        copy_progress(done, total, cancel)

    made._on_copy_progress = progress  # type: ignore[method-assign]
    try:
        with pytest.raises(WeightsCorrupted) as caught:
            reload(made, v2, "v2")
    finally:
        os.close(fd)
    assert caught.value.code == WireCode.WEIGHTS_CORRUPTED
    assert made.describe().degraded is not None


def test_restore_of_a_changed_previous_checkpoint_reports_degraded(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    """The previous checkpoint no longer matches the digests it was loaded with: degraded."""
    private, public = keys["trusted"]
    v1 = signed(tmp_path, "v1", 1, private)
    made = runner(v1, public)
    v2 = signed(tmp_path, "v2", 2, private)
    with open(v1, "r+b") as fh:
        fh.seek(tensor_offset(v1, 0))
        fh.write(b"\x00\x00\x00\x00")
    fd = os.open(v2, os.O_RDWR)
    copy_progress = made._on_copy_progress

    def progress(done: int, total: int, cancel: Any) -> None:
        if done == 1:
            os.pwrite(fd, b"\x01\x02\x03", tensor_offset(v2, -1))
        copy_progress(done, total, cancel)

    made._on_copy_progress = progress  # type: ignore[method-assign]
    try:
        with pytest.raises(WeightsCorrupted) as caught:
            reload(made, v2, "v2")
    finally:
        os.close(fd)
    assert "restoring 'v1'" in caught.value.message
    assert made.describe().degraded is not None


def test_bad_model_keys_are_refused_when_the_runner_is_built(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    private, _ = keys["trusted"]
    with pytest.raises(ValueError, match="PUBLIC KEY"):
        TorchRunner({"model_kwargs": TINY, "model_trust": [str(private)]})
    with pytest.raises(ValueError, match="no model key"):
        TorchRunner({"model_kwargs": TINY, "require_model_signature": True})
    ed = tmp_path / "ed.pub.pem"
    from cryptography.hazmat.primitives.asymmetric import ed25519

    ed.write_bytes(
        ed25519.Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    with pytest.raises(ValueError, match="ECDSA"):
        TorchRunner({"model_kwargs": TINY, "model_trust": [str(ed)]})


def test_the_private_model_signing_modules_we_rely_on_are_there() -> None:
    """oms.py reads a signature and checks its envelope with two private modules of
    model-signing (pinned ==1.1.1): an upgrade that moves them must fail here, loudly."""
    from model_signing import manifest
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    assert callable(sign_sigstore_pb.Signature.read)
    assert callable(sign_ec_key.Verifier)
    assert hasattr(sign_ec_key.Verifier, "verify")
    assert hasattr(manifest.Manifest, "resource_descriptors")
    assert hasattr(manifest.Manifest, "serialization_type")


def test_checkpoint_write_sign_makes_a_checkpoint_the_worker_loads(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    private, public = keys["trusted"]
    cli = CliRunner()
    args = ["write", str(tmp_path / "v2"), "--seed", "2", "--model-kwargs", json.dumps(TINY)]
    out = cli.invoke(checkpoint_app, [*args, "--shards", "2", "--sign", str(private)])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["signature"] == str(tmp_path / "v2" / SIGNATURE_NAME)
    made = runner(None, public)
    reload(made, Path(result["path"]), "v2")
    assert made.describe().weights_version == "v2"
    # Whole files by default: model-signing's own verifier checks what we signed.
    from model_signing import verifying

    verifier = verifying.Config().use_elliptic_key_verifier(  # type: ignore[no-untyped-call]
        public_key=public
    )
    verifier.verify(tmp_path / "v2", tmp_path / "v2" / SIGNATURE_NAME)
    # A public key cannot sign: a usage error, no traceback.
    bad = cli.invoke(checkpoint_app, [*args, "--sign", str(public)])
    assert bad.exit_code == 2 and "cannot sign" in bad.output
    assert "Traceback" not in bad.output


def test_checkpoint_write_sign_hashes_with_blake3_by_default(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    """``--sign`` signs whole files with BLAKE3 (``--sign-hash sha256`` with sha256), and
    model-signing's own verifier checks what it wrote; BLAKE3 shards are a usage error."""
    from model_signing import verifying
    from model_signing._signing import sign_ec_key, sign_sigstore_pb

    private, public = keys["trusted"]
    cli = CliRunner()
    base = ["--seed", "2", "--model-kwargs", json.dumps(TINY), "--shards", "2"]
    hashed = {}
    for name, more in {"default": [], "sha256": ["--sign-hash", "sha256"]}.items():
        out = cli.invoke(
            checkpoint_app, ["write", str(tmp_path / name), *base, "--sign", str(private), *more]
        )
        assert out.exit_code == 0, out.output
        sig = tmp_path / name / SIGNATURE_NAME
        verifier = verifying.Config().use_elliptic_key_verifier(  # type: ignore[no-untyped-call]
            public_key=public
        )
        verifier.verify(tmp_path / name, sig)
        statement = sign_ec_key.Verifier(public).verify(sign_sigstore_pb.Signature.read(sig))
        hashed[name] = statement.serialization_type["hash_type"]
        reload(runner(None, public), Path(json.loads(out.output)["path"]), "v2")
    assert hashed == {"default": "blake3", "sha256": "sha256"}
    bad = cli.invoke(
        checkpoint_app,
        [
            "write",
            str(tmp_path / "bad"),
            *base,
            "--sign",
            str(private),
            "--sign-hash",
            "blake3",
            "--sign-shard-bytes",
            "4096",
        ],
    )
    assert bad.exit_code == 2 and "blake3 hashes whole files" in bad.output
    assert "Traceback" not in bad.output


def _sign_statement(directory: Path, private: Path, hash_type: str, items: list[Any]) -> None:
    """Sign a hand-made statement (what model-signing itself never writes) over ``directory``."""
    from model_signing import manifest, signing
    from model_signing._signing import signing as payloads

    serialization = manifest._ShardSerialization(
        hash_type, SHARD, ignore_paths=[Path(SIGNATURE_NAME)]
    )
    statement = manifest.Manifest(directory.name, items, serialization)
    signer = signing.Config().use_elliptic_key_signer(  # type: ignore[no-untyped-call]
        private_key=private
    )
    assert signer._signer is not None
    signer._signer.sign(payloads.Payload(statement)).write(directory / SIGNATURE_NAME)


@pytest.mark.parametrize("algorithm", ["blake3", "sha512"])
def test_unsupported_hashing_is_invalid(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], algorithm: str
) -> None:
    """BLAKE3 by shards (model-signing hashes BLAKE3 only by whole file) and any other hash,
    however correct its digests, are refused before copying: MODEL_SIGNATURE_INVALID."""
    import hashlib

    from blake3 import blake3
    from model_signing import manifest
    from model_signing._hashing import hashing as digests

    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private, shard_bytes="blake3"), public)
    before, v1_state = weights(made), state(made)
    v2 = checkpoint(tmp_path, "v2", 2)
    items = []
    for file in sorted(v2.parent.iterdir()):
        raw = file.read_bytes()
        for start in range(0, len(raw), SHARD):
            piece = raw[start : start + SHARD]
            value = (
                blake3(piece).digest() if algorithm == "blake3" else hashlib.sha512(piece).digest()
            )
            items.append(
                manifest.ShardedFileManifestItem(
                    path=Path(file.name),
                    start=start,
                    end=start + len(piece),
                    digest=digests.Digest(algorithm, value),
                )
            )
    _sign_statement(v2.parent, private, algorithm, items)
    with pytest.raises(RunnerError) as caught:
        reload(made, v2, "v2")
    assert caught.value.code == WireCode.MODEL_SIGNATURE_INVALID
    assert "blake3 by file" in caught.value.message
    assert state(made) == v1_state
    assert same(weights(made), before)


def test_worker_settings_give_the_model_keys_to_the_runner(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from controlplane.wire.errors import ControlPlaneError, LocalCode

    public = keys["trusted"][1]
    monkeypatch.setenv("FLEET_WORKER_MODEL_TRUST", str(public))
    monkeypatch.setenv("FLEET_WORKER_REQUIRE_MODEL_SIGNATURE", "true")
    settings = load_worker_settings(worker_id="w1")
    assert settings.runner_options["model_trust"] == [str(public.resolve())]
    assert settings.runner_options["require_model_signature"] is True
    monkeypatch.setenv("FLEET_WORKER_MODEL_TRUST", json.dumps([str(public), str(public)]))
    assert len(load_worker_settings(worker_id="w1").model_trust) == 2
    with pytest.raises(ControlPlaneError) as caught:
        load_worker_settings(worker_id="w1", runner="fake")
    assert caught.value.code == LocalCode.SETTINGS_INVALID
    monkeypatch.delenv("FLEET_WORKER_MODEL_TRUST")
    with pytest.raises(ControlPlaneError, match="names no key"):
        load_worker_settings(worker_id="w1")


def test_changed_during_copy_restores_on_every_runner(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], make_runner: Any
) -> None:
    """The same, on each runner kind (XLA reads into host aliases of its buffers; CUDA through
    staging, its copied bytes read back from the device to be hashed)."""
    private, public = keys["trusted"]
    v1 = signed(tmp_path, "v1", 1, private)
    made = make_runner(
        initial_checkpoint=str(v1),
        initial_version="v1",
        model_trust=[str(public)],
        require_model_signature=True,
        read_threads=1,
    )
    v1_state = state(made)
    v2 = signed(tmp_path, "v2", 2, private)
    fd = os.open(v2, os.O_RDWR)
    copy_progress = made._on_copy_progress

    def progress(done: int, total: int, cancel: Any) -> None:
        if done == 1:
            os.pwrite(fd, b"\xde\xad", tensor_offset(v2, -1) + 3)
        copy_progress(done, total, cancel)

    made._on_copy_progress = progress
    try:
        with pytest.raises(RunnerError) as caught:
            reload(made, v2, "v2")
    finally:
        os.close(fd)
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert state(made) == v1_state


# --------------------------------------------------------------------------- the command's sha256


def plain_runner(initial: Path | None, **more: Any) -> TorchRunner:
    options: dict[str, Any] = {"model_kwargs": TINY, "seed": 0, "read_threads": 1, **more}
    if initial is not None:
        options |= {"initial_checkpoint": str(initial), "initial_version": "v1"}
    made = TorchRunner(options)
    made.load()
    return made


@pytest.fixture(params=[None, 4096], ids=["segments-16MiB", "segments-4KiB"])
def segment_bytes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole files are hashed in segments as their tensors come in; small ones cut every file."""
    if request.param is not None:
        import workers.weights.verify as verify

        monkeypatch.setattr(verify, "_SEGMENT_BYTES", request.param)


@pytest.mark.usefixtures("segment_bytes")
def test_the_commands_sha256_is_checked_as_copied_when_the_runner_can_restore(
    tmp_path: Path,
) -> None:
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(checkpoint(tmp_path, "v1", 1), read_threads=2)
    v2 = checkpoint(tmp_path, "v2", 2, shards=2)
    made.reload_weights(
        ReloadWeightsSpec(path=str(v2), version="v2", sha256=sha256_manifest(v2)), v2
    )
    assert made.describe().weights_version == "v2"
    v2_state, v2_weights = state(made), weights(made)
    # A wrong digest is found once the copy is done: v2 comes back, CHECKSUM_MISMATCH.
    v3 = checkpoint(tmp_path, "v3", 3)
    wrong = {name: "0" * 64 for name in sha256_manifest(v3)}
    with pytest.raises(RunnerError) as caught:
        made.reload_weights(ReloadWeightsSpec(path=str(v3), version="v3", sha256=wrong), v3)
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert isinstance(caught.value.__cause__, CopiedBytesMismatch)
    assert state(made) == v2_state
    assert same(weights(made), v2_weights)


def test_sha256_bytes_changed_during_copy_restore_previous_version(tmp_path: Path) -> None:
    """The command's manifest is right; the file changes while it is copied: v1 restored."""
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(checkpoint(tmp_path, "v1", 1))
    before, v1_state = weights(made), state(made)
    v2 = checkpoint(tmp_path, "v2", 2)
    manifest = sha256_manifest(v2)
    fd = os.open(v2, os.O_RDWR)
    copy_progress = made._on_copy_progress

    def progress(done: int, total: int, cancel: Any) -> None:
        if done == 1:
            os.pwrite(fd, b"\xbe\xef", tensor_offset(v2, -1) + 1)
        copy_progress(done, total, cancel)

    made._on_copy_progress = progress  # type: ignore[method-assign]
    try:
        with pytest.raises(RunnerError) as caught:
            made.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2", sha256=manifest), v2)
    finally:
        os.close(fd)
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert "'v1' was restored" in caught.value.message
    assert state(made) == v1_state
    assert same(weights(made), before)


def test_seeded_weights_check_the_commands_sha256_before_copying(tmp_path: Path) -> None:
    """Nothing to restore: a wrong sha256 is refused before any byte is copied, as always."""
    from workers.demo.checkpoints import sha256_manifest

    made = plain_runner(None)
    before = weights(made)
    v2 = checkpoint(tmp_path, "v2", 2)
    wrong = {name: "0" * 64 for name in sha256_manifest(v2)}
    with pytest.raises(RunnerError) as caught:
        made.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2", sha256=wrong), v2)
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert not isinstance(caught.value.__cause__, CopiedBytesMismatch)
    assert same(weights(made), before)
    assert made.describe().degraded is None


# --------------------------------------------------------------------------- more refusals


def test_a_file_grown_after_signing_is_refused_before_copying(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    before = weights(made)
    v2 = signed(tmp_path, "v2", 2, private)
    with open(v2, "ab") as fh:  # trailing bytes: the header still reads
        fh.write(b"\0" * 16)
    with pytest.raises(RunnerError) as caught:
        reload(made, v2, "v2")
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert "the signature says" in caught.value.message
    assert not isinstance(caught.value.__cause__, CopiedBytesMismatch)  # found before copying
    assert same(weights(made), before)


def test_an_index_changed_after_signing_is_refused(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    private, public = keys["trusted"]
    made = runner(signed(tmp_path, "v1", 1, private), public)
    index = signed(tmp_path, "v2", 2, private, shards=2)
    text = index.read_text()
    edited = text.replace("\n  ", "\n\t ", 1)  # the same size, the same JSON, other bytes
    assert edited != text and len(edited) == len(text)
    assert json.loads(edited) == json.loads(text)
    index.write_text(edited)
    with pytest.raises(RunnerError) as caught:
        reload(made, index, "v2")
    assert caught.value.code == WireCode.CHECKSUM_MISMATCH
    assert "differs from the signed one" in caught.value.message
    assert made.describe().weights_version == "v1"


def test_model_keys_without_model_signing_are_a_settings_error(
    keys: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import workers.weights.oms as oms

    def missing() -> Any:
        raise ImportError("No module named 'model_signing'")

    monkeypatch.setattr(oms, "_model_signing", missing)
    with pytest.raises(ValueError, match=r"\[verify\] extra"):
        TorchRunner({"model_kwargs": TINY, "model_trust": [str(keys["trusted"][1])]})
