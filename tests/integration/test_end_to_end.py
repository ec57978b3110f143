"""End to end, every part its own OS process: the session's Kafka broker, a coordinator, worker
agents with real models (torch on the CPU, torch_xla through PJRT_DEVICE=CPU), and the CLI.

Each CLI exit code is shown for a real cause: 0 a good reload, 1 a checkpoint every worker
refuses, 2 a reload that outlasts the command's TTL, 3 no matching worker, 4 no broker. A command
written by a plain Kafka producer is tracked like any other, and a coordinator killed in the
middle of a rollout is replaced by one that reports exactly the same statuses.

The fleet (coordinator and workers) starts once for the module, on its own topic prefix; the
tests run in file order and each leaves the fleet idle. Process logs go to files; their tails
are printed when a test fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiokafka import AIOKafkaProducer
from typer.testing import CliRunner

from tests.conftest import say
from tests.factories import base_env, free_port, tail, worker_argv
from workers.cli import app as worker_app

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

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


@pytest.fixture(scope="module")
def fleet(
    kafka_bootstrap: str,
    tmp_path_factory: pytest.TempPathFactory,
    request: pytest.FixtureRequest,
) -> Iterator[Fleet]:
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
            views = fleet.api("/api/v1/workers")
            ready = {
                w["worker_id"]
                for w in views
                if w["alive"] and w["heartbeat"] and w["heartbeat"]["status"] == "ready"
            }
            return ready >= set(workers)

        fleet.until(all_ready, 180, "every worker is ready")
        _report(
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


def _report(request: pytest.FixtureRequest, line: str) -> None:
    say(request.config, line)


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """When the test fails, print the tail of every process log of the module's fleet."""
    failed_before = request.session.testsfailed
    yield
    if request.session.testsfailed == failed_before or "fleet" not in request.fixturenames:
        return
    fleet: Fleet = request.getfixturevalue("fleet")
    logs = sorted(fleet.root.glob("*.log"))
    for log in logs:
        _report(request, f"\n==== {log.name} (last lines)\n{tail(log, 25)}")


def test_each_worker_runs_the_runner_it_was_given(fleet: Fleet) -> None:
    """The XLA worker reports the xla runner on an XLA device (torch_xla on PJRT's CPU)."""
    views = {w["worker_id"]: w["heartbeat"] for w in fleet.api("/api/v1/workers")}
    assert views["xla-c"]["runner"] == "xla"
    assert views["xla-c"]["device"].startswith("xla") and "(CPU)" in views["xla-c"]["device"]
    assert {views[w]["runner"] for w in ("torch-a", "torch-b")} == {"torch"}
    assert all(views[w]["degraded"] is None for w in fleet.main_ids)


# --------------------------------------------------------------------------- exit code 0


def test_good_reload_succeeds_on_every_worker_and_they_report_the_new_version(
    fleet: Fleet, request: pytest.FixtureRequest
) -> None:
    path = fleet.checkpoints["good"]
    assert path.name == "model.safetensors.index.json"  # sharded: two files and an index
    result = fleet.reload(
        path,
        "v-e2e-1",
        "model=tiny",
        "--wait-timeout",
        "90",
        "--ttl",
        "300",
        "--timeout",
        "120",
        "--json",
    )
    assert result.rc == 0, str(result)
    status = result.json()
    assert status["phase"] == "succeeded" and status["exit_code"] == 0
    assert status["expected"] == 3
    assert status["counts"]["succeeded"] == 3
    assert {w["worker_id"] for w in status["workers"]} == set(fleet.main_ids)
    assert {w["weights_version"] for w in status["workers"]} == {"v-e2e-1"}
    _report(
        request,
        f"[e2e] reload on 3 workers: publish -> succeeded {status['duration_s']:.3f}s "
        f"(status duration_s); CLI wall time {result.wall_s:.2f}s; per worker "
        + ", ".join(f"{w['worker_id']} {w['duration_s']:.3f}s" for w in status["workers"]),
    )

    def versions_reported() -> dict[str, str | None] | None:
        versions = fleet.worker_versions()
        ours = {wid: versions.get(wid) for wid in fleet.main_ids}
        return ours if set(ours.values()) == {"v-e2e-1"} else None

    fleet.until(versions_reported, 30, "`workers --json` reports v-e2e-1 for the three workers")
    # The coordinator agrees, and says the workers are at the desired level.
    assert fleet.api(f"/api/v1/rollouts/{status['rollout_id']}")["phase"] == "succeeded"
    levels = {w["worker_id"]: w for w in fleet.api("/api/v1/workers")}
    for wid in fleet.main_ids:
        assert levels[wid]["desired_version"] == "v-e2e-1"
        assert levels[wid]["reported_version"] == "v-e2e-1"


