"""The checkpoint tool writes files the safetensors library reads, in the Hugging Face layout."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from pydantic import JsonValue
from safetensors import safe_open
from typer.testing import CliRunner

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY
from workers.demo.checkpoints import (
    BROKEN_CODES,
    BrokenKind,
    checkpoint_app,
    model_tensors,
    probe_checkpoint,
    sha256_manifest,
    write_broken,
    write_checkpoint,
)
from workers.runners.tiny_lm import tiny_lm
from workers.runners.torch_runner import TorchRunner


def read_all(files: list[Path]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out[name] = f.get_tensor(name)
    return out


def test_single_file_is_the_seeded_model(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "out", model_kwargs=TINY, seed=3)
    assert path == tmp_path / "out" / "model.safetensors"
    tensors = read_all([path])
    state = tiny_lm(**TINY, seed=3).state_dict()
    assert set(tensors) == set(state)
    assert all(torch.equal(tensors[k], state[k]) for k in tensors)
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()["seed"] == "3"
    named = write_checkpoint(tmp_path / "x.safetensors", model_kwargs=TINY, seed=3)
    assert named == tmp_path / "x.safetensors"
    assert sha256_manifest(named)["x.safetensors"] == sha256_manifest(path)["model.safetensors"]


def test_sharded_layout_and_index(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path, model_kwargs=TINY, seed=1, shards=3)
    assert index.name == "model.safetensors.index.json"
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    raw = json.loads(index.read_text())
    assert set(raw) == {"metadata", "weight_map"}
    assert set(raw["weight_map"].values()) == set(shards)
    tensors = read_all([tmp_path / s for s in shards])
    want = model_tensors(model_kwargs=TINY, seed=1)
    assert set(tensors) == set(raw["weight_map"]) == set(want)
    assert all(torch.equal(tensors[k], want[k]) for k in want)
    assert raw["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    for shard in shards:  # each tensor is in the shard the index names
        assert set(read_all([tmp_path / shard])) == {
            k for k, v in raw["weight_map"].items() if v == shard
        }
    with pytest.raises(ValueError, match="shards"):
        write_checkpoint(tmp_path / "too-many", model_kwargs=TINY, shards=1000)


def test_dtype_cast_and_tied_dedup(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "bf16", model_kwargs=TINY, dtype="bfloat16")
    assert {t.dtype for t in read_all([path]).values()} == {torch.bfloat16}
    tied = write_checkpoint(tmp_path / "tied", model_kwargs={**TINY, "tied": True})
    names = set(read_all([tied]))
    assert "tok_emb.weight" in names and "lm_head.weight" not in names


def test_manifest_and_determinism(tmp_path: Path) -> None:
    a = write_checkpoint(tmp_path / "a", model_kwargs=TINY, seed=5, shards=2)
    b = write_checkpoint(tmp_path / "b", model_kwargs=TINY, seed=5, shards=2)
    c = write_checkpoint(tmp_path / "c", model_kwargs=TINY, seed=6, shards=2)
    manifest = sha256_manifest(a)
    for name, digest in manifest.items():
        assert hashlib.sha256((tmp_path / "a" / name).read_bytes()).hexdigest() == digest
    assert sha256_manifest(b) == manifest != sha256_manifest(c)


@pytest.mark.parametrize("kind", list(BrokenKind), ids=[k.value for k in BrokenKind])
def test_broken_kinds(tmp_path: Path, kind: BrokenKind) -> None:
    broken = write_broken(kind, tmp_path / "b", model_kwargs=TINY)
    assert broken.path.exists() and broken.code is BROKEN_CODES[kind]
    if kind is BrokenKind.CHECKSUM:
        assert broken.sha256 and broken.sha256 != sha256_manifest(broken.path)
    if kind is BrokenKind.TRUNCATED:
        good = write_checkpoint(tmp_path / "good", model_kwargs=TINY)
        assert broken.path.stat().st_size < good.stat().st_size


def test_cli_write_and_broken(tmp_path: Path) -> None:
    cli = CliRunner()
    kwargs = json.dumps(TINY)
    out = cli.invoke(
        checkpoint_app,
        [
            "write",
            str(tmp_path / "w"),
            "--seed",
            "2",
            "--shards",
            "2",
            "--model-kwargs",
            kwargs,
            "--manifest",
        ],
    )
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert Path(result["path"]).name == "model.safetensors.index.json"
    assert result["sha256"] == sha256_manifest(Path(result["path"]))
    out = cli.invoke(
        checkpoint_app, ["broken", "shape", str(tmp_path / "s"), "--model-kwargs", kwargs]
    )
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["code"] == WireCode.WEIGHTS_SHAPE_MISMATCH.value
    bad = cli.invoke(checkpoint_app, ["write", str(tmp_path / "x"), "--model-kwargs", "[1]"])
    assert bad.exit_code != 0


PROMPT = "The capital of France is"


def cli_probe(path: Path, *extra: str) -> dict[str, JsonValue]:
    out = CliRunner().invoke(
        checkpoint_app,
        ["probe", str(path), "--prompt", PROMPT, "--model-kwargs", json.dumps(TINY), *extra],
    )
    assert out.exit_code == 0, out.output
    answer: dict[str, JsonValue] = json.loads(out.output)
    return answer


def worker_probe(path: Path, max_tokens: int) -> dict[str, JsonValue]:
    """What a worker's runner answers after reloading ``path`` over another model (seed 9)."""
    runner = TorchRunner({"model_kwargs": TINY, "seed": 9})
    runner.load()
    try:
        runner.reload_weights(ReloadWeightsSpec(path=str(path), version="v"), path)
        result = runner.probe(PROMPT, max_tokens)
    finally:
        runner.close()
    assert result is not None
    return result.as_dict()


def test_probe_answers_what_a_runner_running_the_checkpoint_reports(tmp_path: Path) -> None:
    v4 = write_checkpoint(tmp_path / "v4", model_kwargs=TINY, seed=4, shards=2)
    wrong = write_checkpoint(tmp_path / "wrong", model_kwargs=TINY, seed=5)
    answer = cli_probe(v4)
    assert answer == worker_probe(v4, 8)  # the default: the probe gate's --probe-max-tokens
    assert set(answer) == {"tokens", "mean_logprob"}
    assert isinstance(answer["tokens"], list) and len(answer["tokens"]) == 8
    assert cli_probe(v4, "--max-tokens", "3") == worker_probe(v4, 3)
    other = cli_probe(wrong)
    assert other == worker_probe(wrong, 8)
    assert other["tokens"] != answer["tokens"]  # valid shapes, other numbers: another answer


def test_probe_of_a_checkpoint_that_does_not_load_is_one_coded_line(tmp_path: Path) -> None:
    broken = write_broken(BrokenKind.SHAPE, tmp_path / "b", model_kwargs=TINY)
    with pytest.raises(ControlPlaneError) as caught:
        probe_checkpoint(broken.path, PROMPT, model_kwargs=TINY)
    assert caught.value.code is WireCode.WEIGHTS_SHAPE_MISMATCH
    out = CliRunner().invoke(
        checkpoint_app,
        ["probe", str(broken.path), "--prompt", PROMPT, "--model-kwargs", json.dumps(TINY)],
    )
    assert out.exit_code == 1
    assert out.output.strip().splitlines() == [
        f"error: WEIGHTS_SHAPE_MISMATCH: {caught.value.message}"
    ]
