"""The instruments: the product's CLI as a subprocess (wall time, peak RSS, exit code, output
bytes, killed at a cap), the coordinator as a child process (start to ready, RSS), timed HTTP
requests, the URLs the dashboard reads for one full update, the API's summary endpoints (probed
in its OpenAPI document), a watcher for false verdicts, and the floor: a bare aiokafka consumer
reading the same topics to their end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from bench.common import REPO_ROOT, bare_consumer, summary

#: Phases a rollout still in progress must never be shown in (its workers are alive).
FALSE_PHASES = {"failed", "timed_out", "aborted"}


# --------------------------------------------------------------------------- processes


def _wait(proc: subprocess.Popen[bytes], cap_s: float) -> tuple[int, Any, bool]:
    """(status, rusage, killed): ``wait4`` for this child's own peak RSS; killed at the cap."""
    deadline = time.monotonic() + cap_s
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage, False
        if time.monotonic() > deadline:
            proc.kill()
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode, usage, True
        time.sleep(0.01)


def cli_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "controlplane", *args]


async def run_cli(args: Sequence[str], cap_s: float, out_dir: Path, name: str) -> dict[str, Any]:
    """``python -m controlplane ARGS`` as a user runs it; stdout to a file (its bytes counted)."""
    out, err = out_dir / f"{name}.out", out_dir / f"{name}.err"
    argv = cli_argv(*args)
    with open(out, "wb") as stdout, open(err, "wb") as stderr:  # noqa: ASYNC230 - local files
        started = time.perf_counter()
        # Popen, not asyncio's: wait4 on its pid gives this child's own peak RSS (asyncio's
        # child watcher would reap it first).
        proc = subprocess.Popen(  # noqa: ASYNC220
            argv, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, cwd=REPO_ROOT
        )
        code, usage, killed = await asyncio.to_thread(_wait, proc, cap_s)
        wall = time.perf_counter() - started
    tail = err.read_text(errors="replace").strip().splitlines()[-3:]
    return {
        "argv": " ".join(["controlplane", *args]),
        "exit_code": code,
        "wall_s": wall,
        "killed_at_cap": killed,
        "max_rss_mb": usage.ru_maxrss / 1024,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "stdout_bytes": out.stat().st_size,
        "stderr_tail": " | ".join(tail)[-600:],
        "stdout_path": str(out),
    }


