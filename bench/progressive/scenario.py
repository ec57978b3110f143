"""The fleet (agents, coordinator, a reader here) and the two arms: waves by hand, the controller."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.common import Child, loadavg
from bench.fanout.scenario import Fanout, profile_summary
from bench.progressive import AGENT_LABELS, RETIRED, TARGET


class Reader:
    """What this process reads back: when each rollout id's command and terminal acks came."""

    def __init__(self) -> None:
        self.command_at: dict[str, float] = {}
        self.terminal: dict[str, set[str]] = defaultdict(set)
        self.failed: dict[str, set[str]] = defaultdict(set)
        self.last_ack_at: dict[str, float] = {}
        #: The same two instants on the wall clock (to set beside the coordinator's trace).
        self.command_wall: dict[str, float] = {}
        self.last_ack_wall: dict[str, float] = {}
        #: rollout id -> when its state was first read here ended
        self.state_wall: dict[str, float] = {}

    def __call__(self, batch: Any) -> None:
        now, wall = time.perf_counter(), time.time()
        for command in batch.commands:
            self.command_at.setdefault(command.rollout_id, now)
            self.command_wall.setdefault(command.rollout_id, wall)
        for ack in batch.acks:
            if ack.state.terminal:
                self.terminal[ack.rollout_id].add(ack.worker_id)
                if ack.state.value != "succeeded":
                    self.failed[ack.rollout_id].add(ack.worker_id)
                self.last_ack_at[ack.rollout_id] = now
                self.last_ack_wall[ack.rollout_id] = wall
        for record in batch.control:
            if getattr(record, "type", None) == "state" and record.phase.terminal:
                self.state_wall.setdefault(record.rollout_id, wall)


