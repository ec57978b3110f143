"""One fleet size: N bare workers, then N agents, in child processes; rollouts followed as the
CLI does; CPU per command of each; idle."""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import os
import pstats
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import CLK_TCK, Child, cpu_seconds, ensure_topics, loadavg, ratio, summary
from bench.fanout import JUDGE_INTERVAL_S, OVERRIDE_KEY
from bench.fanout.broker_probe import between, rss_mb, snapshot
from bench.fanout.floors import measure_floor, measure_http

#: The fleets a :class:`Fanout` can start: the product's agents, or bare workers (bench.fanout.bare).
ROLES = ("agents", "bare")


class Fanout:
    """N agents (or bare workers) in child processes plus a Follower watching their topics from
    this process. Both kinds are started, published to and judged the same way; only agents
    heartbeat, so only their start also waits until the Follower sees every one alive."""

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
        start_timeout_s: float = 600.0,
        role: str = "agents",
        what_ifs: Sequence[str] = (),
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not one of {ROLES}")
        self.role = role
        self.what_ifs = list(what_ifs)
        self.start_timeout_s = start_timeout_s
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
        kind = "fan" if self.role == "agents" else "bare"
        self.settings = await ensure_topics(self.bootstrap, f"{kind}{self.n}-{tag}")
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
                "what_ifs": self.what_ifs,
            }
            log = self.log_dir / f"{self.role}-n{self.n}-p{p}{self._tag}.log"
            self.children.append(await Child.start("bench.fanout", f"{self.role}-child", cfg, log))
        deadline = time.monotonic() + self.start_timeout_s
        hellos = [await c.read(max(1.0, deadline - time.monotonic())) for c in self.children]
        children_ready_s = time.perf_counter() - started
        if self.role == "agents":
            await self._wait_registered(timeout=min(120.0, self.start_timeout_s))
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
        await self._profile_on()
        error = None
        try:
            for i in range(rollouts):
                await self.rollout(10_000 + i, producer)
        except (RuntimeError, TimeoutError) as exc:  # the level's other figures still stand
            error = repr(exc)
            print(f"   profiling stopped: {error}", flush=True)
        files = await self._profile_off(out_dir, "")
        summary = profile_summary(files, rollouts * self.n)
        if error is not None:
            summary["error"] = error  # fewer commands than counted: per-command figures too low
        return summary

    async def profile_idle(self, seconds: float, out_dir: Path) -> dict[str, Any]:
        """cProfile of the idle processes' event loops over ``seconds``: what an idle agent
        spends its CPU on (heartbeats, long-polls, the clients' own timers). Its per-"command"
        figures are per agent-second."""
        await self._profile_on()
        await asyncio.sleep(seconds)
        files = await self._profile_off(out_dir, "-idle")
        summary = profile_summary(files, max(1, round(seconds * self.n)))
        summary["per"] = "agent-second"
        return summary

    async def _profile_on(self) -> None:
        for c in self.children:
            await c.send("profile-on")
            await c.read(60)

    async def _profile_off(self, out_dir: Path, suffix: str) -> list[str]:
        files = []
        for p, c in enumerate(self.children):
            path = out_dir / f"{self.role}-n{self.n}-p{p}{self._tag}{suffix}.prof"
            await c.send(f"profile-off {path}")
            await c.read(60)
            files.append(str(path))
        return files

    @property
    def _tag(self) -> str:
        return "".join(f"-{w}" for w in self.what_ifs)

    def cpu(self) -> float:
        return sum(c.cpu() for c in self.children)

    def loop_cpu(self) -> float:
        """CPU seconds of the children's main threads (their event loops); the rest of
        :meth:`cpu` is their other threads' (runner calls and fsyncs in thread pools, the
        stdin reader)."""
        return sum(_main_thread_cpu(c.proc.pid) for c in self.children)

    def rss_mb(self) -> list[float]:
        """Each agent process's resident memory, MB."""
        return [round(rss_mb(c.proc.pid), 1) for c in self.children]

    async def groups(self) -> int:
        """How many consumer groups the broker lists (``kafka-consumer-groups --list``)."""
        from aiokafka.admin import AIOKafkaAdminClient

        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=60_000)
        await admin.start()
        try:
            return len(await admin.list_consumer_groups())
        finally:
            await admin.close()

    async def stop(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.children))
        if self.follower is not None:
            await self.follower.stop()


