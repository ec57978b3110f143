"""A :class:`Delivery` over the future aiokafka hands back: confirmed (at once when it already
is), given up (coded), or not yet confirmed (PUBLISH_OUTCOME_UNKNOWN, the record kept)."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka.errors import KafkaTimeoutError
from aiokafka.structs import RecordMetadata, TopicPartition

from controlplane.kafka.producer import Delivery
from controlplane.wire.errors import BusError, LocalCode


def _meta(offset: int) -> RecordMetadata:
    return RecordMetadata("acks", 2, TopicPartition("acks", 2), offset, 1_700_000_000_000, 0, 0)


async def test_a_delivery_confirmed_already_gives_its_record_without_waiting() -> None:
    future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
    future.set_result(_meta(41))
    delivery = Delivery("acks", b"w-1", b"{}", future)
    assert delivery.done
    record = await delivery.wait(0.0)  # no time left, and none needed
    assert (record.topic, record.partition, record.offset) == ("acks", 2, 41)
    assert (record.key, record.value, record.timestamp_ms) == (b"w-1", b"{}", 1_700_000_000_000)


async def test_a_delivery_the_producer_gave_up_on_raises_a_coded_error_done_or_not() -> None:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[RecordMetadata] = loop.create_future()
    done.set_exception(KafkaTimeoutError())
    with pytest.raises(BusError) as caught:
        await Delivery("acks", None, b"{}", done).wait(5.0)
    assert caught.value.code is LocalCode.BROKER_UNAVAILABLE

    later: asyncio.Future[RecordMetadata] = loop.create_future()
    waiting = asyncio.ensure_future(Delivery("acks", None, b"{}", later).wait(3600.0))
    await asyncio.sleep(0)
    later.set_exception(KafkaTimeoutError())
    with pytest.raises(BusError) as caught:
        await waiting
    assert caught.value.code is LocalCode.BROKER_UNAVAILABLE


async def test_a_wait_that_times_out_keeps_the_record_for_the_next_wait() -> None:
    future: asyncio.Future[RecordMetadata] = asyncio.get_running_loop().create_future()
    delivery = Delivery("acks", None, b"{}", future)
    with pytest.raises(BusError) as caught:
        await delivery.wait(0.0)
    assert caught.value.code is LocalCode.PUBLISH_OUTCOME_UNKNOWN
    assert not future.cancelled()  # shielded: the producer still retries it
    future.set_result(_meta(7))
    assert (await delivery.wait(0.0)).offset == 7
