"""Faults of the serving path on a real vLLM: a step that fails, a stepping loop that dies, a
reload whose restore fails while a drain holds requests. Our own engine's methods are patched
to inject the fault; vLLM itself is never stood in for.

The module-scoped ``runner`` is one engine per shape, as in test_engines.py; every test leaves
it on checkpoint v1, serving, as it found it.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.vllm.conftest import LONG, NEW_TOKENS, SHORT, Checkpoints
from tests.vllm.test_engines import (
    DRAIN_TOKENS,
    HELD_TOKENS,
    drain_spec,
    fail_inside_vllm,
    held_request,
    hold_until_drain,
    request,
    wait_for,
)
from workers.demo.tiny_llama import hf_greedy
from workers.runners.vllm_engine import InProcessEngine
from workers.runners.vllm_runner import VllmRunner
from workers.runners.vllm_sidecar import Generation, SidecarEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def in_process(runner: VllmRunner) -> InProcessEngine:
    """The runner's in-process engine; the test is skipped on a sidecar."""
    engine = runner._engine
    if not isinstance(engine, InProcessEngine):
        pytest.skip("the in-process engine's own stepping loop")
    return engine


def held_by_vllm(engine: InProcessEngine) -> tuple[int, int]:
    """(requests vLLM's output processor tracks, requests its scheduler holds), read between
    two steps: both 0 when vLLM holds nothing of any request."""
    with engine._held() as llm:
        core = llm.llm_engine.engine_core.engine_core  # in process: the EngineCore itself
        tracked = llm.llm_engine.output_processor.get_num_unfinished_requests()
        return int(tracked), len(core.scheduler.requests)


class Call:
    """One call in a thread, so that a test never waits on it without end."""

    def __init__(self, fn: Any, *args: Any) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn, *args), daemon=True)
        self._thread.start()

    def _run(self, fn: Any, *args: Any) -> None:
        try:
            self.result = fn(*args)
        except BaseException as exc:  # the test's result
            self.error = exc

    def outcome(self, timeout: float = 120) -> Any:
        """Its result, or the error it raised; fails the test if it has not returned."""
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call never returned"
        return self.error if self.error is not None else self.result


# --------------------------------------------------------------------------- a failed step