# --------------------------------------------------------------------------- exit code 1


def test_broken_checkpoint_is_rejected_everywhere_and_versions_stay(fleet: Fleet) -> None:
    before = fleet.worker_versions()
    assert all(before[wid] is not None for wid in fleet.main_ids)
    result = fleet.reload(
        fleet.checkpoints["shape"], "v-broken", "model=tiny", "--wait-timeout", "90", "--json"
    )
    assert result.rc == 1, str(result)
    status = result.json()
    assert status["phase"] == "failed" and status["reason"] == "WORKERS_FAILED"
    assert status["expected"] == 3
    assert status["counts"]["succeeded"] == 0
    for worker in status["workers"]:
        assert worker["state"] in ("rejected", "failed"), worker
        assert worker["error"]["code"] == "WEIGHTS_SHAPE_MISMATCH", worker
        assert worker["weights_version"] == before[worker["worker_id"]], worker
    after = fleet.worker_versions()
    assert {wid: after[wid] for wid in fleet.main_ids} == {
        wid: before[wid] for wid in fleet.main_ids
    }


# --------------------------------------------------------------------------- exit code 2


def test_reload_that_outlasts_its_ttl_times_out(fleet: Fleet) -> None:
    result = fleet.reload(
        fleet.checkpoints["good"],
        "v-late",
        "role=ttl",
        "--ttl",
        "2",
        "--wait-timeout",
        "60",
        "--json",
    )
    assert result.rc == 2, str(result)
    status = result.json()
    assert status["phase"] == "timed_out" and status["reason"] == "EXPIRED"
    assert status["expected"] == 1
    (worker,) = status["workers"]
    assert worker["worker_id"] == "slow-ttl" and worker["state"] == "running"
    assert status["finished_at"] == status["expires_at"]

    # The worker finishes after the deadline: shown as a late state, the phase does not move.
    def late() -> JSON | None:
        now = fleet.rollout(status["rollout_id"])
        assert now is not None
        return now if now["workers"][0]["late_state"] == "succeeded" else None

    settled = fleet.until(late, 30, "the late success is visible")
    assert settled["phase"] == "timed_out"
    rc, from_log = fleet.cli_status(status["rollout_id"])
    assert rc == 2
    assert minus_as_of(from_log) == minus_as_of(settled)


# --------------------------------------------------------------------------- exit codes 3 and 4


def test_no_matching_worker_is_invalid_input(fleet: Fleet) -> None:
    result = fleet.reload(fleet.checkpoints["good"], "v-nobody", "model=nobody-runs-this")
    assert result.rc == 3, str(result)
    assert "NO_MATCHING_WORKERS" in result.stderr
    assert result.stdout.strip() == ""  # nothing was published


def test_unreachable_broker(fleet: Fleet) -> None:
    closed = free_port()  # bound and released: nothing listens there
    result = fleet.reload(
        fleet.checkpoints["good"],
        "v-nowhere",
        "model=tiny",
        "--bootstrap",
        f"127.0.0.1:{closed}",
        "--topic-prefix",
        fleet.prefix,
        kafka=False,
        timeout=90,
    )
    assert result.rc == 4, str(result)
    assert "BROKER_UNAVAILABLE" in result.stderr


# --------------------------------------------------------------------------- any Kafka client