BARE_FILE = f"{os.sep}bench{os.sep}fanout{os.sep}bare.py"


def profile_summary(files: Sequence[str], commands: int, top: int = 18) -> dict[str, Any]:
    stats = pstats.Stats(*files, stream=io.StringIO())
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    agent_steps = set()
    for (file, line, func), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        if f"{os.sep}workers{os.sep}agent{os.sep}" in file or file.endswith(BARE_FILE):
            agent_steps.add(f"{Path(file).name}:{line}({func})")
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
        if r["function"] in agent_steps
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
    if not args.no_bare:
        print(f"== N={n}: starting {n} bare workers (the fair floor)", flush=True)
        level["bare"] = await measure_bare(bootstrap, broker_pid, n, args, tmp)
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
        args.start_timeout_s,
    )
    probe = args.broker_probe
    snaps: dict[str, Any] = {}
    try:
        if probe:
            snaps["before_agents"] = await asyncio.to_thread(snapshot, broker_pid)
        level["agents"] = await fan.start()
        print(f"   started in {level['agents']['start_s']:.1f} s; rollouts", flush=True)
        if probe:
            snaps["started"] = await asyncio.to_thread(snapshot, broker_pid)
            level["agents"]["rss_mb"] = fan.rss_mb()
        async with Producer(fan.settings) as producer:
            await fan.rollout(0, producer)  # warm-up
            if probe:
                snaps["before_rollouts"] = await asyncio.to_thread(snapshot, broker_pid)
            runs, cpu = await timed_rollouts(fan, producer, args.repeats, broker_pid)
            if probe:
                snaps["after_rollouts"] = await asyncio.to_thread(snapshot, broker_pid)
            level["rollout_cpu"] = {
                "window_s": cpu["window_s"],
                "commands": cpu["commands"],
                "agents_cpu_s": cpu["cpu_s"],
                "agents_cpu_ms_per_command": cpu["cpu_ms_per_command"],
                "agents_loop_cpu_ms_per_command": cpu["loop_cpu_ms_per_command"],
                "agents_threads_cpu_ms_per_command": cpu["threads_cpu_ms_per_command"],
                "broker_cpu_ms_per_command": cpu["broker_cpu_ms_per_command"],
                "follower_cpu_ms_per_rollout": cpu["follower_cpu_ms_per_rollout"],
                "cores": cpu["cores"],
            }
            if args.profile and n == max(args.n):
                print(
                    f"== N={n}: profiling agents over {args.profile_rollouts} rollouts", flush=True
                )
                level["agent_profile"] = await fan.profile(
                    args.profile_rollouts, producer, _profile_dir(args, tmp)
                )
        level["rollouts"] = rollout_summary(runs)
        print(f"== N={n}: idle CPU over {args.idle_s:.0f} s", flush=True)
        await asyncio.sleep(1.0)
        if probe:
            snaps["idle_start"] = await asyncio.to_thread(snapshot, broker_pid)
        a0, b0, t0 = fan.cpu(), _broker_cpu(broker_pid), time.perf_counter()
        await asyncio.sleep(args.idle_s)
        a1, b1, t1 = fan.cpu(), _broker_cpu(broker_pid), time.perf_counter()
        if probe:
            snaps["idle_end"] = await asyncio.to_thread(snapshot, broker_pid)
            level["agents"]["rss_mb_idle"] = fan.rss_mb()
            # After the rollouts: a group is listed once it has committed an offset.
            level["agents"]["consumer_groups"] = await fan.groups()
        level["idle"] = {
            "window_s": t1 - t0,
            "agents_pct_core": 100 * (a1 - a0) / (t1 - t0),
            "agents_pct_core_per_agent": 100 * (a1 - a0) / (t1 - t0) / n,
            "broker_pct_core": 100 * (b1 - b0) / (t1 - t0) if broker_pid else None,
            "heartbeat_s": args.heartbeat_s,
        }
        if args.profile and n == max(args.n):  # after the measured window: profiling inflates it
            print(f"== N={n}: profiling idle agents over {args.idle_s:.0f} s", flush=True)
            level["agent_idle_profile"] = await fan.profile_idle(
                args.idle_s, _profile_dir(args, tmp)
            )
    finally:
        await fan.stop()
    if args.what_if:
        level["what_if"] = {
            name: await measure_what_if(bootstrap, broker_pid, level, name, args, tmp)
            for name in args.what_if
        }
    if probe:
        level["broker_probe"] = _probe_windows(snaps, commands=args.repeats * n)
    level["loadavg_after"] = loadavg()
    _derive(level)
    return level


