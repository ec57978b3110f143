"""What a local node and a local cluster share: ``with`` over start/stop, the wait until the
cluster answers, process and port checks, the cluster id and the cache directory."""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Self

if TYPE_CHECKING:
    from controlplane.kafka.admin import ClusterInfo
    from controlplane.kafka.settings import KafkaSettings


def default_cache_dir() -> Path:
    base = os.environ.get("FLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fleet-controlplane"
    )
    return Path(base)


class Launched:
    """``with`` over start() and stop(): a local node, or a cluster of them."""

    def start(self, *, timeout: float = 90.0) -> object:
        raise NotImplementedError

    def stop(self, *, timeout: float = 30.0) -> bool:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def wait_for_metadata(
    timeout: float,
    exited: Callable[[], None],
    address: Callable[[], str | None],
    enough: Callable[[ClusterInfo], bool],
    *,
    probe: Callable[[str], ClusterInfo] | None = None,
) -> str | None:
    """Poll until a metadata request to ``address()`` (None: no port open yet) answers ``enough``;
    None then, else (at ``timeout``) the last error. ``exited()`` raises when a process died.
    ``probe(bootstrap)`` asks (default: a plaintext :func:`~controlplane.kafka.admin.probe_sync`)."""
    from controlplane.kafka.admin import probe_sync  # the one place that speaks Kafka

    ask = probe or (lambda bootstrap: probe_sync(bootstrap, timeout=5.0))

    deadline = time.monotonic() + timeout
    last_error = ""
    while time.monotonic() < deadline:
        exited()
        bootstrap = address()
        if bootstrap is not None:
            try:
                if enough(ask(bootstrap)):
                    return None
            except Exception as exc:  # not ready yet: keep polling until the deadline
                last_error = str(exc)
        time.sleep(0.25)
    return last_error


def probe_as(settings: KafkaSettings, bootstrap: str, *, timeout: float = 5.0) -> ClusterInfo:
    """What the cluster at ``bootstrap`` says of itself, asked with ``settings``' security (a
    secured broker answers only a client that authenticates)."""
    from controlplane.kafka.admin import Admin, ClusterInfo

    async def ask() -> ClusterInfo:
        async with asyncio.timeout(timeout), Admin(settings) as admin:
            info = await admin._admin.describe_cluster()
        return ClusterInfo(
            bootstrap=bootstrap,
            brokers=len(info.get("brokers", [])),
            controller_id=info.get("controller_id"),
            cluster_id=info.get("cluster_id"),
        )

    return asyncio.run(ask())


def new_cluster_id() -> str:
    """A random KRaft cluster id (22 characters of base64url, as kafka-storage random-uuid)."""
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


def alive(pid: int, proc: subprocess.Popen[bytes] | None = None) -> bool:
    if proc is not None and proc.pid == pid:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of another process still answers kill(0); check /proc where we can.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return True


def free_port() -> int:
    """A local TCP port nothing listens on now (bound and released: another process may still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def read_stripped(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def indented_tail(lines: list[str], n: int) -> str:
    return "\n".join("    " + line for line in lines[-n:])
