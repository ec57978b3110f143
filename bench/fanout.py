"""Fleet fan-out: N worker agents (FakeRunner) on a private broker, against the Kafka floor and HTTP.

For each N, on a fresh set of topics and in this order:

1. **floor**: the bare Kafka command/ack round trip on the same broker: one task publishes a
   pre-encoded command, a second task (its own consumer and producer, as a worker would) consumes
   it and publishes a pre-encoded ack, the first consumes the ack. Same client settings as the
   product (``controlplane.kafka.bus``: acks=all, idempotent, read_committed); no decoding, no journal.
2. **http**: what teams script today: N tiny HTTP endpoints, one uvicorn/starlette server process
   listening on N ports (one port per "worker", so a client opens N connections as it would to N
   hosts), each POST calling ``FakeRunner.update_config`` (the same no-op the agents run). Called
   with httpx, sequentially and concurrently (``asyncio.gather``), a fresh client per fan-out.
3. **agents**: N ``workers.agent.loop.Agent`` with ``FakeRunner``, ``ceil(N / per_process)`` OS
   processes, each agent with its own producer, consumer and journal (nothing shared but the
   event loop). Rollouts of ``update_config`` are published pinned to the N workers; the time
   from publish to ``succeeded`` is what ``Follower`` + ``Fleet.status`` (the CLI's ``--wait``)
   shows. Per worker: command-to-ack latency (terminal ack ``sent_at`` - command ``issued_at``).
4. **idle**: CPU of the agent processes (and of the broker) over a quiet window, as % of a core.

Journals default to /dev/shm: on one machine, N agents' fsyncs (two per command, in each agent
process's thread pool) would queue on one disk, which N real hosts would not; ``--state-dir``
puts them on a disk. ``--profile`` also reports, per command, the agent's steps and its produce
requests, offset commits and fetches.

    .venv/bin/python -m bench.fanout --quick            # N in 1, 10, 50   (< 2 minutes)
    .venv/bin/python -m bench.fanout                    # N in 1, 10, 100, 500
    .venv/bin/python -m bench.fanout --n 100 --repeats 30 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import functools
import io
import json
import logging
import math
import os
import pstats
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    Broker,
    conclude,
    cpu_seconds,
    ensure_topics,
    envelope,
    fmt,
    loadavg,
    mode_of,
    ratio,
    summary,
    table,
)

log = logging.getLogger("bench.fanout")

OVERRIDE_KEY = "max_new_tokens"
#: The fixed judging interval of the `cli`/`cli-fixed` policies (the CLI's --wait before it
#: judged by cost, 4063a89; `adaptive` is what it does now).
JUDGE_INTERVAL_S: float = 0.1


# =========================================================================== child: agent host


async def _agent_host(cfg: dict[str, Any]) -> None:
    """Run ``cfg['workers']`` agents in this process until told to stop on stdin."""
    from controlplane.kafka.settings import KafkaSettings
    from workers.agent.loop import Agent
    from workers.agent.settings import WorkerSettings
    from workers.runners.fake_runner import FakeRunner

    if cfg.get("fetch_wait_ms") is not None:
        # A what-if for a product change: the agent's command consumer long-polls longer.
        import workers.agent.loop

        workers.agent.loop.Consumer = functools.partial(  # type: ignore[misc]
            workers.agent.loop.Consumer, fetch_max_wait_ms=cfg["fetch_wait_ms"]
        )
    kafka = KafkaSettings(
        bootstrap_servers=cfg["bootstrap"], topic_prefix=cfg["prefix"], client_id="bench-agent"
    )
    agents = [
        Agent(
            WorkerSettings(
                worker_id=worker_id,
                labels={"bench": "fanout"},
                kafka=kafka,
                runner="fake",
                allowed_roots=[Path(cfg["state_dir"])],
                state_dir=Path(cfg["state_dir"]),
                heartbeat_interval_s=cfg["heartbeat_s"],
                restore_on_start=False,
            ),
            FakeRunner(),
        )
        for worker_id in cfg["workers"]
    ]
    started = time.perf_counter()
    tasks = [asyncio.create_task(agent.run()) for agent in agents]
    ready = asyncio.ensure_future(asyncio.gather(*(a.ready.wait() for a in agents)))
    await asyncio.wait([ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise RuntimeError(f"an agent died while starting: {task.exception()!r}")
        raise RuntimeError("an agent ended while starting")
    _say({"ready": len(agents), "start_s": round(time.perf_counter() - started, 3)})

    loop = asyncio.get_running_loop()
    profiler: cProfile.Profile | None = None
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "profile-on":
            # CPU time of the loop's thread: on a loaded machine wall time would blame whatever
            # call the scheduler happened to preempt.
            profiler = cProfile.Profile(time.thread_time)
            profiler.enable()
            _say({"ok": "profile-on"})
        elif line.startswith("profile-off "):
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(line.split(" ", 1)[1])
                profiler = None
            _say({"ok": "profile-off"})
        else:  # "stop" or EOF
            break
    for agent in agents:
        agent.request_stop()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    _say({"stopped": sum(sum(a.outcomes.values()) for a in agents)})


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


# =========================================================================== child: HTTP endpoints


async def _http_host(cfg: dict[str, Any]) -> None:
    """One uvicorn server on ``cfg['n']`` ports; port i is worker i with its own FakeRunner."""
    import socket

    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from workers.runners.fake_runner import FakeRunner

    sockets: list[socket.socket] = []
    runners: dict[int, FakeRunner] = {}
    for _ in range(cfg["n"]):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        sockets.append(sock)
        runners[sock.getsockname()[1]] = FakeRunner()

    async def config(request: Request) -> JSONResponse:
        runner = runners[request.scope["server"][1]]
        overrides = await request.json()
        desc = runner.update_config(overrides)  # the agents' no-op, minus journal and acks
        return JSONResponse({"ok": True, "config_digest": desc.config_digest})

    app = Starlette(routes=[Route("/config", config, methods=["POST"])])
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", backlog=2048)
    )
    server_task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:  # noqa: ASYNC110 - uvicorn offers no event for this
        await asyncio.sleep(0.01)
    _say({"ports": list(runners)})
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)
    server.should_exit = True
    await server_task


# =========================================================================== parent: children


class Child:
    """A child process of this module speaking JSON lines on stdout, commands on stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name

    @classmethod
    async def spawn(cls, role: str, cfg: dict[str, Any], log_file: Path) -> Child:
        with open(log_file, "ab") as err:  # noqa: ASYNC230 - a local log file
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "bench.fanout",
                f"--{role}",
                json.dumps(cfg),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        return cls(proc, f"{role}:{log_file.name}")

    async def read(self, timeout: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            code = await self.proc.wait()
            raise RuntimeError(f"{self.name} exited with status {code} (see its log)")
        message: dict[str, Any] = json.loads(line)
        return message

    async def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        await self.proc.stdin.drain()

    async def stop(self, timeout: float = 90.0) -> None:
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await self.send("stop")
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)