async def measure_bare(
    bootstrap: str, broker_pid: int | None, n: int, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    """The fair floor: N bare workers in the agents' process layout, the same rollouts published
    and followed the same way; converge and CPU per command as for the agents."""
    return await measure_fleet(bootstrap, broker_pid, n, args, tmp, "bare")


async def measure_what_if(
    bootstrap: str,
    broker_pid: int | None,
    level: dict[str, Any],
    name: str,
    args: argparse.Namespace,
    tmp: Path,
) -> dict[str, Any]:
    """N agents with the what-if ``name`` applied in their processes, against the level's
    unchanged agents (and bare workers)."""
    from bench.fanout.whatif import WHAT_IFS

    n = level["n"]
    print(f"== N={n}: what-if {name}: starting {n} agents", flush=True)
    out = await measure_fleet(bootstrap, broker_pid, n, args, tmp, "agents", [name])
    conv = out["rollouts"]["converge_s"].get("p50")
    cpu = out["rollout_cpu"]["cpu_ms_per_command"]
    bare = level.get("bare", {})
    out.update(
        kind=WHAT_IFS[name].kind,
        says=WHAT_IFS[name].says,
        ratios={
            "converge_over_agents": ratio(conv, level["rollouts"]["converge_s"].get("p50")),
            "cpu_over_agents": ratio(cpu, level["rollout_cpu"]["agents_cpu_ms_per_command"]),
            "converge_over_bare": ratio(
                conv, bare.get("rollouts", {}).get("converge_s", {}).get("p50")
            ),
            "cpu_over_bare": ratio(cpu, bare.get("rollout_cpu", {}).get("cpu_ms_per_command")),
        },
    )
    return out


async def measure_fleet(
    bootstrap: str,
    broker_pid: int | None,
    n: int,
    args: argparse.Namespace,
    tmp: Path,
    role: str,
    what_ifs: Sequence[str] = (),
) -> dict[str, Any]:
    """Start N workers of ``role``, one warm-up rollout, the timed rollouts (and the profile at
    the largest N), stop them: converge and CPU per command."""
    from controlplane.kafka.bus import Producer

    fan = Fanout(
        bootstrap,
        n,
        args.per_process,
        args.heartbeat_s,
        args.state_dir,
        tmp,
        judge=args.judge,
        start_timeout_s=args.start_timeout_s,
        role=role,
        what_ifs=what_ifs,
    )
    out: dict[str, Any] = {"loadavg_before": loadavg()}
    try:
        out["workers"] = await fan.start()
        print(f"   started in {out['workers']['start_s']:.1f} s; rollouts", flush=True)
        async with Producer(fan.settings) as producer:
            await fan.rollout(0, producer)  # warm-up
            runs, out["rollout_cpu"] = await timed_rollouts(fan, producer, args.repeats, broker_pid)
            if args.profile and n == max(args.n) and not what_ifs:
                print(f"== N={n}: profiling {role} over {args.profile_rollouts} rollouts")
                out["profile"] = await fan.profile(
                    args.profile_rollouts, producer, _profile_dir(args, tmp)
                )
        out["rollouts"] = rollout_summary(runs)
    finally:
        await fan.stop()
    return out


async def timed_rollouts(
    fan: Fanout, producer: Any, repeats: int, broker_pid: int | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """``repeats`` rollouts one after another, and the CPU the fleet's processes, the broker
    and this process (the Follower) spent over them."""
    a0, b0, c0 = fan.cpu(), _broker_cpu(broker_pid), time.process_time()
    m0 = fan.loop_cpu()
    t0 = time.perf_counter()
    runs = [await fan.rollout(i + 1, producer) for i in range(repeats)]
    elapsed = time.perf_counter() - t0
    fleet_cpu = fan.cpu() - a0
    loop_cpu = fan.loop_cpu() - m0
    commands = repeats * fan.n
    return runs, {
        "window_s": elapsed,
        "commands": commands,
        "cpu_s": fleet_cpu,
        "cpu_ms_per_command": 1e3 * fleet_cpu / commands,
        "loop_cpu_ms_per_command": 1e3 * loop_cpu / commands,
        "threads_cpu_ms_per_command": 1e3 * (fleet_cpu - loop_cpu) / commands,
        "broker_cpu_ms_per_command": 1e3 * (_broker_cpu(broker_pid) - b0) / commands,
        "follower_cpu_ms_per_rollout": 1e3 * (time.process_time() - c0) / repeats,
        "cores": os.cpu_count(),
    }


def rollout_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        "converge_s": summary([r["converge_s"] for r in runs]),
        "last_ack_s": summary([r["last_ack_s"] for r in runs]),
        "publish_s": summary([r["publish_s"] for r in runs]),
        "status_s": summary([r["status_s"] for r in runs]),
        "ack_s": summary([x for r in runs for x in r["ack_s"]]),
        "received_s": summary([x for r in runs for x in r["received_s"]]),
    }


def _probe_windows(snaps: dict[str, Any], commands: int) -> dict[str, Any]:
    """The snapshots, and the rates over the rollouts and over the idle window."""
    out: dict[str, Any] = {"snapshots": snaps}
    for name, (a, b) in {
        "start": ("before_agents", "started"),
        "rollouts": ("before_rollouts", "after_rollouts"),
        "idle": ("idle_start", "idle_end"),
    }.items():
        if a in snaps and b in snaps and "t" in snaps[a] and "t" in snaps[b]:
            out[name] = between(snaps[a], snaps[b])
    commits = out.get("rollouts", {}).get("requests", {}).get("OffsetCommit")
    if commits is not None:
        out["offset_commits_per_command"] = commits / max(commands, 1)
    return out


def _profile_dir(args: argparse.Namespace, tmp: Path) -> Path:
    """Where the .prof files go: beside the result file (--out-dir), kept; else a temp dir."""
    out: Path | None = args.out_dir
    if out is None:
        return tmp
    out.mkdir(parents=True, exist_ok=True)
    return out


def _main_thread_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process's main thread (``/proc/PID/task/PID``)."""
    try:
        stat = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat.rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _broker_cpu(pid: int | None) -> float:
    return cpu_seconds(pid) if pid else 0.0


def _derive(level: dict[str, Any]) -> None:
    """Ratios of p50s: convergence against the bare workers (the fair floor), against one bare
    command/ack pair (``floor``, kept under its old key: ``converge_over_floor`` is
    ``converge_over_one_pair``) and against HTTP fan-outs; CPU per command against the bare
    workers'."""
    one_pair = level["floor"]["round_trip_s"].get("p50")
    conv = level["rollouts"]["converge_s"].get("p50")
    http = level.get("http", {})
    bare = level.get("bare", {})
    cpu = level["rollout_cpu"]
    # The agents' time-driven CPU (heartbeats, fetch long-polls) at the idle rate, taken out: what
    # is left is what the commands cost, comparable across rollouts of different lengths (the
    # bare workers have no heartbeats; their idle fetches are left in).
    idle_s = level.get("idle", {}).get("agents_pct_core", 0.0) / 100 * cpu["window_s"]
    cpu["agents_cpu_ms_per_command_less_idle"] = (
        1e3 * (cpu["agents_cpu_s"] - idle_s) / cpu["commands"]
    )
    level["ratios"] = {
        "cpu_less_idle_over_bare": ratio(
            cpu["agents_cpu_ms_per_command_less_idle"],
            bare.get("rollout_cpu", {}).get("cpu_ms_per_command"),
        ),
        "converge_over_floor": ratio(conv, one_pair),
        "converge_over_one_pair": ratio(conv, one_pair),
        "converge_over_bare": ratio(
            conv, bare.get("rollouts", {}).get("converge_s", {}).get("p50")
        ),
        "cpu_over_bare": ratio(
            level["rollout_cpu"]["agents_cpu_ms_per_command"],
            bare.get("rollout_cpu", {}).get("cpu_ms_per_command"),
        ),
        "converge_over_http_concurrent": ratio(conv, http.get("concurrent_s", {}).get("p50")),
        "converge_over_http_sequential": ratio(conv, http.get("sequential_s", {}).get("p50")),
    }
