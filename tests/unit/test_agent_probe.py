"""The agent's probe after a reload (workers/agent/apply.py), on the fake runner, without Kafka.

A reload that asks for a probe and succeeds carries ``result["probe"]``: the runner's result, or
``{"unsupported": true}``, or ``{"error": {"code", "message"}}``; the reload stays succeeded.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import threading
from pathlib import Path
from typing import Any

import pytest

from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.messages import ProbeSpec
from controlplane.wire.protocol import AckState, ReloadWeightsSpec
from tests.unit.conftest import reload_command
from workers.agent.apply import Outcome, apply
from workers.agent.session import AgentLog, StopSignal
from workers.runners.base import RUNNERS, ProbeResult, ReloadResult, RunnerDescription
from workers.runners.fake_runner import FakeRunner, fake_probe

PROBE = ProbeSpec(prompt="The capital of France is", max_tokens=5)


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\0" * 64)
    return path


def loaded(**options: Any) -> FakeRunner:
    runner = FakeRunner(options)
    runner.load()
    return runner


async def reload(
    runner: Any,
    ckpt: Path,
    version: str,
    probe: ProbeSpec | None = PROBE,
    *,
    timeout_s: float | None = None,
    stop: StopSignal | None = None,
) -> Outcome:
    command = reload_command(
        spec=ReloadWeightsSpec(path=str(ckpt), version=version, probe=probe), timeout_s=timeout_s
    )
    return await apply(
        runner,
        command,
        ckpt,
        default_timeout_s=600.0,
        stop=stop or StopSignal(drain_timeout_s=600.0),
        log=AgentLog("w1"),
    )


def probe_of(outcome: Outcome) -> Any:
    assert outcome.state is AckState.SUCCEEDED, outcome.error
    assert outcome.result is not None
    return outcome.result["probe"]


async def test_a_probe_runs_on_the_new_weights_and_goes_into_the_result(ckpt: Path) -> None:
    runner = loaded()
    outcome = await reload(runner, ckpt, "v2")
    assert probe_of(outcome) == fake_probe("v2", PROBE.prompt, 5).as_dict()
    assert outcome.result is not None and outcome.result["version"] == "v2"  # the reload's facts
    assert runner.probes == [("v2", PROBE.prompt, 5)]
    bad = await reload(runner, ckpt, "badprobe-v3")
    assert probe_of(bad)["mean_logprob"] == -50.0
    assert runner.describe().weights_version == "badprobe-v3"


async def test_no_probe_asked_none_run(ckpt: Path) -> None:
    runner = loaded()
    outcome = await reload(runner, ckpt, "v2", probe=None)
    assert outcome.state is AckState.SUCCEEDED
    assert outcome.result is not None and "probe" not in outcome.result
    assert runner.probes == []


async def test_a_failed_reload_is_not_probed(ckpt: Path) -> None:
    runner = loaded()
    outcome = await reload(runner, ckpt, "fail-v2")
    assert outcome.state is AckState.FAILED and outcome.result is None
    assert runner.probes == []


class WithoutProbe:
    """A runner written before probes: everything but ``probe``."""

    name = "old"

    def __init__(self) -> None:
        self.inner = loaded()

    def reload_weights(self, spec: ReloadWeightsSpec, path: Path, **kw: Any) -> ReloadResult:
        return self.inner.reload_weights(spec, path, **kw)

    def describe(self) -> RunnerDescription:
        return self.inner.describe()


async def test_a_runner_that_cannot_probe_says_so(ckpt: Path) -> None:
    assert probe_of(await reload(loaded(probe_unsupported=True), ckpt, "v2")) == {
        "unsupported": True
    }
    assert probe_of(await reload(WithoutProbe(), ckpt, "v2")) == {"unsupported": True}


class Broken(FakeRunner):
    def __init__(self, error: Exception) -> None:
        super().__init__({})
        self.error = error
        self.load()

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        raise self.error


async def test_a_probe_that_raises_is_a_coded_error_and_the_reload_stands(ckpt: Path) -> None:
    runner = loaded()
    failed = probe_of(await reload(runner, ckpt, "probefail-v2"))
    assert failed == {
        "error": {"code": "RUNNER_FAILED", "message": "scripted probe failure for 'probefail-v2'"}
    }
    assert runner.describe().weights_version == "probefail-v2"
    bug = probe_of(await reload(Broken(ZeroDivisionError("division by zero")), ckpt, "v2"))
    assert bug == {"error": {"code": "INTERNAL", "message": "ZeroDivisionError: division by zero"}}
    long = RunnerError("x" * 5000, code=WireCode.WEIGHTS_CORRUPTED)
    clipped = probe_of(await reload(Broken(long), ckpt, "v2"))
    assert clipped["error"]["code"] == "WEIGHTS_CORRUPTED"
    assert clipped["error"]["message"] == "x" * 1024


async def test_a_probe_past_the_command_timeout_is_given_up(ckpt: Path) -> None:
    runner = loaded(probe_delay_s=600)
    try:
        outcome = await reload(runner, ckpt, "v2", timeout_s=0.5)
        assert probe_of(outcome)["error"]["code"] == "COMMAND_TIMEOUT"
        assert runner.describe().weights_version == "v2"
    finally:
        runner.close()  # ends the probe's delay


class Announcing(FakeRunner):
    """Says when a probe begins."""

    def __init__(self, **options: Any) -> None:
        super().__init__(options)
        self.probing = threading.Event()
        self.load()

    def probe(self, prompt: str, max_tokens: int) -> ProbeResult | None:
        self.probing.set()
        return super().probe(prompt, max_tokens)


async def test_a_probe_cut_short_by_a_stop(ckpt: Path) -> None:
    runner = Announcing(probe_delay_s=600)
    stop = StopSignal(drain_timeout_s=0.0)
    try:
        running = asyncio.ensure_future(reload(runner, ckpt, "v2", stop=stop))
        assert await asyncio.to_thread(runner.probing.wait, 60)
        stop.request()
        outcome = await asyncio.wait_for(running, 60)
        assert probe_of(outcome)["error"]["code"] == "WORKER_SHUTTING_DOWN"
    finally:
        runner.close()


def test_a_probe_result_must_be_finite() -> None:
    assert ProbeResult.of([1, 2], [-1.0, -2.0]) == ProbeResult((1, 2), -1.5)
    with pytest.raises(RunnerError) as info:
        ProbeResult.of([1, 2], [-1.0, math.nan])
    assert info.value.code is WireCode.RUNNER_FAILED
    with pytest.raises(RunnerError):
        ProbeResult.of([1], [-math.inf])
    with pytest.raises(ValueError, match="2 tokens and 1 log-probabilities"):
        ProbeResult.of([1, 2], [-1.0])


@pytest.mark.parametrize("name", ["fake", "vllm"])
def test_every_runner_has_a_probe(name: str) -> None:
    """A runner without one would be "unsupported" everywhere, silently (torch's and xla's, the
    torch runner's, are tested in tests/component/test_torch_runner.py)."""
    module, _, attr = RUNNERS[name].partition(":")
    assert callable(getattr(getattr(importlib.import_module(module), attr), "probe", None))


def test_the_vllm_runner_says_it_cannot_probe() -> None:
    from workers.runners.vllm_runner import VllmRunner

    assert VllmRunner({"model": "m", "mode": "sidecar"}).probe("p", 1) is None
