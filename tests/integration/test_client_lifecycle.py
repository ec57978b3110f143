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
    """The start is cancelled while bootstrap's metadata request is on its way; that request is
    held until stop() is called, so stop() returns before it is answered unless it waits."""
    client = CLIENTS[kind](kafka)
    opened: list[AIOKafkaConnection] = []
    starting: asyncio.Task[None] | None = None
    stopping = asyncio.Event()
    connect = aiokafka.client.create_conn

    async def connect_and_hold_the_metadata_request(
        *args: Any, **kwargs: Any
    ) -> AIOKafkaConnection:
        conn: AIOKafkaConnection = await connect(*args, **kwargs)
        opened.append(conn)
        if len(opened) == 1:  # bootstrap's connection: its metadata request comes next
            send = conn.send

            async def cancel_the_start_then_send(*args: Any, **kwargs: Any) -> Any:
                assert starting is not None
                starting.cancel()
                await stopping.wait()
                return await send(*args, **kwargs)

            monkeypatch.setattr(conn, "send", cancel_the_start_then_send)
        return conn

    monkeypatch.setattr(aiokafka.client, "create_conn", connect_and_hold_the_metadata_request)
    starting = asyncio.create_task(client.start())
    with pytest.raises(asyncio.CancelledError):
        await starting
    stopping.set()
    await client.stop()
    assert opened
    assert not [conn for conn in opened if conn.connected()]
