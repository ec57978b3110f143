"""``--wait``'s fold (:class:`controlplane.cli.follow.PublishedFleet`): of its rollout, only the
command it published is judged. The reviewer's repro: the real r1/c1 goes to w1 and w2, w1
succeeds and w2 fails; an unsigned forgery r1/c1 issued earlier names w1 only. Whatever the
order the records are read in, the verdict is the real one (failed), and the forgery is said
once (the live, real-broker run: tests/integration/test_cli_forged.py)."""

from __future__ import annotations

import pytest

from controlplane.cli.follow import PublishedFleet, foreign_commands
from controlplane.coordinator.follower import Follower
from controlplane.kafka.bus import Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.codec import encode
from controlplane.wire.messages import AckState
from controlplane.wire.protocol import Command, WireModel
from tests.factories import at, command, full

SETTINGS = KafkaSettings(bootstrap_servers="127.0.0.1:9")
REAL = command("r1", "c1", issued=10, workers=("w1", "w2"))
FORGED = command("r1", "c1", issued=5, workers=("w1",)).model_copy(update={"issuer": "mallory"})
ACKS = [
    *full("w1", 11, 12),
    *full("w2", 11, 13, terminal=AckState.FAILED, code="WEIGHTS_SHAPE_MISMATCH"),
]


async def folded(fleet: Fleet, events: list[WireModel]) -> Follower:
    follower = Follower(SETTINGS, fleet)
    await follower.stop()
    topics = SETTINGS.topics
    for offset, event in enumerate(events):
        topic = topics.commands if isinstance(event, Command) else topics.acks
        follower.fold([Record(topic.name, 0, offset, None, encode(event), 0)])
    return follower


@pytest.mark.parametrize("where", range(len(ACKS) + 2))
async def test_the_published_command_is_judged_wherever_a_forgery_of_its_ids_falls(
    where: int,
) -> None:
    fleet = PublishedFleet()
    fleet.publishing(REAL)
    events: list[WireModel] = [REAL, *ACKS]
    events.insert(where, FORGED)
    follower = await folded(fleet, events)
    status = fleet.status("r1", at(20))
    assert status.phase is RolloutPhase.FAILED
    assert (status.counts.succeeded, status.counts.failed, status.expected) == (1, 1, 2)
    assert fleet.command("r1") == REAL and fleet.ignored == [FORGED]
    told: set[tuple[str, str]] = set()
    (line,) = foreign_commands(follower, "r1", told)
    assert "ignored command c1 of rollout r1" in line and "'mallory'" in line
    assert foreign_commands(follower, "r1", told) == []  # said once


async def test_other_rollouts_and_redeliveries_of_the_published_command_are_folded() -> None:
    fleet = PublishedFleet()
    fleet.publishing(REAL)
    other = command("r2", "c2", issued=1, workers=("w1",))
    await folded(fleet, [REAL, REAL, other])
    assert fleet.command("r1") == REAL and fleet.command("r2") == other
    assert fleet.ignored == []
