"""The real-engine scenarios, once per engine shape: a ``vllm.LLM`` in this process, and a
``vllm serve`` sidecar over HTTP on 127.0.0.1.

The module-scoped ``runner`` is one engine per shape: pytest runs each shape's tests together
and stops that engine (and the sidecar's server) before it starts the next. Every test leaves
the engine on checkpoint v1, as it found it.
"""

from __future__ import annotations

import asyncio
import shutil
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import JsonValue

from tests.vllm.conftest import SKIP_REASON

pytest.importorskip("vllm", reason=SKIP_REASON)

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import RunnerError, WireCode
from controlplane.wire.messages import DrainPolicy
from controlplane.wire.protocol import Ack, AckState, ReloadWeightsSpec, UpdateConfigSpec
from tests.fleet import acks_tail, heartbeats_tail, latest, make_command, settled, terminal
from tests.vllm.conftest import (
    LONG,
    NEW_TOKENS,
    SHORT,
    TIMINGS,
    Checkpoints,
    running_agent,
    sha256_of,
)
from workers.demo.tiny_llama import hf_greedy, write_tiny_llama
from workers.runners.vllm_config import translate_config_error
from workers.runners.vllm_engine import InProcessEngine
from workers.runners.vllm_runner import VllmRunner
from workers.runners.vllm_sidecar import Generation, SidecarClient, SidecarEngine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


async def generate(runner: VllmRunner, prompt: list[int] = SHORT) -> list[int]:
    return await asyncio.to_thread(runner.generate, prompt, NEW_TOKENS)


def reload_cmd(path: Path, version: str, **kw: Any) -> Any:
    return make_command(ReloadWeightsSpec(path=str(path), version=version, **kw))


async def ack_of(kafka: KafkaSettings, tail: Any, cmd: Any) -> Ack:
    await settled(kafka, tail, cmd, timeout=120)
    (ack,) = terminal(tail.items, cmd.command_id)
    return ack


class ReloadSpy:
    """Counts the reloads that reached vLLM (the engine's reload method)."""

    def __init__(self, runner: VllmRunner, monkeypatch: pytest.MonkeyPatch) -> None:
        engine = runner._engine
        assert engine is not None
        self.calls: list[str] = []
        original = engine.reload

        def spy(weights_dir: str) -> None:
            self.calls.append(weights_dir)
            original(weights_dir)

        monkeypatch.setattr(engine, "reload", spy)


# --------------------------------------------------------------------------- drain, versions

#: Long enough that a reload lands while requests are in flight.
DRAIN_TOKENS = 96


@pytest.fixture(scope="module")
def long_refs(ckpts: Checkpoints) -> dict[str, list[int]]:
    """transformers' greedy DRAIN_TOKENS new tokens of SHORT, per version."""
    return {name: hf_greedy(path, SHORT, DRAIN_TOKENS) for name, path in
            (("v1", ckpts.v1), ("v2", ckpts.v2))}  # fmt: skip


def drain_spec(path: Path, version: str, mode: str, timeout_s: float = 120) -> ReloadWeightsSpec:
    return ReloadWeightsSpec.model_validate(
        {"path": str(path), "version": version, "drain": {"mode": mode, "timeout_s": timeout_s}}
    )


