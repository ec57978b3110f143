"""The data set: R rollouts' commands, W heartbeats and R x W x 3 acks as pre-encoded bytes of real
agent messages (rendered from templates), and producing them to the private broker.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

_T = [datetime(2001, 1, 1, 1, 1, 1, i, tzinfo=UTC) for i in (1, 2, 3, 4)]
_ROLLOUT, _WORKER = "RRRRRRRRRRRRRRRRRRRR", "WWWWWWWWWWWWWW"


# --------------------------------------------------------------------------- the data set


class Template:
    """An encoded message cut at its placeholders; ``render`` joins the pieces with values."""

    def __init__(self, encoded: str, holes: dict[str, str]) -> None:
        by_sentinel = {sentinel: name for name, sentinel in holes.items()}
        pattern = (
            "(" + "|".join(re.escape(s) for s in sorted(by_sentinel, key=len, reverse=True)) + ")"
        )
        pieces = re.split(pattern, encoded)
        self.parts: list[str] = pieces[0::2]
        self.names: list[str] = [by_sentinel[s] for s in pieces[1::2]]

    def render(self, values: dict[str, str]) -> bytes:
        out = [self.parts[0]]
        for name, part in zip(self.names, self.parts[1:], strict=True):
            out.append(values[name])
            out.append(part)
        return "".join(out).encode()


def _ack_templates() -> dict[tuple[str, str], Template]:
    """(kind, state) -> template of a real agent ack, with ids and timestamps as holes."""
    from controlplane.wire.protocol import Ack, AckError, AckState, CommandKind, Timings, encode

    holes = {
        "rollout": _ROLLOUT,
        "worker": _WORKER,
        **{f"t{i}": _T[i].isoformat().replace("+00:00", "Z") for i in range(4)},
    }
    reload_result: dict[str, Any] = {
        "version": "v-20250101-0001",
        "files": 1,
        "tensors": 243,
        "bytes": 1023410176,
        "validate_s": 0.001874,
        "copy_s": 0.128402,
        "duration_s": 0.130276,
        "gbps": 7.97,
    }
    out: dict[tuple[str, str], Template] = {}
    for kind in (CommandKind.RELOAD_WEIGHTS, CommandKind.UPDATE_CONFIG):
        for state in (AckState.ACCEPTED, AckState.RUNNING, AckState.SUCCEEDED, AckState.FAILED):
            terminal = state in (AckState.SUCCEEDED, AckState.FAILED)
            result: dict[str, Any] = {}
            if state is AckState.SUCCEEDED:
                result = (
                    reload_result
                    if kind is CommandKind.RELOAD_WEIGHTS
                    else {"overrides": ["max_new_tokens", "temperature"]}
                )
            ack = Ack(
                command_id=f"{_ROLLOUT}.c1",
                rollout_id=_ROLLOUT,
                worker_id=_WORKER,
                kind=kind,
                state=state,
                weights_version="v-20250101-0001"
                if state is AckState.SUCCEEDED and kind is CommandKind.RELOAD_WEIGHTS
                else "v-20241231-0007",
                config_digest="5f1c0e2a9b7d4c31",
                error=AckError(
                    code="WEIGHTS_UNREADABLE",
                    message="cannot open 'model-00002-of-00004.safetensors': [Errno 5] I/O error",
                    retryable=False,
                )
                if state is AckState.FAILED
                else None,
                timings=Timings(
                    received_at=_T[0],
                    started_at=_T[1] if state is not AckState.ACCEPTED else None,
                    finished_at=_T[2] if terminal else None,
                ),
                sent_at=_T[3],
                result=result,
            )
            out[(kind.value, state.value)] = Template(encode(ack).decode(), holes)
    return out


def _ts(dt: datetime) -> str:
    return dt.isoformat(timespec="microseconds").replace("+00:00", "Z")


def ack_times(
    rollout_id: str, worker_id: str, w: int, issued: datetime
) -> tuple[dict[str, str], list[str]]:
    """The template values of worker number ``w``'s acks of a rollout issued at ``issued``
    (received 3 ms + 40 us a worker later, ran 2 s), and the ``t3`` (sent at) of its accepted,
    running and terminal acks, in that order."""
    received = issued + timedelta(microseconds=40 * w + 3000)
    started = received + timedelta(milliseconds=1)
    finished = started + timedelta(seconds=2)
    values = {
        "rollout": rollout_id,
        "worker": worker_id,
        "t0": _ts(received),
        "t1": _ts(started),
        "t2": _ts(finished),
    }
    return values, [_ts(received), _ts(started), _ts(finished + timedelta(milliseconds=1))]


class DataSet:
    """The commands, heartbeats and acks of ``rollouts`` rollouts over ``workers`` workers."""

    def __init__(self, acks: int, workers: int) -> None:
        self.workers = workers
        self.rollouts = max(1, math.ceil(acks / (3 * workers)))
        self.acks = self.rollouts * workers * 3
        self.base = datetime.now(UTC).replace(microsecond=0) - timedelta(days=1)
        self.worker_ids = [f"gpu-node-{w:05d}.pool-a" for w in range(workers)]
        self.rollout_ids = [f"r-20250101-{r:06d}-bench" for r in range(self.rollouts)]
        self.failures = 0

    def kind(self, r: int) -> str:
        return "reload_weights" if r % 2 == 0 else "update_config"

    def commands(self) -> list[bytes]:
        from controlplane.coordinator.publisher import build_command
        from controlplane.wire.protocol import (
            ReloadWeightsSpec,
            Selector,
            UpdateConfigSpec,
            encode,
        )

        out = []
        for r, rid in enumerate(self.rollout_ids):
            spec: ReloadWeightsSpec | UpdateConfigSpec = (
                ReloadWeightsSpec(path="/models/llm/v-20250101-0001", version="v-20250101-0001")
                if self.kind(r) == "reload_weights"
                else UpdateConfigSpec(overrides={"max_new_tokens": 256, "temperature": 0.7})
            )
            command = build_command(
                spec,
                Selector(worker_ids=self.worker_ids),
                issuer="ops@cli",
                rollout_id=rid,
                now=self.base + timedelta(seconds=10 * r),
            )
            out.append(encode(command))
        return out

    def heartbeats(self) -> list[tuple[bytes, bytes]]:
        from controlplane.wire.protocol import Heartbeat, WorkerStatus, encode, utcnow

        now = utcnow()
        return [
            (
                w.encode(),
                encode(
                    Heartbeat(
                        worker_id=w,
                        labels={"pool": "a", "model": "llm"},
                        runner="torch",
                        device="cuda:0",
                        status=WorkerStatus.READY,
                        weights_version="v-20250101-0001",
                        config_digest="5f1c0e2a9b7d4c31",
                        seq=1000,
                        sent_at=now,
                        started_at=self.base - timedelta(days=1),
                        interval_s=3.0,
                        agent_version="0.1.0",
                    )
                ),
            )
            for w in self.worker_ids
        ]

    def ack_chunks(self, chunk: int = 20_000) -> Iterator[list[tuple[bytes, bytes]]]:
        """(key, value) pairs in log order: per rollout, every worker's three acks."""
        templates = _ack_templates()
        batch: list[tuple[bytes, bytes]] = []
        for r, rid in enumerate(self.rollout_ids):
            kind = self.kind(r)
            issued = self.base + timedelta(seconds=10 * r)
            accepted = templates[(kind, "accepted")]
            running = templates[(kind, "running")]
            for w, wid in enumerate(self.worker_ids):
                values, sent = ack_times(rid, wid, w, issued)
                key = wid.encode()
                batch.append((key, accepted.render({**values, "t3": sent[0]})))
                batch.append((key, running.render({**values, "t3": sent[1]})))
                failed = r % 10 == 3 and w == r % self.workers  # one rollout in ten fails
                self.failures += failed
                values["t3"] = sent[2]
                batch.append(
                    (key, templates[(kind, "failed" if failed else "succeeded")].render(values))
                )
                if len(batch) >= chunk:
                    yield batch
                    batch = []
        if batch:
            yield batch


