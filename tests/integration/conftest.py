"""Shared helpers for the integration tests: the agent tests' in-test runner, their weights
and reloads, and a read of every ack on the topic (test_agent*.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from controlplane.kafka.bus import Consumer
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.protocol import (
    Ack,
    Command,
    ReloadWeightsSpec,
    decode_ack,
)
from tests.factories import running_agent, weights_dir
from tests.fleet import (
    Tail,
    acks_tail,
    make_command,
    settled,
)
from workers.runners.base import ReloadResult, RunnerDescription, config_digest


class RecordingRunner:
    """A minimal real Runner: records what it applied; versions named bad-* are refused.

    ``delay_s``: each reload takes that long. ``gate``: each reload waits until it is set (the
    test decides when a reload ends). Either way a reload stops when cancelled.
    """

    name = "recording"

    def __init__(
        self,
        delay_s: float = 0.0,
        *,
        gate: threading.Event | None = None,
        load_error: Exception | None = None,
    ) -> None:
        self.delay_s = delay_s
        self.gate = gate
        self.load_error = load_error
        self.version: str | None = None
        self.config: dict[str, Any] = {"max_new_tokens": 16}
        self.applied: list[str] = []
        self.loaded = False
        self.closed = False

    def load(self) -> None:
        if self.load_error is not None:
            raise self.load_error
        self.loaded = True
        self.version = "init"

    def reload_weights(
        self, spec: ReloadWeightsSpec, path: Path, *, cancel: threading.Event | None = None
    ) -> ReloadResult:
        if not self.loaded:
            raise RunnerError("no model is loaded", code=WireCode.MODEL_NOT_LOADED)
        if spec.version.startswith("bad-"):
            raise RunnerError(
                "tensor w has shape [2] in the checkpoint, [3] in the model",
                code=WireCode.WEIGHTS_SHAPE_MISMATCH,
            )
        end = time.monotonic() + self.delay_s
        while time.monotonic() < end or (self.gate is not None and not self.gate.is_set()):
            if cancel is not None and cancel.is_set():
                raise RunnerError("cancelled before copying", code=WireCode.COMMAND_TIMEOUT)
            time.sleep(0.01)
        self.applied.append(spec.version)
        self.version = spec.version
        return ReloadResult(spec.version, 1, 1, path.stat().st_size, 0.0, 0.0, self.delay_s, 0.0)

    def update_config(self, overrides: dict[str, Any]) -> RunnerDescription:
        if set(overrides) - {"max_new_tokens"}:
            raise RunnerError(
                f"unknown keys {sorted(overrides)}", code=WireCode.CONFIG_KEY_REJECTED
            )
        self.config.update(overrides)
        return self.describe()

    def describe(self) -> RunnerDescription:
        return RunnerDescription(
            runner=self.name,
            device="cpu",
            model_loaded=self.loaded,
            weights_version=self.version,
            config=dict(self.config),
            config_digest=config_digest(self.config),
            accepts={"max_new_tokens": "integer"},
        )

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return weights_dir(tmp_path)


async def acks_on_the_topic(kafka: KafkaSettings) -> list[Ack]:
    """Every ack on the acks topic now: read up to each partition's end offset."""
    topic = kafka.topics.acks.name
    out: list[Ack] = []
    async with Consumer(kafka) as consumer:
        await consumer.assign(topic)
        await consumer.seek_to_beginning()
        ends = await consumer.end_offsets(topic)
        position = await consumer.beginning_offsets(topic)
        deadline = time.monotonic() + 30
        while any(position[p] < ends[p] for p in ends):
            assert time.monotonic() < deadline, f"acks not read to {ends}: at {position}"
            for _, partition, records in await consumer.fetch_partitions(timeout_s=0.2):
                for record in records:
                    if record.value is not None:
                        out.append(decode_ack(record.value))
                    position[partition] = record.offset + 1
    return out


def reload(weights: Path, version: str, **kw: Any) -> Any:
    return make_command(
        ReloadWeightsSpec(path=str(weights / "model.safetensors"), version=version), **kw
    )


async def reloaded(
    kafka: KafkaSettings, tmp_path: Path, runner: RecordingRunner, weights: Path, version: str
) -> tuple[Tail, Command]:
    """An agent on ``runner`` is sent one reload to ``version`` and stopped once it is acked:
    the acks read until then, and the command."""
    async with running_agent(kafka, tmp_path, runner), acks_tail(kafka) as acks:
        cmd = reload(weights, version)
        await settled(kafka, acks, cmd)
    return acks, cmd
