"""Shared helpers of the benchmarks: machine facts, result files, tables, a private broker, CPU/RSS,
the run's skeleton (arguments, logging, a journal directory, the broker around the run) and
child processes speaking JSON lines.

Every benchmark writes ``bench/results/<name>-<timestamp>.json`` (git-ignored) holding the
commit, the date, the machine and the load average next to its numbers, so a noisy run shows.
Nothing here asserts on times: the benchmarks measure, they do not test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- machine and run facts


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded (noise shows here first)."""
    return [round(x, 2) for x in os.getloadavg()]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_total_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and Python: what a reader needs to compare two result files."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "ram_gb": round(_mem_total_bytes() / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "platform": platform.platform(terse=True),
    }


def git_commit() -> dict[str, Any]:
    """HEAD's hash and whether the work tree differs from it."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=30
        ).stdout.strip()

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def envelope(name: str, mode: str, argv: Sequence[str]) -> dict[str, Any]:
    """The common head of every result file; ``loadavg_start`` is taken now."""
    return {
        "benchmark": name,
        "mode": mode,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, "-m", f"bench.{name}", *argv]),
        **git_commit(),
        "machine": machine(),
        "loadavg_start": loadavg(),
    }


def write_results(result: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Stamp the end load average and write ``<out_dir>/<name>-<timestamp>.json``."""
    result["loadavg_end"] = loadavg()
    directory = out_dir or DEFAULT_OUT_DIR
    directory.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    path = directory / f"{result['benchmark']}-{stamp}.json"
    n = 1
    while path.exists():
        n += 1
        path = directory / f"{result['benchmark']}-{stamp}-{n}.json"
    path.write_text(json.dumps(result, indent=2, sort_keys=False, default=str) + "\n")
    return path


def conclude(result: dict[str, Any], report: str, out_dir: Path | None, started: float) -> int:
    """End a run: its elapsed time, the printed report, the JSON file and a closing line."""
    result["elapsed_s"] = time.perf_counter() - started
    print()
    print(report)
    path = write_results(result, out_dir)
    print(
        f"\nloadavg {result['loadavg_start']} -> {result['loadavg_end']}; "
        f"{result['elapsed_s']:.0f} s; results: {path}"
    )
    return 0


def mode_of(quick: bool, tiny: bool) -> str:
    return "tiny" if tiny else "quick" if quick else "full"


# --------------------------------------------------------------------------- numbers and tables


