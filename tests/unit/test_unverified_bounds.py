"""What a coordinator with a trust store holds of forged commands stays bounded, a verdict it
gave stays given, and a command its own store refuses is never published (reviewer's defects
3, 4, 5 on the coordinator's verification).

Pure: records folded by a :class:`Follower` that never starts (no Kafka), the controller's
decisions through :class:`tests.unit.progressive_sim.Sim`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import pytest

from controlplane.coordinator import follower as follower_module
from controlplane.coordinator.follower import Follower
from controlplane.coordinator.snapshots import decode_payload, encode_sections
from controlplane.kafka.bus import Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout import progressive
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.codec import encode
from controlplane.wire.control import ControlPhase, Strategy
from controlplane.wire.errors import CommandRejected, WireCode
from controlplane.wire.protocol import Ack, Command
from controlplane.wire.signing import TrustStore, Verifier
from tests.factories import at, command, nack
from tests.unit import progressive_sim
from tests.unit.progressive_sim import Sim

SETTINGS = KafkaSettings(bootstrap_servers="127.0.0.1:9")
Event = Command | Ack


async def follower(fleet: Fleet) -> Follower:
    """A follower never started, verifying with an empty store: every command is unverified."""
    f = Follower(SETTINGS, fleet, verifier=Verifier(TrustStore()))
    await f.stop()
    return f


def fold(f: Follower, events: Sequence[Event], offset: int = 0) -> int:
    topics = SETTINGS.topics
    for event in events:
        topic = topics.commands if isinstance(event, Command) else topics.acks
        f.fold([Record(topic.name, 0, offset, None, encode(event), 0)])
        offset += 1
    return offset


def forgery(i: int, workers: int = 50) -> list[Event]:
    """An unsigned command (issued at ``i``, expiring at ``i + 10``) and its workers' NACKs."""
    rid = f"forged{i}"
    nacks = [
        nack(f"w{j}", i + 1, "SIGNATURE_MISSING", rollout_id=rid, command_id="f")
        for j in range(workers)
    ]
    return [command(rid, "f", issued=i, expires=i + 10, workers=None), *nacks]


def nacks_held(fleet: Fleet) -> int:
    return sum(len(n) for n in fleet.fold_state().unreadable.values())


async def test_forged_commands_and_their_nacks_are_bounded_and_never_become_rollouts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cap = 20
    f = await follower(Fleet(max_ended_rollouts=2, max_ended_workers=10))
    fleet = f.fleet
    fleet.max_unverified = cap
    offset = 0
    with caplog.at_level(logging.WARNING, logger=follower_module.__name__):
        for i in range(200):
            offset = fold(f, forgery(i), offset)
            assert fleet.stats().unverified <= 2 * cap + 64  # bounded between compactions too
    # Read while catching up (this follower never started): no line per command.
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert fleet.rollout_ids() == [] and fleet.unended() == []
    fleet.compact(at(10_000))  # every forgery expired
    stats = fleet.stats()
    assert (stats.unverified, stats.unverified_dropped) == (cap, 200 - cap)
    assert nacks_held(fleet) == 0  # was 10,000
    listed = fleet.unverified()
    assert [u.rollout_id for u in listed] == [f"forged{i}" for i in range(200 - cap, 200)]
    assert all(u.nacks == 50 for u in listed)  # counted before they were dropped
    # NACKs read later (of a listed forgery, of a dropped one) and a redelivered dropped
    # command: no rollout known from NACKs, nothing held.
    dropped = fleet.stats().dropped_acks
    late = [
        nack("w99", 500, "SIGNATURE_MISSING", rollout_id="forged0", command_id="f"),
        nack("w99", 500, "SIGNATURE_MISSING", rollout_id="forged199", command_id="f"),
    ]
    offset = fold(f, [*late, forgery(0)[0]], offset)
    assert fleet.stats().dropped_acks == dropped + 2
    assert "forged0" not in fleet and "forged199" not in fleet and fleet.rollout_ids() == []
    assert nacks_held(fleet) == 0 and fleet.stats().unverified == cap
    # A snapshot carries what was dropped: a restored fleet drops the same late NACKs.
    again = Fleet()
    again.max_unverified = cap
    again.restore(decode_payload(encode_sections(fleet.fold_state(), None)).fold)
    again.observe_ack(nack("w98", 600, "SIGNATURE_MISSING", rollout_id="forged3", command_id="f"))
    assert again.rollout_ids() == [] and nacks_held(again) == 0
    assert again.unverified() == fleet.unverified()
    assert again.stats().unverified_dropped == 200 - cap + 1  # the redelivery too
    # Once caught up, refused commands are logged, at most UNVERIFIED_LOG_LINES a window.
    f.caught_up.set()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=follower_module.__name__):
        for i in range(1000, 1200):
            offset = fold(f, forgery(i, workers=0), offset)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(lines) <= 2 * follower_module.UNVERIFIED_LOG_LINES


