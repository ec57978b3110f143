"""The torch and XLA runners' drain policy (issue 14): requests in flight during a reload run
wholly on one version of the weights, and the reload's policy says what happens to them.

Real torch modules: :class:`GatedLM` is the built-in TinyLM with one hook, which holds chosen
requests mid-generation (after their first token) until the test lets them go, so that "in
flight during the reload" is a fact of the test, not of timing. References: the greedy output
of each prompt with exactly v1 and exactly v2, computed first by runners that never reload
concurrently. No sleeps, no clocks: events, barriers and the gate's own condition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.messages import DrainMode, DrainPolicy
from controlplane.wire.protocol import ReloadWeightsSpec
from tests.component.conftest import MakeCheckpoint, MakeRunner
from workers.runners.base import GenerationAborted, ReloadResult
from workers.runners.tiny_lm import TinyLM, init_weights
from workers.runners.torch_runner import TorchRunner

FACTORY = f"{__name__}:gated_tiny_lm"
PROMPTS = ["Hello, w", "The cap", "0123", "zz top"]
NEW_TOKENS = 4
#: A guard against a hang, never a measurement: every wait below ends long before it.
GUARD_S = 120.0


# --------------------------------------------------------------------------- the gated model


@dataclass
class Hold:
    """Hold the first ``count`` requests after their first token: they meet the test at
    ``entered``, then wait for ``release`` or, with ``until_aborted``, for their abort flag."""

    count: int
    until_aborted: bool = False
    release: threading.Event = field(default_factory=threading.Event)
    entered: threading.Barrier = field(init=False)
    _taken: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.entered = threading.Barrier(self.count + 1)

    def take(self) -> bool:
        with self._lock:
            if self._taken >= self.count:
                return False
            self._taken += 1
            return True


HOLDS: dict[str, Hold] = {}
_CALL = threading.local()


class GatedLM(TinyLM):
    """TinyLM whose requests the test can hold mid-generation (see :class:`Hold`)."""

    def __init__(self, hold: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hold_key = hold

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        *,
        stop: threading.Event | None = None,
        **kwargs: Any,
    ) -> list[int]:
        _CALL.tokens, _CALL.stop = 0, stop
        out: list[int] = super().generate(prompt_ids, max_new_tokens, stop=stop, **kwargs)
        return out

    def next_logits(self, ids: list[int], *, pad_to: int | None = None) -> Any:
        _CALL.tokens = getattr(_CALL, "tokens", 0) + 1
        hold = HOLDS.get(self.hold_key)
        if _CALL.tokens == 2 and hold is not None and hold.take():
            hold.entered.wait(GUARD_S)
            stop: threading.Event | None = getattr(_CALL, "stop", None)
            waited = stop if hold.until_aborted and stop is not None else hold.release
            assert waited.wait(GUARD_S), "held past the guard"
        return super().next_logits(ids, pad_to=pad_to)


def gated_tiny_lm(
    hold: str = "",
    vocab_size: int = 256,
    d_model: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    max_seq: int = 128,
    seed: int = 0,
    tied: bool = False,
) -> GatedLM:
    """The tiny_lm factory's model (same seeded weights), gated by ``HOLDS[hold]``."""
    model = GatedLM(
        hold,
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        max_seq=max_seq,
        tied=tied,
    )
    init_weights(model, seed)
    return model.eval().requires_grad_(False)


# --------------------------------------------------------------------------- fixtures


@dataclass
class Versions:
    v2: Path
    ref1: dict[str, list[int]]
    ref2: dict[str, list[int]]

    def version_of(self, prompt: str, out: list[int]) -> str:
        """Which version generated ``out``: v1 or v2 exactly, or the test fails."""
        if out == self.ref1[prompt]:
            return "v1"
        assert out == self.ref2[prompt], f"{prompt!r}: {out} is neither v1 nor v2 (mixed?)"
        return "v2"