class Bench:
    """N agents (bench.fanout's), one coordinator child, and a follower of the controller topic."""

    def __init__(self, bootstrap: str, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.fan = Fanout(
            bootstrap, args.n, args.per_process, args.heartbeat_s, args.state_dir, tmp
        )
        self.coordinator: Child | None = None
        self.reader = Reader()
        self.producer: Any = None
        self.checkpoint = Path()
        self.version = 1  # the agents' FakeRunner starts on "init"; v2 is the first rolled out
        self.running = "init"
        self.profile_path = tmp / "decide.prof"

    @property
    def control(self) -> Any:
        return self.fan.follower.control

    async def start(self) -> dict[str, Any]:
        from controlplane.coordinator.follower import Follower
        from controlplane.kafka.bus import Producer
        from controlplane.rollout.targets import ControlState

        agents = await self.fan.start()
        # Fanout's follower folds no controller topic: the same reader, with one.
        await self.fan.follower.stop()
        self.fan.follower = Follower(self.fan.settings, control=ControlState())
        await self.fan.follower.start()
        self.fan.follower.listeners.append(self.reader)
        # the agents' allowed root: the directory Fanout just made (a --state-dir may hold older)
        state_dir = max(
            self.args.state_dir.glob(f"n{self.args.n}-*"), key=lambda p: p.stat().st_mtime
        )
        self.checkpoint = state_dir / "model.safetensors"
        self.checkpoint.write_bytes(b"\0" * 64)
        cfg = {
            "bootstrap": self.fan.bootstrap,
            "prefix": self.fan.settings.topic_prefix,
            "profile": str(self.profile_path) if self.args.profile else None,
        }
        started = time.perf_counter()
        self.coordinator = await Child.start(
            "bench.progressive", "coordinator-child", cfg, self.tmp / "coordinator.log"
        )
        hello = await self.coordinator.read(300)
        self.producer = Producer(self.fan.settings)
        await self.producer.start()
        await self._until(lambda: self.fan.follower.caught_up.is_set(), 120)
        return {
            **agents,
            "coordinator_start_s": time.perf_counter() - started,
            "coordinator_child_s": hello.get("start_s"),
        }

    async def stop(self) -> None:
        if self.producer is not None:
            await self.producer.stop()
        if self.coordinator is not None:
            await self.coordinator.stop()
        await self.fan.stop()

    # ------------------------------------------------------------------ helpers

    async def _until(self, condition: Any, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"not reached within {timeout:g} s")
            await self.fan.follower.poll(timeout_s=0.25)

    def _next_version(self) -> str:
        self.version += 1
        return f"v{self.version}"

    def _weights(self, version: str) -> Any:
        from controlplane.wire.control import WeightsRef

        return WeightsRef(path=str(self.checkpoint), version=version)

    def strategy(self) -> Any:
        from controlplane.wire.control import Strategy

        return Strategy(canary=self.args.canary, steps=self.args.steps)

    def waves(self) -> list[list[str]]:
        from controlplane.rollout.waves import plan_waves

        return plan_waves(self.fan.worker_ids, self.strategy())

    def _cpu(self) -> tuple[float, float]:
        assert self.coordinator is not None
        return self.coordinator.cpu(), self.fan.cpu()

    async def stats(self, profile: bool = False) -> dict[str, Any]:
        """The coordinator's counters and trace since the last call; ``profile``: profile its
        decide() calls until the next."""
        assert self.coordinator is not None
        await self.coordinator.send("stats profile-on" if profile else "stats")
        return await self.coordinator.read(60)

    async def set_target(self, selector: dict[str, str], stable: str | None) -> None:
        """Write the target's spec; return once this reader and the coordinator folded it."""
        from controlplane.coordinator.publisher import publish_control
        from controlplane.wire.control import Desired, TargetSpec
        from controlplane.wire.protocol import utcnow

        spec = TargetSpec(
            name=TARGET,
            selector=selector,
            stable=None if stable is None else Desired(weights=self._weights(stable)),
            issued_at=utcnow(),
            issuer="bench",
        )
        await publish_control(self.fan.settings, spec, self.producer)

        def folded() -> bool:
            target = self.control.target(TARGET)
            return target is not None and dict(target.spec.selector) == selector

        await self._until(folded, 60)
        assert self.coordinator is not None
        await self.coordinator.send(f"wait-target {TARGET} {json.dumps(selector)}")
        await self.coordinator.read(90)

    # ------------------------------------------------------------------ the two arms

    async def by_hand(self, tag: str) -> dict[str, Any]:
        """Each wave one plain command; the next once the wave's terminal acks are read."""
        from controlplane.coordinator.publisher import build_command, publish
        from controlplane.wire.protocol import ReloadWeightsSpec, Selector

        version = self._next_version()
        before = await self.stats()
        cpu0 = self._cpu()
        start = previous_end = time.perf_counter()
        waves = []
        for i, wave in enumerate(self.waves()):
            rid = f"hand-{tag}.w{i}"
            command = build_command(
                ReloadWeightsSpec(path=str(self.checkpoint), version=version),
                Selector(worker_ids=wave),
                issuer="bench",
                ttl_s=600,
                rollout_id=rid,
            )
            await publish(self.fan.settings, command, self.producer)
            size = len(wave)
            await self._until(lambda rid=rid, size=size: len(self.reader.terminal[rid]) >= size)
            waves.append(self._wave(rid, len(wave), previous_end))
            previous_end = self.reader.last_ack_at[rid]
        total = time.perf_counter() - start
        cpu1 = self._cpu()
        after = await self.stats()
        self.running = version
        return {
            "version": version,
            "total_s": total,
            "waves": waves,
            "coordinator_cpu_s": cpu1[0] - cpu0[0],
            "agents_cpu_s": cpu1[1] - cpu0[1],
            # The target is retired meanwhile: the controller must leave the workers alone.
            "controller_commands": after["commands_published"] - before["commands_published"],
            "decide": _decide_cost(after["trace"]),
            "failed": sorted({w for r in waves for w in r["failed"]}),
        }

    async def controller(self, tag: str) -> dict[str, Any]:
        """The target over the agents, then one RolloutSpec; until ``succeeded`` is read back."""
        from controlplane.coordinator.publisher import publish_control
        from controlplane.rollout.progressive import batch_rollout_id
        from controlplane.wire.control import Desired, RolloutSpec
        from controlplane.wire.protocol import utcnow

        version = self._next_version()
        await self.set_target(AGENT_LABELS, self.running)
        rid = f"prog-{tag}"
        spec = RolloutSpec(
            rollout_id=rid,
            target=TARGET,
            desired=Desired(weights=self._weights(version)),
            strategy=self.strategy(),
            issued_at=utcnow(),
            issuer="bench",
        )
        before = await self.stats(profile=self.args.profile)
        cpu0 = self._cpu()
        start, start_wall = time.perf_counter(), time.time()
        await publish_control(self.fan.settings, spec, self.producer)

        def ended() -> bool:
            rollout = self.control.rollout(rid)
            return rollout is not None and rollout.ended

        await self._until(ended)
        total = time.perf_counter() - start
        cpu1 = self._cpu()
        after = await self.stats()
        rollout = self.control.rollout(rid)
        state = rollout.state
        waves = []
        previous_end = start
        for i, wave in enumerate(state.waves):
            batch = batch_rollout_id(rid, i, 0)
            waves.append(self._wave(batch, len(wave), previous_end))
            previous_end = self.reader.last_ack_at.get(batch, previous_end)
        self.running = version
        result = {
            "version": version,
            "phase": state.phase.value,
            "message": state.message,
            "total_s": total,
            "waves": waves,
            "last_ack_to_state_s": total - (previous_end - start),
            "coordinator_cpu_s": cpu1[0] - cpu0[0],
            "agents_cpu_s": cpu1[1] - cpu0[1],
            "decisions": after["decisions"] - before["decisions"],
            "commands": after["commands_published"] - before["commands_published"],
            "state_revision": state.revision,
            "decide": _decide_cost(after["trace"]),
            "boundaries": _boundaries(
                after["trace"], self.reader, rid, len(state.waves), start_wall
            ),
        }
        # The quiet window, as long as the rollout, the target still on the agents: what the
        # coordinator spends anyway (following heartbeats, deciding there is nothing to do).
        assert self.coordinator is not None
        c0, t0 = self.coordinator.cpu(), time.perf_counter()
        await asyncio.sleep(total)
        result["idle_cpu_s"] = (self.coordinator.cpu() - c0) * total / (time.perf_counter() - t0)
        result["idle_decide"] = _decide_cost((await self.stats())["trace"])
        await self.set_target(RETIRED, None)
        return result

    def _wave(self, rid: str, size: int, since: float) -> dict[str, Any]:
        """One wave as read here: from ``since`` (the arm's start, or the previous wave's last
        terminal ack read back) to its command read back, and to its last terminal ack."""
        command = self.reader.command_at.get(rid)
        last = self.reader.last_ack_at.get(rid)
        return {
            "rollout_id": rid,
            "workers": size,
            "to_command_s": None if command is None else command - since,
            "to_last_ack_s": None if last is None else last - since,
            "apply_s": None if command is None or last is None else last - command,
            "failed": sorted(self.reader.failed.get(rid, ())),
        }


def _decide_cost(trace: list[dict[str, Any]]) -> dict[str, Any]:
    """decide() calls in a window of the coordinator's trace, and their wall time in all."""
    calls = [e for e in trace if "decide" in e]
    writes = [e["s"] for e in trace if "write" in e]
    return {
        "calls": len(calls),
        "total_s": sum(e["s"] for e in calls),
        "cpu_s": sum(e["cpu_s"] for e in calls),
        "max_cpu_s": max((e["cpu_s"] for e in calls), default=0.0),
        "writes": len(writes),
        "write_total_s": sum(writes),
    }


def _boundaries(
    trace: list[dict[str, Any]], reader: Reader, rid: str, waves: int, start_wall: float
) -> list[dict[str, Any]]:
    """Where the time goes between a wave's last ack (or the spec's publish) read here and the
    next wave's command read here: the coordinator waking to decide, decide() itself, the
    transaction, then the command reaching this reader."""
    from controlplane.rollout.progressive import batch_rollout_id

    out = []
    since = start_wall
    previous, size = "", 0
    for wave in range(waves + 1):
        # the last row: the decision that wrote the end, and this reader reading it
        batch = batch_rollout_id(rid, wave, 0) if wave < waves else "end"
        if wave < waves:
            decided = next((e for e in trace if "decide" in e and batch in e["commands"]), None)
            command = reader.command_wall.get(batch)
        else:
            decided = next(
                (
                    e
                    for e in trace
                    if "decide" in e and any(s[0] != "progressing" for s in e["states"])
                ),
                None,
            )
            command = reader.state_wall.get(rid)
        row: dict[str, Any] = {"wave": wave if wave < waves else "end"}
        if decided is not None and command is not None:
            end = decided["decide"] + decided["s"]
            write = next((e for e in trace if "write" in e and e["write"] >= end - 1e-3), None)
            back = next(
                (
                    e
                    for e in trace
                    if "read_back" in e and write and e["read_back"] >= write["write"]
                ),
                None,
            )
            txn = None if write is None else write["s"] - (back["s"] if back else 0.0)
            # when the coordinator had folded the previous wave's last terminal ack
            read = _all_acked(trace, previous, size) if previous else None
            row.update(
                {
                    "wake_s": decided["decide"] - since,
                    "coordinator_read_s": None if read is None else read - since,
                    "decide_s": decided["s"],
                    "decide_cpu_s": decided["cpu_s"],
                    "txn_s": txn,
                    "to_reader_s": None if txn is None else command - (end + txn),
                    "total_s": command - since,
                    "decides_between": sum(
                        1
                        for e in trace
                        if "decide" in e and since <= e["decide"] < decided["decide"]
                    ),
                    # states those wrote (e.g. "waiting for <worker>"), each a transaction
                    "states_between": [
                        s
                        for e in trace
                        if "decide" in e and since <= e["decide"] < decided["decide"]
                        for s in e["states"]
                    ],
                }
            )
        out.append(row)
        since = reader.last_ack_wall.get(batch, since)
        previous, size = batch, len(reader.terminal.get(batch, ()))
    return out


def _all_acked(trace: list[dict[str, Any]], rollout_id: str, size: int) -> float | None:
    """When the coordinator's follower had folded ``size`` terminal acks of ``rollout_id``."""
    seen = 0
    for event in trace:
        if "acks" in event:
            seen += event["terminal"].get(rollout_id, 0)
            if seen >= size:
                return float(event["acks"])
    return None


async def measure(bootstrap: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"loadavg_before": loadavg()}
    bench = Bench(bootstrap, args, tmp)
    try:
        print(f"== starting {args.n} agents and a coordinator", flush=True)
        out["fleet"] = await bench.start()
        out["waves"] = [len(w) for w in bench.waves()]
        print(f"   waves {out['waves']}; warm-up (one of each arm, not counted)", flush=True)
        await bench.set_target(RETIRED, None)
        out["warmup"] = {"hand": await bench.by_hand("warm"), "controller": None}
        out["warmup"]["controller"] = await bench.controller("warm")
        rounds = []
        for r in range(args.rounds):
            first_hand = r % 2 == 0
            arms: dict[str, Any] = {}
            for arm in ("hand", "controller") if first_hand else ("controller", "hand"):
                run = bench.by_hand if arm == "hand" else bench.controller
                arms[arm] = await run(f"r{r}")
            print(
                f"   round {r}: by hand {arms['hand']['total_s']:.3f} s, controller "
                f"{arms['controller']['total_s']:.3f} s ({arms['controller']['phase']})",
                flush=True,
            )
            rounds.append({"order": "hand first" if first_hand else "controller first", **arms})
        out["rounds"] = rounds
    finally:
        await bench.stop()
    if args.profile:
        calls = sum(r["controller"]["decide"]["calls"] for r in out["rounds"])
        calls += out["warmup"]["controller"]["decide"]["calls"]
        out["decide_profile"] = profile_summary([str(bench.profile_path)], calls)
    out["loadavg_after"] = loadavg()
    return out