# =========================================================================== measurements


async def measure_floor(bootstrap: str, repeats: int, n_workers: int) -> dict[str, Any]:
    """Bare command/ack round trips (pre-encoded bytes both ways) through the same broker."""
    from controlplane.coordinator.publisher import build_command
    from controlplane.kafka.bus import Consumer, Producer
    from controlplane.wire.protocol import Selector, UpdateConfigSpec, encode
    from controlplane.wire.topics import command_key

    settings = await ensure_topics(bootstrap, f"floor-{uuid.uuid4().hex[:8]}")
    topics = settings.topics
    ids = [f"w{i:04d}" for i in range(n_workers)]
    command = encode(
        build_command(
            UpdateConfigSpec(overrides={OVERRIDE_KEY: 8}),
            Selector(worker_ids=ids),
            issuer="bench",
        )
    )
    ack = _ack_bytes()
    times: list[float] = []
    async with (
        Producer(settings) as cmd_producer,
        Producer(settings) as ack_producer,
        Consumer(settings, group_id=f"{topics.prefix}.floor") as worker_consumer,
        Consumer(settings) as ack_consumer,
    ):
        await worker_consumer.assign(topics.commands.name, [0])
        await worker_consumer.seek_to_beginning()
        await ack_consumer.assign(topics.acks.name)
        await ack_consumer.seek_to_beginning()

        stop = asyncio.Event()

        async def responder() -> None:
            while not stop.is_set():
                for record in await worker_consumer.fetch(timeout_s=0.2, max_records=16):
                    await ack_producer.send(topics.acks.name, ack, key=b"w0000")
                    await worker_consumer.commit(record.topic, 0, record.offset + 1)

        task = asyncio.create_task(responder())
        try:
            for i in range(repeats + 5):  # five warm-up round trips
                start = time.perf_counter()
                await cmd_producer.send(topics.commands.name, command, key=command_key(f"r{i}"))
                while not await ack_consumer.fetch(timeout_s=1.0):
                    pass
                if i >= 5:
                    times.append(time.perf_counter() - start)
        finally:
            stop.set()
            await task
    return {"round_trip_s": summary(times)}