def test_command_from_a_plain_kafka_producer_is_rolled_out_and_tracked(fleet: Fleet) -> None:
    """What kcat would send: a JSON object, no key, a labels-only selector, not our code."""
    now = datetime.now(UTC).replace(microsecond=0)
    rollout_id = f"r-kcat-{uuid.uuid4().hex[:8]}"
    command = {
        "schema_version": 1,
        "command_id": f"{rollout_id}.c1",
        "rollout_id": rollout_id,
        "issued_at": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "expires_at": (now + timedelta(minutes=10)).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "issuer": "kcat@ci",
        "selector": {"labels": {"model": "tiny"}},
        "spec": {
            "kind": "reload_weights",
            "path": str(fleet.checkpoints["kcat"]),
            "version": "v-kcat",
        },
    }

    async def produce() -> None:
        producer = AIOKafkaProducer(bootstrap_servers=fleet.bootstrap, acks="all")
        await producer.start()
        try:
            await producer.send_and_wait(
                f"{fleet.prefix}.commands", json.dumps(command).encode("utf-8")
            )
        finally:
            await producer.stop()

    asyncio.run(produce())
    status = fleet.terminal_rollout(rollout_id, timeout=90)
    assert status["phase"] == "succeeded", status
    assert status["expected"] == 3 and status["counts"]["succeeded"] == 3
    assert {w["worker_id"] for w in status["workers"]} == set(fleet.main_ids)
    assert status["selector"] == {"worker_ids": None, "labels": {"model": "tiny"}}
    listed = {s["rollout_id"]: s for s in fleet.api("/api/v1/rollouts")}
    assert listed[rollout_id]["phase"] == "succeeded"
    rc, from_log = fleet.cli_status(rollout_id)
    assert rc == 0
    assert minus_as_of(from_log) == minus_as_of(fleet.api(f"/api/v1/rollouts/{rollout_id}"))
    fleet.until(
        lambda: {fleet.worker_versions()[w] for w in fleet.main_ids} == {"v-kcat"},
        30,
        "the workers report v-kcat",
    )


# --------------------------------------------------------------------------- coordinator restart


def test_coordinator_restarted_mid_rollout_reports_the_same_status(fleet: Fleet) -> None:
    # What the first coordinator says about every rollout that has ended.
    ended_before = {
        s["rollout_id"]: minus_as_of(s)
        for s in fleet.api("/api/v1/rollouts")
        if s["exit_code"] is not None
    }
    assert len(ended_before) >= 3, sorted(ended_before)
    rollout_id = f"r-restart-{uuid.uuid4().hex[:8]}"
    waiter = fleet.cli_background(
        "cli-wait-restart",
        "reload-weights",
        str(fleet.checkpoints["good"]),
        "--version",
        "v-restart",
        "-s",
        "role=restart",
        "--rollout-id",
        rollout_id,
        "--ttl",
        "300",
        "--wait",
        "--wait-timeout",
        "120",
        "--json",
    )
    try:

        def running() -> JSON | None:
            status = fleet.rollout(rollout_id)
            if status is None or status["phase"] != "progressing":
                return None
            return status if status["counts"]["running"] == 1 else None

        seen_by_first = fleet.until(running, 60, "the slow rollout is running")
        assert fleet.coordinator.kill() == -signal.SIGKILL
        fleet.start_coordinator()  # same settings, same port, nothing but the log to go on
        second_phase = fleet.api(f"/api/v1/rollouts/{rollout_id}")["phase"]
        final = fleet.terminal_rollout(rollout_id, timeout=90)
        assert waiter.wait(60) == 0, tail(waiter.log, 25)
    finally:
        waiter.kill()
    assert final["phase"] == "succeeded", final
    assert second_phase in ("progressing", "succeeded")

    # The second coordinator, the CLI computing from the log, and the CLI that waited all agree.
    rc, from_log = fleet.cli_status(rollout_id)
    assert rc == 0
    assert minus_as_of(from_log) == minus_as_of(final)
    assert waiter.out is not None
    waited = json.loads(waiter.out.read_text())
    assert minus_as_of(waited) == minus_as_of(final)
    # What the first coordinator saw of it has not changed.
    for key in ("command_id", "issued_at", "expires_at", "selector", "expected", "started_at"):
        assert final[key] == seen_by_first[key], key
    (worker,) = final["workers"]
    assert worker["started_at"] == seen_by_first["workers"][0]["started_at"]
    assert worker["weights_version"] == "v-restart"

    # Every rollout that ended before the restart reads exactly as it did.
    ended_after = {
        s["rollout_id"]: minus_as_of(s)
        for s in fleet.api("/api/v1/rollouts")
        if s["rollout_id"] in ended_before
    }
    assert ended_after == ended_before
    for rid, before in ended_before.items():
        assert minus_as_of(fleet.api(f"/api/v1/rollouts/{rid}")) == before, rid
