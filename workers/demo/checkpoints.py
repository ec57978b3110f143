"""Write real safetensors checkpoints of a seeded model (whole, sharded, or broken on purpose),
and probe one offline.

A tool for tests, demos and benchmarks; torch is imported inside the functions so that mounting
``checkpoint_app`` under the CLI stays cheap. Only :func:`probe_checkpoint` loads a checkpoint,
into the torch runner itself, so its answer is the one a worker running it reports.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.exits import error_line
from workers.weights.oms import DEFAULT_SIGN_HASH
from workers.weights.paths import checkpoint_files, open_member

if TYPE_CHECKING:
    import torch

    from workers.runners.base import ProbeResult

DEFAULT_FACTORY = "workers.runners.tiny_lm:tiny_lm"
INDEX_NAME = "model.safetensors.index.json"


class SignHash(StrEnum):
    """What ``checkpoint write --sign`` hashes each file with (``oms.SIGN_HASHES``)."""

    BLAKE3 = "blake3"
    SHA256 = "sha256"


class BrokenKind(StrEnum):
    MISSING = "missing"
    UNEXPECTED = "unexpected"
    SHAPE = "shape"
    DTYPE = "dtype"
    UNREADABLE = "unreadable"
    TRUNCATED = "truncated"
    CHECKSUM = "checksum"
    INDEX = "index"


#: The error each broken kind must produce when reloaded (strictly, with its manifest).
BROKEN_CODES: dict[BrokenKind, WireCode] = {
    BrokenKind.MISSING: WireCode.WEIGHTS_MISSING,
    BrokenKind.UNEXPECTED: WireCode.WEIGHTS_UNEXPECTED,
    BrokenKind.SHAPE: WireCode.WEIGHTS_SHAPE_MISMATCH,
    BrokenKind.DTYPE: WireCode.WEIGHTS_DTYPE_MISMATCH,
    BrokenKind.UNREADABLE: WireCode.WEIGHTS_UNREADABLE,
    BrokenKind.TRUNCATED: WireCode.WEIGHTS_UNREADABLE,
    BrokenKind.CHECKSUM: WireCode.CHECKSUM_MISMATCH,
    BrokenKind.INDEX: WireCode.WEIGHTS_UNREADABLE,
}


@dataclass(frozen=True)
class BrokenCheckpoint:
    path: Path
    sha256: dict[str, str]
    code: WireCode


def model_tensors(
    factory: str = DEFAULT_FACTORY,
    model_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    dtype: str | None = None,
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of a freshly built model: parameters and persistent buffers,
    one name per shared tensor, floating ones cast to ``dtype`` when given."""
    import torch

    from workers.runners.tiny_lm import build_model
    from workers.weights.loaders import module_targets

    model = build_model(factory, model_kwargs or {}, seed)
    tensors, _ = module_targets(model)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        t = tensor.detach().cpu().contiguous()
        if dtype is not None and t.is_floating_point():
            t = t.to(getattr(torch, dtype))
        out[name] = t
    return out