async def test_a_verified_command_sharing_a_forged_id_keeps_its_nacks() -> None:
    """Only NACKs of ids known only from forgeries are dropped with them."""
    f = await follower(Fleet(max_ended_rollouts=2))
    fleet = f.fleet
    fleet.max_unverified = 0
    fold(f, forgery(0, workers=2))
    fleet.observe_command(command("forged0", "f", issued=5))  # as if verified
    fleet.compact(at(10_000))
    assert "forged0" in fleet and fleet.stats().unverified == 0
    assert len(fleet.status("forged0", at(10_000)).anomalies) == 2  # its unreadable NACKs


async def test_a_verdict_from_nacks_stays_when_a_forgery_of_its_ids_comes() -> None:
    """A rollout known only from NACKs is judged failed; once found ended, a forged command
    with its ids does not make it vanish (/tmp/rv_nack.py)."""
    f = await follower(Fleet())
    fleet = f.fleet
    offset = fold(
        f,
        [
            nack("w1", 1, "MALFORMED_JSON", rollout_id="r9", command_id="c9"),
            nack("w2", 2, "MALFORMED_JSON", rollout_id="r9", command_id="c9"),
        ],
    )
    given = fleet.status("r9", at(10))
    assert given.terminal and given.phase is RolloutPhase.FAILED
    fleet.note_ended(given)  # the coordinator's readers note what they judged ended
    fold(f, [command("r9", "c9", issued=0)], offset)
    assert "r9" in fleet and fleet.rollout_ids() == ["r9"]
    again = fleet.status("r9", at(20))
    assert (again.phase, again.expected, again.finished_at) == (
        given.phase,
        given.expected,
        given.finished_at,
    )
    assert [u.nacks for u in fleet.unverified()] == [0]  # its NACKs are the rollout's
    fleet.max_ended_rollouts = 0
    assert fleet.compact(at(30)) == 1 and fleet.is_summarized("r9")


def refusing(code: WireCode) -> Callable[[Command], Command]:
    def seal(cmd: Command) -> Command:
        raise CommandRejected(f"{cmd.rollout_id}: outside the key's scope", code=code)

    return seal


def test_a_progressive_rollout_whose_command_its_store_refuses_ends_aborted_unpublished(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/tmp/rv_ctrl.py: the same batch command was published at every tick (601 times)."""
    sealed = functools.partial(progressive.decide, seal=refusing(WireCode.SCOPE_DENIED))
    monkeypatch.setattr(progressive_sim, "decide", sealed)
    sim = Sim(4, policy=lambda c, w: "silent")
    sim.start(Strategy(canary=1, steps=["100%"]))
    for _ in range(50):
        sim.decide()
        sim.tick(1.0)
    assert sim.commands == []
    state = sim.current()
    assert (state.phase, state.code) == (ControlPhase.ABORTED, "SCOPE_DENIED")
    assert "outside the key's scope" in (state.message or "")
    assert len({s.revision for s in sim.states}) == len(sim.states) <= 2


def test_a_sync_its_store_refuses_is_left_out_of_the_decision() -> None:
    sim = Sim(2)
    sim.workers["w00"].version = "v0"  # drifted from the target's stable v1
    sim.beat()
    plain = progressive.decide(sim.control, sim.fleet, sim.now)
    assert [c.selector.worker_ids for c in plain.commands] == [["w00"]]
    sealed = progressive.decide(
        sim.control, sim.fleet, sim.now, seal=refusing(WireCode.SIGNATURE_MISSING)
    )
    assert sealed.commands == [] and not sealed
    assert [(c.rollout_id, e.code) for c, e in sealed.refused] == [
        (plain.commands[0].rollout_id, WireCode.SIGNATURE_MISSING)
    ]
