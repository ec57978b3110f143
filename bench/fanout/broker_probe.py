"""The broker's own view of a fleet of readers: its metrics over JMX, its CPU, RSS and sockets.

``--broker-probe`` takes a :func:`snapshot` of the run's broker at a few moments of each fleet
size (agents started, before and after the timed rollouts, before and after the idle window) and
:func:`between` turns two of them into rates: requests per second by type (Fetch, Produce =
heartbeats when idle, OffsetCommit), CPU, connection count, incremental fetch sessions and their
evictions. The metrics are read by ``JmxProbe.java`` (next to this file, compiled once into a
temporary directory with ``javac``), which attaches to the broker's JVM by pid: no JMX port is
opened on the broker. Where Java cannot attach, the snapshot says why and holds the rest.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import cpu_seconds

PATTERNS = (
    "kafka.server:type=FetchSessionCache,*",
    "kafka.server:type=socket-server-metrics,listener=PLAINTEXT,*",
    "kafka.network:type=RequestMetrics,name=RequestsPerSec,*",
    "kafka.network:type=SocketServer,name=NetworkProcessorAvgIdlePercent",
    "kafka.server:type=KafkaRequestHandlerPool,name=RequestHandlerAvgIdlePercent",
    "kafka.server:type=group-coordinator-metrics,*",
    "kafka.log:type=Log,name=Size,topic=__consumer_offsets,*",
)
_SOURCE = Path(__file__).with_name("JmxProbe.java")
_classes: Path | None = None


def _compiled() -> Path:
    global _classes
    if _classes is None:
        out = Path(tempfile.mkdtemp(prefix="bench-jmxprobe-"))
        atexit.register(shutil.rmtree, out, True)
        subprocess.run(
            ["javac", "-d", str(out), str(_SOURCE)], check=True, capture_output=True, timeout=120
        )
        _classes = out
    return _classes


def jmx(pid: int) -> dict[tuple[str, str], float]:
    """Every numeric attribute of the :data:`PATTERNS` MBeans: ``(mbean, attribute) -> value``."""
    proc = subprocess.run(
        ["java", "-cp", str(_compiled()), "JmxProbe", str(pid), *PATTERNS],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"JmxProbe exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
    values: dict[tuple[str, str], float] = {}
    for line in proc.stdout.splitlines():
        name, attr, value = line.split("\t")
        values[(name, attr)] = float(value)
    return values


def _status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss_mb(pid: int) -> float:
    return _status_kb(pid, "VmRSS") / 1024


def digest(raw: dict[tuple[str, str], float]) -> dict[str, Any]:
    """The figures the scaling doc needs, out of the raw MBean attributes."""
    requests: dict[str, float] = defaultdict(float)
    groups: dict[str, float] = {}
    out: dict[str, Any] = {
        "connections": 0.0,
        "connections_created": 0.0,
        "bytes_out": 0.0,
        "bytes_in": 0.0,
        "offsets_log_bytes": 0.0,
    }
    for (name, attr), value in raw.items():
        if "name=RequestsPerSec" in name and attr == "Count":
            match = re.search(r"request=([A-Za-z]+)", name)
            if match:
                requests[match.group(1)] += value
        elif "type=socket-server-metrics" in name:
            if attr == "connection-count":
                out["connections"] += value
            elif attr == "connection-creation-total":
                out["connections_created"] += value
            elif attr == "outgoing-byte-total":
                out["bytes_out"] += value
            elif attr == "incoming-byte-total":
                out["bytes_in"] += value
        elif "NumIncrementalFetchSessions" in name:
            out["fetch_sessions"] = value
        elif "NumIncrementalFetchPartitionsCached" in name:
            out["fetch_partitions_cached"] = value
        elif "IncrementalFetchSessionEvictionsPerSec" in name and attr == "Count":
            out["fetch_session_evictions"] = value
        elif "NetworkProcessorAvgIdlePercent" in name:
            out["network_idle"] = value
        elif "RequestHandlerAvgIdlePercent" in name and attr == "OneMinuteRate":
            out["handler_idle_1m"] = value
        elif "group-coordinator-metrics" in name and re.search(r"count|total", attr):
            tags = name.split(",", 1)[1] if "," in name else ""
            groups[f"{attr}{{{tags}}}"] = value
        elif "topic=__consumer_offsets" in name and attr == "Value":
            out["offsets_log_bytes"] += value
    out["requests"] = dict(requests)
    out["group_coordinator"] = groups
    return out


def snapshot(pid: int | None) -> dict[str, Any]:
    """The broker now: CPU seconds, RSS, open descriptors and its metrics (or why none)."""
    if pid is None:
        return {"error": "no broker pid"}
    snap: dict[str, Any] = {
        "t": time.monotonic(),
        "cpu_s": cpu_seconds(pid),
        "rss_mb": rss_mb(pid),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "nofile_limit": _nofile(pid),
        "listen_overflows": _listen_overflows(),
    }
    try:
        snap.update(digest(jmx(pid)))
    except (OSError, RuntimeError, subprocess.SubprocessError, ValueError) as exc:
        snap["jmx_error"] = str(exc)
    # The JMX read takes a moment: CPU and time are taken again, so a window between two
    # snapshots starts and ends after their reads.
    snap["t"], snap["cpu_s"] = time.monotonic(), cpu_seconds(pid)
    return snap


def _listen_overflows() -> int | None:
    """The kernel's count of connections dropped because a listen backlog was full (all
    sockets of the machine: ``nstat TcpExtListenOverflows``)."""
    lines = Path("/proc/net/netstat").read_text().splitlines()
    for head, values in zip(lines[::2], lines[1::2], strict=False):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split(), values.split(), strict=True))["ListenOverflows"])
    return None


def _nofile(pid: int) -> int | None:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    return None


def between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Rates from snapshot ``a`` to ``b``: requests/s by type, broker % of a core."""
    window = b["t"] - a["t"]
    out: dict[str, Any] = {
        "window_s": window,
        "broker_pct_core": 100 * (b["cpu_s"] - a["cpu_s"]) / window,
    }
    ra, rb = a.get("requests"), b.get("requests")
    if ra is not None and rb is not None:
        out["requests"] = {k: rb[k] - ra.get(k, 0.0) for k in rb if rb[k] - ra.get(k, 0.0) > 0}
        out["requests_per_s"] = {k: v / window for k, v in out["requests"].items()}
    for key in (
        "fetch_session_evictions",
        "connections_created",
        "bytes_out",
        "bytes_in",
        "offsets_log_bytes",
        "listen_overflows",
    ):
        if a.get(key) is not None and b.get(key) is not None:
            out[key] = b[key] - a[key]
    return out
