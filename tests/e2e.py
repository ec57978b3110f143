"""The end-to-end fleet (tests/integration/test_end_to_end.py): its processes, the CLI and API
as the tests drive them, and how the module's fleet starts (``start_fleet``).

Every part its own OS process: a coordinator and five workers (torch, torch, xla and two slow
fake ones) on their own topic prefix of the session's broker. Process logs go to files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from tests.conftest import say
from tests.factories import base_env, free_port, tail, worker_argv
from workers.cli import app as worker_app

TOKEN = "e2e-secret-token"
HEARTBEAT_S = 1.0
#: The fake workers' reload time: past a 2 s TTL, and long enough to restart a coordinator in.
TTL_WORKER_DELAY_S = 4.0
RESTART_WORKER_DELAY_S = 10.0

JSON = dict[str, Any]


def minus_as_of(status: JSON) -> JSON:
    return {k: v for k, v in status.items() if k != "as_of"}


@dataclass
class Proc:
    """A child process whose output goes to a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    #: Where stdout goes when it is not the log (a CLI's JSON).
    out: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log, open(self.out or os.devnull, "ab") as out:
            log.write(f"---- start {' '.join(self.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=log if self.out is None else out,
                stderr=subprocess.STDOUT if self.out is None else log,
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait(30)

    def terminate(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.terminate()

    def wait(self, timeout: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return self.kill()


@dataclass
class CliResult:
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    wall_s: float

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError as exc:
            raise AssertionError(f"not JSON from {self.argv}: {self}") from exc

    def __str__(self) -> str:
        return (
            f"rc={self.rc} in {self.wall_s:.2f}s\n--- stdout\n{self.stdout[-3000:]}"
            f"\n--- stderr\n{self.stderr[-3000:]}"
        )


@dataclass
class Fleet:
    """The module's processes and how to talk to them."""

    bootstrap: str
    prefix: str
    root: Path
    port: int
    env: dict[str, str]
    coordinator: Proc
    workers: dict[str, Proc]
    checkpoints: dict[str, Path] = field(default_factory=dict)
    main_ids: tuple[str, ...] = ()

    @property
    def ckpt_dir(self) -> Path:
        return self.root / "ckpts"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def processes(self) -> list[Proc]:
        return [self.coordinator, *self.workers.values()]

    # ------------------------------------------------------------------ the CLI

    def cli(self, *args: str, timeout: float = 120.0, kafka: bool = True) -> CliResult:
        """``python -m controlplane ARGS`` against this fleet's broker and topics."""
        argv = [sys.executable, "-m", "controlplane", *args]
        if kafka:
            argv += ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]
        start = time.monotonic()
        done = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=timeout)
        return CliResult(argv, done.returncode, done.stdout, done.stderr, time.monotonic() - start)

    def reload(self, path: Path, version: str, selector: str, *args: str, **kw: Any) -> CliResult:
        """``reload-weights PATH --version VERSION -s SELECTOR --wait ARGS``, as ``cli``."""
        return self.cli(
            "reload-weights", str(path), "--version", version, "-s", selector, "--wait", *args, **kw
        )

    def cli_background(self, name: str, *args: str) -> Proc:
        argv = [sys.executable, "-m", "controlplane", *args]
        argv += ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]
        proc = Proc(name, argv, self.env, self.root / f"{name}.log", self.root / f"{name}.out")
        proc.start()
        return proc

    def worker_versions(self) -> dict[str, str | None]:
        result = self.cli("workers", "--json")
        assert result.rc == 0, str(result)
        return {w["worker_id"]: w["weights_version"] for w in result.json()}

    def cli_status(self, rollout_id: str) -> tuple[int, JSON]:
        result = self.cli("status", rollout_id, "--json")
        assert result.rc in (0, 1, 2), str(result)
        status: JSON = result.json()
        return result.rc, status

    # ------------------------------------------------------------------ the coordinator's API

    def get(self, path: str, timeout: float = 10.0) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", timeout=timeout)

    def api(self, path: str) -> Any:
        response = self.get(path)
        assert response.status_code == 200, (path, response.status_code, response.text)
        return response.json()

    def every(self, path: str) -> list[Any]:
        """Every item of a paginated list: its pages, following ``Link: rel="next"``."""
        items: list[Any] = []
        url: str | None = path
        while url is not None:
            response = self.get(url)
            assert response.status_code == 200, (url, response.status_code, response.text)
            items.extend(response.json())
            url = response.links.get("next", {}).get("url")
        return items

    def start_coordinator(self) -> None:
        self.coordinator.start()
        self.until(self._coordinator_ready, 90, "the coordinator is ready")

    def _coordinator_ready(self) -> bool:
        if not self.coordinator.running:
            raise AssertionError(f"the coordinator exited:\n{tail(self.coordinator.log, 25)}")
        try:
            return self.get("/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def until(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting until {what}")
            time.sleep(0.2)

    def rollout(self, rollout_id: str) -> JSON | None:
        response = self.get(f"/api/v1/rollouts/{rollout_id}")
        if response.status_code == 404:
            return None
        assert response.status_code == 200, response.text
        status: JSON = response.json()
        return status

    def terminal_rollout(self, rollout_id: str, timeout: float = 60.0) -> JSON:
        def ended() -> JSON | None:
            status = self.rollout(rollout_id)
            return status if status is not None and status["exit_code"] is not None else None

        result: JSON = self.until(ended, timeout, f"rollout {rollout_id} ends")
        return result

    def write_checkpoint(self, *args: str) -> Path:
        """`fleet-worker checkpoint ...` (in this process: torch is imported once, not per call)."""
        result = CliRunner().invoke(worker_app, ["checkpoint", *args])
        assert result.exit_code == 0, (result.output, result.exception)
        return Path(json.loads(result.stdout)["path"])