def wait_for(condition: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def request(
    runner: VllmRunner,
    prompt: list[int],
    max_tokens: int,
    on_tokens: Callable[[], None] | None = None,
) -> Generation:
    """One greedy request with vLLM's weight-version spans: in process from the engine's
    outputs; a sidecar's through vLLM's token-in/token-out endpoint, streamed, straight to the
    server (as a client of the server would, not through the runner)."""
    if runner.options.mode == "in_process":
        return runner.generate_full(prompt, max_tokens)
    import json

    import httpx

    body = {
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True},
    }
    url = f"{runner.options.base_url}/inference/v1/generate"
    tokens: list[int] = []
    spans: list[tuple[str, int, int]] | None = None
    reason: str | None = None
    with httpx.stream("POST", url, json=body, timeout=300, trust_env=False) as response:
        if response.status_code != 200:
            return Generation([], None, f"HTTP {response.status_code}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :]).get("choices", []):
                tokens.extend(choice.get("token_ids") or [])
                if tokens and on_tokens is not None:
                    on_tokens()
                reason = choice.get("finish_reason") or reason
                found = choice.get("weight_versions")
                if found is not None:
                    spans = [(s["version"], s["start"], s["end"]) for s in found]
    return Generation(tokens, spans, reason)


def one_version(out: Generation, refs: dict[str, list[int]]) -> str:
    """The one version ``out`` was generated with: by vLLM's spans, and by its tokens."""
    assert out.weight_versions is not None, out
    versions = {version for version, _, _ in out.weight_versions}
    assert len(versions) == 1, out.weight_versions
    (version,) = versions
    assert out.weight_versions == [(version, 0, len(out.token_ids))], out
    assert out.token_ids == refs[version], (version, out)
    return version


def fail_inside_vllm(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The next reload passes our checks, then vLLM is told to load a directory that is gone:
    it fails mid-reload (after moving parameters to the meta device)."""
    validate = runner._validate

    def vanished(spec: ReloadWeightsSpec, path: Path, cancel: Any) -> Any:
        weights_dir, entries, files, snapshot, digest = validate(spec, path, cancel)
        runner._snapshots.remove(snapshot)  # type: ignore[union-attr]
        return weights_dir, entries, files, ckpts.root / "vanished-after-validation", digest

    monkeypatch.setattr(runner, "_validate", vanished)


def test_vllm_weight_version_is_ours_at_start_after_reloads_and_after_a_failed_one(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    # First in the module: the engine is fresh, labelled by the runner's start.
    assert runner.vllm_weight_version() == "v1" == runner.describe().weights_version
    runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v2), version="v2"), ckpts.v2)
    assert runner.vllm_weight_version() == "v2" == runner.describe().weights_version
    fail_inside_vllm(runner, ckpts, monkeypatch)
    with pytest.raises(RunnerError) as caught:
        runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1-bad"), ckpts.v1)
    assert caught.value.code is WireCode.RUNNER_FAILED
    monkeypatch.undo()
    assert runner.vllm_weight_version() == "v2" == runner.describe().weights_version
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v2")
    runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
    assert runner.vllm_weight_version() == "v1"


@pytest.mark.kafka
async def test_a_failed_restore_resumes_serving_labelled_degraded(
    runner: VllmRunner,
    ckpts: Checkpoints,
    monkeypatch: pytest.MonkeyPatch,
    kafka: KafkaSettings,
    tmp_path: Path,
) -> None:
    """vLLM fails the reload and then the restore of v1 (both inside vLLM, mid-load), through
    Kafka and the agent: a coded NACK, serving resumes all the same (never left paused), vLLM's
    weight version is ``v1!degraded`` (no version can be that), the runner and the worker's
    heartbeats report degraded; a good reload recovers."""

    def degraded(code: str | None) -> Callable[[list[Any]], bool]:
        def check(items: list[Any]) -> bool:
            beat = latest(items, "vllm-1")
            found = None if beat is None or beat.degraded is None else beat.degraded.code
            return beat is not None and found == code

        return check

    fail_inside_vllm(runner, ckpts, monkeypatch)
    monkeypatch.setattr(runner, "_loaded_dir", ckpts.root / "vanished-before-the-restore")
    async with (
        running_agent(kafka, tmp_path, runner, ckpts.root),
        acks_tail(kafka) as acks,
        heartbeats_tail(kafka) as beats,
    ):
        ack = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2"))
        monkeypatch.undo()
        assert ack.state is AckState.FAILED, ack
        assert ack.error is not None and ack.error.code == "WEIGHTS_CORRUPTED", ack.error
        assert "'v1!degraded'" in ack.error.message
        await beats.until(degraded("WEIGHTS_CORRUPTED"))
        assert runner.vllm_weight_version() == "v1!degraded"
        described = runner.describe()
        assert described.degraded is not None and described.degraded.code == "WEIGHTS_CORRUPTED"
        assert described.weights_version == "v1"
        engine = runner._engine
        if isinstance(engine, InProcessEngine):
            assert not engine._paused and not engine._draining  # the stepping loop serves again
            with pytest.raises(RunnerError) as refused:  # the runner's own generate refuses
                runner.generate(SHORT, NEW_TOKENS)
            assert refused.value.code is WireCode.WEIGHTS_CORRUPTED
        else:
            assert isinstance(engine, SidecarEngine) and not engine.client.is_paused()
        back = await ack_of(kafka, acks, reload_cmd(ckpts.v1, "v1"))
        assert back.state is AckState.SUCCEEDED, back.error
        await beats.until(degraded(None))
    assert runner.describe().degraded is None and runner.vllm_weight_version() == "v1"
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")


def hold_until_drain(runner: VllmRunner, monkeypatch: pytest.MonkeyPatch, requests: int) -> Any:
    """In process, ``requests`` requests surely in flight together: once that many are in vLLM,
    the engine's stepping loop waits before its next step until a reload's drain began (then it
    steps on; the drain takes the engine after that step). Returns an event set at the hold."""
    engine = runner._engine
    assert isinstance(engine, InProcessEngine)
    step = engine._step
    held = threading.Event()

    def hold() -> list[Any]:
        if not held.is_set() and sum(r.added for r in engine._requests.values()) >= requests:
            held.set()
            wait_for(lambda: engine._draining)
        return step()

    monkeypatch.setattr(engine, "_step", hold)
    return held


class Clients:
    """Threads sending the same greedy request back to back until stopped."""

    def __init__(self, runner: VllmRunner, count: int, max_tokens: int) -> None:
        self.results: list[Generation] = []
        #: (``time.monotonic()`` when it was sent, the response), in the order they came back.
        self.sent: list[tuple[float, Generation]] = []
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(runner, max_tokens), daemon=True)
            for _ in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, runner: VllmRunner, max_tokens: int) -> None:
        while not self.stop.is_set():
            try:
                sent = time.monotonic()
                out = request(runner, SHORT, max_tokens)
                self.sent.append((sent, out))
                self.results.append(out)
            except BaseException as exc:  # every failure is the test's result
                self.errors.append(exc)

    def wait_more(self, count: int) -> None:
        """Until ``count`` more responses than now have come back."""
        done = len(self.results)
        wait_for(lambda: len(self.results) >= done + count)

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=300)


@pytest.mark.kafka
async def test_a_wait_rollout_under_load_fails_nothing_and_mixes_no_versions(
    runner: VllmRunner,
    ckpts: Checkpoints,
    long_refs: dict[str, list[int]],
    kafka: KafkaSettings,
    tmp_path: Path,
) -> None:
    """Clients send greedy requests continuously while a reload v1 -> v2 with drain wait comes
    through Kafka and the agent."""
    clients = Clients(runner, 3, DRAIN_TOKENS)
    try:
        await asyncio.to_thread(wait_for, lambda: len(clients.results) >= 2)
        async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
            wait = DrainPolicy(mode="wait", timeout_s=120)
            ack = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2", drain=wait))
            acked = time.monotonic()  # the terminal ack is sent once serving has resumed
        assert ack.state is AckState.SUCCEEDED, ack.error
        drain = ack.result["drain"]
        assert isinstance(drain, dict) and drain["mode"] == "wait" and drain["aborted"] == 0
        await asyncio.to_thread(
            wait_for, lambda: sum(1 for sent, _ in clients.sent if sent > acked) >= 3
        )
    finally:
        clients.finish()
        runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
    assert clients.errors == []
    assert all(out.finish_reason == "length" for out in clients.results), clients.results
    versions = [(sent, one_version(out, long_refs)) for sent, out in clients.sent]
    assert versions[0][1] == "v1", versions  # the clients ran before the rollout
    # Every request sent after the reload is served wholly on v2; never v1 again. (By when each
    # was sent, not by when it came back: a v1 response can reach its client thread after a
    # v2 one on a busy machine, as fresh-ci saw once.)
    after = [version for sent, version in versions if sent > acked]
    assert len(after) >= 3 and set(after) == {"v2"}, versions


def reload_under_load(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch, mode: str
) -> tuple[Any, Clients]:
    """In process: reload v1 -> v2 with drain ``mode`` while two requests are surely in flight
    together (served by the same engine steps, held until the drain began); then two more
    responses, then back to v1."""
    held = hold_until_drain(runner, monkeypatch, 2)
    clients = Clients(runner, 2, DRAIN_TOKENS)
    try:
        assert held.wait(120), "two requests were never in flight together"
        result = runner.reload_weights(drain_spec(ckpts.v2, "v2", mode), ckpts.v2)
        clients.wait_more(2)
    finally:
        clients.finish()
        monkeypatch.undo()
        runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
    assert clients.errors == []
    return result, clients


#: The request a sidecar test holds in flight: long, so that it is still running when held.
HELD_TOKENS = 480  # long: on a quiet machine 200 were generated before the hold


@pytest.fixture(scope="module")
def held_refs(ckpts: Checkpoints) -> dict[str, list[int]]:
    """transformers' greedy HELD_TOKENS new tokens of SHORT, per version."""
    return {name: hf_greedy(path, SHORT, HELD_TOKENS) for name, path in
            (("v1", ckpts.v1), ("v2", ckpts.v2))}  # fmt: skip


class HeldRequest:
    """A sidecar request held in flight, checked, not timed: streamed from vLLM's
    token-in/token-out endpoint, and on its first token the streaming thread itself freezes
    vLLM's scheduler with ``/pause?mode=keep`` (nothing else is sent to the server meanwhile).
    It is held if, with the scheduler frozen, vLLM still counts a request running or waiting and
    the stream has not ended: it stays in vLLM, unfinished, its tokens so far from v1, so the
    reload's drain, whenever it lands, meets it in flight; the reload's resume unfreezes it.
    Under load vLLM may stream a whole response late, at once (its server starved of CPU): a
    request that finished before the pause landed is not held (:meth:`held` says so)."""

    def __init__(self, runner: VllmRunner) -> None:
        self._client = SidecarClient(runner.options.base_url)
        self._paused = threading.Event()
        self.result: Generation | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(runner,), daemon=True)
        self._thread.start()

    def _run(self, runner: VllmRunner) -> None:
        try:
            self.result = request(runner, SHORT, HELD_TOKENS, on_tokens=self._pause_once)
        except BaseException as exc:  # the test's result
            self.error = exc
        finally:
            self._paused.set()

    def _pause_once(self) -> None:
        if not self._paused.is_set():
            self._client.pause("keep", timeout_s=60)
            self._paused.set()

    def held(self) -> bool:
        """Whether the request is held in flight (see the class); if not, serving is resumed
        and the request has ended."""
        assert self._paused.wait(120), "the held request produced no token"
        counts = self._client.request_counts()
        assert counts is not None, "vLLM serves no request gauges on /metrics"
        if self._thread.is_alive() and counts.running + counts.waiting >= 1:
            return True
        self._client.resume()
        self.finish()
        return False

    def finish(self) -> Generation:
        self._thread.join(timeout=300)
        assert self.error is None, self.error
        assert self.result is not None
        return self.result


async def held_request(runner: VllmRunner) -> HeldRequest:
    """A request held in flight (HeldRequest), tried until one is (twenty times at most)."""
    for attempt in range(1, 21):
        TIMINGS["sidecar_hold_attempts"] = attempt
        held = HeldRequest(runner)
        if await asyncio.to_thread(held.held):
            return held
    raise AssertionError("every request finished before the pause landed, twenty times")


async def sidecar_rollout_under_load(
    runner: VllmRunner, ckpts: Checkpoints, kafka: KafkaSettings, tmp_path: Path, mode: str
) -> tuple[Ack, Generation, Clients]:
    """A sidecar: v1 -> v2 through Kafka and the agent with drain ``mode`` while one request is
    held in flight (HeldRequest) and a client sends requests back to back (from the hold on:
    queued behind it, then served); then two more responses, then back to v1. The held request
    finishing all v1 (nothing of it was in flight at the drain after all: vLLM's gauges as of
    its last step said otherwise) is tried again, three times at most."""
    for attempt in range(1, 4):
        TIMINGS[f"sidecar_{mode}_rollout_attempts"] = attempt
        held = await held_request(runner)
        clients = Clients(runner, 1, DRAIN_TOKENS)
        try:
            async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
                policy = DrainPolicy.model_validate({"mode": mode, "timeout_s": 120})
                ack = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2", drain=policy))
            out = await asyncio.to_thread(held.finish)
            await asyncio.to_thread(clients.wait_more, 2)
        finally:
            clients.finish()
            runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
        assert ack.state is AckState.SUCCEEDED, ack.error
        assert clients.errors == []
        if not (out.finish_reason == "length" and out.weight_versions == [("v1", 0, HELD_TOKENS)]):
            return ack, out, clients
    raise AssertionError("the held request finished before the drain, three times")


@pytest.mark.kafka
async def test_an_abort_reload_aborts_the_requests_in_flight_the_rest_are_one_version(
    runner: VllmRunner,
    ckpts: Checkpoints,
    long_refs: dict[str, list[int]],
    held_refs: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    kafka: KafkaSettings,
    tmp_path: Path,
) -> None:
    if runner.options.mode == "sidecar":
        ack, held, clients = await sidecar_rollout_under_load(
            runner, ckpts, kafka, tmp_path, "abort"
        )
        drain = ack.result["drain"]
        assert isinstance(drain, dict) and drain["mode"] == "abort", ack.result
        # vLLM's answer to an aborted request: its last chunk, finish_reason "abort" (HTTP 200),
        # after the tokens it had streamed, all from v1 (vLLM's span says so).
        assert held.finish_reason == "abort", held
        cut = len(held.token_ids)
        assert 0 < cut < HELD_TOKENS and held.token_ids == held_refs["v1"][:cut], held
        assert held.weight_versions == [("v1", 0, cut)], held
        results = clients.results
    else:
        result, clients = await asyncio.to_thread(
            reload_under_load, runner, ckpts, monkeypatch, "abort"
        )
        assert result.drain is not None and result.drain.mode == "abort"
        assert (result.drain.in_flight, result.drain.aborted) == (2, 2)  # in process: exact
        aborted = [out for out in clients.results if out.finish_reason != "length"]
        assert len(aborted) == 2, "the two requests in flight were not both aborted"
        assert all(out == Generation([], None, "abort") for out in aborted), aborted
        results = [out for out in clients.results if out not in aborted]
    for out in clients.results:
        if out.finish_reason == "abort":  # another request in flight: a v1 prefix, or none
            assert out.token_ids == long_refs["v1"][: len(out.token_ids)], out
    served = [one_version(out, long_refs) for out in results if out.finish_reason == "length"]
    assert served[-1] == "v2", served


#: Requests a sidecar test streams at once: more than the server's ``--max-num-seqs`` (4), so
#: that vLLM runs four and queues the rest, as under real load.
STREAMS = 6


def stream_all(
    runner: VllmRunner, count: int, max_tokens: int, *, freeze: bool = False
) -> tuple[list[Generation], Callable[[], None]]:
    """``count`` requests streamed at once, one thread each; returns their results (filled as
    they finish) and a join(). Waits until four of them are streaming tokens; with ``freeze``,
    the first token seen freezes vLLM's scheduler (``/pause?mode=keep``, from that stream's own
    thread) and it waits for that instead: what vLLM holds then stays in flight."""
    results: list[Generation] = []
    errors: list[BaseException] = []
    streaming: set[int] = set()
    frozen = threading.Event()
    freezing = threading.Lock()
    client = SidecarClient(runner.options.base_url)

    def seen(index: int) -> None:
        streaming.add(index)
        if freeze and not frozen.is_set():
            with freezing:
                if not frozen.is_set():
                    client.pause("keep", timeout_s=60)
                    frozen.set()

    def one(index: int) -> None:
        try:
            results.append(request(runner, SHORT, max_tokens, on_tokens=lambda: seen(index)))
        except BaseException as exc:  # the test's result
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()

    def join() -> None:
        for thread in threads:
            thread.join(timeout=300)
        assert errors == [], errors

    if freeze:
        wait_for(lambda: frozen.is_set() or len(results) == count)
    else:
        wait_for(lambda: len(streaming) >= 4 or len(results) == count)
    return results, join


def test_an_abort_reload_aborts_the_streams_in_flight_and_counts_them(
    runner: VllmRunner, ckpts: Checkpoints, held_refs: dict[str, list[int]]
) -> None:
    """A sidecar under real load, nothing frozen beforehand: STREAMS long requests go to vLLM at
    once (it runs four, queues the rest), and while four stream tokens a reload with drain
    abort comes. Every request vLLM held when the pause landed ends with finish reason abort
    (a v1 prefix; none if it was queued), the rest are one version, and the drain's counts are
    vLLM's: aborted is exactly the responses aborted, in_flight at least that. All requests may
    have finished before the pause reached vLLM (nothing to abort; on a quiet machine vLLM
    streams 480 tokens faster than a reload reaches its pause): tried again, twice as they
    come, then three times frozen by the first token seen (``stream_all(freeze=True)``), so
    that vLLM surely holds requests when the reload's drain lands."""
    if runner.options.mode != "sidecar":
        pytest.skip("the in-process engine's counts are exact (the test above)")
    for attempt in range(1, 6):
        TIMINGS["sidecar_abort_streams_attempts"] = attempt
        results, join = stream_all(runner, STREAMS, HELD_TOKENS, freeze=attempt > 2)
        try:
            result = runner.reload_weights(drain_spec(ckpts.v2, "v2", "abort"), ckpts.v2)
        finally:
            join()
            runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
        aborted = [out for out in results if out.finish_reason == "abort"]
        if not aborted:
            continue
        assert result.drain is not None and result.drain.mode == "abort", result
        assert result.drain.aborted == len(aborted), (result.drain, results)
        assert result.drain.in_flight >= result.drain.aborted, result.drain
        for out in aborted:
            cut = len(out.token_ids)
            assert out.token_ids == held_refs["v1"][:cut], out
            assert all(v == "v1" for v, _, _ in out.weight_versions or []), out
        for out in results:
            if out.finish_reason != "abort":
                one_version(out, held_refs)
        return
    raise AssertionError("every request finished before the reload's pause, five times")


@pytest.mark.kafka
async def test_a_keep_reload_carries_requests_on_with_the_new_weights_labelled_by_span(
    runner: VllmRunner,
    ckpts: Checkpoints,
    long_refs: dict[str, list[int]],
    held_refs: dict[str, list[int]],
    monkeypatch: pytest.MonkeyPatch,
    kafka: KafkaSettings,
    tmp_path: Path,
) -> None:
    """What vLLM's keep guarantees: a request in flight is not failed; it is frozen, and after
    the reload it goes on with the new weights over its whole context (the prefix cache reset
    preempts it, so its KV is recomputed, none of the old weights' is reused); vLLM's spans say
    which tokens came from which version: keep mixes two versions in one response. Others are
    one version."""
    if runner.options.mode == "sidecar":
        ack, held, clients = await sidecar_rollout_under_load(
            runner, ckpts, kafka, tmp_path, "keep"
        )
        drain = ack.result["drain"]
        assert isinstance(drain, dict) and drain["mode"] == "keep" and drain["aborted"] == 0
        kept = [out for out in clients.results if len(out.weight_versions or []) > 1]
        check_kept(held, ckpts, held_refs, HELD_TOKENS)
    else:
        result, clients = await asyncio.to_thread(
            reload_under_load, runner, ckpts, monkeypatch, "keep"
        )
        assert result.drain is not None and (result.drain.in_flight, result.drain.aborted) == (2, 0)
        kept = [out for out in clients.results if len(out.weight_versions or []) > 1]
        assert len(kept) == 2, [(out.weight_versions, out.finish_reason) for out in clients.results]
    assert all(out.finish_reason == "length" for out in clients.results), clients.results
    for out in kept:
        check_kept(out, ckpts, long_refs, DRAIN_TOKENS)
    served = [one_version(out, long_refs) for out in clients.results if out not in kept]
    assert served[-1] == "v2", served


def check_kept(
    out: Generation, ckpts: Checkpoints, refs: dict[str, list[int]], max_tokens: int
) -> None:
    """A kept request: v1's greedy tokens up to the pause, then v2's greedy continuation of the
    prompt plus those tokens (KV recomputed with v2), vLLM's spans v1 [0, cut), v2 [cut, n)."""
    assert out.finish_reason == "length" and out.weight_versions is not None, out
    (first, _, cut), (second, start, end) = out.weight_versions
    assert (first, second, start, end) == ("v1", "v2", cut, max_tokens), out
    assert 0 < cut < max_tokens
    assert out.token_ids[:cut] == refs["v1"][:cut]
    continued = hf_greedy(ckpts.v2, SHORT + out.token_ids[:cut], max_tokens - cut)
    assert out.token_ids[cut:] == continued


@pytest.mark.kafka
async def test_reload_rollout_through_kafka_matches_fresh_weights(
    runner: VllmRunner, ckpts: Checkpoints, kafka: KafkaSettings, tmp_path: Path
) -> None:
    assert await generate(runner) == ckpts.want("v1")
    async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
        forward = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2", sha256=sha256_of(ckpts.v2)))
        assert forward.state is AckState.SUCCEEDED, forward.error
        assert forward.weights_version == "v2"
        shards = len(sha256_of(ckpts.v2))
        assert forward.result["files"] == shards and shards > 1
        nbytes = forward.result["bytes"]
        assert forward.result["tensors"] == 21 and isinstance(nbytes, int) and nbytes > 0
        assert await generate(runner) == ckpts.want("v2")
        back = await ack_of(kafka, acks, reload_cmd(ckpts.v1, "v1"))
        assert back.state is AckState.SUCCEEDED, back.error
        assert await generate(runner) == ckpts.want("v1")
    duration = forward.result["duration_s"]
    assert isinstance(duration, float)
    TIMINGS[f"{runner.options.mode}_reload_s"] = duration
    states = [a.state for a in acks.items if a.command_id == forward.command_id]
    assert states == [AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED]


@pytest.mark.kafka
async def test_different_manifest_is_rejected_before_vllm_sees_it(
    runner: VllmRunner,
    ckpts: Checkpoints,
    kafka: KafkaSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spy = ReloadSpy(runner, monkeypatch)
    cases = [
        (reload_cmd(ckpts.wide, "wide"), "WEIGHTS_SHAPE_MISMATCH"),
        (reload_cmd(ckpts.deep, "deep"), "WEIGHTS_UNEXPECTED"),
        (reload_cmd(ckpts.half, "half"), "WEIGHTS_DTYPE_MISMATCH"),
        (reload_cmd(ckpts.v2, "v2-bad-sum", sha256=dict.fromkeys(sha256_of(ckpts.v2), "0" * 64)),
         "CHECKSUM_MISMATCH"),
        (reload_cmd(ckpts.root / "nowhere", "gone"), "WEIGHTS_UNREADABLE"),
        # One shard of a directory: vLLM would read the whole directory instead.
        (reload_cmd(min(ckpts.v2.glob("model-*.safetensors")), "one-shard"), "WEIGHTS_UNREADABLE"),
    ]  # fmt: skip
    async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
        for cmd, code in cases:
            ack = await ack_of(kafka, acks, cmd)
            assert ack.state is AckState.REJECTED, (code, ack)
            assert ack.error is not None and ack.error.code == code, ack.error
            assert ack.weights_version == "v1"
    assert spy.calls == []
    assert await generate(runner) == ckpts.want("v1")
    assert await generate(runner, LONG) == ckpts.want("v1", "long")


async def test_prefix_cache_never_serves_kv_of_the_old_weights(
    runner: VllmRunner, ckpts: Checkpoints
) -> None:
    # The 40-token prompt fills one 32-token block, which vLLM caches under v1's weights.
    assert await generate(runner, LONG) == ckpts.want("v1", "long")
    assert await generate(runner, LONG) == ckpts.want("v1", "long")  # now a prefix-cache hit
    # A checkpoint may be named by its index json or its one file: vLLM gets the directory.
    index = ckpts.v2 / "model.safetensors.index.json"
    spec = ReloadWeightsSpec(path=str(index), version="v2")
    await asyncio.to_thread(runner.reload_weights, spec, index)
    assert await generate(runner, LONG) == ckpts.want("v2", "long")
    single = ckpts.v1 / "model.safetensors"
    spec = ReloadWeightsSpec(path=str(single), version="v1")
    await asyncio.to_thread(runner.reload_weights, spec, single)
    assert await generate(runner, LONG) == ckpts.want("v1", "long")
    assert runner.describe().extra["weights_path"] == str(ckpts.v1)


CONFIG_ERRORS: list[tuple[dict[str, Any], str]] = [
    ({"foo_config": {}}, "CONFIG_KEY_REJECTED"),
    ({"load_config": {"no_such_field": 1}}, "CONFIG_KEY_REJECTED"),
    ({"load_config": 5}, "CONFIG_VALUE_INVALID"),
    ({"load_config": {"load_format": "bogus"}}, "CONFIG_VALUE_INVALID"),
    ({"model_config": {"max_logprobs": 3}}, "CONFIG_KEY_REJECTED"),
]


@pytest.mark.kafka
async def test_update_config_errors_are_coded_nacks_and_the_engine_keeps_serving(
    runner: VllmRunner, ckpts: Checkpoints, kafka: KafkaSettings, tmp_path: Path
) -> None:
    before = runner.describe().config_digest
    async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
        for overrides, code in CONFIG_ERRORS:
            ack = await ack_of(kafka, acks, make_command(UpdateConfigSpec(overrides=overrides)))
            assert ack.state is AckState.REJECTED, (overrides, ack)
            assert ack.error is not None and ack.error.code == code, (overrides, ack.error)
            assert ack.config_digest == before
        assert await generate(runner) == ckpts.want("v1")
        good = {"load_config": {"load_format": "safetensors"}}
        ok = await ack_of(kafka, acks, make_command(UpdateConfigSpec(overrides=good)))
        assert ok.state is AckState.SUCCEEDED, ok.error
        assert ok.config_digest != before
        # The engine still reloads (with the new load_format) and serves.
        forward = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2"))
        assert forward.state is AckState.SUCCEEDED, forward.error
        assert await generate(runner) == ckpts.want("v2")
        back = await ack_of(kafka, acks, reload_cmd(ckpts.v1, "v1"))
        assert back.state is AckState.SUCCEEDED, back.error
    assert runner.describe().config == good
    assert await generate(runner) == ckpts.want("v1")


#: The errors vLLM itself raises (it accepts a bogus load_format until the next reload).
VLLM_CONFIG_ERRORS = [
    case for case in CONFIG_ERRORS if case[0] != {"load_config": {"load_format": "bogus"}}
]


@pytest.mark.parametrize(("overrides", "code"), VLLM_CONFIG_ERRORS)
def test_vllm_own_config_errors_translate_to_our_codes(
    runner: VllmRunner, overrides: dict[str, Any], code: str
) -> None:
    """Past our checks: vLLM's real error text (raw in process, wrapped over HTTP) -> our code."""
    engine = runner._engine
    assert engine is not None
    with pytest.raises(Exception) as caught:
        engine.update_config(overrides)
    assert translate_config_error(caught.value, engine.vllm_version, dry_run=False).code == code


async def test_a_failing_vllm_reload_restores_the_old_weights(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM fails mid-reload (after moving parameters to the meta device): we reload the old one."""
    fail_inside_vllm(runner, ckpts, monkeypatch)
    spec = ReloadWeightsSpec(path=str(ckpts.v2), version="v2")
    with pytest.raises(RunnerError) as caught:
        await asyncio.to_thread(runner.reload_weights, spec, ckpts.v2)
    assert caught.value.code is WireCode.RUNNER_FAILED, caught.value
    assert "restored 'v1'" in caught.value.message
    described = runner.describe()
    assert described.degraded is None and described.weights_version == "v1"
    assert await generate(runner) == ckpts.want("v1")
    assert await generate(runner, LONG) == ckpts.want("v1", "long")


def test_describe_names_model_version_dtype_device_and_vllm(
    runner: VllmRunner, ckpts: Checkpoints
) -> None:
    import vllm

    described = runner.describe()
    assert described.runner == "vllm" and described.model_loaded
    assert described.device == "cpu"
    assert described.weights_version == "v1"
    assert described.extra["vllm_version"] == vllm.__version__
    assert described.extra["dtype"] == "float32"
    assert described.extra["model"] == str(ckpts.v1)
    assert described.extra["weights_path"] == str(ckpts.v1)
    assert "load_config.load_format" in described.accepts
    assert not any(key.startswith("model_config.") for key in described.accepts)


def test_a_checkpoint_rewritten_after_its_check_is_never_what_vllm_loads(
    runner: VllmRunner, ckpts: Checkpoints, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checks bind to the bytes vLLM loads: after the sha256 manifest and the headers were
    checked, every shard is rewritten in place (same names, same inodes) with other weights of
    the same layout; vLLM must still load exactly the verified v2."""
    mutable = ckpts.root / f"v2-rewritten-{runner.options.mode}"
    shutil.copytree(ckpts.v2, mutable)
    other = write_tiny_llama(
        tmp_path / "other", seed=7, tokenizer_from=ckpts.v1, max_shard_size="100KB"
    )
    shards = sorted(p.name for p in mutable.glob("*.safetensors"))
    assert shards == sorted(p.name for p in other.glob("*.safetensors"))
    validate = runner._validate

    def then_rewrite(spec: ReloadWeightsSpec, path: Path, cancel: Any) -> Any:
        checked = validate(spec, path, cancel)
        for name in shards:
            with open(mutable / name, "r+b") as fh:  # the same inode, other bytes
                fh.write((other / name).read_bytes())
                fh.truncate()
        return checked

    monkeypatch.setattr(runner, "_validate", then_rewrite)
    spec = ReloadWeightsSpec(path=str(mutable), version="v2", sha256=sha256_of(ckpts.v2))
    snapshot: Path | None = None
    try:
        result = runner.reload_weights(spec, mutable)
        assert result.version == "v2"
        assert sha256_of(mutable) != sha256_of(ckpts.v2)  # the rewrite did happen
        assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v2")
        assert runner.generate(LONG, NEW_TOKENS) == ckpts.want("v2", "long")
        snapshot = Path(str(runner.describe().extra["weights_snapshot"]))
        assert sha256_of(snapshot) == sha256_of(ckpts.v2)
        assert all(stat.S_IMODE(f.stat().st_mode) & 0o222 == 0 for f in snapshot.iterdir())
    finally:
        monkeypatch.undo()
        back = ReloadWeightsSpec(path=str(ckpts.v1), version="v1")
        runner.reload_weights(back, ckpts.v1)
    assert snapshot is not None and not snapshot.exists()  # removed once v1 is loaded
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")


def test_validate_reload_and_config_check_everything_and_touch_nothing(
    runner: VllmRunner, ckpts: Checkpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Contract C2 (dry runs): a good checkpoint validates with its facts; each bad one raises
    the code its reload raises; config errors are update_config's codes; vLLM is never called,
    its weights, weight version and config stay as they were."""
    spy = ReloadSpy(runner, monkeypatch)
    before = runner.describe()
    spec = ReloadWeightsSpec(path=str(ckpts.v2), version="v2", sha256=sha256_of(ckpts.v2))
    facts = runner.validate_reload(spec, ckpts.v2)
    assert facts["tensors"] == 21 and facts["files"] == len(sha256_of(ckpts.v2)) > 1
    assert isinstance(facts["bytes"], int) and facts["bytes"] > 0
    bad_sum = dict.fromkeys(sha256_of(ckpts.v2), "0" * 64)
    cases = [
        (ReloadWeightsSpec(path=str(ckpts.wide), version="wide"), "WEIGHTS_SHAPE_MISMATCH"),
        (ReloadWeightsSpec(path=str(ckpts.deep), version="deep"), "WEIGHTS_UNEXPECTED"),
        (ReloadWeightsSpec(path=str(ckpts.half), version="half"), "WEIGHTS_DTYPE_MISMATCH"),
        (ReloadWeightsSpec(path=str(ckpts.v2), version="v2", sha256=bad_sum), "CHECKSUM_MISMATCH"),
        (ReloadWeightsSpec(path=str(min(ckpts.v2.glob("model-*.safetensors"))), version="one"),
         "WEIGHTS_UNREADABLE"),
    ]  # fmt: skip
    for bad, code in cases:
        with pytest.raises(RunnerError) as dry:
            runner.validate_reload(bad, Path(bad.path))
        with pytest.raises(RunnerError) as real:
            runner.reload_weights(bad, Path(bad.path))
        assert dry.value.code.value == real.value.code.value == code, (dry.value, real.value)
    for overrides, code in CONFIG_ERRORS:
        with pytest.raises(RunnerError) as refused:
            runner.validate_config(overrides)
        assert refused.value.code.value == code, (overrides, refused.value)
    good: dict[str, JsonValue] = {"load_config": {"load_format": "safetensors"}}
    assert runner.validate_config(good) == {"keys": ["load_config.load_format"]}
    assert spy.calls == []
    after = runner.describe()
    assert after.config_digest == before.config_digest and after.config == before.config
    assert after.weights_version == "v1" == runner.vllm_weight_version()
    assert after.extra["weights_digest"] == before.extra["weights_digest"]
    assert runner.generate(SHORT, NEW_TOKENS) == ckpts.want("v1")


@pytest.mark.kafka
async def test_a_worker_restart_labels_vllm_with_the_journaled_version(
    runner: VllmRunner, ckpts: Checkpoints, kafka: KafkaSettings, tmp_path: Path
) -> None:
    """A worker restart: its journal holds v2 (applied through Kafka); then a new engine (in
    process: a new ``vllm.LLM``, as a new process would start; sidecar: a new runner next to the
    running server) starts labelled with its initial version v1, and the new agent's restore
    reloads the journaled v2: vLLM's weight version is v2, the version the worker reports.
    Last in the module: in process it replaces the module's engine."""
    async with running_agent(kafka, tmp_path, runner, ckpts.root), acks_tail(kafka) as acks:
        ack = await ack_of(kafka, acks, reload_cmd(ckpts.v2, "v2"))
        assert ack.state is AckState.SUCCEEDED, ack.error
    if runner.options.mode == "in_process":
        await asyncio.to_thread(runner.close)  # the worker's process ends: its engine with it
        again = runner
    else:
        again = VllmRunner({**runner.options.model_dump(), "initial_version": "v1"})
    try:
        await asyncio.to_thread(again.load)
        assert again.vllm_weight_version() == "v1" == again.describe().weights_version
        async with running_agent(kafka, tmp_path, again, ckpts.root):  # restores the journal
            assert again.vllm_weight_version() == "v2" == again.describe().weights_version
            assert await generate(again) == ckpts.want("v2")
    finally:
        if again is not runner:
            again.close()
    runner.reload_weights(ReloadWeightsSpec(path=str(ckpts.v1), version="v1"), ckpts.v1)
    assert runner.vllm_weight_version() == "v1"
