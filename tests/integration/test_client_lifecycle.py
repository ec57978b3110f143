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

from controlplane.kafka.bus import Admin, Consumer, Producer, probe
from controlplane.kafka.client import ClientLifecycle
from controlplane.kafka.election import LeaderElection
from controlplane.kafka.settings import KafkaSettings
from controlplane.kafka.transactions import TransactionalProducer
from controlplane.wire.errors import BusError, LocalCode

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


async def test_a_probe_that_times_out_during_the_metadata_request_leaves_no_connection_open(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker answers the bootstrap's metadata request only after the probe gave up (a
    broker still starting, on a loaded machine; the tests' broker is probed like this until it
    serves): the probe's timeout cancelled the bootstrap during that request, and its
    connection stayed open. Here the answer comes once the probe is stopping its client."""
    opened: list[AIOKafkaConnection] = []
    stopping = asyncio.Event()
    connect = aiokafka.client.create_conn
    stop = Admin.stop

    async def connect_and_answer_the_metadata_request_late(
        *args: Any, **kwargs: Any
    ) -> AIOKafkaConnection:
        conn: AIOKafkaConnection = await connect(*args, **kwargs)
        opened.append(conn)
        if len(opened) == 1:  # bootstrap's connection: its metadata request comes next
            send = conn.send

            async def send_once_the_probe_gave_up(*args: Any, **kwargs: Any) -> Any:
                await stopping.wait()
                return await send(*args, **kwargs)

            monkeypatch.setattr(conn, "send", send_once_the_probe_gave_up)
        return conn

    async def stop_noted(admin: Admin) -> None:
        stopping.set()
        await stop(admin)

    monkeypatch.setattr(
        aiokafka.client, "create_conn", connect_and_answer_the_metadata_request_late
    )
    monkeypatch.setattr(Admin, "stop", stop_noted)
    with pytest.raises(BusError) as info:
        await probe(kafka_bootstrap, timeout=1.0)
    assert info.value.code is LocalCode.BROKER_UNAVAILABLE
    assert opened
    assert not [conn for conn in opened if conn.connected()]