def write_safetensors(
    file: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> None:
    """Stream ``tensors`` into ``file`` in the safetensors format (atomically, no full-size buffer)."""
    import torch

    from workers.weights.checks import TORCH_TO_SAFETENSORS

    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": TORCH_TO_SAFETENSORS[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % 8)  # tensor data starts 8-byte aligned
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(f".{file.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        for tensor in tensors.values():
            if tensor.numel():
                data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                fh.write(data.numpy().data)
    os.replace(tmp, file)


def write_checkpoint(
    out: Path,
    *,
    factory: str = DEFAULT_FACTORY,
    model_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    shards: int = 1,
    dtype: str | None = None,
) -> Path:
    """Write the seeded model's weights; return the path a reload command should name.

    ``shards == 1``: ``out`` itself when it ends in ``.safetensors``, else ``out/model.safetensors``.
    ``shards > 1``: ``out/model-0000i-of-0000n.safetensors`` plus ``out/model.safetensors.index.json``
    (Hugging Face layout); the index path is returned.
    """
    tensors = model_tensors(factory, model_kwargs, seed, dtype)
    metadata = {"format": "pt", "factory": factory, "seed": str(seed)}
    if shards < 1 or shards > len(tensors):
        raise ValueError(f"shards must be between 1 and {len(tensors)}, got {shards}")
    if shards == 1:
        file = out if out.suffix == ".safetensors" else out / "model.safetensors"
        write_safetensors(file, tensors, metadata)
        return file
    weight_map: dict[str, str] = {}
    for i, group in enumerate(_split(tensors, shards), start=1):
        name = f"model-{i:05d}-of-{shards:05d}.safetensors"
        write_safetensors(out / name, group, metadata)
        weight_map.update(dict.fromkeys(group, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = out / INDEX_NAME
    index.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    return index


def _split(tensors: dict[str, torch.Tensor], shards: int) -> list[dict[str, torch.Tensor]]:
    """Consecutive groups of roughly equal bytes, none empty."""
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    target = sum(sizes) / shards
    groups: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    for i, name in enumerate(names):
        left_after = len(names) - i - 1
        groups[-1][name] = tensors[name]
        filled += sizes[i]
        need = shards - len(groups)
        if need and (filled >= target * len(groups) or left_after == need):
            groups.append({})
    return groups


def sha256_manifest(path: Path) -> dict[str, str]:
    """File name (relative to the checkpoint) -> sha256 hex, for every data file of ``path``."""
    files = checkpoint_files(path)
    manifest: dict[str, str] = {}
    for file in files.files:
        fd = open_member(file, files.members[file], files.within)
        with os.fdopen(fd, "rb") as fh:
            manifest[file.relative_to(files.base_dir).as_posix()] = hashlib.file_digest(
                fh, "sha256"
            ).hexdigest()
    return manifest


def write_broken(
    kind: BrokenKind | str,
    out: Path,
    *,
    factory: str = DEFAULT_FACTORY,
    model_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
) -> BrokenCheckpoint:
    """A checkpoint that must be refused with ``BROKEN_CODES[kind]``, leaving the model untouched.

    The damage is in the *last* tensor of the file, so a loader that copies while it validates
    would have changed the model by the time it notices.
    """
    import torch

    kind = BrokenKind(kind)
    code = BROKEN_CODES[kind]
    if kind is BrokenKind.INDEX:
        index = write_checkpoint(
            out, factory=factory, model_kwargs=model_kwargs, seed=seed, shards=2
        )
        raw = json.loads(index.read_text())
        first, second = sorted(set(raw["weight_map"].values()))
        moved = next(n for n, f in raw["weight_map"].items() if f == first)
        raw["weight_map"][moved] = second
        index.write_text(json.dumps(raw))
        return BrokenCheckpoint(index, {}, code)
    file = out if out.suffix == ".safetensors" else out / "model.safetensors"
    if kind is BrokenKind.UNREADABLE:
        file.parent.mkdir(parents=True, exist_ok=True)
        junk = b"{this is not a safetensors header}"
        file.write_bytes(struct.pack("<Q", len(junk)) + junk + b"\x00" * 64)
        return BrokenCheckpoint(file, {}, code)
    tensors = model_tensors(factory, model_kwargs, seed)
    last = list(tensors)[-1]
    if kind is BrokenKind.MISSING:
        del tensors[last]
    elif kind is BrokenKind.UNEXPECTED:
        tensors["not_in_the_model.weight"] = torch.zeros(3)
    elif kind is BrokenKind.SHAPE:
        shape = list(tensors[last].shape)
        shape[0] += 1
        tensors[last] = torch.zeros(shape, dtype=tensors[last].dtype)
    elif kind is BrokenKind.DTYPE:
        wrong = torch.float16 if tensors[last].dtype != torch.float16 else torch.float32
        tensors[last] = tensors[last].to(wrong)
    write_safetensors(file, tensors, {"format": "pt", "broken": kind.value})
    manifest = sha256_manifest(file)
    if kind is BrokenKind.TRUNCATED:
        cut = tensors[last].numel() * tensors[last].element_size() // 2
        os.truncate(file, file.stat().st_size - max(cut, 1))
        manifest = {}
    elif kind is BrokenKind.CHECKSUM:
        manifest = {name: hashlib.sha256(b"not these bytes").hexdigest() for name in manifest}
    return BrokenCheckpoint(file, manifest, code)


def probe_checkpoint(
    path: Path,
    prompt: str,
    max_tokens: int = 8,
    *,
    factory: str = DEFAULT_FACTORY,
    model_kwargs: Mapping[str, Any] | None = None,
) -> ProbeResult:
    """What a worker's probe answers once it runs ``path``: a torch runner on the CPU loads the
    checkpoint (strictly) and runs its own ``probe(prompt, max_tokens)``: same model build, byte
    tokens and greedy decode. The release's expected answer, computed without a fleet.

    ControlPlaneError (coded) when the checkpoint does not load or the model cannot probe.
    """
    from workers.runners.torch_runner import TorchRunner

    try:
        runner = TorchRunner(
            {
                "factory": factory,
                "model_kwargs": dict(model_kwargs or {}),
                "initial_checkpoint": str(path),
                "initial_version": "probe",
            }
        )
    except ValueError as exc:  # the options (a factory that is not 'module:callable')
        raise ControlPlaneError(str(exc), code=WireCode.SCHEMA_INVALID) from None
    try:
        runner.load()
        result = runner.probe(prompt, max_tokens)
    finally:
        runner.close()
    if result is None:
        raise ControlPlaneError(
            f"the model of {factory!r} has no next_logits(): it cannot probe",
            code=WireCode.RUNNER_FAILED,
        )
    return result


# --------------------------------------------------------------------------- CLI

checkpoint_app = typer.Typer(
    help="Write demo safetensors checkpoints (whole, sharded, or broken on purpose).",
    no_args_is_help=True,
)

FactoryOpt = Annotated[str, typer.Option(help="Model factory, 'package.module:callable'.")]
KwargsOpt = Annotated[str, typer.Option(help="Factory keyword arguments as a JSON object.")]
SeedOpt = Annotated[int, typer.Option(help="Seed of the weights.")]


def _kwargs(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--model-kwargs") from None
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object", param_hint="--model-kwargs")
    return value


@checkpoint_app.command("write")
def write_command(
    out: Annotated[Path, typer.Argument(help="Output directory (or .safetensors file).")],
    seed: SeedOpt = 0,
    shards: Annotated[int, typer.Option(min=1, help="Number of shard files.")] = 1,
    factory: FactoryOpt = DEFAULT_FACTORY,
    model_kwargs: KwargsOpt = "{}",
    dtype: Annotated[str | None, typer.Option(help="Cast floating tensors, e.g. bfloat16.")] = None,
    manifest: Annotated[bool, typer.Option(help="Also print the sha256 manifest.")] = False,
    sign: Annotated[
        Path | None,
        typer.Option(
            "--sign",
            metavar="KEY",
            help="Sign the checkpoint's directory (model.sig, OpenSSF model signing) with this"
            " ECDSA private key (PEM); needs the [verify] extra.",
        ),
    ] = None,
    sign_shard_bytes: Annotated[
        int,
        typer.Option(
            min=0,
            help="With --sign: sha256 by shards of this many bytes (a worker hashes a file on"
            " several threads), not by whole file (0, what model-signing's own verify checks).",
        ),
    ] = 0,
    sign_hash: Annotated[
        SignHash | None,
        typer.Option(
            "--sign-hash",
            help="With --sign: hash each whole file with blake3 (the default: ~5x faster to"
            " verify than sha256; model-signing's own verify checks it) or sha256 (the default"
            " with --sign-shard-bytes, which only sha256 shards).",
        ),
    ] = None,
) -> None:
    """Write a checkpoint of the seeded model and print its path (and manifest) as JSON."""
    if sign is not None and not sign.is_file():
        raise typer.BadParameter(f"{str(sign)!r} is not a file", param_hint="--sign")
    if sign_hash is SignHash.BLAKE3 and sign_shard_bytes:
        raise typer.BadParameter(
            "blake3 hashes whole files (each on several threads); --sign-shard-bytes is for sha256",
            param_hint="--sign-hash",
        )
    if sign_hash is None:
        sign_hash = SignHash.SHA256 if sign_shard_bytes else SignHash(DEFAULT_SIGN_HASH)
    path = write_checkpoint(
        out,
        factory=factory,
        model_kwargs=_kwargs(model_kwargs),
        seed=seed,
        shards=shards,
        dtype=dtype,
    )
    result: dict[str, Any] = {"path": str(path)}
    if manifest:
        result["sha256"] = sha256_manifest(path)
    if sign is not None:
        result["signature"] = str(
            sign_written(path, sign, sign_shard_bytes or None, algorithm=sign_hash.value)
        )
    typer.echo(json.dumps(result))


def sign_written(
    path: Path, key: Path, shard_bytes: int | None = None, *, algorithm: str = DEFAULT_SIGN_HASH
) -> Path:
    """Sign the directory of the checkpoint at ``path`` with ``key`` (whole files hashed with
    ``algorithm``, or sha256 shards of ``shard_bytes``); the signature's path."""
    from workers.weights.oms import sign_checkpoint

    directory = path if path.is_dir() else path.parent
    if shard_bytes is not None:
        algorithm = "sha256"
    try:
        return sign_checkpoint(directory, key, shard_bytes=shard_bytes, algorithm=algorithm)
    except ImportError as exc:
        raise typer.BadParameter(
            f"signing needs model-signing ({exc}): pip install 'fleet-controlplane[verify]'",
            param_hint="--sign",
        ) from None
    except (ValueError, TypeError, OSError) as exc:
        raise typer.BadParameter(
            f"cannot sign with {str(key)!r}: {exc}", param_hint="--sign"
        ) from None


@checkpoint_app.command("broken")
def broken_command(
    kind: Annotated[BrokenKind, typer.Argument(help="What to break.")],
    out: Annotated[Path, typer.Argument(help="Output directory (or .safetensors file).")],
    seed: SeedOpt = 0,
    factory: FactoryOpt = DEFAULT_FACTORY,
    model_kwargs: KwargsOpt = "{}",
) -> None:
    """Write a checkpoint broken on purpose; print its path, manifest and expected error code."""
    broken = write_broken(kind, out, factory=factory, model_kwargs=_kwargs(model_kwargs), seed=seed)
    typer.echo(
        json.dumps({"path": str(broken.path), "sha256": broken.sha256, "code": broken.code.value})
    )


@checkpoint_app.command("probe")
def probe_command(
    path: Annotated[Path, typer.Argument(help="The checkpoint (file, directory or index json).")],
    prompt: Annotated[str, typer.Option("--prompt", help="The probe's fixed prompt.")],
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=1, max=64, help="Greedy tokens to generate.")
    ] = 8,
    factory: FactoryOpt = DEFAULT_FACTORY,
    model_kwargs: KwargsOpt = "{}",
) -> None:
    """Print what a worker running the checkpoint answers to the probe gate, as JSON:
    {"tokens": [...], "mean_logprob": x} (tokens go to `rollout start --probe-expect-tokens`)."""
    try:
        result = probe_checkpoint(
            path, prompt, max_tokens, factory=factory, model_kwargs=_kwargs(model_kwargs)
        )
    except ControlPlaneError as exc:
        typer.echo(error_line(exc), err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps(result.as_dict()))