def _ack_bytes() -> bytes:
    from controlplane.wire.protocol import Ack, AckState, CommandKind, Timings, encode, utcnow

    now = utcnow()
    return encode(
        Ack(
            command_id="r-bench.c1",
            rollout_id="r-bench",
            worker_id="w0000",
            kind=CommandKind.UPDATE_CONFIG,
            state=AckState.SUCCEEDED,
            weights_version="init",
            config_digest="0123456789abcdef",
            timings=Timings(received_at=now, started_at=now, finished_at=now),
            sent_at=now,
            result={"overrides": [OVERRIDE_KEY]},
        )
    )


async def measure_http(n: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Sequential and concurrent httpx fan-outs to N endpoints of one uvicorn process."""
    import httpx

    server = await Child.spawn("http-child", {"n": n}, tmp / f"http-{n}.log")
    try:
        ports: list[int] = (await server.read(120))["ports"]
        urls = [f"http://127.0.0.1:{p}/config" for p in ports]
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        timeout = httpx.Timeout(60.0)

        async def sequential(client: httpx.AsyncClient, i: int) -> float:
            start = time.perf_counter()
            for url in urls:
                (await client.post(url, json={OVERRIDE_KEY: 1 + i % 64})).raise_for_status()
            return time.perf_counter() - start

        per_request: list[float] = []

        async def concurrent(client: httpx.AsyncClient, i: int) -> float:
            async def one(url: str) -> None:
                t0 = time.perf_counter()
                (await client.post(url, json={OVERRIDE_KEY: 1 + i % 64})).raise_for_status()
                per_request.append(time.perf_counter() - t0)

            start = time.perf_counter()
            await asyncio.gather(*(one(u) for u in urls))
            return time.perf_counter() - start

        # One client per mode, its connections opened by a warm-up fan-out: HTTP's best case.
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await sequential(client, 0)
            seq = [await sequential(client, i) for i in range(repeats)]
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            await concurrent(client, 0)
            per_request.clear()
            conc = [await concurrent(client, i) for i in range(repeats)]
        return {
            "server": f"one uvicorn process, {n} listening ports, warm keep-alive connections",
            "sequential_s": summary(seq),
            "concurrent_s": summary(conc),
            "concurrent_request_s": summary(per_request),
        }
    finally:
        await server.stop()


class Fanout:
    """N agents in child processes plus a Follower watching their topics from this process."""

    def __init__(
        self,
        bootstrap: str,
        n: int,
        per_process: int,
        heartbeat_s: float,
        state_root: Path,
        log_dir: Path,
        fetch_wait_ms: int | None = None,
        judge: str = "cli",
    ) -> None:
        self.fetch_wait_ms = fetch_wait_ms
        self.judge = judge
        self.bootstrap = bootstrap
        self.n = n
        self.per_process = per_process
        self.heartbeat_s = heartbeat_s
        self.state_root = state_root
        self.log_dir = log_dir
        self.children: list[Child] = []
        self.worker_ids: list[str] = []
        self.settings: Any = None
        self.follower: Any = None
        self.acks: list[Any] = []

    async def start(self) -> dict[str, Any]:
        from controlplane.coordinator.follower import Follower

        tag = uuid.uuid4().hex[:6]
        self.settings = await ensure_topics(self.bootstrap, f"fan{self.n}-{tag}")
        self.follower = Follower(self.settings)
        await self.follower.start()
        self.follower.listeners.append(lambda batch: self.acks.extend(batch.acks))
        processes = max(1, math.ceil(self.n / self.per_process))
        groups: list[list[str]] = [[] for _ in range(processes)]
        for i in range(self.n):
            groups[i % processes].append(f"n{self.n}-p{i % processes}-w{i:04d}")
        self.worker_ids = sorted(w for g in groups for w in g)
        state_dir = self.state_root / f"n{self.n}-{tag}"
        state_dir.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        for p, group in enumerate(groups):
            cfg = {
                "bootstrap": self.bootstrap,
                "prefix": self.settings.topic_prefix,
                "workers": group,
                "state_dir": str(state_dir),
                "heartbeat_s": self.heartbeat_s,
                "fetch_wait_ms": self.fetch_wait_ms,
            }
            self.children.append(
                await Child.spawn("agents-child", cfg, self.log_dir / f"agents-n{self.n}-p{p}.log")
            )
        hellos = [await c.read(600) for c in self.children]
        children_ready_s = time.perf_counter() - started
        await self._wait_registered(timeout=120)
        return {
            "processes": processes,
            "agents_per_process": [len(g) for g in groups],
            "start_s": time.perf_counter() - started,
            "children_ready_s": children_ready_s,
            "child_start_s": [h.get("start_s") for h in hellos],
        }

    async def _wait_registered(self, timeout: float) -> None:
        from controlplane.rollout.registry import is_alive
        from controlplane.wire.protocol import utcnow

        deadline = time.monotonic() + timeout
        registry = self.follower.fleet.registry
        while True:
            now = utcnow()
            alive = sum(
                1
                for w in self.worker_ids
                if (hb := registry.latest(w)) is not None and is_alive(hb, now)
            )
            if alive == self.n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {alive} of {self.n} agents heartbeat")
            await self.follower.poll(timeout_s=0.25)

    async def rollout(self, i: int, producer: Any) -> dict[str, Any]:
        """Publish one update_config rollout; follow it as the CLI does until it is terminal."""
        from controlplane.coordinator.publisher import build_command, publish
        from controlplane.wire.protocol import Selector, UpdateConfigSpec, utcnow

        fleet = self.follower.fleet
        command = build_command(
            UpdateConfigSpec(overrides={OVERRIDE_KEY: 1 + i % 64}),
            Selector(worker_ids=self.worker_ids),
            issuer="bench",
            ttl_s=600,
            now=utcnow(),
        )
        rid = command.rollout_id
        self.acks.clear()
        start = time.perf_counter()
        await publish(self.settings, command, producer)
        published = time.perf_counter() - start
        status_s = 0.0
        polls = 0
        judged_at, touched, last_cost = -1.0, True, 0.0
        status = None
        while True:
            # When to judge, as the CLI's --wait does (policy "cli"): when a batch touched the
            # rollout, at most every JUDGE_INTERVAL_S, at least every second. "every-poll" is the
            # earlier CLI (after every poll); "cli-fixed" is "cli" with the poll's timeout cut to
            # the next moment a judgement is allowed, so a touched rollout is not left unjudged
            # until the 0.25 s poll times out; "adaptive" throttles by cost instead of a fixed
            # interval: at most every 5x the last judgement's duration (capped at 0.25 s).
            now_m = time.monotonic()
            interval = JUDGE_INTERVAL_S if self.judge != "adaptive" else min(0.25, 5 * last_cost)
            due = self.judge == "every-poll" or (
                (touched and now_m - judged_at >= interval) or now_m - judged_at >= 1.0
            )
            if rid in fleet and due:
                judged_at, touched = now_m, False
                t0 = time.perf_counter()
                status = fleet.status(rid, utcnow())
                last_cost = time.perf_counter() - t0
                status_s += last_cost
                if status.terminal:
                    break
            timeout = 0.25
            if self.judge in ("cli-fixed", "adaptive") and touched and judged_at >= 0:
                # Not 0: a zero-timeout fetch may return without yielding to aiokafka's fetcher.
                timeout = min(timeout, max(0.01, judged_at + interval - time.monotonic()))
            batch = await self.follower.poll(timeout_s=timeout)
            polls += 1
            touched = touched or rid in batch.rollout_ids or bool(batch.heartbeats)
            if time.perf_counter() - start > 300:
                raise RuntimeError(f"rollout {rid} not terminal after 300 s")
        converge = time.perf_counter() - start
        assert status is not None
        if status.phase.value != "succeeded":
            raise RuntimeError(f"rollout {rid} ended {status.phase.value}: {status.message}")
        issued = command.issued_at
        mine = [a for a in self.acks if a.rollout_id == rid]
        terminal = [(a.sent_at - issued).total_seconds() for a in mine if a.state.terminal]
        received = [
            (a.timings.received_at - issued).total_seconds()
            for a in mine
            if a.state.value == "accepted"
        ]
        assert status.finished_at is not None
        return {
            "converge_s": converge,
            "publish_s": published,
            "last_ack_s": (status.finished_at - issued).total_seconds(),
            "ack_s": terminal,
            "received_s": received,
            "status_s": status_s,
            "polls": polls,
        }

    async def profile(self, rollouts: int, producer: Any, out_dir: Path) -> dict[str, Any]:
        """cProfile of the agent processes' event loops over ``rollouts`` extra rollouts."""
        for c in self.children:
            await c.send("profile-on")
            await c.read(60)
        for i in range(rollouts):
            await self.rollout(10_000 + i, producer)
        files = []
        for p, c in enumerate(self.children):
            path = out_dir / f"agents-n{self.n}-p{p}.prof"
            await c.send(f"profile-off {path}")
            await c.read(60)
            files.append(str(path))
        return profile_summary(files, rollouts * self.n)

    def cpu(self) -> float:
        return sum(c.cpu() for c in self.children)

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.children))
        if self.follower is not None:
            await self.follower.stop()


