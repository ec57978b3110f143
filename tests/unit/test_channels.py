"""Each channel is declared once; the follower's decoders and the schema export come from it."""

from __future__ import annotations

import pytest

from controlplane.coordinator.follower import Follower
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.ack_codec import decode_ack_fast
from controlplane.wire.channels import ACKS, CHANNELS, COMMANDS, HEARTBEATS
from controlplane.wire.errors import ProtocolError
from controlplane.wire.protocol import (
    Ack,
    Command,
    Heartbeat,
    ReloadWeightsSpec,
    decode_ack,
    decode_command,
    decode_heartbeat,
    encode,
)
from controlplane.wire.schema_export import SCHEMA_DIR, json_schemas
from controlplane.wire.topics import Topics, command_key, worker_key
from tests.factories import T0, fake_heartbeat, succeeded_acks
from tests.fleet import make_command

TOPICS = Topics(prefix="fleet-x")


def _command() -> Command:
    return make_command(
        ReloadWeightsSpec(path="/w", version="v2"), command_id="c1", rollout_id="r1"
    )


def _ack() -> Ack:
    return succeeded_acks("w1", "r1", "c1")[0]


def _heartbeat() -> Heartbeat:
    return fake_heartbeat("w1", T0, interval_s=3)


def test_the_three_channels_name_their_topics_keys_models_and_decoders() -> None:
    assert CHANNELS == (COMMANDS, ACKS, HEARTBEATS)
    assert [c.topic(TOPICS) for c in CHANNELS] == [t.name for t in TOPICS.all()]
    assert [c.spec(TOPICS) for c in CHANNELS] == TOPICS.all()
    assert (COMMANDS.model, ACKS.model, HEARTBEATS.model) == (Command, Ack, Heartbeat)
    assert (COMMANDS.decode, ACKS.decode, HEARTBEATS.decode) == (
        decode_command,
        decode_ack,
        decode_heartbeat,
    )
    assert (COMMANDS.reader, ACKS.reader, HEARTBEATS.reader) == (
        decode_command,
        decode_ack_fast,
        decode_heartbeat,
    )
    command, ack, beat = _command(), _ack(), _heartbeat()
    assert COMMANDS.record(TOPICS, command) == (
        "fleet-x.commands",
        command_key("r1"),
        encode(command),
    )
    assert ACKS.record(TOPICS, ack) == ("fleet-x.acks", worker_key("w1"), encode(ack))
    assert HEARTBEATS.record(TOPICS, beat) == ("fleet-x.workers", worker_key("w1"), encode(beat))


@pytest.mark.parametrize("message", [_command(), _ack(), _heartbeat()], ids=type)
def test_what_a_channel_writes_its_decoders_read_back(message: Command | Ack | Heartbeat) -> None:
    (channel,) = [c for c in CHANNELS if c.model is type(message)]
    _, _, value = channel.record(TOPICS, message)
    assert channel.decode(value) == message
    read = channel.reader(value)
    if channel.reader is channel.decode:
        assert read == message
    else:  # the fast decoder's own types, equal values
        assert isinstance(message, Ack)
        assert (read.command_id, read.state, read.sent_at) == (
            message.command_id,
            message.state,
            message.sent_at,
        )
    with pytest.raises(ProtocolError):
        channel.reader(b"{}")


def test_the_schema_export_has_one_file_per_channel() -> None:
    assert list(json_schemas()) == [c.schema for c in CHANNELS]
    assert sorted(p.stem for p in SCHEMA_DIR.glob("*.json")) == sorted(c.schema for c in CHANNELS)


async def test_the_follower_reads_each_channel_with_its_decoder() -> None:
    settings = KafkaSettings(bootstrap_servers="127.0.0.1:9", topic_prefix="fleet-x")
    follower = Follower(settings)
    slow = Follower(settings, decode_ack=decode_ack)
    await follower.stop()  # never started: the table needs no Kafka
    await slow.stop()
    table = {topic: (decode, kind) for topic, (decode, _, kind) in follower._decoders.items()}
    assert table == {c.topic(TOPICS): (c.reader, c.name) for c in CHANNELS}
    assert slow._decoders["fleet-x.acks"][0] is decode_ack
