"""Status aggregation: fold acks from the log into rollout status, against a bare consumer.

On a private broker, writes ``R`` rollouts' commands (each pinned to ``W`` workers, as the CLI
publishes them), ``W`` heartbeats and ``R x W x 3`` acks (accepted, running, then succeeded or,
rarely, failed; reload and config rollouts alternate) as pre-encoded bytes of real agent acks.
Then times, each reading every record of the three topics from the beginning:

* **bare**: an ``AIOKafkaConsumer`` with the Follower's fetch settings that does nothing;
* **bus**: ``controlplane.kafka.bus.Consumer.fetch`` (our Record wrapping, nothing else);
* **follower**: ``controlplane.coordinator.follower.Follower.catch_up`` (decode with the compiled
  ``ack_codec.decode_ack_fast`` + ``Fleet`` fold), followed by the status of every rollout
  (``Fleet.rollouts(now)``) and every worker's level;

plus, without Kafka, decode alone (pydantic ``protocol.decode_ack`` against ``decode_ack_fast``,
interleaved) and fold alone over the same bytes, and a cProfile (CPU time) of one Follower
catch-up. Target: follower >= 0.5x the bare consumer's rate.

``dataset`` (the acks as pre-encoded bytes, produced), ``readers`` (bare, bus, Follower, in
memory, the profile), ``main`` (arguments, the run, the report).

    .venv/bin/python -m bench.aggregate --quick    # ~100,000 acks
    .venv/bin/python -m bench.aggregate            # ~1,000,000 acks
"""

from __future__ import annotations

import logging

log = logging.getLogger("bench.aggregate")