async def produce(settings: Any, data: DataSet) -> dict[str, Any]:
    from controlplane.kafka.bus import Producer

    topics = settings.topics
    started = time.perf_counter()
    generate_s = 0.0
    nbytes = 0
    sample: list[bytes] = []
    async with Producer(settings, linger_ms=20) as producer:
        commands = data.commands()
        await producer.send_many(topics.commands.name, [(None, c) for c in commands])
        await producer.send_many(topics.workers.name, data.heartbeats())
        chunks = data.ack_chunks()
        while True:
            t0 = time.perf_counter()
            batch = next(chunks, None)
            generate_s += time.perf_counter() - t0
            if batch is None:
                break
            if len(sample) < 100_000:
                sample.extend(v for _, v in batch[: 100_000 - len(sample)])
            nbytes += sum(len(v) for _, v in batch)
            await producer.send_many(topics.acks.name, batch)
    elapsed = time.perf_counter() - started
    data.sample = sample  # type: ignore[attr-defined]
    return {
        "acks": data.acks,
        "commands": len(commands),
        "heartbeats": data.workers,
        "ack_bytes": nbytes,
        "mean_ack_bytes": nbytes / data.acks,
        "command_bytes": len(commands[0]),
        "failed_terminal_acks": data.failures,
        "elapsed_s": elapsed,
        "generate_s": generate_s,
        "acks_per_s": data.acks / elapsed,
    }
