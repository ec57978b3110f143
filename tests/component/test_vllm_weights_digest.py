"""The vLLM runner's weights digest (issue 13), against the stand-in ``vllm serve`` of
test_vllm_sidecar_start (real HTTP, no vLLM needed): the torch runners' fingerprint of the files
vLLM was told to load, from start on, in the succeeded ack and in describe() (so in heartbeats);
a failed reload that restored the old weights keeps the old digest."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from controlplane.wire.errors import RunnerError
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import TINY
from tests.component.test_vllm_sidecar_start import FakeVllm, fake_server
from workers.demo.checkpoints import write_checkpoint
from workers.runners.torch_runner import TorchRunner
from workers.runners.vllm_runner import VllmRunner

__all__ = ["fake_server"]  # the fixture, used here


def torch_digest(checkpoint: Path) -> str:
    """The torch runner's digest of a model holding ``checkpoint``."""
    runner = TorchRunner({"model_kwargs": TINY, "initial_checkpoint": str(checkpoint)})
    runner.load()
    try:
        digest = runner.describe().weights_digest
        assert digest is not None
        return digest
    finally:
        runner.close()


@pytest.fixture
def vllm(tmp_path: Path, fake_server: tuple[str, list[FakeVllm]]) -> Iterator[VllmRunner]:
    url, holder = fake_server
    model = tmp_path / "ckpt"
    write_checkpoint(model, model_kwargs=TINY, seed=1)
    holder.append(FakeVllm(str(model), server_info_ok=True))
    runner = VllmRunner(
        {"mode": "sidecar", "model": str(model), "base_url": url, "startup_timeout_s": 30}
    )
    runner.load()
    try:
        yield runner
    finally:
        runner.close()


def test_the_digest_is_of_what_vllm_loaded_from_start_on(vllm: VllmRunner, tmp_path: Path) -> None:
    seed1 = torch_digest(tmp_path / "ckpt")
    assert vllm.describe().weights_digest == seed1  # the operator's model, at start
    v2 = tmp_path / "v2"
    write_checkpoint(v2, model_kwargs=TINY, seed=2)
    result = vllm.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)
    assert result.as_dict()["weights_digest"] == vllm.describe().weights_digest
    assert result.weights_digest == torch_digest(v2) != seed1
    again = tmp_path / "again"
    write_checkpoint(again, model_kwargs=TINY, seed=1)
    assert (
        vllm.reload_weights(ReloadWeightsSpec(path=str(again), version="v3"), again).weights_digest
        == seed1
    )


def test_a_failed_reload_that_restored_keeps_the_old_digest(
    vllm: VllmRunner, tmp_path: Path, fake_server: tuple[str, list[FakeVllm]], monkeypatch: Any
) -> None:
    before = vllm.describe().weights_digest
    assert before is not None
    fake = fake_server[1][0]
    answer = fake.answer
    failed: list[bool] = []

    def fail_once(method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/collective_rpc" and body.get("method") == "reload_weights" and not failed:
            failed.append(True)
            return 500, {"error": {"message": "boom"}}
        return answer(method, path, body)

    monkeypatch.setattr(fake, "answer", fail_once)
    v2 = tmp_path / "v2"
    write_checkpoint(v2, model_kwargs=TINY, seed=2)
    with pytest.raises(RunnerError, match="restored"):
        vllm.reload_weights(ReloadWeightsSpec(path=str(v2), version="v2"), v2)
    assert vllm.describe().weights_digest == before
