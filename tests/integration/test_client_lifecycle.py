"""Our Kafka clients leave no connection open, against the real broker, whenever they stop.

aiokafka's bootstrap (the first step of every client's start) opens a connection, asks it for
the cluster's metadata and closes it; a start cancelled in those milliseconds (the coordinator
stopping just as its controller was elected and began to start its transactional producer)
dropped that connection unclosed, out of reach of any close(): the garbage collector found it
later, during whichever test ran then ("Unclosed AIOKafkaConnection", an error under
``filterwarnings = error``).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import aiokafka.client
import pytest
from aiokafka.conn import AIOKafkaConnection

from controlplane.kafka.bus import Admin, Consumer, Producer
from controlplane.kafka.client import ClientLifecycle
from controlplane.kafka.election import LeaderElection
from controlplane.kafka.settings import KafkaSettings
from controlplane.kafka.transactions import TransactionalProducer
from tests.fleet import wait_for

pytestmark = pytest.mark.kafka

CLIENTS: dict[str, Callable[[KafkaSettings], ClientLifecycle]] = {
    "producer": Producer,
    "transactional-producer": lambda s: TransactionalProducer(s, f"tx-{uuid.uuid4().hex}"),
    "consumer": Consumer,
    "admin": Admin,
    "leader-election": LeaderElection,
}


@pytest.mark.parametrize("kind", list(CLIENTS))
async def test_a_start_cancelled_while_bootstrapping_leaves_no_connection_open(
    kafka: KafkaSettings, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    client = CLIENTS[kind](kafka)
    opened: list[AIOKafkaConnection] = []
    starting: asyncio.Task[None] | None = None
    connect = aiokafka.client.create_conn

    async def connect_then_cancel_the_start(*args: Any, **kwargs: Any) -> AIOKafkaConnection:
        conn: AIOKafkaConnection = await connect(*args, **kwargs)
        opened.append(conn)
        if len(opened) == 1 and starting is not None:  # bootstrap's: its metadata request next
            starting.cancel()
        return conn

    monkeypatch.setattr(aiokafka.client, "create_conn", connect_then_cancel_the_start)
    starting = asyncio.create_task(client.start())
    with pytest.raises(asyncio.CancelledError):
        await starting
    await client.stop()
    assert opened
    await wait_for(lambda: not any(conn.connected() for conn in opened), timeout=15)
