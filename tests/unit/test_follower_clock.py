"""A probing follower's clock of the workers partition: the latest append read there (a broker
append time, or the send time of this reader's own probe).

Records are built here (the fold's input); no broker needed. The cluster-level behaviour is in
tests/integration/test_cluster.py (a prober judges no worker lost while Kafka holds writes back).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest

from controlplane.coordinator.follower import PROBE_KEY, Follower
from controlplane.kafka.bus import LOG_APPEND_TIME, Record
from controlplane.kafka.settings import KafkaSettings

T0 = 1_800_000_000.0


@pytest.fixture
async def f() -> AsyncIterator[Follower]:
    follower = Follower(
        KafkaSettings(bootstrap_servers="127.0.0.1:9"), probe=True, probe_interval_s=1.0
    )
    yield follower
    await follower.stop()  # never started: closes its consumer


def _heartbeat(at: float) -> Record:
    return Record("fleet.workers", 0, 0, b"w1", b"{}", int(at * 1000), LOG_APPEND_TIME)


def _probe(follower: Follower, at: float) -> Record:
    value = json.dumps({"probe": follower.reader_id, "sent_at": at}).encode()
    return Record("fleet.workers", 0, 0, PROBE_KEY, value, int(at * 1000), LOG_APPEND_TIME)


async def test_the_clock_is_the_latest_append_read(f: Follower) -> None:
    f._note_written([_heartbeat(T0), _probe(f, T0 + 1), _heartbeat(T0 + 1.5)])
    assert f.written_as_of() == T0 + 1.5
    assert f.probes_read == 1


async def test_the_clock_follows_the_appends(f: Follower) -> None:
    f._note_written([_probe(f, T0 + i * 1.0) for i in range(10)])
    assert f.written_as_of() == T0 + 9


async def test_without_append_times_only_this_readers_own_probes_move_it(f: Follower) -> None:
    def create_time(key: bytes, value: bytes, at: float) -> Record:
        return Record("fleet.workers", 0, 0, key, value, int(at * 1000), 0)

    other = json.dumps({"probe": "someone-else", "sent_at": T0 + 50}).encode()
    own = json.dumps({"probe": f.reader_id, "sent_at": T0 + 2}).encode()
    f._note_written([create_time(b"w1", b"{}", T0 + 99), create_time(PROBE_KEY, other, T0 + 50)])
    assert f.written_as_of() is None  # a worker's or another reader's clock proves nothing
    f._note_written([create_time(PROBE_KEY, own, T0 + 99)])
    assert f.written_as_of() == T0 + 2 and f.probes_read == 1
