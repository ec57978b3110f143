"""Measures the dashboard in headless Chromium at fleet scale (see the package's docstring)."""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
from selenium.webdriver import Chrome
from selenium.webdriver.support.ui import WebDriverWait

import bench.dashboard as package
from bench.common import argument_parser, conclude, envelope, fmt, quiet_logging, ratio, table
from bench.dashboard.devtools import NetworkLog, Transfer, per_update
from controlplane.api.server import ApiServer
from controlplane.coordinator.follower import Batch
from controlplane.wire.protocol import AckState
from tests.browser.chrome import chrome
from tests.fleet_at_scale import Served, _acks, _fold, heartbeat, rollout_command, worker_ids

MILESTONES = ("page_ms", "events_sent_ms", "events_ms", "workers_ms", "ready_ms")
#: Issue 15's targets.
TARGET_UPDATE_BYTES = 100_000
TARGET_FIRST_RENDER_MS = 1000.0

MODES: dict[str, dict[str, Any]] = {
    "quick": {"workers": 300, "rollouts": 15, "active": 3, "loads": 1, "observe_s": 8.0},
    "full": {"workers": 1000, "rollouts": 50, "active": 5, "loads": 5, "observe_s": 60.0},
}

#: Added before the page's own scripts: when data-ready became "1" (ms from navigation start,
#: and wall-clock ms) and each new value of data-updates (wall-clock ms).
MARKS = """
(() => {
  const marks = (window.__bench = {origin: performance.timeOrigin, ready: null, updates: []});
  const wall = () => performance.timeOrigin + performance.now();
  const look = () => {
    const html = document.documentElement;
    if (!html) return;
    if (marks.ready === null && html.getAttribute('data-ready') === '1')
      marks.ready = {ms: performance.now(), wall: wall(), updates: html.getAttribute('data-updates')};
    const n = html.getAttribute('data-updates');
    const last = marks.updates[marks.updates.length - 1];
    if (n !== null && (!last || last.n !== n)) marks.updates.push({n: n, wall: wall()});
  };
  new MutationObserver(look).observe(document, {
    subtree: true, attributes: true, attributeFilter: ['data-ready', 'data-updates']});
})();
"""


