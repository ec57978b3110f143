"""A controller stand-in, run as a child process by tests/integration/test_controller_fencing.py.

    python -m tests.controller_member BOOTSTRAP PREFIX NAME [SESSION_MS]

Joins the controller group of fleet PREFIX; while it leads a generation it writes
``NAME-SEQ-gGENERATION`` to the commands topic, one transaction each, through the transactional
producer with the fleet's fixed id, exactly as a controller must (init and every transaction under
``election.leading``; fenced: step down and rejoin; never re-init in that generation). It prints
one line per event for the test to wait on: ``MEMBER g``, ``LEADER g epoch e``, ``TRY v``,
``WROTE v offset``, ``FENCED g v``, ``UNKNOWN g v``, ``LOST g``. SIGTERM ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

from controlplane.kafka.election import LeaderElection, LeadershipLost
from controlplane.kafka.settings import KafkaSettings
from controlplane.kafka.transactions import (
    TransactionalProducer,
    TransactionFenced,
    TransactionOutcomeUnknown,
)

#: Between two transactions of a leader: a pace, so the log is not flooded (no synchronization).
TICK_S = 0.05


def say(line: str) -> None:
    print(line, flush=True)


async def report_membership(election: LeaderElection) -> None:
    """Print each new generation this member is assigned in (the test waits for B's)."""
    seen: int | None = None
    while True:
        if election.member_generation != seen:
            seen = election.member_generation
            say(f"MEMBER {seen}")
        await asyncio.sleep(0.02)


async def lead(
    election: LeaderElection,
    settings: KafkaSettings,
    name: str,
    generation: int,
    stop: asyncio.Event,
    seq: int,
) -> int:
    """Write while leading ``generation``; return the last sequence number used."""
    topics = settings.topics
    producer = TransactionalProducer(settings, topics.controller_transactional_id)
    try:
        async with election.leading(generation):
            await producer.start()  # fences every older holder of the id
        say(f"LEADER {generation} epoch {producer.producer_epoch}")
        while not stop.is_set():
            seq += 1
            value = f"{name}-{seq}-g{generation}"
            try:
                async with election.leading(generation):
                    say(f"TRY {value}")
                    async with producer.transaction() as txn:
                        txn.send(topics.commands.name, value.encode())
            except TransactionFenced:
                say(f"FENCED {generation} {value}")
                await election.rejoin(generation)
                return seq
            except TransactionOutcomeUnknown:
                say(f"UNKNOWN {generation} {value}")
                await election.rejoin(generation)
                return seq
            say(f"WROTE {value} {txn.records[0].offset}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), TICK_S)
    except LeadershipLost:
        say(f"LOST {generation}")
    finally:
        await producer.stop()
    return seq


async def main(bootstrap: str, prefix: str, name: str, session_ms: int) -> None:
    settings = KafkaSettings(bootstrap_servers=bootstrap, topic_prefix=prefix)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    election = LeaderElection(settings, session_timeout_ms=session_ms, heartbeat_interval_ms=1000)
    async with election:
        reporter = asyncio.create_task(report_membership(election))
        seq = 0
        while not stop.is_set():
            leader = asyncio.ensure_future(election.wait_leader())
            stopping = asyncio.ensure_future(stop.wait())
            await asyncio.wait({leader, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not leader.done():
                leader.cancel()
                break
            seq = await lead(election, settings, name, leader.result(), stop, seq)
        reporter.cancel()
    say("EXIT")


if __name__ == "__main__":
    session = int(sys.argv[4]) if len(sys.argv) > 4 else 6000
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], session))
