"""Signed checkpoints through a real broker and a real agent whose torch runner trusts one model
key and requires signatures (FLEET_WORKER_MODEL_TRUST, FLEET_WORKER_REQUIRE_MODEL_SIGNATURE): a
signed reload succeeds; a tampered signed checkpoint, one signed by a stranger and an unsigned one
are NACKed with their codes, and the worker keeps the weights it had."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import WireCode
from controlplane.wire.protocol import Ack, AckState, ReloadWeightsSpec
from tests.factories import agent_running, agent_settings
from tests.fleet import Tail, acks_tail, make_command, settled, terminal
from workers.demo.checkpoints import write_checkpoint
from workers.runners.base import create_runner
from workers.weights.oms import sign_checkpoint

pytest.importorskip("model_signing", reason="the [verify] extra is not installed")

pytestmark = pytest.mark.kafka

TINY: dict[str, Any] = {
    "vocab_size": 256,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "max_seq": 16,
}


def key_pair(where: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP384R1())
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


def flip_a_tensor_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    first = min(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    raw[8 + length + first + 7] ^= 0xFF
    path.write_bytes(bytes(raw))


async def reload(kafka: KafkaSettings, acks: Tail, path: Path, version: str) -> Ack:
    command = make_command(ReloadWeightsSpec(path=str(path), version=version))
    await settled(kafka, acks, command)
    (ack,) = terminal(acks.items, command.command_id)
    return ack


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
async def test_a_tampered_signed_checkpoint_is_nacked_and_the_weights_stay(
    kafka: KafkaSettings, tmp_path: Path, algorithm: str
) -> None:
    """Whole files signed with sha256, or BLAKE3 (what ``checkpoint write --sign`` signs)."""
    keys = tmp_path / "keys"
    keys.mkdir()
    trusted, trusted_pub = key_pair(keys, "release")
    stranger, _ = key_pair(keys, "stranger")
    root = tmp_path / "ckpts"
    root.mkdir()

    def checkpoint(name: str, seed: int, key: Path | None) -> Path:
        path = write_checkpoint(root / name, model_kwargs=TINY, seed=seed, shards=2)
        if key is not None:
            sign_checkpoint(root / name, key, algorithm=algorithm)
        return path

    v1 = checkpoint("v1", 1, trusted)
    tampered = checkpoint("v2", 2, trusted)
    flip_a_tensor_byte(sorted((root / "v2").glob("*.safetensors"))[-1])
    foreign = checkpoint("v3", 3, stranger)
    unsigned = checkpoint("v4", 4, None)

    settings = agent_settings(
        kafka,
        tmp_path,
        runner="torch",
        runner_options={"model_kwargs": TINY},
        model_trust=[trusted_pub],
        require_model_signature=True,
    )
    runner = create_runner(settings.runner, settings.runner_options)
    try:
        async with agent_running(settings, runner), acks_tail(kafka) as acks:
            ok = await reload(kafka, acks, v1, "v1")
            assert ok.state is AckState.SUCCEEDED, ok.error
            for path, version, code in (
                (tampered, "v2", WireCode.CHECKSUM_MISMATCH),
                (foreign, "v3", WireCode.MODEL_SIGNATURE_INVALID),
                (unsigned, "v4", WireCode.MODEL_SIGNATURE_MISSING),
            ):
                nack = await reload(kafka, acks, path, version)
                assert nack.state is not AckState.SUCCEEDED
                assert nack.error is not None and nack.error.code == code.value, nack.error
                described = runner.describe()
                assert described.weights_version == "v1"
                assert described.degraded is None
    finally:
        runner.close()