class Feed:
    """What changes while the page is open: heartbeats (every worker every 3 s) and, every
    second, ten more workers of each rollout in progress succeeding (one in a hundred fails)."""

    def __init__(self, served: Served, rollouts: int, active: int) -> None:
        self.served = served
        self.ids = worker_ids(served.workers)
        settled = f"v{max(0, rollouts - active - 1)}"
        self.versions = dict.fromkeys(self.ids, settled)
        self.active = list(range(rollouts - active, rollouts))
        # The workers build() left running in each rollout in progress: every odd one.
        self.running = {r: self.ids[1::2] for r in self.active}
        self.commands = {r: rollout_command(r, rollouts, self.ids) for r in self.active}
        self.acks = 0

    async def heartbeats(self) -> None:
        n, i, step = len(self.ids), 0, max(1, len(self.ids) // 10)
        while True:
            batch = Batch()
            for _ in range(step):
                worker = self.ids[i % n]
                batch.heartbeats.append(
                    heartbeat(worker, i % n, self.served.clock(), self.versions[worker])
                )
                i += 1
            _fold(self.served.coordinator, batch)
            await asyncio.sleep(0.3)

    async def progress(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            batch = Batch()
            for r in self.active:
                done, self.running[r] = self.running[r][:10], self.running[r][10:]
                for worker in done:
                    failed = int(worker[1:]) % 100 == 1
                    states = (AckState.SUCCEEDED,)
                    batch.acks.extend(_acks(self.commands[r], worker, states, failed=failed))
                    if not failed:
                        self.versions[worker] = f"v{r}"
            self.acks += len(batch.acks)
            _fold(self.served.coordinator, batch)


def response_bytes(response: httpx.Response) -> int:
    """Bytes on the wire: status line, headers, body."""
    head = len(f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n") + 2
    head += sum(len(k) + len(v) + 4 for k, v in response.headers.raw)
    return head + len(response.content)


async def every_page(client: httpx.AsyncClient, url: str) -> tuple[int, int]:
    """(bytes, requests) of every page of ``url``, following ``Link: rel=next``."""
    total, requests, next_url = 0, 0, url
    while next_url:
        response = await client.get(next_url)
        response.raise_for_status()
        total, requests = total + response_bytes(response), requests + 1
        link = response.links.get("next")
        next_url = link["url"] if link else ""
    return total, requests


async def baseline(url: str) -> dict[str, Any]:
    """What polling dashboards download per refresh, against this server now."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        rollouts, r_requests = await every_page(client, "/api/v1/rollouts")
        workers, w_requests = await every_page(client, "/api/v1/workers")
        ids = [r["rollout_id"] for r in (await client.get("/api/v1/rollouts?limit=1000")).json()]
        every = 0
        for rollout_id in ids:
            response = await client.get(f"/api/v1/rollouts/{rollout_id}")
            response.raise_for_status()
            every += response_bytes(response)
    return {
        "full_poll_bytes": rollouts + workers,
        "full_poll_requests": r_requests + w_requests,
        "rollouts_bytes": rollouts,
        "workers_bytes": workers,
        "every_rollout_with_workers_bytes": every,
        "every_rollout_with_workers_requests": len(ids),
    }


def _ready(driver: Any) -> Any:
    """The page's marks once its first render is done (falsy before)."""
    marks = driver.execute_script("return window.__bench || null")
    return marks if marks is not None and marks["ready"] is not None else False


def _performance_log(driver: Chrome) -> list[dict[str, Any]]:
    """DevTools' events since the last read (the log drains)."""
    entries: list[dict[str, Any]] = driver.get_log("performance")  # type: ignore[no-untyped-call]
    return entries


def _path(url: str) -> str:
    path = urlsplit(url).path
    return path if path.startswith("/api/v1/events") else path.rstrip("/") or "/"


def by_path(transfers: list[Transfer]) -> dict[str, dict[str, int]]:
    """Bytes and transfers by URL path."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"bytes": 0, "transfers": 0})
    for t in transfers:
        out[_path(t.url)]["bytes"] += t.nbytes
        out[_path(t.url)]["transfers"] += 1
    return dict(out)


def milestones(log: NetworkLog, start: float, ready: float) -> dict[str, float | None]:
    """Where a first render's time went, in ms from navigation start (DevTools times): the page
    received, the event stream opened and its first bytes, the first workers page, ready."""
    firsts: dict[str, float] = {}
    for request in log.requests.values():
        if _path(request.url) == "/api/v1/events" and request.sent is not None:
            firsts["events sent"] = min(firsts.get("events sent", request.sent), request.sent)
        times = [at for at, _ in request.transfers() if at <= ready]
        path = "page" if request.kind == "Document" else _path(request.url)
        if times and path in ("page", "/api/v1/events", "/api/v1/workers"):
            firsts[path] = min(firsts.get(path, times[0]), *times)
    shown = {
        "page": "page_ms",
        "events sent": "events_sent_ms",
        "/api/v1/events": "events_ms",
        "/api/v1/workers": "workers_ms",
    }
    out: dict[str, float | None] = {
        name: 1000 * (firsts[path] - start) if path in firsts else None
        for path, name in shown.items()
    }
    out["ready_ms"] = 1000 * (ready - start)
    return out


def browse(url: str, loads: int, observe_s: float) -> dict[str, Any]:
    """Load the dashboard ``loads`` times (first render each); on the first load, watch what it
    receives for ``observe_s`` seconds after its first render."""
    driver = chrome(performance_log=True)
    out: dict[str, Any] = {"first_render_ms": [], "milestones": []}
    try:
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": MARKS})
        # A fresh browser's first navigation also starts its renderer: not the dashboard's cost.
        driver.get(f"{url}/healthz")
        for k in range(loads):
            _performance_log(driver)  # drained: this load's events only
            driver.get(url)
            marks: dict[str, Any] = WebDriverWait(driver, 60, 0.02).until(
                _ready, "data-ready never became 1"
            )
            out["first_render_ms"].append(marks["ready"]["ms"])
            log = NetworkLog()
            log.feed(_performance_log(driver))
            ready_at = log.devtools_time(marks["ready"]["wall"])
            out["milestones"].append(milestones(log, log.devtools_time(marks["origin"]), ready_at))
            if k:
                continue
            first = [t for t in log.transfers() if t.at <= ready_at]
            out["first_load_bytes"] = sum(t.nbytes for t in first)
            out["first_load_by_path"] = by_path(first)
            time.sleep(observe_s)  # a window of the page left alone (nothing is asserted)
            log.feed(_performance_log(driver))
            marks = driver.execute_script("return window.__bench")
            later = [u for u in marks["updates"] if u["wall"] > marks["ready"]["wall"]]
            after = log.transfers(after=ready_at)
            costs = per_update(after, [log.devtools_time(u["wall"]) for u in later])
            out.update(
                observe_s=observe_s,
                updates=len(later),
                update_values=[u["n"] for u in later][-3:],
                bytes_after_first_render=sum(t.nbytes for t in after),
                per_update_bytes=costs,
                mean_update_bytes=statistics.fmean(costs) if costs else None,
                max_update_bytes=max(costs) if costs else None,
                by_path=by_path(after),
            )
    finally:
        driver.quit()
    return out


async def run(result: dict[str, Any], p: dict[str, Any]) -> None:
    started = time.perf_counter()
    served = Served(p["workers"], p["rollouts"], p["active"])
    result["build_s"] = time.perf_counter() - started
    print(f"built {p['workers']} workers x {p['rollouts']} rollouts in {result['build_s']:.1f} s")
    served.go_live()
    feed = Feed(served, p["rollouts"], p["active"])
    tasks = [asyncio.create_task(feed.heartbeats()), asyncio.create_task(feed.progress())]
    try:
        async with ApiServer(served.coordinator, "127.0.0.1", 0, app=served.app) as server:
            result["baseline"] = await baseline(server.url)
            print(f"baseline measured; browser on {server.url}", flush=True)
            result["browser"] = await asyncio.to_thread(
                browse, server.url, p["loads"], p["observe_s"]
            )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await served.coordinator.stop()
    result["feed_acks"] = feed.acks


def main(argv: list[str] | None = None) -> int:
    parser = argument_parser(package)
    parser.add_argument("--quick", action="store_true", help="300 workers x 15 rollouts, 1 load")
    parser.add_argument("--workers", type=int, default=None)
    parser.add_argument("--rollouts", type=int, default=None)
    parser.add_argument("--loads", type=int, default=None, help="page loads (first render)")
    parser.add_argument("--observe-s", type=float, default=None, help="seconds watched")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    quiet_logging()
    started = time.perf_counter()
    mode = "quick" if args.quick else "full"
    p = dict(MODES[mode])
    for key in ("workers", "rollouts", "loads", "observe_s"):
        if getattr(args, key) is not None:
            p[key] = getattr(args, key)
    p["active"] = min(p["active"], p["rollouts"])
    result = envelope("dashboard", mode, sys.argv[1:] if argv is None else argv)
    result["parameters"] = p
    asyncio.run(run(result, p))
    result["targets"] = targets(result)
    return conclude(result, report(result), args.out_dir, started)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    b = result["browser"]
    worst = b.get("max_update_bytes")
    renders = b["first_render_ms"]
    median = statistics.median(renders)
    return [
        {
            "name": "< 100 KB per update after the first (the largest)",
            "value": worst,
            "detail": f"{b['updates']} updates in {b['observe_s']:.0f} s",
            "verdict": "no update seen"
            if worst is None
            else "met"
            if worst < TARGET_UPDATE_BYTES
            else "missed",
        },
        {
            "name": "first render < 1 s (median of the loads)",
            "value": median,
            "detail": f"{len(renders)} loads, max {max(renders):.0f} ms",
            "verdict": "met" if median < TARGET_FIRST_RENDER_MS else "missed",
        },
    ]


def report(result: dict[str, Any]) -> str:
    p, b, base = result["parameters"], result["browser"], result["baseline"]
    mean = b.get("mean_update_bytes")
    rows = [
        ["fleet", f"{p['workers']} workers, {p['rollouts']} rollouts ({p['active']} in progress)"],
        ["first render (ms, each load)", ", ".join(f"{ms:.0f}" for ms in b["first_render_ms"])],
        ["bytes up to the first render", b.get("first_load_bytes")],
        [f"updates in {b['observe_s']:.0f} s after it", b.get("updates")],
        ["bytes received meanwhile", b.get("bytes_after_first_render")],
        ["bytes per update (mean)", fmt(mean, ".0f")],
        ["bytes per update (max)", b.get("max_update_bytes")],
        ["baseline: full poll of rollouts + workers", base["full_poll_bytes"]],
        ["baseline: every rollout with its workers", base["every_rollout_with_workers_bytes"]],
        ["full poll / update (mean)", fmt(ratio(base["full_poll_bytes"], mean), ".0f")],
        [
            "every rollout / update (mean)",
            fmt(ratio(base["every_rollout_with_workers_bytes"], mean), ".0f"),
        ],
    ]
    lines = [table(rows, ["measure", "value"]), ""]
    steps = [
        [k + 1, *(fmt(m.get(key), ".0f") for key in MILESTONES)]
        for k, m in enumerate(b.get("milestones", []))
    ]
    if steps:
        headers = [
            "load",
            "page received",
            "stream opened",
            "its first bytes",
            "workers page",
            "ready",
        ]
        lines += ["ms from navigation start:", table(steps, headers), ""]
    for key, when in (("first_load_by_path", "up to"), ("by_path", "after")):
        paths = [[path, v["bytes"], v["transfers"]] for path, v in b.get(key, {}).items()]
        if paths:
            lines += [table(paths, [f"{when} the first render: path", "bytes", "transfers"]), ""]
    for t in result["targets"]:
        lines.append(f"target {t['name']}: {t['verdict']} ({t['detail']}; {fmt(t['value'])})")
    return "\n".join(lines)
