"""Fixtures for the runner component tests: tiny seeded checkpoints and runners that close;
for the API tests (test_api*.py): a never-started Coordinator fed events directly, its app
and a client; for the loader tests (test_loaders*.py): destination and source tensors.

Runners: torch on the CPU, XLA on PJRT's CPU device, and torch on CUDA (``gpu``: deselected
without a GPU, see tests/conftest.py).

PJRT_DEVICE is set here, before anything imports torch_xla, so XLA runs on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

from collections.abc import AsyncIterator, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from fastapi import FastAPI
from pydantic import SecretStr

from controlplane.api.app import create_app
from controlplane.coordinator.follower import Batch
from controlplane.coordinator.service import (
    Coordinator,
    CoordinatorSettings,
)
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    Heartbeat,
    InFlight,
    ReloadWeightsSpec,
    Selector,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
)
from tests import factories
from workers.demo.checkpoints import write_checkpoint
from workers.runners.torch_runner import TorchRunner
from workers.weights.loaders import load_checkpoint

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


# --------------------------------------------------------------------------- the API tests (test_api*.py)
# A Coordinator that is never started, its Fleet fed events directly, and a client of its app.


T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def at(seconds: float) -> datetime:
    return factories.at(seconds, T0)


class Clock:
    def __init__(self, seconds: float) -> None:
        self.now = at(seconds)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


# --------------------------------------------------------------------------- factories


def command(
    rollout_id: str,
    *,
    workers: list[str] | None = None,
    issued: float = 0.0,
    version: str = "v2",
    overrides: dict[str, Any] | None = None,
) -> Command:
    spec = (
        UpdateConfigSpec(overrides=overrides)
        if overrides is not None
        else ReloadWeightsSpec(path="/ckpt/model.safetensors", version=version)
    )
    return Command(
        command_id=f"{rollout_id}.c1",
        rollout_id=rollout_id,
        issued_at=at(issued),
        expires_at=at(issued + 3600),
        issuer="ci",
        selector=Selector(worker_ids=workers or ["w1", "w2"]),
        spec=spec,
    )


def ack(
    cmd: Command,
    worker_id: str,
    state: AckState,
    sent: float,
    *,
    code: str | None = None,
) -> Ack:
    error = None
    if state in (AckState.FAILED, AckState.REJECTED):
        error = AckError(code=code or "RUNNER_FAILED", message=f"{worker_id} could not")
    version = cmd.spec.version if isinstance(cmd.spec, ReloadWeightsSpec) else None
    return Ack(
        command_id=cmd.command_id,
        rollout_id=cmd.rollout_id,
        worker_id=worker_id,
        kind=cmd.kind,
        state=state,
        weights_version=version if state is AckState.SUCCEEDED else "v1",
        error=error,
        timings=Timings(
            received_at=at(sent - 0.5),
            started_at=at(sent - 0.4),
            finished_at=at(sent) if state.terminal else None,
        ),
        sent_at=at(sent),
    )


def heartbeat(
    worker_id: str,
    sent: float,
    *,
    version: str = "v1",
    labels: dict[str, str] | None = None,
    status: WorkerStatus = WorkerStatus.READY,
    in_flight: Command | None = None,
) -> Heartbeat:
    return factories.heartbeat(
        worker_id,
        sent,
        t0=T0,
        labels=labels if labels is not None else {"model": "tiny"},
        status=status,
        version=version,
        in_flight=(
            InFlight(
                command_id=in_flight.command_id,
                rollout_id=in_flight.rollout_id,
                kind=in_flight.kind,
                since=at(sent - 1),
            )
            if in_flight is not None
            else None
        ),
        seq=int(sent * 10) + 1000,
    )


def feed(coordinator: Coordinator, *events: Command | Ack | Heartbeat) -> None:
    """What the follower does with one fetch: fold into the Fleet, then tell the listeners."""
    batch = Batch()
    for event in events:
        if isinstance(event, Command):
            coordinator.fleet.observe_command(event)
            batch.commands.append(event)
        elif isinstance(event, Ack):
            coordinator.fleet.observe_ack(event)
            batch.acks.append(event)
        else:
            coordinator.fleet.observe_heartbeat(event)
            batch.heartbeats.append(event)
    for listener in coordinator.follower.listeners:
        listener(batch)


def succeeded(cmd: Command, *workers: str, sent: float = 5.0) -> list[Ack]:
    return [
        a
        for w in workers
        for a in (ack(cmd, w, AckState.RUNNING, sent - 1), ack(cmd, w, AckState.SUCCEEDED, sent))
    ]


def sse_events(text: str) -> list[tuple[str, str]]:
    """(event, data) pairs of an SSE body, pings left out."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields = dict(
            line.split(": ", 1)
            for line in block.split("\n")
            if ": " in line and not line.startswith(":")
        )
        if "event" in fields:
            out.append((fields["event"], fields.get("data", "")))
    return out


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def clock() -> Clock:
    return Clock(10.0)


@pytest.fixture
async def coordinator(clock: Clock) -> AsyncIterator[Coordinator]:
    """Never started: nothing here touches Kafka (the address is unroutable on purpose)."""
    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"), api_token=SecretStr(TOKEN)
    )
    coord = Coordinator(settings, clock=clock, current_as_of=clock)
    coord.follower.caught_up.set()
    try:
        yield coord
    finally:
        await coord.stop()


@pytest.fixture
def app(coordinator: Coordinator) -> FastAPI:
    return create_app(coordinator, sse_tick_s=0.05)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
        yield c


@pytest.fixture
def fleet_of_two(coordinator: Coordinator) -> Iterator[dict[str, Command]]:
    """w1 and w2 alive; r-old succeeded on both, r-new progressing (w1 failed, w2 running)."""
    old = command("r-old", issued=1.0, version="v2")
    new = command("r-new", issued=6.0, version="v3")
    feed(coordinator, heartbeat("w1", 0.0), heartbeat("w2", 0.0), old)
    feed(coordinator, *succeeded(old, "w1", "w2", sent=4.0))
    feed(
        coordinator,
        new,
        ack(new, "w1", AckState.REJECTED, 7.0, code="CHECKSUM_MISMATCH"),
        ack(new, "w2", AckState.RUNNING, 7.5),
        heartbeat("w1", 9.0, version="v2"),
        heartbeat("w2", 9.0, version="v2", status=WorkerStatus.BUSY, in_flight=new),
    )
    yield {"old": old, "new": new}


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of metric ``name`` with exactly ``labels`` in a Prometheus text page."""
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        metric, _, rest = key.partition("{")
        got = dict(p.split("=", 1) for p in rest.rstrip("}").split(",") if p) if rest else {}
        if metric == name and {k: v.strip('"') for k, v in got.items()} == labels:
            return float(value)
    return None


# --------------------------------------------------------------------------- the loader tests (test_loaders*.py)


def targets() -> dict[str, torch.Tensor]:
    """Destination tensors for the loader tests: zeros of four shapes and dtypes."""
    return {
        "w": torch.zeros(4, 3),
        "b": torch.zeros(3, dtype=torch.bfloat16),
        "steps": torch.zeros((), dtype=torch.int64),
        "empty": torch.zeros(0, 5),
    }


def source(seed: int = 1) -> dict[str, torch.Tensor]:
    """Seeded values for ``targets()``."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(4, 3, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "steps": torch.tensor(7 + seed, dtype=torch.int64),
        "empty": torch.zeros(0, 5),
    }


def load(path: Path, dst: dict[str, torch.Tensor], **kw: Any) -> Any:
    return load_checkpoint(path, dst, version="v1", from_version="v0", **kw)