@pytest.fixture
def gated(make_runner: MakeRunner) -> Iterator[Callable[[Hold | None], TorchRunner]]:
    """A runner over the gated model (initial weights: seed 0, version ``init`` = v1)."""
    keys: list[str] = []

    def make(hold: Hold | None = None) -> TorchRunner:
        key = f"hold-{len(HOLDS)}-{len(keys)}"
        keys.append(key)
        if hold is not None:
            HOLDS[key] = hold
        return make_runner(
            factory=FACTORY,
            model_kwargs={"hold": key},
            config={"max_new_tokens": NEW_TOKENS},
        )

    yield make
    for key in keys:
        HOLDS.pop(key, None)


@pytest.fixture
def versions(
    gated: Callable[[Hold | None], TorchRunner], make_checkpoint: MakeCheckpoint
) -> Versions:
    """v2's checkpoint, and each prompt's greedy output with exactly v1 and exactly v2."""
    v2 = make_checkpoint(1)
    one, two = gated(None), gated(None)
    ref1 = {p: one.generate(p) for p in PROMPTS}
    two.reload_weights(spec(v2), v2)
    ref2 = {p: two.generate(p) for p in PROMPTS}
    for p in PROMPTS:
        assert len(ref1[p]) == NEW_TOKENS and ref1[p] != ref2[p], p  # versions tell apart
    return Versions(v2, ref1, ref2)


def spec(path: Path, drain: DrainPolicy | None = None) -> ReloadWeightsSpec:
    return ReloadWeightsSpec(path=str(path), version="v2", drain=drain)


def held_count(runner: TorchRunner) -> int:
    """Requests the test can hold at once: one where the runner serves one at a time (XLA)."""
    return 1 if runner._one_request_at_a_time else 2


class Request(threading.Thread):
    """One request in its own thread: its tokens, or the RunnerError it raised."""

    def __init__(self, clients: Clients, prompt: str) -> None:
        super().__init__()
        self.clients, self.prompt = clients, prompt
        self.outcome: list[int] | Exception | None = None
        self.start()

    def run(self) -> None:
        self.outcome = self.clients.send(self.prompt)

    def result(self) -> list[int] | Exception | None:
        self.join(GUARD_S)
        assert not self.is_alive()
        return self.outcome