def summary(values: Sequence[float]) -> dict[str, float | int]:
    """n, mean, min, p50, p90, p99, max (nearest-rank percentiles; p99 of 20 samples is the max)."""
    if not values:
        return {"n": 0}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]

    return {
        "n": len(ordered),
        "mean": statistics.fmean(ordered),
        "min": ordered[0],
        "p50": rank(50),
        "p90": rank(90),
        "p99": rank(99),
        "max": ordered[-1],
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A plain text table (also valid Markdown)."""
    cells = [[str(h) for h in headers], *[[fmt(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


# --------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Broker:
    """A private Apache Kafka broker on free ports in a temporary data dir (stopped on exit)."""

    def __init__(self, heap_mb: int = 1024) -> None:
        from controlplane.kafka.broker import BrokerConfig, LocalBroker
        from controlplane.kafka.launch import free_port

        self._tmp = tempfile.TemporaryDirectory(prefix="bench-kafka-")
        self.broker = LocalBroker(
            BrokerConfig(
                port=free_port(),
                controller_port=free_port(),
                data_dir=Path(self._tmp.name),
                heap_mb=heap_mb,
            )
        )
        self.bootstrap = self.broker.bootstrap
        self.pid: int | None = None
        self.start_s = 0.0

    def __enter__(self) -> Broker:
        started = time.perf_counter()
        try:
            self.pid = self.broker.start(timeout=180).pid
        except BaseException:
            self._tmp.cleanup()
            raise
        self.start_s = time.perf_counter() - started
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.broker.stop()
        finally:
            self._tmp.cleanup()


async def ensure_topics(bootstrap: str, prefix: str) -> Any:
    """KafkaSettings for a fresh set of the three topics under ``prefix``."""
    from controlplane.kafka.bus import Admin
    from controlplane.kafka.settings import KafkaSettings

    settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix, client_id="bench")
    async with Admin(settings) as admin:
        await admin.ensure_topics(settings.topics)
    return settings


# --------------------------------------------------------------------------- memory


def rss() -> tuple[int, int]:
    """(anonymous, file-backed) resident bytes of this process."""
    anon = file = 0
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
            elif line.startswith("RssFile:"):
                file = int(line.split()[1]) * 1024
    return anon, file


@contextlib.contextmanager
def peak_rss(interval_s: float = 0.001) -> Iterator[dict[str, int]]:
    """Sample RSS from a thread; the yielded dict holds the peak growth (bytes) on exit."""
    base_anon, base_file = rss()
    out = {"anon": 0, "file": 0, "total": 0}
    stop = threading.Event()

    def sample() -> None:
        while True:
            anon, file = rss()
            out["anon"] = max(out["anon"], anon - base_anon)
            out["file"] = max(out["file"], file - base_file)
            out["total"] = max(out["total"], anon + file - base_anon - base_file)
            if stop.wait(interval_s):
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join()


# --------------------------------------------------------------------------- the run's skeleton


def argument_parser(package: ModuleType) -> argparse.ArgumentParser:
    """A parser named ``python -m <package>``, described by the first line of its docstring."""
    return argparse.ArgumentParser(
        prog=f"python -m {package.__name__}", description=(package.__doc__ or "").splitlines()[0]
    )


def quiet_logging() -> None:
    """Warnings only; aiokafka's NotLeaderForPartition while a new topic's leader is elected
    (it retries) is silenced."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


@contextlib.contextmanager
def state_dir(given: Path | None, prefix: str) -> Iterator[Path]:
    """``given``, or a temporary directory in /dev/shm (removed on exit) for agent journals."""
    if given is not None:
        yield given
        return
    shm = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=shm if shm.is_dir() else None))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_on_broker(
    result: dict[str, Any],
    run: Callable[[Broker], Coroutine[Any, Any, None]],
    report: Callable[[dict[str, Any]], str],
    out_dir: Path | None,
) -> int:
    """Start a private broker (outside the event loop: its probe runs its own), run ``run`` on
    it, stop it, then print ``report(result)`` and write the result file."""
    started = time.perf_counter()
    with Broker() as broker:
        result["broker"] = {"bootstrap": broker.bootstrap, "start_s": broker.start_s}
        print(f"broker up at {broker.bootstrap} in {broker.start_s:.1f} s", flush=True)
        asyncio.run(run(broker))
    return conclude(result, report(result), out_dir, started)


class Child:
    """A child process ``python -m <module> --<role> <cfg JSON>`` speaking JSON lines on stdout,
    taking commands on stdin (``stop`` ends it); its stderr goes to a log file."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name

    @classmethod
    async def start(cls, module: str, role: str, cfg: dict[str, Any], log_file: Path) -> Child:
        with open(log_file, "ab") as err:  # noqa: ASYNC230 - a local log file
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                module,
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


def say(message: dict[str, Any]) -> None:
    """A child's answer to its parent: one JSON line on stdout."""
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def bare_consumer(settings: Any) -> Any:
    """An ``AIOKafkaConsumer`` with the Follower's client and fetch settings (read_committed,
    4 MiB a partition): the floor of any replay, counting records and nothing else."""
    from aiokafka import AIOKafkaConsumer

    from controlplane.kafka.bus import client_options

    return AIOKafkaConsumer(
        **client_options(settings),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        max_partition_fetch_bytes=4 * 1024 * 1024,
        fetch_max_wait_ms=100,
        isolation_level="read_committed",
    )