def profile_summary(files: Sequence[str], commands: int, top: int = 18) -> dict[str, Any]:
    stats = pstats.Stats(*files, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "calls": ncalls,
                "tottime_s": round(tottime, 4),
                "cumtime_s": round(cumtime, 4),
            }
        )
    by_tot = sorted(rows, key=lambda r: r["tottime_s"], reverse=True)[:top]
    by_cum = sorted(rows, key=lambda r: r["cumtime_s"], reverse=True)[:top]
    # Per command: how often the agent's own steps ran, and what it asked of Kafka (produce
    # requests, each carrying any number of records; offset commits; fetches), with their
    # cumulative CPU ms. A coroutine counts one call per resumption, not per await of it.
    counted = {
        r["function"]: [
            round(r["calls"] / max(commands, 1), 3),
            round(r["cumtime_s"] / max(commands, 1) * 1e3, 3),
        ]
        for r in rows
        if r["function"].startswith(("agent.py:", "state.py:"))
        or r["function"].endswith(
            ("(_send_produce_req)", "(commit_offsets)", "(_fetch_requests_routine)")
        )
    }
    return {
        "profiled_s": round(total, 3),
        "commands": commands,
        "cpu_ms_per_command": round(total / max(commands, 1) * 1e3, 3),
        "top_tottime": by_tot,
        "top_cumtime": by_cum,
        "calls_per_command": dict(sorted(counted.items())),
    }


