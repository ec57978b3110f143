"""Faults of the serving path on a real vLLM: a step that fails, a stepping loop that dies, a
reload whose restore fails while a drain holds requests. Our own engine's methods are patched
to inject the fault; vLLM itself is never stood in for.

The module-scoped ``runner`` is one engine per shape, as in test_engines.py; every test leaves
it on checkpoint v1, serving, as it found it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from controlplane.wire.errors import RunnerError, WireCode
from tests.vllm.conftest import ENGINES, LONG, NEW_TOKENS, SHORT, Checkpoints
from tests.vllm.test_engines import DRAIN_TOKENS, wait_for
from workers.runners.vllm_engine import InProcessEngine
from workers.runners.vllm_runner import VllmRunner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module", params=list(ENGINES))
def runner(
    request: pytest.FixtureRequest, ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmRunner]:
    with ENGINES[request.param](ckpts, tmp_path_factory) as engine:
        yield engine


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