def test_a_request_lost_to_a_failed_step_is_aborted_in_vllm_too(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vLLM step raises after it ran (the request is in vLLM's scheduler, its KV allocated):
    the request is failed to its caller, and vLLM lets go of it, so it holds nothing of it and
    generates for no one; the next requests are served as before."""
    engine = in_process(runner)
    step = engine._step
    broke = threading.Event()

    def fails_once() -> list[Any]:
        out = step()
        if not broke.is_set():
            broke.set()
            raise RuntimeError("a vLLM step failed (injected)")
        return out

    monkeypatch.setattr(engine, "_step", fails_once)
    lost = Call(runner.generate, SHORT, NEW_TOKENS).outcome()
    assert isinstance(lost, RunnerError) and lost.code is WireCode.RUNNER_FAILED, lost
    assert "lost: vLLM failed a step" in lost.message
    assert held_by_vllm(engine) == (0, 0)
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")
    assert runner.generate(LONG, NEW_TOKENS) == ckpts.want("v1", "long")
    assert held_by_vllm(engine) == (0, 0)
    assert runner.describe().degraded is None


# --------------------------------------------------------------------------- a dead loop


def test_a_dead_stepping_loop_fails_every_request_pending_and_refuses_the_next(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stepping loop itself dies (its bookkeeping raises, outside any step) while two
    requests are in flight: neither waits for ever, both fail RUNNER_FAILED, a later request
    is refused at once with that code, vLLM holds nothing of them, and the runner reports
    itself degraded (RUNNER_FAILED). A new engine (a worker restart) serves again."""
    engine = in_process(runner)
    step, finish = engine._step, engine._finish
    broke = threading.Event()

    def both_in_flight() -> list[Any]:
        wait_for(lambda: len(engine._requests) >= 2)  # the short one cannot finish alone
        return step()

    def breaks_once(rid: str, **outcome: Any) -> None:
        if outcome.get("result") is not None and not broke.is_set():
            broke.set()
            raise RuntimeError("the loop's bookkeeping broke (injected)")
        finish(rid, **outcome)

    monkeypatch.setattr(engine, "_step", both_in_flight)
    monkeypatch.setattr(engine, "_finish", breaks_once)
    try:
        calls = [
            Call(runner.generate, SHORT, NEW_TOKENS),
            Call(runner.generate, SHORT, DRAIN_TOKENS),
        ]
        for outcome in [call.outcome() for call in calls]:
            assert isinstance(outcome, RunnerError), outcome
            assert outcome.code is WireCode.RUNNER_FAILED, outcome
            assert "stepping loop died (RuntimeError: the loop's bookkeeping" in outcome.message
        assert broke.is_set()
        later = Call(runner.generate, SHORT, NEW_TOKENS).outcome()
        assert isinstance(later, RunnerError) and later.code is WireCode.RUNNER_FAILED, later
        assert held_by_vllm(engine) == (0, 0)
        degraded = runner.describe().degraded
        assert degraded is not None and degraded.code == "RUNNER_FAILED", degraded
        assert "stepping loop died" in degraded.message
    finally:
        monkeypatch.undo()
        runner.close()  # the worker restarts: a new engine
        runner.load()
    assert runner.describe().degraded is None
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")


# --------------------------------------------------------------------------- a failed restore


def fail_reload_and_restore(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> RunnerError:
    """A reload v1 -> v2 with drain keep whose load fails inside vLLM (mid-load), and whose
    restore of v1 fails too (its directory gone): the error (WEIGHTS_CORRUPTED)."""
    fail_inside_vllm(runner, ckpts, monkeypatch)
    monkeypatch.setattr(runner, "_loaded_dir", ckpts.root / "vanished-before-the-restore")
    with pytest.raises(RunnerError) as caught:
        runner.reload_weights(drain_spec(ckpts.v2, "v2", "keep"), ckpts.v2)
    assert caught.value.code is WireCode.WEIGHTS_CORRUPTED, caught.value
    assert "'v1!degraded'" in caught.value.message
    return caught.value


def recover(runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    """Patches undone, a good reload of v1: not degraded, serving v1 again."""
    monkeypatch.undo()
    runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
    assert runner.describe().degraded is None and runner.vllm_weight_version() == "v1"
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")


def test_a_failed_restore_aborts_the_requests_a_keep_drain_held_in_process(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two requests in flight are frozen by drain keep; the reload and its restore both fail:
    serving resumes (labelled degraded), but the two frozen requests end aborted (no token from
    the broken weights) instead of going on on them, and vLLM holds nothing of them; the
    runner's own generate refuses (WEIGHTS_CORRUPTED). A good reload recovers."""
    engine = in_process(runner)
    held = hold_until_drain(runner, monkeypatch, 2)
    calls = [Call(request, runner, SHORT, DRAIN_TOKENS) for _ in range(2)]
    try:
        assert held.wait(120), "two requests were never in flight together"
        error = fail_reload_and_restore(runner, ckpts, monkeypatch)
        assert "the requests the drain held were aborted (2)" in error.message, error
        assert [call.outcome() for call in calls] == [Generation([], None, "abort")] * 2
        assert not engine._paused and not engine._draining  # serving resumed
        assert held_by_vllm(engine) == (0, 0)
        assert runner.vllm_weight_version() == "v1!degraded"
        refused = Call(runner.generate, SHORT, NEW_TOKENS).outcome()
        assert isinstance(refused, RunnerError), refused
        assert refused.code is WireCode.WEIGHTS_CORRUPTED, refused
    finally:
        recover(runner, ckpts, monkeypatch)


async def test_a_failed_restore_aborts_the_request_a_keep_drain_held_on_a_sidecar(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sidecar: a request held in flight (vLLM's scheduler frozen), a reload with drain keep,
    the reload and the restore both fail: vLLM's ``/pause?mode=abort`` on the paused server
    aborts the held request (its stream ends, finish reason abort, its tokens all v1's), then
    serving resumes, labelled degraded. A good reload recovers."""
    if runner.options.mode != "sidecar":
        pytest.skip("in process: the test above")
    refs = await asyncio.to_thread(hf_greedy, ckpts.v1, SHORT, HELD_TOKENS)
    held = await held_request(runner)
    try:
        await asyncio.to_thread(fail_reload_and_restore, runner, ckpts, monkeypatch)
        out = await asyncio.to_thread(held.finish)
        assert out.finish_reason == "abort", out
        cut = len(out.token_ids)
        assert 0 < cut < HELD_TOKENS and out.token_ids == refs[:cut], out
        assert out.weight_versions == [("v1", 0, cut)], out  # nothing from the broken weights
        engine = runner._engine
        assert isinstance(engine, SidecarEngine) and not engine.client.is_paused()
        assert runner.vllm_weight_version() == "v1!degraded"
    finally:
        await asyncio.to_thread(recover, runner, ckpts, monkeypatch)
