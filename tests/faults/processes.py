"""The fault suite's processes: fake-runner worker agents (`python -m workers run`), `controlplane`
CLI runs, each with its output in a file, and the ``Fleet`` of them on the local 3-node cluster.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.kafka.broker import LocalCluster
from controlplane.wire.protocol import (
    AckState,
    Heartbeat,
    WorkerStatus,
    decode_ack,
    decode_heartbeat,
)
from tests.factories import base_env, tail, worker_argv
from tests.faults.reading import JSON, read_topic, until

# --------------------------------------------------------------------------- processes


class WorkerProcess:
    """`python -m workers run` with the fake runner; its log and journal in ``root``."""

    def __init__(
        self,
        root: Path,
        bootstrap: str,
        prefix: str,
        worker_id: str,
        options: JSON,
        labels: dict[str, str],
    ) -> None:
        self.worker_id = worker_id
        self.root = root
        self.log = root / f"{worker_id}.log"
        # The product's default heartbeat period: the liveness it gives is what is tested.
        self.argv = worker_argv(
            worker_id,
            bootstrap=bootstrap,
            prefix=prefix,
            state_dir=root / "state",
            options=options,
            allow_root=root / "ckpts",
            labels=labels,
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv, env=base_env(), stdout=log, stderr=subprocess.STDOUT
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM (drain), then SIGKILL if it does not exit."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)

    def journal(self) -> list[JSON]:
        path = self.root / "state" / self.worker_id / "state.jsonl"
        try:
            lines = path.read_text().splitlines()
        except FileNotFoundError:
            return []
        out: list[JSON] = []
        for line in lines:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except ValueError:  # a torn last line while it is being written
                    continue
        return out

    def outcomes(self) -> Counter[str]:
        """How many outcomes the journal recorded per command id (1 = applied once)."""
        return Counter(e["ack"]["command_id"] for e in self.journal() if e.get("t") == "outcome")

    def published(self) -> set[str]:
        """Command ids whose terminal ack the journal marks as published (or compacted so)."""
        marks = {e["id"] for e in self.journal() if e.get("t") == "published"}
        marks |= {
            e["ack"]["command_id"]
            for e in self.journal()
            if e.get("t") == "outcome" and e.get("published") is True
        }
        return marks

    def applied(self) -> Counter[str]:
        """How many times the agent started applying each command (its "applying" log lines)."""
        counts: Counter[str] = Counter()
        pattern = re.compile(r"\[worker=\S+ command=(\S+) rollout=\S+\] applying ")
        for line in self.log.read_text(errors="replace").splitlines():
            match = pattern.search(line)
            if match:
                counts[match.group(1)] += 1
        return counts


@dataclass
class CliRun:
    """One `python -m controlplane ...` process; stdout and stderr in files."""

    name: str
    argv: list[str]
    root: Path
    proc: subprocess.Popen[bytes] | None = None
    rc: int | None = None

    @property
    def out(self) -> Path:
        return self.root / f"{self.name}.out"

    @property
    def err(self) -> Path:
        return self.root / f"{self.name}.err"

    def start(self) -> CliRun:
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(self.argv, env=base_env(), stdout=out, stderr=err)
        return self

    def poll(self) -> int | None:
        assert self.proc is not None
        self.rc = self.proc.poll()
        return self.rc

    def wait(self, timeout: float) -> int | None:
        """Its exit status, or None when it had not exited after ``timeout`` (then it is killed:
        a hang)."""
        assert self.proc is not None
        try:
            self.rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            self.rc = None
        return self.rc

    async def wait_async(self, timeout: float) -> int | None:
        return await asyncio.to_thread(self.wait, timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def json(self) -> Any:
        try:
            return json.loads(self.stdout)
        except ValueError as exc:
            raise AssertionError(f"not JSON from {self.name}: {self}") from exc

    def __str__(self) -> str:
        return (
            f"{self.name}: rc={self.rc}\n--- stdout\n{self.stdout[-3000:]}"
            f"\n--- stderr\n{self.stderr[-3000:]}"
        )


@dataclass
class Fleet:
    """Three fake-runner workers on fresh RF-3 topics of the cluster, and the CLI against them."""

    cluster: LocalCluster
    root: Path
    prefix: str
    reload_delay_s: float
    size: int = 3
    labels: dict[str, str] = field(default_factory=lambda: {"suite": "faults"})
    workers: dict[str, WorkerProcess] = field(default_factory=dict)
    clis: list[CliRun] = field(default_factory=list)

    @property
    def bootstrap(self) -> str:
        return self.cluster.bootstrap

    @property
    def ckpt(self) -> Path:
        return self.root / "ckpts" / "model.safetensors"

    def topic(self, name: str) -> str:
        return f"{self.prefix}.{name}"

    def cli(self, name: str, *args: str) -> CliRun:
        """Start ``controlplane ARGS --bootstrap ... --topic-prefix ...`` (not waited for)."""
        argv = [sys.executable, "-m", "controlplane", *args]
        argv += ["--bootstrap", self.bootstrap, "--topic-prefix", self.prefix]
        run = CliRun(name, argv, self.root).start()
        self.clis.append(run)
        return run

    async def cli_done(self, name: str, *args: str, timeout: float = 300.0) -> CliRun:
        run = self.cli(name, *args)
        await run.wait_async(timeout)
        return run

    def reload(
        self,
        name: str,
        version: str,
        rollout_id: str,
        *extra: str,
        wait: bool = True,
        as_json: bool = True,
    ) -> CliRun:
        """`controlplane reload-weights` to every worker of the fleet (by its label); without
        ``as_json`` it prints what a person sees (progress lines on stderr, the table)."""
        args = [
            "reload-weights",
            str(self.ckpt),
            "--version",
            version,
            "--rollout-id",
            rollout_id,
            *[a for k, v in self.labels.items() for a in ("-s", f"{k}={v}")],
            "--ttl",
            "1800",
            *(["--json"] if as_json else []),
            *extra,
        ]
        if wait and "--wait" not in extra:
            args += ["--wait", "--wait-timeout", "600"]
        return self.cli(name, *args)

    async def setup(self) -> None:
        """`topics ensure` with RF 3 and min ISR 2, then the workers, until all are ready."""
        (self.root / "ckpts").mkdir(parents=True, exist_ok=True)
        self.ckpt.write_bytes(b"\0" * 64)
        ensured = await self.cli_done(
            "topics-ensure", "topics", "ensure", "--replication-factor", "3",
            "--min-insync-replicas", "2",
        )  # fmt: skip
        assert ensured.rc == 0, str(ensured)
        assert "replication factor 3, min.insync.replicas 2" in ensured.stdout, str(ensured)
        for i in range(1, self.size + 1):
            wid = f"w{i}"
            self.workers[wid] = WorkerProcess(
                self.root,
                self.bootstrap,
                self.prefix,
                wid,
                {"reload_delay_s": self.reload_delay_s},
                self.labels,
            )
            self.workers[wid].start()
        await self.wait_ready()

    async def wait_ready(self, timeout: float = 180.0) -> None:
        """Every worker's latest heartbeat in the log is ``ready`` (and no process exited)."""

        async def ready() -> bool:
            for w in self.workers.values():
                if not w.running:
                    raise AssertionError(f"worker {w.worker_id} exited:\n{tail(w.log)}")
            beats = await read_topic(self.bootstrap, self.topic("workers"), decode_heartbeat)
            latest: dict[str, Heartbeat] = {}
            for hb in beats:
                if hb.worker_id not in latest or hb.seq > latest[hb.worker_id].seq:
                    latest[hb.worker_id] = hb
            return all(
                wid in latest and latest[wid].status is WorkerStatus.READY for wid in self.workers
            )

        await until(ready, timeout=timeout, what="every worker is ready")

    async def wait_running(self, command_id: str, timeout: float = 120.0) -> None:
        """Every worker has acked ``running`` for ``command_id``: it is mid-apply."""

        async def running() -> bool:
            acks = await read_topic(self.bootstrap, self.topic("acks"), decode_ack)
            seen = {
                a.worker_id
                for a in acks
                if a.command_id == command_id and a.state is AckState.RUNNING
            }
            return seen >= set(self.workers)

        await until(running, timeout=timeout, what=f"every worker runs {command_id}")

    async def wait_published(self, command_ids: Iterable[str], timeout: float = 180.0) -> None:
        """Every worker's journal marks each command's terminal ack published (all in the log)."""
        wanted = set(command_ids)

        def published() -> bool:
            return all(wanted <= w.published() for w in self.workers.values())

        await until(published, timeout=timeout, what="every terminal ack is marked published")

    def stop(self) -> None:
        for run in self.clis:
            run.kill()
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.proc.terminate()
        for w in self.workers.values():
            w.stop()

    def logs(self) -> str:
        parts = [f"==== {w.log.name}\n{tail(w.log)}" for w in self.workers.values()]
        parts += [str(run) for run in self.clis[-6:]]
        return "\n".join(parts)
