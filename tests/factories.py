"""Shared test factories: times, wire messages, worker argv, a running agent, free ports, and
the fold tests' builders (commands, acks and a fed ``Fleet``).

Imported by both environments (``tests/vllm`` runs in ``.venv-vllm``): only the standard
library, pydantic and the project here, nothing heavy at module level.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.kafka.launch import free_port as free_port  # one home; tests import it from here
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import DEFAULT_PROGRESS_DEADLINE_S, Fleet
from controlplane.rollout.models import RolloutStatus, WorkerState
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    Command,
    CommandKind,
    Degraded,
    Heartbeat,
    InFlight,
    ReloadWeightsSpec,
    Selector,
    Timings,
    UpdateConfigSpec,
    WorkerStatus,
    utcnow,
)

if TYPE_CHECKING:
    from controlplane.kafka.broker import LocalCluster
    from workers.agent.loop import Agent
    from workers.agent.settings import WorkerSettings

#: The fold tests' origin: ``at(s)`` is ``s`` seconds after it.
T0 = datetime(2025, 1, 1, tzinfo=UTC)


def at(seconds: float, t0: datetime = T0) -> datetime:
    return t0 + timedelta(seconds=seconds)


def fresh_topics(bootstrap: str, tag: str) -> KafkaSettings:
    """Settings for topics no other test uses: prefix ``tag`` and eight random hex digits."""
    return KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=f"{tag}{uuid.uuid4().hex[:8]}")


# --------------------------------------------------------------------------- wire messages


def heartbeat(
    worker_id: str = "w1",
    sent: float = 0.0,
    *,
    t0: datetime = T0,
    started: float = -100.0,
    seq: int | None = None,
    labels: dict[str, str] | None = None,
    status: WorkerStatus = WorkerStatus.READY,
    interval: float = 5.0,
    version: str | None = "v1",
    in_flight: InFlight | None = None,
    flight: tuple[str, float] | None = None,
    degraded: bool = False,
    incarnation: int = 0,
) -> Heartbeat:
    """A torch worker's heartbeat ``sent`` seconds after ``t0``, as the fold tests feed it.

    ``flight``: (command_id, since) of a reload of rollout r1 in flight (or ``in_flight`` itself);
    ``degraded``: a corrupted v1 -> v2 reload since 0; ``seq`` defaults to the milliseconds
    since ``started``.
    """
    if flight is not None:
        in_flight = InFlight(
            command_id=flight[0],
            rollout_id="r1",
            kind=CommandKind.RELOAD_WEIGHTS,
            since=at(flight[1], t0),
        )
    return Heartbeat(
        worker_id=worker_id,
        labels=labels if labels is not None else {"model": "llama"},
        runner="torch",
        device="cpu",
        status=status,
        weights_version=version,
        in_flight=in_flight,
        degraded=(
            Degraded(
                code="WEIGHTS_CORRUPTED",
                message="x",
                from_version="v1",
                to_version="v2",
                since=at(0, t0),
            )
            if degraded
            else None
        ),
        seq=seq if seq is not None else max(0, round((sent - started) * 1000)),
        sent_at=at(sent, t0),
        started_at=at(started, t0),
        interval_s=interval,
        incarnation=incarnation,
    )


def fake_heartbeat(
    worker_id: str,
    sent_at: datetime,
    *,
    interval_s: float,
    started_at: datetime | None = None,
    seq: int = 1,
    **fields: Any,
) -> Heartbeat:
    """A ready fake worker's heartbeat (started when sent unless told)."""
    return Heartbeat(
        worker_id=worker_id,
        runner="fake",
        device="cpu",
        status=WorkerStatus.READY,
        seq=seq,
        sent_at=sent_at,
        started_at=sent_at if started_at is None else started_at,
        interval_s=interval_s,
        **fields,
    )


def succeeded_acks(
    worker_id: str,
    rollout_id: str,
    command_id: str,
    kind: CommandKind = CommandKind.UPDATE_CONFIG,
) -> list[Ack]:
    """Accepted, running, succeeded: what a worker that applied the command writes, now."""
    now = utcnow()
    return [
        Ack(
            command_id=command_id,
            rollout_id=rollout_id,
            worker_id=worker_id,
            kind=kind,
            state=state,
            timings=Timings(received_at=now, started_at=now, finished_at=now),
            sent_at=utcnow(),
        )
        for state in (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED)
    ]