async def measure_level(
    bootstrap: str, broker_pid: int | None, n: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    from controlplane.kafka.bus import Producer

    level: dict[str, Any] = {"n": n, "loadavg_before": loadavg()}
    print(f"\n== N={n}: floor", flush=True)
    level["floor"] = await measure_floor(bootstrap, args.floor_repeats, n)
    if not args.no_http:
        print(f"== N={n}: HTTP fan-out", flush=True)
        level["http"] = await measure_http(n, args.http_repeats, tmp)
    print(f"== N={n}: starting {n} agents", flush=True)
    fan = Fanout(
        bootstrap,
        n,
        args.per_process,
        args.heartbeat_s,
        args.state_dir,
        tmp,
        args.agent_fetch_wait_ms,
        args.judge,
    )
    try:
        level["agents"] = await fan.start()
        print(f"   started in {level['agents']['start_s']:.1f} s; rollouts", flush=True)
        async with Producer(fan.settings) as producer:
            await fan.rollout(0, producer)  # warm-up
            a0, b0, c0 = fan.cpu(), _broker_cpu(broker_pid), time.process_time()
            t0 = time.perf_counter()
            runs = [await fan.rollout(i + 1, producer) for i in range(args.repeats)]
            elapsed = time.perf_counter() - t0
            commands = args.repeats * n
            level["rollout_cpu"] = {
                "window_s": elapsed,
                "agents_cpu_s": fan.cpu() - a0,
                "agents_cpu_ms_per_command": 1e3 * (fan.cpu() - a0) / commands,
                "broker_cpu_ms_per_command": 1e3 * (_broker_cpu(broker_pid) - b0) / commands,
                "follower_cpu_ms_per_rollout": 1e3 * (time.process_time() - c0) / args.repeats,
                "cores": os.cpu_count(),
            }
            if args.profile and n == max(args.n):
                print(
                    f"== N={n}: profiling agents over {args.profile_rollouts} rollouts", flush=True
                )
                level["agent_profile"] = await fan.profile(args.profile_rollouts, producer, tmp)
        level["rollouts"] = {
            "converge_s": summary([r["converge_s"] for r in runs]),
            "last_ack_s": summary([r["last_ack_s"] for r in runs]),
            "publish_s": summary([r["publish_s"] for r in runs]),
            "status_s": summary([r["status_s"] for r in runs]),
            "ack_s": summary([x for r in runs for x in r["ack_s"]]),
            "received_s": summary([x for r in runs for x in r["received_s"]]),
        }
        print(f"== N={n}: idle CPU over {args.idle_s:.0f} s", flush=True)
        await asyncio.sleep(1.0)
        a0, b0, t0 = fan.cpu(), _broker_cpu(broker_pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        a1, b1, t1 = fan.cpu(), _broker_cpu(broker_pid), time.perf_counter()
        level["idle"] = {
            "window_s": t1 - t0,
            "agents_pct_core": 100 * (a1 - a0) / (t1 - t0),
            "agents_pct_core_per_agent": 100 * (a1 - a0) / (t1 - t0) / n,
            "broker_pct_core": 100 * (b1 - b0) / (t1 - t0) if broker_pid else None,
            "heartbeat_s": args.heartbeat_s,
        }
    finally:
        await fan.stop()
    level["loadavg_after"] = loadavg()
    _derive(level)
    return level


def _broker_cpu(pid: int | None) -> float:
    return cpu_seconds(pid) if pid else 0.0


def _derive(level: dict[str, Any]) -> None:
    """Ratios of p50s: convergence against the floor and against HTTP fan-outs."""
    floor = level["floor"]["round_trip_s"].get("p50")
    conv = level["rollouts"]["converge_s"].get("p50")
    http = level.get("http", {})
    level["ratios"] = {
        "converge_over_floor": ratio(conv, floor),
        "converge_over_http_concurrent": ratio(conv, http.get("concurrent_s", {}).get("p50")),
        "converge_over_http_sequential": ratio(conv, http.get("sequential_s", {}).get("p50")),
    }


# =========================================================================== report


def report(result: dict[str, Any]) -> str:
    ms = 1e3
    rows, rows2 = [], []
    for lv in result["levels"]:
        r, h, f = lv["rollouts"], lv.get("http", {}), lv["floor"]["round_trip_s"]
        cpu, idle = lv["rollout_cpu"], lv["idle"]
        rows.append(
            [
                lv["n"],
                f["p50"] * ms,
                r["converge_s"]["p50"] * ms,
                r["converge_s"]["p99"] * ms,
                r["ack_s"]["p50"] * ms,
                r["ack_s"]["p99"] * ms,
                h.get("sequential_s", {}).get("p50", 0) * ms or None,
                h.get("concurrent_s", {}).get("p50", 0) * ms or None,
                lv["ratios"]["converge_over_floor"],
                lv["ratios"]["converge_over_http_concurrent"],
            ]
        )
        rows2.append(
            [
                lv["n"],
                lv["agents"]["processes"],
                r["publish_s"]["p50"] * ms,
                r["received_s"]["p50"] * ms,
                r["received_s"]["p99"] * ms,
                cpu["agents_cpu_ms_per_command"],
                lv["n"] * cpu["agents_cpu_ms_per_command"] / (cpu["cores"] or 1),
                cpu["broker_cpu_ms_per_command"],
                cpu["follower_cpu_ms_per_rollout"],
                idle["agents_pct_core"],
                idle["broker_pct_core"],
            ]
        )
    head = [
        "N",
        "floor p50 ms",
        "converge p50 ms",
        "converge p99 ms",
        "ack p50 ms",
        "ack p99 ms",
        "HTTP seq p50 ms",
        "HTTP conc p50 ms",
        "conv/floor",
        "conv/HTTP conc",
    ]
    head2 = [
        "N",
        "procs",
        "publish p50 ms",
        "received p50 ms",
        "received p99 ms",
        "agent CPU ms/cmd",
        "CPU bound ms",
        "broker CPU ms/cmd",
        "follower CPU ms/rollout",
        "idle agents % core",
        "idle broker % core",
    ]
    lines = [table(rows, head), "", table(rows2, head2), ""]
    lines.append("CPU bound: N x agent CPU per command / cores, the least a rollout can take here.")
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({t['detail']})")
    for lv in result["levels"]:
        prof = lv.get("agent_profile")
        if prof:
            lines.append(
                f"\nagent profile at N={lv['n']} (CPU time of the event loops, "
                f"{prof['cpu_ms_per_command']} ms per command):"
            )
            lines.append(
                table(
                    [
                        [x["function"], x["calls"], x["tottime_s"], x["cumtime_s"]]
                        for x in prof["top_tottime"]
                    ],
                    ["function (by tottime)", "calls", "tottime s", "cumtime s"],
                )
            )
            calls = prof.get("calls_per_command", {})
            lines.append(
                "per command, calls and cumulative CPU ms: "
                + ", ".join(
                    f"{name} {per:g} ({ms:g} ms)"
                    for name, (per, ms) in calls.items()
                    if per >= 0.01
                )
            )
    return "\n".join(lines)


def targets(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_n = {lv["n"]: lv for lv in levels}
    out: list[dict[str, Any]] = []
    ref = by_n.get(100) or by_n[max(by_n)]
    r = ref["ratios"]["converge_over_floor"]
    out.append(
        {
            "name": "converge <= 5x floor at N=100"
            + ("" if ref["n"] == 100 else f" (this run: N={ref['n']})"),
            "n": ref["n"],
            "value": r,
            "verdict": "n/a" if r is None else "met" if r <= 5 else "missed",
            "detail": f"N={ref['n']}: {fmt(r)}x",
        }
    )
    http = [lv for lv in levels if lv["n"] >= 100 and "http" in lv] or [
        lv for lv in levels if lv["n"] == max(by_n) and "http" in lv
    ]
    if http:
        values = {lv["n"]: lv["ratios"]["converge_over_http_concurrent"] for lv in http}
        ok = all(v is not None and v < 1 for v in values.values())
        out.append(
            {
                "name": "faster than concurrent HTTP from N>=100"
                + ("" if min(values) >= 100 else f" (this run: N={min(values)})"),
                "values": values,
                "verdict": "met" if ok else "missed",
                "detail": ", ".join(f"N={k}: {fmt(v)}x" for k, v in values.items()),
            }
        )
    top = by_n[max(by_n)]
    out.append(
        {
            "name": f"idle CPU of {top['n']} agents",
            "value": top["idle"]["agents_pct_core"],
            "verdict": "reported",
            "detail": f"{fmt(top['idle']['agents_pct_core'])}% of one core, broker "
            f"{fmt(top['idle']['broker_pct_core'])}%",
        }
    )
    return out


# =========================================================================== main


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="N in 1, 10, 50; fewer repeats.")
    p.add_argument("--tiny", action="store_true", help="N in 1, 3; for the CI smoke test.")
    p.add_argument("--n", type=int, nargs="+", help="Fleet sizes (overrides the mode's).")
    p.add_argument("--repeats", type=int, help="Rollouts per N (after one warm-up).")
    p.add_argument("--floor-repeats", type=int, default=None)
    p.add_argument("--http-repeats", type=int, default=None)
    p.add_argument("--per-process", type=int, default=50, help="Agents per OS process.")
    p.add_argument(
        "--agent-fetch-wait-ms",
        type=int,
        default=None,
        help="What-if: the agents' consumer fetch_max_wait_ms (default: the product's).",
    )
    p.add_argument("--heartbeat-s", type=float, default=3.0, help="Agents' heartbeat period.")
    p.add_argument("--idle-s", type=float, default=None, help="Quiet window for idle CPU.")
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="Where agent journals go (default: a temp dir in /dev/shm).",
    )
    p.add_argument("--no-http", action="store_true", help="Skip the HTTP baseline.")
    p.add_argument(
        "--judge",
        choices=["cli", "every-poll", "cli-fixed", "adaptive"],
        default="adaptive",
        help="When the follower recomputes the status: at most every 100 ms ('cli', the CLI "
        "at 7c3c4c5), after every poll (the CLI before it), the same with the poll cut short, "
        "or at most every 5x the last judgement's cost ('adaptive', default: what the CLI's "
        "--wait does since it was measured here).",
    )
    p.add_argument("--profile", action="store_true", help="cProfile the agents at the largest N.")
    p.add_argument("--profile-rollouts", type=int, default=5)
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--agents-child", help=argparse.SUPPRESS)
    p.add_argument("--http-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mode = mode_of(args.quick, args.tiny)
    defaults = {
        "tiny": ([1, 3], 3, 5, 2, 1.0),
        "quick": ([1, 10, 50], 8, 20, 3, 5.0),
        "full": ([1, 10, 100, 500], 20, 50, 5, 20.0),
    }[mode]
    args.mode = mode
    args.n = args.n or defaults[0]
    args.repeats = args.repeats or defaults[1]
    args.floor_repeats = args.floor_repeats or defaults[2]
    args.http_repeats = args.http_repeats or defaults[3]
    args.idle_s = args.idle_s if args.idle_s is not None else defaults[4]
    return args


async def run(args: argparse.Namespace, broker: Broker, result: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp_name:
        tmp = Path(tmp_name)
        levels = []
        for n in args.n:
            levels.append(await measure_level(broker.bootstrap, broker.pid, n, args, tmp))
    result["levels"] = levels
    result["targets"] = targets(levels)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # aiokafka logs NotLeaderForPartition while a new topic's leader is elected, then retries.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    if args.agents_child:
        asyncio.run(_agent_host(json.loads(args.agents_child)))
        return 0
    if args.http_child:
        asyncio.run(_http_host(json.loads(args.http_child)))
        return 0
    own_state = args.state_dir is None
    if own_state:
        shm = Path("/dev/shm")
        args.state_dir = Path(
            tempfile.mkdtemp(prefix="bench-fanout-state-", dir=shm if shm.is_dir() else None)
        )
    result = envelope("fanout", args.mode, argv)
    result["parameters"] = {
        "n": args.n,
        "repeats": args.repeats,
        "floor_repeats": args.floor_repeats,
        "http_repeats": args.http_repeats,
        "per_process": args.per_process,
        "heartbeat_s": args.heartbeat_s,
        "idle_s": args.idle_s,
        "state_dir": str(args.state_dir),
        "agent_fetch_wait_ms": args.agent_fetch_wait_ms,
        "judge": args.judge,
        "judge_interval_s": JUDGE_INTERVAL_S,
    }
    started = time.perf_counter()
    try:
        with Broker() as broker:  # started outside the event loop: its probe runs its own
            result["broker"] = {"bootstrap": broker.bootstrap, "start_s": broker.start_s}
            print(f"broker up at {broker.bootstrap} in {broker.start_s:.1f} s", flush=True)
            asyncio.run(run(args, broker, result))
    finally:
        if own_state:
            shutil.rmtree(args.state_dir, ignore_errors=True)
    return conclude(result, report(result), args.out_dir, started)


if __name__ == "__main__":
    sys.exit(main())
