"""The fair floor of a fan-out: a bare worker, the least a hand-written one does with aiokafka.

Each bare worker has its own ``AIOKafkaConsumer`` and ``AIOKafkaProducer``, as each agent does,
with the client settings that matter for what it promises (as in ``controlplane.kafka``):

* commands: partition 0 of the commands topic (one partition, every worker reads every command),
  assigned by hand under the worker's own group (``Topics.worker_group``, never joined), read
  ``read_committed``, from the committed offset or else the head of the log; the same fetch
  settings as the agent's consumer (``fetch_max_wait_ms`` 3000, ``max_partition_fetch_bytes``
  2 MiB, the background fetcher polling every 3 s (``consumer_timeout_ms``), ``getmany`` of at
  most 16 records with a 5 s timeout);
* acks: ``acks=all``, idempotent, no linger, keyed by worker id (one partition per worker, in
  order), one terminal ``succeeded`` ack per command, awaited until the cluster confirms it;
* then the next offset is committed (a worker that restarts resumes after what it acked).

Per command it ``json.loads`` the record, skips it unless the worker id is in the selector, and
writes a ``json.dumps`` of the fields the schema requires. Nothing else: no schema validation,
no signatures, no journal, no accepted/running acks, no heartbeats, no runner thread. The
coordinator's ``Follower`` judges these acks exactly as it judges an agent's.
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime
from typing import Any

#: The agent's consumer settings (``workers.agent.loop``: ``fetch_max_wait_ms=3000``,
#: ``fetcher_poll_ms=3000``, and the command loop's ``fetch(timeout_s=COMMAND_WAIT_S,
#: max_records=16)``).
FETCH_MAX_WAIT_MS = 3000
FETCHER_POLL_MS = 3000
FETCH_TIMEOUT_MS = 5000
MAX_RECORDS = 16
MAX_PARTITION_FETCH_BYTES = 2 * 1024 * 1024


class BareWorker:
    """One hand-written worker: read a command, ack it ``succeeded``, commit the offset."""

    def __init__(self, bootstrap: str, prefix: str, worker_id: str) -> None:
        from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

        from controlplane.wire.topics import Topics

        topics = Topics(prefix)
        self.worker_id = worker_id
        self.key = worker_id.encode()
        self.acks_topic = topics.acks.name
        self.partition = TopicPartition(topics.commands.name, 0)
        self.acked = 0
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            client_id="bench-bare",
            group_id=topics.worker_group(worker_id),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_partition_fetch_bytes=MAX_PARTITION_FETCH_BYTES,
            fetch_max_wait_ms=FETCH_MAX_WAIT_MS,
            consumer_timeout_ms=FETCHER_POLL_MS,
            isolation_level="read_committed",
        )
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            client_id="bench-bare",
            acks="all",
            enable_idempotence=True,
            linger_ms=0,
            max_request_size=2 * 1024 * 1024,
        )

    async def start(self) -> None:
        """Connect, and read from the committed offset, else from the head of the log (a new
        worker is not given the history), fixed now: a command published after this is seen."""
        await self.producer.start()
        await self.consumer.start()
        tp = self.partition
        self.consumer.assign([tp])
        committed = await self.consumer.committed(tp)
        if committed is None or committed < 0:
            committed = (await self.consumer.end_offsets([tp]))[tp]
        self.consumer.seek(tp, committed)

    async def run(self, stop: asyncio.Event) -> None:
        tp = self.partition
        while not stop.is_set():
            batch = await self.consumer.getmany(
                tp, timeout_ms=FETCH_TIMEOUT_MS, max_records=MAX_RECORDS
            )
            for record in batch.get(tp, ()):
                ack = self.ack(record.value)
                if ack is not None:
                    await self.producer.send_and_wait(self.acks_topic, ack, key=self.key)
                    self.acked += 1
                await self.consumer.commit({tp: record.offset + 1})

    def ack(self, value: bytes | None) -> bytes | None:
        """The terminal ack of a command addressed to this worker; None for any other record."""
        received = datetime.now(UTC).isoformat()
        try:
            command: dict[str, Any] = json.loads(value or b"")
            ids = command["selector"].get("worker_ids")
            if ids is not None and self.worker_id not in ids:
                return None
            ack = {
                "schema_version": 1,
                "command_id": command["command_id"],
                "rollout_id": command["rollout_id"],
                "worker_id": self.worker_id,
                "kind": command["spec"]["kind"],
                "state": "succeeded",
                "timings": {"received_at": received},
                "sent_at": datetime.now(UTC).isoformat(),
            }
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # not a command this worker can read: skipped
        return json.dumps(ack, separators=(",", ":")).encode()

    async def close(self) -> None:
        await self.consumer.stop()
        await self.producer.stop()