# --------------------------------------------------------------------------- workers


def base_env() -> dict[str, str]:
    """Our environment without any FLEET_* setting of the person running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env.update(
        PJRT_DEVICE="CPU",  # torch_xla on the CPU
        OMP_NUM_THREADS="1",  # several processes on a few cores: no oversubscription
        PYTHONUNBUFFERED="1",
    )
    return env


def tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log (or why it cannot be read)."""
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"<{exc}>"
    return "\n".join(text[-lines:])


def worker_argv(
    worker_id: str,
    *,
    bootstrap: str,
    prefix: str,
    state_dir: Path,
    runner: str = "fake",
    options: dict[str, Any] | None = None,
    allow_root: Path | None = None,
    heartbeat_s: float | str | None = None,
    labels: dict[str, str] | None = None,
) -> list[str]:
    """``python -m workers run`` for one worker (``--runner-options`` only when given)."""
    argv = [sys.executable, "-m", "workers", "run", "--id", worker_id, "--runner", runner]
    if options is not None:
        argv += ["--runner-options", json.dumps(options)]
    argv += ["--bootstrap", bootstrap, "--topic-prefix", prefix]
    if allow_root is not None:
        argv += ["--allow-root", str(allow_root)]
    argv += ["--state-dir", str(state_dir)]
    if heartbeat_s is not None:
        argv += ["--heartbeat-s", str(heartbeat_s)]
    for key, value in (labels or {}).items():
        argv += ["--label", f"{key}={value}"]
    return argv


def weights_dir(tmp_path: Path) -> Path:
    """``tmp_path/ckpts`` holding a 64-byte model.safetensors (the agent tests' allowed root)."""
    root = tmp_path / "ckpts"
    root.mkdir()
    (root / "model.safetensors").write_bytes(b"\0" * 64)
    return root


def agent_settings(kafka: KafkaSettings, tmp_path: Path, /, **kw: Any) -> WorkerSettings:
    """Worker w1, model=tiny, weights only from ``tmp_path/ckpts``, journal in ``tmp_path/state``,
    a heartbeat every 0.5 s; ``kw`` overrides any of those or sets more."""
    from workers.agent.settings import WorkerSettings

    values: dict[str, Any] = {
        "worker_id": "w1",
        "labels": {"model": "tiny"},
        "allowed_roots": [tmp_path / "ckpts"],
        "state_dir": tmp_path / "state",
        "heartbeat_interval_s": 0.5,
    }
    values.update(kw)
    return WorkerSettings(kafka=kafka, **values)


@asynccontextmanager
async def agent_running(
    settings: WorkerSettings, runner: Any, *, ready_s: float = 30.0, stop_s: float = 60.0
) -> AsyncIterator[tuple[Agent, asyncio.Task[None]]]:
    """An in-process agent and its run task, ready; stopped (and waited for) when the block ends."""
    from workers.agent.loop import Agent  # the agent only where one runs

    agent = Agent(settings, runner)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), ready_s)
        yield agent, task
    finally:
        agent.request_stop()
        await asyncio.wait_for(task, stop_s)


@asynccontextmanager
async def running_agent(
    kafka: KafkaSettings, tmp_path: Path, runner: Any, /, *, ready_s: float = 30.0, **kw: Any
) -> AsyncIterator[Agent]:
    """``agent_running`` with ``agent_settings(kafka, tmp_path, **kw)``: the agent alone."""
    async with agent_running(agent_settings(kafka, tmp_path, **kw), runner, ready_s=ready_s) as (
        agent,
        _,
    ):
        yield agent


def heal(cluster: LocalCluster, nodes: int) -> None:
    """Whatever a test crashed comes back (before the next test)."""
    for node_id in range(1, nodes + 1):
        if not cluster.node(node_id).status().running:
            cluster.start_node(node_id, timeout=180)
    cluster.wait_for_brokers(nodes, timeout=180)


# --------------------------------------------------------------------------- the fold (tests/unit/test_rollout*.py)

TICK = timedelta(microseconds=1)
A, R, S, F, X = (
    AckState.ACCEPTED,
    AckState.RUNNING,
    AckState.SUCCEEDED,
    AckState.FAILED,
    AckState.REJECTED,
)


# --------------------------------------------------------------------------- factories


