"""One configuration (N workers, R past rollouts) on a fresh set of topics, in this order:

1. ``topics ensure`` (the CLI: the product's topic settings apply), the heartbeat generator
   (until every worker has sent one), the R past rollouts and the in-progress one;
2. the floor: a bare consumer reading every topic to its end;
3. the CLI: ``reload-weights --selector model=big`` (publish), ``status <in-progress id>
   --json``, ``status --json`` (all);
4. the coordinator: start to ready, then the API (``/api/v1/workers``,
   ``/api/v1/rollouts?limit=50``, summary endpoints where the API has them, one dashboard
   update as its script fetches it, ``/metrics``), ``/healthz`` while a big response is being
   built, and one rollout's 3N acks produced in a burst until the API shows it succeeded; a
   watcher polls the alive count and the in-progress rollout's phase all along.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import Child
from bench.scale import HEARTBEAT_PERIOD_S
from bench.scale.fleet import Rollouts, kafka_settings, produce_history
from bench.scale.probe import (
    Coordinator,
    Watcher,
    api_paths,
    dashboard_paths,
    dashboard_update,
    healthz_during,
    read_bare,
    run_cli,
    sample,
    summary_endpoints,
    timed_get,
)

#: The coordinator that writes the snapshot a restart is timed from writes it soon after catching
#: up (the product's default is every 300 s). The coordinator under the API's load keeps the
#: default: a snapshot every few seconds would pause its fold in the middle of what is timed.
SNAPSHOT_SOON = {"FLEET_COORDINATOR_SNAPSHOT_INTERVAL_S": "2"}


class Scenario:
    def __init__(self, args: argparse.Namespace, bootstrap: str, n: int, r: int, tmp: Path) -> None:
        self.args, self.bootstrap, self.n, self.r = args, bootstrap, n, r
        self.prefix = f"scale-n{n}-r{r}"
        self.settings = kafka_settings(bootstrap, self.prefix, "bench-scale")
        self.tmp = tmp / self.prefix
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.rollouts = Rollouts(n, r)
        self.out: dict[str, Any] = {"n": n, "rollouts": r, "prefix": self.prefix}
        self.t0 = time.perf_counter()

    def log(self, what: str) -> None:
        print(
            f"  [N={self.n} R={self.r} +{time.perf_counter() - self.t0:5.0f} s] {what}", flush=True
        )

    def kafka_args(self) -> list[str]:
        return ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]

    async def run(self) -> dict[str, Any]:
        cap = self.args.cap_s
        ensure = await run_cli(["topics", "ensure", *self.kafka_args()], cap, self.tmp, "ensure")
        self.out["topics_ensure"] = ensure
        if ensure["exit_code"] != 0:
            self.out["error"] = f"topics ensure failed: {ensure['stderr_tail']}"
            return self.out
        generator = await Child.start(
            "bench.scale",
            "generator-child",
            {
                "bootstrap": self.bootstrap,
                "prefix": self.prefix,
                "n": self.n,
                "period_s": HEARTBEAT_PERIOD_S,
            },
            self.tmp / "generator.log",
        )
        try:
            ready = await generator.read(timeout=cap)
            if not ready.get("ready"):
                raise RuntimeError(f"the heartbeat generator failed: {ready}")
            self.log(f"{self.n} workers heartbeating every {HEARTBEAT_PERIOD_S:g} s")
            self.out["history"] = await produce_history(self.settings, self.rollouts)
            h = self.out["history"]
            self.log(
                f"history: {h['commands']} commands, {h['acks']} acks in {h['elapsed_s']:.1f} s"
            )
            await self.measure()
        finally:
            await generator.send("stats")
            self.out["generator"] = await generator.read(timeout=60)
            await generator.stop()
        return self.out

    async def measure(self) -> None:
        cap = self.args.cap_s
        floor = await read_bare(self.settings, cap)
        self.out["floor"] = floor
        self.log(f"floor: {floor['records']} records in {floor['elapsed_s']:.2f} s")
        cli: dict[str, Any] = {}
        self.out["cli"] = cli
        cli["publish"] = await run_cli(
            [
                "reload-weights",
                "/models/big/v-next",
                "--version",
                "v-next",
                "--selector",
                "model=big",
                "--json",
                *self.kafka_args(),
            ],
            cap,
            self.tmp,
            "publish",
        )
        cli["publish"]["pinned"] = _pinned_of(Path(cli["publish"]["stdout_path"]))
        self.log(_said("publish", cli["publish"]) + f", pinned {cli['publish']['pinned']}")
        cli["status_one"] = await run_cli(
            ["status", self.rollouts.live, "--json", *self.kafka_args()], cap, self.tmp, "status1"
        )
        cli["status_one"]["phase"] = _phase_of(Path(cli["status_one"]["stdout_path"]))
        self.log(_said("status <id>", cli["status_one"]))
        cli["status_all"] = await run_cli(
            ["status", "--json", *self.kafka_args()], cap, self.tmp, "status-all"
        )
        self.log(_said("status (all)", cli["status_all"]))
        async with httpx.AsyncClient() as client:
            await self.api(client)

    async def api(self, client: httpx.AsyncClient) -> None:
        cap, samples, budget = self.args.cap_s, self.args.samples, self.args.budget_s
        coordinator = Coordinator(self.bootstrap, self.prefix, self.tmp / "coordinator.log")
        api: dict[str, Any] = {}
        self.out["api"] = api
        try:
            api["start"] = await coordinator.start(client, cap)
            self.log(f"coordinator: {api['start']}")
            if not api["start"].get("ready"):
                return
            base = coordinator.url
            watcher = Watcher(client, base, self.n, self.rollouts.live, self.rollouts.live_acked_at)
            watcher.start(time.perf_counter())
            try:
                api["status_one_api"] = await run_cli(
                    ["status", self.rollouts.live, "--json", "--api", base, *self.kafka_args()],
                    cap,
                    self.tmp,
                    "status1-api",
                )
                api["status_one_api"]["phase"] = _phase_of(
                    Path(api["status_one_api"]["stdout_path"])
                )
                self.log(_said("status <id> --api", api["status_one_api"]))
                api["paths"] = await api_paths(client, base)
                endpoints = {
                    "workers": "/api/v1/workers",
                    "rollouts_limit_50": "/api/v1/rollouts?limit=50",
                    "metrics": "/metrics",
                }
                for name, path in endpoints.items():
                    api[name] = await sample(client, base + path, samples, budget, cap)
                    self.log(f"GET {path}: {_said_http(api[name])}")
                found = await summary_endpoints(client, base, self.rollouts.live)
                api["summary"] = {}
                for path in found:
                    api["summary"][path] = await sample(client, base + path, samples, budget, cap)
                    self.log(f"GET {path}: {_said_http(api['summary'][path])}")
                if not found:
                    self.log("summary endpoints: absent")
                api["dashboard"] = await self.dashboard(client, base)
                biggest = max(
                    ("/api/v1/workers", "/api/v1/rollouts?limit=50"),
                    key=lambda p: (
                        api["workers" if "workers" in p else "rollouts_limit_50"]["s"].get("p50")
                        or 0
                    ),
                )
                api["healthz_under_load"] = await healthz_during(client, base, biggest, cap)
                self.log(f"/healthz while {biggest} is built: {api['healthz_under_load']}")
                api["burst"] = await self.burst(client, base)
                self.log(f"burst: {api['burst']}")
            finally:
                api["watcher"] = await watcher.stop()
                api["memory_at_end"] = coordinator.memory()
        finally:
            coordinator.stop()
        api["restart"] = await self.restart(client)

    async def restart(self, client: httpx.AsyncClient) -> dict[str, Any]:
        """A coordinator started again on the same log from a snapshot: one more coordinator
        replays it in full and writes a snapshot soon after (its start is a second sample of
        the full replay's), then a third starts: the time until it is ready, and what it
        restored from."""
        cap = self.args.cap_s
        writer = Coordinator(
            self.bootstrap, self.prefix, self.tmp / "coordinator-writer.log", SNAPSHOT_SOON
        )
        try:
            out: dict[str, Any] = {"writer_start": await writer.start(client, cap)}
            if out["writer_start"].get("ready"):
                out["written"] = await writer.snapshot_written(client, cap)
        finally:
            writer.stop()
        self.log(f"snapshot: {out.get('written')}")
        if not out.get("written", {}).get("written"):
            return out
        again = Coordinator(self.bootstrap, self.prefix, self.tmp / "coordinator-restart.log")
        try:
            out.update(await again.start(client, cap))
        finally:
            again.stop()
        out["snapshot"] = out.pop("health", {}).get("snapshot")
        self.log(f"coordinator restart: {out}")
        return out

    async def dashboard(self, client: httpx.AsyncClient, base: str) -> dict[str, Any]:
        page = await timed_get(client, f"{base}/", self.args.cap_s)
        urls = dashboard_paths(self.rollouts.live)
        polls: list[dict[str, Any]] = []
        started = time.perf_counter()
        while len(polls) < self.args.samples and (
            len(polls) < 2 or time.perf_counter() - started < self.args.budget_s
        ):
            polls.append(await dashboard_update(client, base, urls, self.args.cap_s))
        out = {
            "page_bytes": page["bytes"],
            "urls": urls,
            "polls": len(polls),
            "s": sorted(p["s"] for p in polls),
            "bytes": max(p["bytes"] for p in polls),
            "per_url": polls[-1]["per_url"],
            "ok": all(p["ok"] for p in polls),
        }
        self.log(f"dashboard update: {urls}: {out['s']} s, {out['bytes']} bytes")
        return out

    async def burst(self, client: httpx.AsyncClient, base: str) -> dict[str, Any]:
        """Publish one rollout pinned to all N, wait until the API knows it, then produce its 3N
        acks (rendered beforehand) in one burst; poll until the API shows it succeeded."""
        from controlplane.kafka.bus import Producer

        cap = self.args.cap_s
        rid, topics = self.rollouts.burst, self.settings.topics
        issued = datetime.now(UTC)
        acks = self.rollouts.acks(rid, issued, ("accepted", "running", "succeeded"))
        url = f"{base}/api/v1/rollouts/{rid}"
        async with Producer(self.settings, linger_ms=20) as producer:
            await producer.send_many(topics.commands.name, [self.rollouts.command(rid, issued)])
            deadline = time.perf_counter() + cap
            while (await timed_get(client, url, cap))["status"] != 200:
                if time.perf_counter() > deadline:
                    return {"error": f"the API did not show {rid} within {cap:g} s"}
                await asyncio.sleep(0.05)
            t0 = time.perf_counter()
            await producer.send_many(topics.acks.name, acks, timeout_s=cap)
            produced = time.perf_counter()
        polls, phase = 0, None
        while time.perf_counter() - produced < cap:
            polls += 1
            try:
                r = await client.get(url, timeout=cap)
                phase = r.json().get("phase") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                phase = None
            if phase == "succeeded":
                seen = time.perf_counter()
                return {
                    "acks": len(acks),
                    "produce_s": produced - t0,
                    "visible_s": seen - produced,
                    "from_first_ack_s": seen - t0,
                    "polls": polls,
                }
            await asyncio.sleep(0.02)
        return {
            "acks": len(acks),
            "produce_s": produced - t0,
            "error": f"not shown succeeded within {cap:g} s (last phase {phase})",
            "killed_at_cap": True,
        }


def _json_of(path: Path) -> Any:
    try:
        return json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None


def _phase_of(path: Path) -> str | None:
    body = _json_of(path)
    return body.get("phase") if isinstance(body, dict) else None


def _pinned_of(path: Path) -> int | None:
    """How many workers the published command was pinned to (a list, or a packed one)."""
    body = _json_of(path)
    if not isinstance(body, dict):
        return None
    selector = body.get("selector") or body.get("command", {}).get("selector") or {}
    ids = selector.get("worker_ids")
    if isinstance(ids, list):
        return len(ids)
    if isinstance(ids, dict) and isinstance(ids.get("count"), int):
        return int(ids["count"])
    return None


def _said(what: str, run: dict[str, Any]) -> str:
    text = (
        f"{what}: exit {run['exit_code']} in {run['wall_s']:.2f} s, "
        f"{run['max_rss_mb']:.0f} MB, {run['stdout_bytes']} bytes out"
    )
    if run["killed_at_cap"]:
        text += " (killed at the cap)"
    if run["exit_code"] != 0 and run["stderr_tail"]:
        text += f": {run['stderr_tail'][:200]}"
    return text


def _said_http(s: dict[str, Any]) -> str:
    p50, p99 = s["s"].get("p50"), s["s"].get("p99")
    if p50 is None:
        return f"no answer ({s['statuses']}, {s['errors'][:1]})"
    return f"p50 {p50:.3f} s, p99 {p99:.3f} s, {s['bytes']} bytes, {s['samples']} samples"
