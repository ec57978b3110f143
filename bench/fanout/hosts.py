"""The child processes: agents in one process, bare workers in another, N HTTP endpoints in
another (JSON lines on stdout, commands on stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import json
import sys
import time
from pathlib import Path
from typing import Any


async def agent_host(cfg: dict[str, Any]) -> None:
    """Run ``cfg['workers']`` agents in this process until told to stop on stdin."""
    from controlplane.kafka.settings import KafkaSettings
    from workers.agent.loop import Agent
    from workers.agent.settings import WorkerSettings
    from workers.runners.fake_runner import FakeRunner

    if cfg.get("what_ifs"):
        from bench.fanout.whatif import apply_what_ifs

        apply_what_ifs(cfg["what_ifs"])
    if cfg.get("fetch_wait_ms") is not None:
        # A what-if for a product change: the agent's command consumer long-polls longer.
        import workers.agent.loop

        # The agent passes fetch_max_wait_ms itself, so the what-if must override the call's
        # keyword (a functools.partial's keyword loses to the call's).
        consumer = workers.agent.loop.Consumer  # type: ignore[attr-defined]
        wait_ms = cfg["fetch_wait_ms"]

        def longer_poll(*args: Any, **kwargs: Any) -> Any:
            return consumer(*args, **{**kwargs, "fetch_max_wait_ms": wait_ms})

        workers.agent.loop.Consumer = longer_poll  # type: ignore[attr-defined,assignment]
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
    waited: list[asyncio.Future[Any]] = [ready, *tasks]
    await asyncio.wait(waited, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():
        for task in tasks:
            if task.done() and task.exception() is not None:
                raise RuntimeError(f"an agent died while starting: {task.exception()!r}")
        raise RuntimeError("an agent ended while starting")
    _say({"ready": len(agents), "start_s": round(time.perf_counter() - started, 3)})

    await _serve_stdin()
    for agent in agents:
        agent.request_stop()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    _say({"stopped": sum(sum(a.outcomes.values()) for a in agents)})


async def bare_host(cfg: dict[str, Any]) -> None:
    """Run ``cfg['workers']`` bare workers (bench.fanout.bare) in this process, as
    :func:`agent_host` runs agents: started together, then until told to stop on stdin."""
    from bench.fanout.bare import BareWorker

    workers = [BareWorker(cfg["bootstrap"], cfg["prefix"], w) for w in cfg["workers"]]
    started = time.perf_counter()
    await asyncio.gather(*(w.start() for w in workers))
    stop = asyncio.Event()
    tasks = [asyncio.create_task(w.run(stop)) for w in workers]
    _say({"ready": len(workers), "start_s": round(time.perf_counter() - started, 3)})
    await _serve_stdin()
    stop.set()
    for task in tasks:  # each may be waiting up to FETCH_TIMEOUT_MS for a command
        task.cancel()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
    await asyncio.gather(*(w.close() for w in workers), return_exceptions=True)
    _say({"stopped": sum(w.acked for w in workers)})


async def _serve_stdin() -> None:
    """The parent's commands, until "stop" (or EOF): ``profile-on``, ``profile-off PATH``."""
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
            return


def _say(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def http_host(cfg: dict[str, Any]) -> None:
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