def command(
    rollout_id: str = "r1",
    command_id: str = "c1",
    *,
    workers: Sequence[str] | None = ("w1", "w2"),
    labels: dict[str, str] | None = None,
    issued: float = 0.0,
    expires: float = 3600.0,
    version: str = "v2",
    overrides: dict[str, Any] | None = None,
) -> Command:
    spec: ReloadWeightsSpec | UpdateConfigSpec = (
        UpdateConfigSpec(overrides=overrides)
        if overrides is not None
        else ReloadWeightsSpec(path="/ckpt", version=version)
    )
    return Command(
        command_id=command_id,
        rollout_id=rollout_id,
        issued_at=at(issued),
        expires_at=at(expires),
        issuer="ci",
        selector=Selector(
            worker_ids=list(workers) if workers is not None else None, labels=labels or {}
        ),
        spec=spec,
    )


def ack(
    worker_id: str,
    state: AckState,
    sent: float,
    *,
    rollout_id: str = "r1",
    command_id: str = "c1",
    code: str | None = None,
    version: str | None = None,
    attempt: int = 1,
    started: float | None = None,
    retryable: bool = False,
) -> Ack:
    error = None
    if state in (F, X):
        default = "CHECKSUM_MISMATCH" if state is X else "RUNNER_FAILED"
        error = AckError(code=code or default, message=f"{worker_id} broke", retryable=retryable)
    if version is None and state is S:
        version = "v2"
    if started is None and state is R:
        started = sent
    return Ack(
        command_id=command_id,
        rollout_id=rollout_id,
        worker_id=worker_id,
        kind=CommandKind.RELOAD_WEIGHTS,
        state=state,
        weights_version=version,
        error=error,
        timings=Timings(
            received_at=at(sent if started is None else min(started, sent)),
            started_at=at(started) if started is not None else None,
            finished_at=at(sent) if state.terminal else None,
        ),
        attempt=attempt,
        sent_at=at(sent),
    )


Event = Command | Ack | Heartbeat | tuple[str, str, datetime]


def abort_event(reason: str, when: float, rollout_id: str = "r1") -> tuple[str, str, datetime]:
    return (rollout_id, reason, at(when))


def feed(fleet: Fleet, events: Iterable[Event]) -> Fleet:
    for event in events:
        if isinstance(event, Command):
            fleet.observe_command(event)
        elif isinstance(event, Ack):
            fleet.observe_ack(event)
        elif isinstance(event, Heartbeat):
            fleet.observe_heartbeat(event)
        else:
            fleet.abort(*event)
    return fleet


def fleet(*events: Event, deadline: float = DEFAULT_PROGRESS_DEADLINE_S) -> Fleet:
    return feed(Fleet(progress_deadline_s=deadline), events)


def alive(*workers: str, sent: float, **kw: Any) -> list[Heartbeat]:
    return [heartbeat(w, sent, **kw) for w in workers]


def status(*events: Event, now: float, deadline: float = 600.0) -> RolloutStatus:
    return fleet(*events, deadline=deadline).status("r1", at(now))


def states(st_: RolloutStatus) -> dict[str, WorkerState]:
    return {d.worker_id: d.state for d in st_.workers}


def full(worker_id: str, start: float, end: float, terminal: AckState = S, **kw: Any) -> list[Ack]:
    """accepted, running and a terminal ack, as a worker sends them."""
    return [
        ack(worker_id, A, start, **kw),
        ack(worker_id, R, start + 1, **kw),
        ack(worker_id, terminal, end, started=start + 1, **kw),
    ]


def nack(worker_id: str, sent: float, code: str, **kw: Any) -> Ack:
    """A worker's NACK of a record it could not read: no kind."""
    return ack(worker_id, X, sent, code=code, **kw).model_copy(update={"kind": None})


def event_time(event: Event) -> tuple[datetime, int]:
    """When an event happened, commands first among equals (a log's order)."""
    if isinstance(event, Command):
        return event.issued_at, 0
    if isinstance(event, Ack | Heartbeat):
        return event.sent_at, 1
    return event[2], 1


def compacted_log(events: list[Event]) -> list[Event]:
    """What a restarted coordinator reads: only each worker's latest heartbeat survives."""
    latest: dict[str, Heartbeat] = {}
    for e in events:
        if isinstance(e, Heartbeat):
            held = latest.get(e.worker_id)
            if held is None or (e.started_at, e.seq) > (held.started_at, held.seq):
                latest[e.worker_id] = e
    return [e for e in events if not isinstance(e, Heartbeat)] + list(latest.values())