def _proc_status(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


class Coordinator:
    """``python -m controlplane coordinator`` as a child process, on a free port."""

    def __init__(
        self, bootstrap: str, prefix: str, log_file: Path, env: dict[str, str] | None = None
    ) -> None:
        from controlplane.kafka.launch import free_port

        self.env = {**os.environ, **(env or {})}

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = log_file
        self.argv = cli_argv(
            "coordinator",
            "--bootstrap",
            bootstrap,
            "--topic-prefix",
            prefix,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "WARNING",
        )
        self.proc: subprocess.Popen[bytes] | None = None

    async def start(self, client: httpx.AsyncClient, cap_s: float) -> dict[str, Any]:
        """Start it and poll ``/healthz`` until it says ``ready``: the time and RSS then."""
        with open(self.log_file, "ab") as log:  # noqa: ASYNC230 - a local log file
            started = time.perf_counter()
            self.proc = subprocess.Popen(  # noqa: ASYNC220 - /proc is read by its pid
                self.argv,
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                env=self.env,
            )
        deadline = started + cap_s
        polls = unanswered = 0
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                return {"ready": False, "error": f"exited {self.proc.returncode} (see its log)"}
            polls += 1
            try:
                r = await client.get(f"{self.url}/healthz", timeout=5)
                if r.status_code == 200 and r.json().get("ready"):
                    ready_s = time.perf_counter() - started
                    mem = _proc_status(self.proc.pid)
                    return {
                        "ready": True,
                        "ready_s": ready_s,
                        "rss_mb_at_ready": mem.get("VmRSS", 0) / 2**20,
                        "health": r.json(),
                        "polls": polls,
                        "unanswered_polls": unanswered,
                    }
            except httpx.HTTPError:
                unanswered += 1
            await asyncio.sleep(0.1)
        return {"ready": False, "killed_at_cap": True, "error": f"not ready within {cap_s:g} s"}

    async def snapshot_written(self, client: httpx.AsyncClient, cap_s: float) -> dict[str, Any]:
        """Poll ``/healthz`` until this coordinator has written a snapshot of its fold."""
        started = time.perf_counter()
        while time.perf_counter() - started < cap_s:
            try:
                info = (await client.get(f"{self.url}/healthz", timeout=5)).json()["snapshot"]
            except (httpx.HTTPError, KeyError, ValueError):
                info = {}
            if info.get("written"):
                return {"written": True, "waited_s": time.perf_counter() - started, "info": info}
            await asyncio.sleep(0.5)
        return {"written": False, "error": f"no snapshot written within {cap_s:g} s"}

    def memory(self) -> dict[str, float]:
        if self.proc is None:
            return {}
        mem = _proc_status(self.proc.pid)
        return {"rss_mb": mem.get("VmRSS", 0) / 2**20, "peak_rss_mb": mem.get("VmHWM", 0) / 2**20}

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------------- HTTP


async def timed_get(client: httpx.AsyncClient, url: str, timeout_s: float) -> dict[str, Any]:
    """One GET: seconds, bytes, status (or the error)."""
    t0 = time.perf_counter()
    try:
        r = await client.get(url, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return {"s": time.perf_counter() - t0, "bytes": 0, "status": None, "error": repr(exc)}
    return {"s": time.perf_counter() - t0, "bytes": len(r.content), "status": r.status_code}


async def sample(
    client: httpx.AsyncClient, url: str, n: int, budget_s: float, timeout_s: float
) -> dict[str, Any]:
    """Up to ``n`` sequential GETs, fewer when ``budget_s`` is spent (at least two)."""
    runs: list[dict[str, Any]] = []
    started = time.perf_counter()
    while len(runs) < n and (len(runs) < 2 or time.perf_counter() - started < budget_s):
        runs.append(await timed_get(client, url, timeout_s))
        if runs[-1]["status"] is None and len(runs) >= 2:
            break  # unanswered twice in a row would only repeat the timeout
    return _summarize(url, runs)


def _summarize(url: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r["status"] == 200]
    return {
        "url": url,
        "samples": len(runs),
        "ok": len(ok),
        "statuses": sorted({str(r["status"]) for r in runs}),
        "errors": [r["error"] for r in runs if "error" in r][:3],
        "s": summary([r["s"] for r in ok]),
        "bytes": max((r["bytes"] for r in ok), default=None),
    }


def dashboard_paths(selected: str) -> list[str]:
    """What the dashboard (controlplane/api/static/dashboard.html) reads for one update that
    changed the fleet's counts, with rollout ``selected`` open: the fleet in counts (here the
    stream's snapshot, read once; live, a delta carries only what changed), the first page of
    workers problems first, and the open rollout's two pages of workers (failed, rejected and
    lost; then the others)."""
    detail = f"/api/v1/rollouts/{selected}/workers"
    return [
        "/api/v1/events?once=true",
        "/api/v1/workers?order=problems&limit=50",
        f"{detail}?state=failed&state=rejected&state=lost&limit=50",
        f"{detail}?state=running&state=accepted&state=pending&state=succeeded&limit=50",
    ]


async def dashboard_update(
    client: httpx.AsyncClient, base: str, urls: list[str], timeout_s: float
) -> dict[str, Any]:
    """One full dashboard update (``dashboard_paths``): ``/healthz`` first if listed, then the
    rest together."""
    t0 = time.perf_counter()
    first = [u for u in urls if u == "/healthz"]
    rest = [u for u in urls if u != "/healthz"]
    runs = [await timed_get(client, base + u, timeout_s) for u in first]
    runs += await asyncio.gather(*(timed_get(client, base + u, timeout_s) for u in rest))
    return {
        "s": time.perf_counter() - t0,
        "bytes": sum(r["bytes"] for r in runs),
        "per_url": {u: {"s": r["s"], "bytes": r["bytes"]} for u, r in zip(urls, runs, strict=True)},
        "ok": all(r["status"] == 200 for r in runs),
    }


async def summary_endpoints(client: httpx.AsyncClient, base: str, rollout_id: str) -> list[str]:
    """GET paths of the API whose path names a summary, from its OpenAPI document (path
    parameters naming a rollout filled with ``rollout_id``; others skipped)."""
    try:
        r = await client.get(f"{base}/openapi.json", timeout=30)
        paths: dict[str, Any] = r.json().get("paths", {})
    except (httpx.HTTPError, ValueError):
        return []
    out = []
    for path, ops in paths.items():
        if "get" not in ops or "summary" not in path.lower():
            continue
        filled = re.sub(r"\{rollout[_a-z]*\}", rollout_id, path)
        if "{" not in filled:
            out.append(filled)
    return out


async def api_paths(client: httpx.AsyncClient, base: str) -> list[str]:
    try:
        r = await client.get(f"{base}/openapi.json", timeout=30)
        return sorted(r.json().get("paths", {}))
    except (httpx.HTTPError, ValueError):
        return []


def count_of(body: Any) -> int | None:
    """How many items a list endpoint returned: a plain list, or a page with a total."""
    if isinstance(body, list):
        return len(body)
    if isinstance(body, dict):
        for key in ("total", "count", "matched"):
            if isinstance(body.get(key), int):
                return int(body[key])
        for key in ("items", "workers", "data"):
            if isinstance(body.get(key), list):
                return len(body[key])
    return None


class Watcher:
    """Polls the count of alive workers (every page of ``/api/v1/workers?alive=true``) and an
    in-progress rollout's phase, one request at a time, and records every false verdict: fewer
    than N alive, or that rollout shown ended."""

    def __init__(
        self, client: httpx.AsyncClient, base: str, n: int, live_id: str, acked_at: float
    ) -> None:
        from controlplane.rollout.fleet import DEFAULT_PROGRESS_DEADLINE_S

        self.client, self.base, self.n, self.live_id = client, base, n, live_id
        #: A rollout without an ack for the progress deadline times out by the product's rule:
        #: from then on ``timed_out / PROGRESS_DEADLINE_EXCEEDED`` is no false verdict.
        self.deadline_at = acked_at + DEFAULT_PROGRESS_DEADLINE_S
        self.past_deadline = 0
        self.polls = 0
        self.unanswered = 0
        self.alive_low: list[dict[str, Any]] = []
        self.phase_false: list[dict[str, Any]] = []
        self.slowest_s = 0.0
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.perf_counter()

    def start(self, t0: float) -> None:
        self._t0 = t0
        self._task = asyncio.create_task(self._run())

    async def _get(self, path: str) -> Any:
        t = time.perf_counter()
        try:
            r = await self.client.get(self.base + path, timeout=120)
            body = r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            body = None
        self.slowest_s = max(self.slowest_s, time.perf_counter() - t)
        if body is None:
            self.unanswered += 1
        return body

    async def _count(self, path: str) -> int | None:
        """Items of a list endpoint over all its pages (``Link: <...>; rel="next"``)."""
        total, url = 0, self.base + path
        t = time.perf_counter()
        try:
            for _ in range(10_000):
                r = await self.client.get(url, timeout=120)
                count = count_of(r.json()) if r.status_code == 200 else None
                if count is None:
                    self.unanswered += 1
                    return None
                total += count
                nxt = re.search(r'<([^>]+)>\s*;\s*rel="?next"?', r.headers.get("link", ""))
                if nxt is None:
                    break
                url = nxt.group(1) if "://" in nxt.group(1) else self.base + nxt.group(1)
        except (httpx.HTTPError, ValueError):
            self.unanswered += 1
            return None
        finally:
            self.slowest_s = max(self.slowest_s, time.perf_counter() - t)
        return total

    async def _run(self) -> None:
        while True:
            self.polls += 1
            at = round(time.perf_counter() - self._t0, 2)
            epoch = round(time.time(), 3)
            alive = await self._count("/api/v1/workers?alive=true")
            if alive is not None and alive < self.n:
                self.alive_low.append({"t_s": at, "at": epoch, "alive": alive})
            status = await self._get(f"/api/v1/rollouts/{self.live_id}")
            deadline = (
                isinstance(status, dict)
                and status.get("reason") == "PROGRESS_DEADLINE_EXCEEDED"
                and epoch >= self.deadline_at
            )
            self.past_deadline += bool(deadline)
            if isinstance(status, dict) and status.get("phase") in FALSE_PHASES and not deadline:
                self.phase_false.append(
                    {
                        "t_s": at,
                        "at": epoch,
                        "phase": status.get("phase"),
                        "reason": status.get("reason"),
                    }
                )
            await asyncio.sleep(1.0)

    async def stop(self) -> dict[str, Any]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return {
            "polls": self.polls,
            "unanswered": self.unanswered,
            "slowest_poll_s": self.slowest_s,
            "alive_below_n": self.alive_low[:20],
            "alive_below_n_count": len(self.alive_low),
            "in_progress_shown_ended": self.phase_false[:20],
            "in_progress_shown_ended_count": len(self.phase_false),
            "timed_out_past_progress_deadline": self.past_deadline,
        }


async def healthz_during(
    client: httpx.AsyncClient, base: str, big_url: str, timeout_s: float
) -> dict[str, Any]:
    """``/healthz`` latencies (one at a time) while one ``big_url`` response is being built."""
    big = asyncio.create_task(timed_get(client, base + big_url, timeout_s))
    await asyncio.sleep(0)  # the big request is sent first
    latencies: list[float] = []
    while True:  # at least one, however fast the big one is
        r = await timed_get(client, f"{base}/healthz", timeout_s)
        latencies.append(r["s"])
        if big.done():
            break
    built = await big
    return {"big_url": big_url, "big_s": built["s"], "healthz_s": summary(latencies)}


# --------------------------------------------------------------------------- the floor


async def read_bare(settings: Any, cap_s: float) -> dict[str, Any]:
    """A bare ``AIOKafkaConsumer`` (the product's client options, read_committed) reading every
    topic from the beginning to the end offsets it saw at start: the floor of any replay."""
    from aiokafka import TopicPartition

    consumer = bare_consumer(settings)
    started = time.perf_counter()
    await consumer.start()
    try:
        tps = []
        for topic in settings.topics.all():
            parts = consumer.partitions_for_topic(topic.name)
            if parts is None:
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic.name) or set()
            tps += [TopicPartition(topic.name, p) for p in sorted(parts)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        await consumer.seek_to_beginning()
        count = 0
        by_topic: dict[str, int] = {}
        deadline = started + cap_s
        while time.perf_counter() < deadline:
            pending = [tp for tp in tps if await consumer.position(tp) < ends[tp]]
            if not pending:
                break
            batches = await consumer.getmany(*pending, timeout_ms=500)
            for tp, msgs in batches.items():
                count += len(msgs)
                by_topic[tp.topic] = by_topic.get(tp.topic, 0) + len(msgs)
        elapsed = time.perf_counter() - started
    finally:
        await consumer.stop()
    return {
        "records": count,
        "by_topic": by_topic,
        "end_offsets": sum(ends.values()),
        "elapsed_s": elapsed,
        "killed_at_cap": elapsed >= cap_s,
    }