def _worker(
    fleet_root: Path,
    env: dict[str, str],
    bootstrap: str,
    prefix: str,
    worker_id: str,
    runner: str,
    labels: dict[str, str],
    options: dict[str, Any] | None = None,
) -> Proc:
    argv = worker_argv(
        worker_id,
        bootstrap=bootstrap,
        prefix=prefix,
        state_dir=fleet_root / "state",
        runner=runner,
        options=options or {},
        allow_root=fleet_root / "ckpts",
        heartbeat_s=HEARTBEAT_S,
        labels=labels,
    )
    return Proc(worker_id, argv, env, fleet_root / f"{worker_id}.log")


def start_fleet(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Fleet]:
    """Start the module's fleet (the body of test_end_to_end's ``fleet`` fixture): ensure its
    topics, start the coordinator and workers, write the checkpoints, wait until all are ready;
    stopped when the generator is closed."""
    root = tmp_path_factory.mktemp("e2e")
    (root / "ckpts").mkdir()
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    env = base_env()
    port = free_port()
    coordinator = Proc(
        "coordinator",
        [
            sys.executable,
            "-m",
            "controlplane",
            "coordinator",
            "--bootstrap",
            kafka_bootstrap,
            "--topic-prefix",
            prefix,
            "--port",
            str(port),
        ],
        {**env, "FLEET_COORDINATOR_API_TOKEN": TOKEN},
        root / "coordinator.log",
    )
    # Three workers with the real model, and two fake ones whose reloads take long on purpose.
    tiny = {"model": "tiny"}
    specs: list[tuple[str, str, dict[str, str], dict[str, Any]]] = [
        ("torch-a", "torch", tiny, {}),
        ("torch-b", "torch", tiny, {}),
        # Always the XLA runner: without torch_xla the worker exits with RUNNER_LOAD_FAILED and
        # the fleet does not start (a torch worker in its place would pass as XLA).
        ("xla-c", "xla", tiny, {}),
        (
            "slow-ttl",
            "fake",
            {"model": "slow", "role": "ttl"},
            {"reload_delay_s": TTL_WORKER_DELAY_S},
        ),
        (
            "slow-restart",
            "fake",
            {"model": "slow", "role": "restart"},
            {"reload_delay_s": RESTART_WORKER_DELAY_S},
        ),
    ]
    workers = {
        wid: _worker(root, env, kafka_bootstrap, prefix, wid, runner, labels, options)
        for wid, runner, labels, options in specs
    }
    fleet = Fleet(
        kafka_bootstrap,
        prefix,
        root,
        port,
        env,
        coordinator,
        workers,
        main_ids=tuple(wid for wid, _, labels, _ in specs if labels == tiny),
    )
    try:
        ensured = fleet.cli("topics", "ensure")
        assert ensured.rc == 0, str(ensured)
        started = time.monotonic()
        for proc in fleet.processes():
            proc.start()
        # While the workers import torch, write the checkpoints with the real tool.
        fleet.checkpoints["good"] = fleet.write_checkpoint(
            "write", str(fleet.ckpt_dir / "good"), "--seed", "1", "--shards", "2"
        )
        fleet.checkpoints["kcat"] = fleet.write_checkpoint(
            "write", str(fleet.ckpt_dir / "kcat"), "--seed", "2"
        )
        fleet.checkpoints["shape"] = fleet.write_checkpoint(
            "broken", "shape", str(fleet.ckpt_dir / "broken-shape")
        )
        fleet.until(fleet._coordinator_ready, 120, "the coordinator is ready")

        def all_ready() -> bool:
            for proc in workers.values():
                if not proc.running:
                    raise AssertionError(f"worker {proc.name} exited:\n{tail(proc.log, 25)}")
            views = fleet.every("/api/v1/workers")
            ready = {
                w["worker_id"]
                for w in views
                if w["alive"] and w["heartbeat"] and w["heartbeat"]["status"] == "ready"
            }
            return ready >= set(workers)

        fleet.until(all_ready, 180, "every worker is ready")
        report(
            request,
            f"[e2e] coordinator and {len(workers)} workers ready in "
            f"{time.monotonic() - started:.1f}s; logs in {root}",
        )
        yield fleet
    finally:
        for proc in fleet.processes():
            proc.terminate()
        for proc in fleet.processes():
            proc.wait(20)


def report(request: pytest.FixtureRequest, line: str) -> None:
    say(request.config, line)
