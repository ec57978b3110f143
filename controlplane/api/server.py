"""Serving the coordinator's API with uvicorn, programmatically: no signals of its own, port 0 for tests.

The entry point (CLI) owns signals and process settings.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.coordinator.service import Coordinator
from controlplane.kafka.lifecycle import AsyncService
from controlplane.wire.errors import ControlPlaneError, LocalCode

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- serving


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: signals belong to the entry point."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer(AsyncService):
    """``async with ApiServer(coordinator, port=0) as s:`` serves on ``s.port`` until the block ends.

    Binds the socket itself (port 0 picks a free one), runs uvicorn with lifespan off and no
    signal handlers. Stopping ends the SSE streams, then lets requests drain for ``graceful_s``.
    """

    def __init__(
        self,
        coordinator: Coordinator,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        app: FastAPI | None = None,
        graceful_s: int = 5,
    ) -> None:
        self.app = app if app is not None else create_app(coordinator)
        self.host = host
        self._requested_port = port
        self._graceful_s = graceful_s
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._port: int | None = None

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the server is not started")
        return self._port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        if self._task is not None:
            return
        sock = _listen(self.host, self._requested_port)
        self._port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            log_config=None,
            access_log=False,
            ws="none",
            timeout_graceful_shutdown=self._graceful_s,
        )
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="api-server")
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # raises what failed it
                raise RuntimeError("the HTTP server exited during start-up")
            await asyncio.sleep(0.01)
        log.info("HTTP API and dashboard on %s", self.url)

    async def stop(self) -> None:
        """End SSE streams, stop accepting, drain; idempotent."""
        self.app.state.closing.set()
        self.app.state.summaries.close()
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), self._graceful_s + 5.0)
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def wait(self) -> None:
        """Until the server stops by itself (it does not, unless it fails)."""
        if self._task is not None:
            await asyncio.shield(self._task)


def _listen(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
            0
        ][0]
        return socket.create_server((host, port), family=family)
    except OSError as exc:
        raise ControlPlaneError(
            f"cannot listen on {host}:{port}: {exc}", code=LocalCode.PORT_IN_USE
        ) from exc


async def serve(
    coordinator: Coordinator, host: str, port: int, *, app: FastAPI | None = None
) -> None:
    """Serve the API until cancelled; on cancel, drain (see :class:`ApiServer`) and re-raise."""
    async with ApiServer(coordinator, host, port, app=app) as server:
        await server.wait()