class Clients:
    """Requests to one runner: ``once`` one thread per prompt, ``loop`` one thread per prompt
    sending it over and over until ``join``. Every outcome is kept, in ``outcomes``."""

    def __init__(self, runner: TorchRunner) -> None:
        self.runner = runner
        self.outcomes: list[tuple[str, list[int] | Exception]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def send(self, prompt: str) -> list[int] | Exception:
        try:
            out: list[int] | Exception = self.runner.generate(prompt)
        except RunnerError as exc:
            out = exc
        with self._lock:
            self.outcomes.append((prompt, out))
        return out

    def once(self, *prompts: str) -> list[Request]:
        requests = [Request(self, p) for p in prompts]
        self._threads.extend(requests)
        return requests

    def loop(self, *prompts: str) -> None:
        def run(prompt: str) -> None:
            while not self._stop.is_set():
                self.send(prompt)

        for prompt in prompts:
            thread = threading.Thread(target=run, args=(prompt,))
            thread.start()
            self._threads.append(thread)

    def join(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(GUARD_S)
            assert not thread.is_alive()


class Reload:
    """A reload running in its own thread: its result, or the error it raised."""

    def __init__(
        self, runner: TorchRunner, spec: ReloadWeightsSpec, cancel: threading.Event | None = None
    ) -> None:
        self.outcome: ReloadResult | Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(runner, spec, cancel))
        self.thread.start()

    def _run(
        self, runner: TorchRunner, spec: ReloadWeightsSpec, cancel: threading.Event | None
    ) -> None:
        try:
            self.outcome = runner.reload_weights(spec, Path(spec.path), cancel=cancel)
        except RunnerError as exc:
            self.outcome = exc

    def result(self) -> ReloadResult | Exception | None:
        self.thread.join(GUARD_S)
        assert not self.thread.is_alive()
        return self.outcome


# --------------------------------------------------------------------------- the policies


@pytest.mark.parametrize("mode", ["wait", "keep"])
def test_wait_serves_every_request_wholly_on_one_version(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions, mode: DrainMode
) -> None:
    """wait (and keep, which torch cannot do otherwise): no request fails; the ones in flight
    finish on v1 before the copy, the ones arriving during the drain run on v2 after it, and
    clients sending continuously get each response entirely v1 or entirely v2."""
    hold = Hold(held_count(gated(None)))
    runner = gated(hold)
    clients = Clients(runner)
    held = clients.once(*PROMPTS[: hold.count])
    hold.entered.wait(GUARD_S)  # in flight, one token generated with v1
    clients.loop(*PROMPTS)  # continuously, from before the reload to after it
    reload = Reload(runner, spec(versions.v2, DrainPolicy(mode=mode, timeout_s=3600)))
    assert runner.drain_gate.wait_draining(GUARD_S)
    late = clients.once(*PROMPTS)  # arriving while the reload drains: admitted after it
    hold.release.set()
    result = reload.result()
    held_out = [(r.prompt, r.result()) for r in held]
    late_out = [(r.prompt, r.result()) for r in late]
    clients.join()

    assert isinstance(result, ReloadResult), result
    assert result.drain is not None
    assert (result.drain.mode, result.drain.aborted) == (mode, 0)
    assert result.drain.in_flight >= hold.count
    assert result.as_dict()["drain"] == result.drain.as_dict()
    assert runner.describe().weights_version == "v2"
    assert [out for _, out in clients.outcomes if not isinstance(out, list)] == []
    assert {versions.version_of(p, out) for p, out in held_out} == {"v1"}  # type: ignore[arg-type]
    assert {versions.version_of(p, out) for p, out in late_out} == {"v2"}  # type: ignore[arg-type]
    for p, out in clients.outcomes:
        versions.version_of(p, out)  # type: ignore[arg-type]


def test_late_requests_run_after_the_reload(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """A request that arrives while a reload drains is held back, not refused, and runs on
    the new weights: it cannot have started before the copy."""
    hold = Hold(1)
    runner = gated(hold)
    clients = Clients(runner)
    clients.once(PROMPTS[0])
    hold.entered.wait(GUARD_S)
    reload = Reload(runner, spec(versions.v2))
    assert runner.drain_gate.wait_draining(GUARD_S)
    clients.once(*PROMPTS[1:])
    hold.release.set()
    assert isinstance(reload.result(), ReloadResult)
    clients.join()
    outcome = dict(clients.outcomes)
    assert outcome[PROMPTS[0]] == versions.ref1[PROMPTS[0]]
    assert {p: outcome[p] for p in PROMPTS[1:]} == {p: versions.ref2[p] for p in PROMPTS[1:]}


def test_abort_fails_the_requests_in_flight_and_no_other(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """abort: the requests in flight stop at their next token and raise GenerationAborted
    (RUNNER_FAILED) with no tokens; the reload goes on; every other response is single-version."""
    hold = Hold(held_count(gated(None)), until_aborted=True)
    runner = gated(hold)
    clients = Clients(runner)
    held = clients.once(*PROMPTS[: hold.count])
    hold.entered.wait(GUARD_S)
    clients.loop(*PROMPTS)
    # Held until their abort flag is set: only the reload can let them go.
    reload = Reload(runner, spec(versions.v2, DrainPolicy(mode="abort", timeout_s=3600)))
    assert runner.drain_gate.wait_draining(GUARD_S)
    late = clients.once(*PROMPTS)
    result = reload.result()
    held_out = [r.result() for r in held]
    late_out = [(r.prompt, r.result()) for r in late]
    clients.join()

    assert isinstance(result, ReloadResult), result
    assert result.drain is not None and result.drain.mode == "abort"
    assert result.drain.aborted == result.drain.in_flight >= hold.count
    for out in held_out:
        assert isinstance(out, GenerationAborted) and out.code is WireCode.RUNNER_FAILED
    failed = [out for _, out in clients.outcomes if not isinstance(out, list)]
    assert all(isinstance(out, GenerationAborted) for out in failed)
    # Flagged but past its last check when flagged: it finished on v1, never failed.
    assert hold.count <= len(failed) <= result.drain.aborted
    for p, out in clients.outcomes:
        if isinstance(out, list):
            versions.version_of(p, out)
    assert {versions.version_of(p, out) for p, out in late_out} == {"v2"}  # type: ignore[arg-type]
    assert runner.describe().weights_version == "v2"


def test_abort_applies_to_probes_too(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """A probe in flight is aborted like a generate (it checks its flag before each token)."""
    hold = Hold(1)
    runner = gated(hold)
    probed: list[object] = []

    def probe() -> None:
        try:
            probed.append(runner.probe(PROMPTS[0], NEW_TOKENS))
        except RunnerError as exc:
            probed.append(exc)

    thread = threading.Thread(target=probe)
    thread.start()
    hold.entered.wait(GUARD_S)
    reload = Reload(runner, spec(versions.v2, DrainPolicy(mode="abort")))
    assert runner.drain_gate.wait_draining(GUARD_S)  # flagged by now (same lock, same hold)
    hold.release.set()
    thread.join(GUARD_S)
    assert isinstance(reload.result(), ReloadResult)
    assert len(probed) == 1 and isinstance(probed[0], GenerationAborted)
    again = runner.probe(PROMPTS[0], NEW_TOKENS)
    assert again is not None and list(again.tokens) == versions.ref2[PROMPTS[0]]


# --------------------------------------------------------------------------- the deadline


def test_wait_past_its_deadline_nacks_command_timeout_with_the_weights_untouched(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """A request that outlives the drain deadline: the reload NACKs COMMAND_TIMEOUT (retryable)
    before touching any weight; the request finishes on v1 and requests are admitted again."""
    hold = Hold(1)
    runner = gated(hold)
    before = runner.describe()
    clients = Clients(runner)
    clients.once(PROMPTS[0])
    hold.entered.wait(GUARD_S)
    # The held request ends only when released, after the reload returned: the deadline passes.
    outcome = Reload(runner, spec(versions.v2, DrainPolicy(timeout_s=0.001))).result()
    assert isinstance(outcome, RunnerError) and not isinstance(outcome, GenerationAborted)
    assert outcome.code is WireCode.COMMAND_TIMEOUT and outcome.retryable
    assert "weights untouched" in outcome.message
    after = runner.describe()
    assert (after.weights_version, after.weights_digest) == ("init", before.weights_digest)
    assert after.extra["phase"] == "idle" and after.degraded is None
    assert not runner.drain_gate.wait_draining(0)  # admitting again
    hold.release.set()
    clients.join()
    assert clients.outcomes == [(PROMPTS[0], versions.ref1[PROMPTS[0]])]
    assert runner.generate(PROMPTS[1]) == versions.ref1[PROMPTS[1]]
    # Nothing in flight now: the same reload goes through.
    assert isinstance(runner.reload_weights(spec(versions.v2), versions.v2), ReloadResult)
    assert runner.generate(PROMPTS[0]) == versions.ref2[PROMPTS[0]]


def test_the_commands_cancel_ends_a_drain_like_its_deadline(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """The agent's cancel (the command's own timeout, a shutdown) ends the wait at once."""
    hold = Hold(1)
    runner = gated(hold)
    clients = Clients(runner)
    clients.once(PROMPTS[0])
    hold.entered.wait(GUARD_S)
    cancel = threading.Event()
    reload = Reload(runner, spec(versions.v2, DrainPolicy(timeout_s=3600)), cancel)
    assert runner.drain_gate.wait_draining(GUARD_S)
    cancel.set()
    outcome = reload.result()
    assert isinstance(outcome, RunnerError) and outcome.code is WireCode.COMMAND_TIMEOUT
    assert runner.describe().weights_version == "init"
    hold.release.set()
    clients.join()
    assert clients.outcomes == [(PROMPTS[0], versions.ref1[PROMPTS[0]])]


def test_no_policy_given_is_wait(
    gated: Callable[[Hold | None], TorchRunner], versions: Versions
) -> None:
    """A spec without ``drain`` (every command before drain policies) waits."""
    runner = gated(None)
    result = runner.reload_weights(spec(versions.v2), versions.v2)
    assert result.drain is not None
    assert (result.drain.mode, result.drain.in_flight, result.drain.aborted) == ("wait", 0, 0)
    assert set(result.as_dict()["drain"]) == {"mode", "paused_s", "in_flight", "aborted"}  # type: ignore[arg-type]
