"""Fixtures for the runner component tests: tiny seeded checkpoints and runners that close.

Runners: torch on the CPU, XLA on PJRT's CPU device, and torch on CUDA (``gpu``: deselected
without a GPU, see tests/conftest.py).

PJRT_DEVICE is set here, before anything imports torch_xla, so XLA runs on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from workers.demo.checkpoints import write_checkpoint
from workers.runners.torch_runner import TorchRunner

#: Small enough that XLA compiles each graph in about a second.
TINY: dict[str, Any] = {
    "vocab_size": 256,
    "d_model": 32,
    "n_layers": 2,
    "n_heads": 2,
    "max_seq": 16,
}

RUNNER_KINDS = [
    pytest.param("torch", id="torch"),
    pytest.param("xla", id="xla", marks=pytest.mark.xla),
    # The torch runner on an NVIDIA GPU: reads through pinned, double-buffered staging.
    pytest.param("cuda", id="cuda", marks=pytest.mark.gpu),
]

MakeRunner = Callable[..., TorchRunner]
MakeCheckpoint = Callable[..., Path]


@pytest.fixture(params=RUNNER_KINDS)
def runner_kind(request: pytest.FixtureRequest) -> str:
    kind: str = request.param
    if kind == "xla":
        pytest.importorskip("torch_xla", reason="torch_xla cannot be imported here")
    return kind


@pytest.fixture
def make_runner(runner_kind: str) -> Iterator[MakeRunner]:
    """Build a runner of the parametrized kind over the tiny model; loaded unless load=False."""
    created: list[TorchRunner] = []

    def make(
        *, load: bool = True, model_kwargs: dict[str, Any] | None = None, **options: Any
    ) -> TorchRunner:
        opts: dict[str, Any] = {
            "model_kwargs": {**TINY, **(model_kwargs or {})},
            "seed": 0,
            **options,
        }
        if runner_kind == "xla":
            from workers.runners.xla_runner import XlaRunner

            runner: TorchRunner = XlaRunner(opts)
        elif runner_kind == "cuda":
            runner = TorchRunner({"device": "cuda", **opts})
        else:
            runner = TorchRunner(opts)
        created.append(runner)
        if load:
            runner.load()
        return runner

    yield make
    for runner in created:
        runner.close()


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> MakeCheckpoint:
    """Write the tiny model's weights for ``seed``; returns the path a reload names."""
    counter = iter(range(1_000_000))

    def make(
        seed: int, *, shards: int = 1, model_kwargs: dict[str, Any] | None = None, **kw: Any
    ) -> Path:
        out = tmp_path / f"ckpt-{next(counter)}-seed{seed}"
        return write_checkpoint(
            out, model_kwargs={**TINY, **(model_kwargs or {})}, seed=seed, shards=shards, **kw
        )

    return make
