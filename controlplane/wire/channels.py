"""Each channel of the wire declared once: its topic, record key, message model and decoders.

The follower's decoder table and the schema export are derived from :data:`CHANNELS`; a writer
names a channel's topic and key through it (:meth:`Channel.record`). The topics' configs stay
in :mod:`controlplane.wire.topics`. No I/O.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Generic, TypeVar

from controlplane.wire.ack_codec import decode_ack_fast
from controlplane.wire.codec import decode_ack, decode_command, decode_heartbeat, encode
from controlplane.wire.control import control_key, decode_control
from controlplane.wire.messages import Ack, Command, Heartbeat, WireModel
from controlplane.wire.topics import Topics, TopicSpec, command_key, worker_key

M = TypeVar("M", bound=WireModel)


@dataclass(frozen=True)
class Channel(Generic[M]):
    """One kind of message on one topic."""

    #: What a reader calls its messages (the follower's ``Batch`` field: "commands", ...).
    name: str
    #: The schema's name (``controlplane/wire/schemas/<schema>.json``).
    schema: str
    #: The topic, from a fleet's :class:`~controlplane.wire.topics.Topics`.
    spec: Callable[[Topics], TopicSpec]
    model: type[M]
    #: The record key of a message (its partition, hence its order).
    key: Callable[[M], bytes]
    #: The canonical decoder: a model, or a coded ProtocolError.
    decode: Callable[[bytes], M]
    #: A faster decoder giving equal values (not necessarily the model's type), if any.
    fast_decode: Callable[[bytes], Any] | None = None

    def topic(self, topics: Topics) -> str:
        return self.spec(topics).name

    @property
    def reader(self) -> Callable[[bytes], Any]:
        """The decoder a reader of the whole log uses: the fast one where there is one."""
        return self.fast_decode or self.decode

    def record(self, topics: Topics, message: M) -> tuple[str, bytes, bytes]:
        """(topic, key, value) of ``message`` as it goes on the wire."""
        return self.topic(topics), self.key(message), encode(message)


def _commands(topics: Topics) -> TopicSpec:
    return topics.commands


def _acks(topics: Topics) -> TopicSpec:
    return topics.acks


def _workers(topics: Topics) -> TopicSpec:
    return topics.workers


def _controller(topics: Topics) -> TopicSpec:
    return topics.controller


def _by_rollout(command: Command) -> bytes:
    return command_key(command.rollout_id)


def _by_worker(message: Ack | Heartbeat) -> bytes:
    return worker_key(message.worker_id)


#: One partition: every worker sees every command in one total order.
COMMANDS: Final = Channel("commands", "command", _commands, Command, _by_rollout, decode_command)
#: Keyed by worker id: one worker's acks stay in order on one partition.
ACKS: Final = Channel("acks", "ack", _acks, Ack, _by_worker, decode_ack, decode_ack_fast)
#: Compacted, keyed by worker id: the latest heartbeat of each worker survives.
HEARTBEATS: Final = Channel(
    "heartbeats", "heartbeat", _workers, Heartbeat, _by_worker, decode_heartbeat
)
CHANNELS: Final[tuple[Channel[Any], ...]] = (COMMANDS, ACKS, HEARTBEATS)
#: Compacted, one partition: targets, rollouts, operator actions and the controller's state,
#: folded by every reader in one order (wire/control.py). Not one of :data:`CHANNELS`: the
#: workers never read it.
CONTROL: Final = Channel("control", "control", _controller, WireModel, control_key, decode_control)
