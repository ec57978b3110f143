"""The coordinator's fold with a trust store: a command it does not verify never becomes or
changes a rollout, in whatever order the log brings it, its NACKs and the real command.

Pure: records folded by a :class:`Follower` that never starts (no Kafka), as in
test_ack_codec.py; the signatures are real.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from datetime import timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.coordinator.controller import Controller
from controlplane.coordinator.follower import Follower, verify_command
from controlplane.coordinator.snapshots import decode_payload, encode_sections
from controlplane.kafka.bus import Record
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import AnomalyCode, RolloutPhase, RolloutReason
from controlplane.rollout.targets import ControlState
from controlplane.wire.codec import encode
from controlplane.wire.errors import CommandRejected, WireCode
from controlplane.wire.messages import CommandKind
from controlplane.wire.protocol import Ack, Command, ReloadWeightsSpec
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    Verifier,
    command_object,
    public_key_text,
)
from tests.factories import at, command, full, nack

CI = Signer(Ed25519PrivateKey.generate(), "ci")
ROGUE = Signer(Ed25519PrivateKey.generate(), "rogue")
OLD = Signer(Ed25519PrivateKey.generate(), "old")
STORE = TrustStore(
    keys={
        "ci": TrustedKey(
            public_key=public_key_text(CI.key.public_key()),
            scope=KeyScope(
                kinds=[CommandKind.RELOAD_WEIGHTS, CommandKind.UPDATE_CONFIG],
                path_roots=["/ckpt"],
            ),
        ),
        "old": TrustedKey(public_key=public_key_text(OLD.key.public_key())),
    },
    revoked=["old"],
)
SETTINGS = KafkaSettings(bootstrap_servers="127.0.0.1:9")
Event = Command | Ack

#: The real rollout r1: signed, issued at 10, both workers succeed.
REAL = CI.sign(command("r1", "c1", issued=10))
REAL_ACKS: list[Event] = [*full("w1", 11, 12), *full("w2", 11, 13)]
#: Forgeries of r1, issued earlier (the earliest issued_at would be the rollout): unsigned, by
#: a key the store does not hold; and the workers' NACKs of them (no kind: refused unread).
UNSIGNED = command("r1", "f1", issued=0, version="evil")
UNKNOWN = ROGUE.sign(command("r1", "f2", issued=1, version="evil"))
FORGED_NACKS: list[Event] = [
    nack("w1", 2, "SIGNATURE_MISSING", command_id="f1"),
    nack("w2", 3, "KEY_UNKNOWN", command_id="f2"),
]


async def fold(events: Sequence[Event], verifier: Verifier | None = None) -> Follower:
    """``events`` folded in this order, one record per fetch, by a follower never started."""
    follower = Follower(SETTINGS, Fleet(), verifier=verifier)
    await follower.stop()
    topics = SETTINGS.topics
    for offset, event in enumerate(events):
        topic = topics.commands if isinstance(event, Command) else topics.acks
        follower.fold([Record(topic.name, 0, offset, None, encode(event), 0)])
    return follower


async def test_a_forged_command_issued_earlier_never_takes_the_rollout_over_in_any_order() -> None:
    units: list[list[Event]] = [[REAL], [UNSIGNED], [UNKNOWN], REAL_ACKS, FORGED_NACKS]
    for order in itertools.permutations(units):
        f = (await fold([e for unit in order for e in unit], Verifier(STORE))).fleet
        assert f.rollout_ids() == ["r1"] and "r1" in f
        assert f.command("r1") == REAL
        s = f.status("r1", at(20))
        assert (s.command_id, s.phase, s.target_version) == ("c1", RolloutPhase.SUCCEEDED, "v2")
        assert [(a.code, a.command_id) for a in s.anomalies] == [
            (AnomalyCode.COMMAND_UNVERIFIED, "f1"),
            (AnomalyCode.COMMAND_UNVERIFIED, "f2"),
        ]  # their NACKs are listed with them, not as unreadable-command anomalies
        assert "SIGNATURE_MISSING" in s.anomalies[0].message
        assert "KEY_UNKNOWN" in s.anomalies[1].message
        listed = [(u.command_id, u.code, u.key_id, u.nacks) for u in f.unverified()]
        assert listed == [
            ("f1", "SIGNATURE_MISSING", None, 1),
            ("f2", "KEY_UNKNOWN", "rogue", 1),
        ]
        assert f.stats().unverified == 2 and f.stats().commands == 1
        assert f.unended() == ["r1"]


async def test_without_a_trust_store_every_command_folds_as_before() -> None:
    f = (await fold([REAL, UNSIGNED, *REAL_ACKS])).fleet
    assert f.command("r1") == UNSIGNED  # the earliest issued: why the coordinator verifies
    assert f.unverified() == []


async def test_an_id_known_only_from_unverified_commands_and_their_nacks_is_no_rollout() -> None:
    forged = command("r2", "f9", issued=5)
    nacks: list[Event] = [
        nack("w1", 6, "SIGNATURE_MISSING", rollout_id="r2", command_id="f9"),
        nack("w2", 7, "SIGNATURE_MISSING", rollout_id="r2", command_id="f9"),
    ]
    units: list[list[Event]] = [[forged], nacks[:1], nacks[1:], [REAL]]
    for order in itertools.permutations(units):
        f = (await fold([e for unit in order for e in unit], Verifier(STORE))).fleet
        assert f.rollout_ids() == ["r1"] and "r2" not in f
        assert f.unended() == ["r1"] and f.stats().rollouts == 1
        with pytest.raises(KeyError):
            f.status("r2", at(20))
        assert [(u.rollout_id, u.nacks) for u in f.unverified()] == [("r2", 2)]
    # The real issuer may still use the id: its command is the rollout.
    f = (
        await fold([forged, *nacks, CI.sign(command("r2", "c2", issued=8))], Verifier(STORE))
    ).fleet
    assert "r2" in f and f.status("r2", at(9)).command_id == "c2"
    assert [a.code for a in f.status("r2", at(9)).anomalies] == [AnomalyCode.COMMAND_UNVERIFIED]


async def test_a_nack_folded_before_its_command_is_judged_when_asked() -> None:
    forged = command("r2", "f9", issued=5)
    refused = nack("w1", 6, "SIGNATURE_MISSING", rollout_id="r2", command_id="f9")
    garbled = nack("w2", 7, "SCHEMA_INVALID", rollout_id="r2", command_id="c7")
    follower = await fold([refused], Verifier(STORE))
    f = follower.fleet
    assert "r2" in f  # as far as the fold knows, a command no worker could read
    assert f.status("r2", at(8)).reason is RolloutReason.COMMAND_REJECTED
    follower.fold([Record(SETTINGS.topics.commands.name, 0, 9, None, encode(forged), 0)])
    assert "r2" not in f and f.rollout_ids() == [] and f.unended() == []
    # A NACK of another command id (a record no worker could read) still makes a rollout.
    follower.fold([Record(SETTINGS.topics.acks.name, 0, 10, None, encode(garbled), 0)])
    assert f.rollout_ids() == ["r2"]
    s = f.status("r2", at(8))
    assert (s.command_id, s.expected, s.reason) == ("c7", 1, RolloutReason.COMMAND_REJECTED)


async def test_unverified_commands_survive_a_snapshot() -> None:
    events = [UNSIGNED, REAL, UNKNOWN, *REAL_ACKS, *FORGED_NACKS, command("r2", "f9", issued=5)]
    f = (await fold(events, Verifier(STORE))).fleet
    again = Fleet()
    again.restore(decode_payload(encode_sections(f.fold_state(), None)).fold)
    assert again.unverified() == f.unverified() and len(again.unverified()) == 3
    assert again.rollout_ids() == f.rollout_ids() == ["r1"]
    assert again.status("r1", at(20)) == f.status("r1", at(20))
    assert "r2" not in again


async def test_what_the_coordinator_checks_without_clock_or_filesystem() -> None:
    verifier = Verifier(STORE)

    def code(cmd: Command, max_ttl_s: float = 7 * 86400.0) -> WireCode | None:
        try:
            verify_command(verifier, cmd, command_object(cmd), max_ttl_s=max_ttl_s)
        except CommandRejected as exc:
            return WireCode(exc.code)
        return None

    assert code(REAL) is None
    assert code(UNSIGNED) is WireCode.SIGNATURE_MISSING
    assert code(UNKNOWN) is WireCode.KEY_UNKNOWN
    assert code(OLD.sign(command())) is WireCode.KEY_REVOKED
    assert code(REAL.model_copy(update={"issuer": "mallory"})) is WireCode.SIGNATURE_INVALID
    assert code(REAL, max_ttl_s=60) is WireCode.TTL_TOO_LONG
    long = command(expires=8 * 86400.0)
    assert code(CI.sign(long)) is WireCode.TTL_TOO_LONG  # over the default (7 days)
    for path, refused in [
        ("/ckpt/v3", False),
        ("/ckpt/../etc/v3", True),  # lexically: no filesystem on the coordinator
        ("/ckptx/v3", True),
        ("ckpt/v3", True),
        ("/ckpt/./a/../v3", False),
    ]:
        spec = ReloadWeightsSpec(path=path, version="v3")
        signed = CI.sign(command().model_copy(update={"spec": spec}))
        assert code(signed) is (WireCode.SCOPE_DENIED if refused else None), path
    unscoped = TrustStore(keys={"ci": STORE.keys["ci"].model_copy(update={"scope": KeyScope()})})
    pinned = CI.sign(command(issued=0, expires=timedelta(days=1).total_seconds()))
    verify_command(Verifier(unscoped), pinned, command_object(pinned), max_ttl_s=86400.0)


async def test_a_rollout_found_ended_from_nacks_then_known_forged_keeps_its_verdict() -> None:
    """Compaction judged a NACK-only rollout ended; its command then came, unverified: the
    verdict was given, so the rollout stays (its NACKs are its own, not the forgery's), and
    compaction summarizes it without tripping over it."""
    refused = nack("w1", 6, "SIGNATURE_MISSING", rollout_id="r2", command_id="f9")
    follower = await fold([refused], Verifier(STORE))
    f = follower.fleet
    f.max_ended_rollouts = 0
    assert f.check_ended("r2", at(100)) == at(6) and f.excess() == ["r2"]
    follower.fold(
        [Record(SETTINGS.topics.commands.name, 0, 9, None, encode(command("r2", "f9")), 0)]
    )
    assert "r2" in f and f.status("r2", at(200)).reason is RolloutReason.COMMAND_REJECTED
    assert f.excess() == ["r2"] and f.compact(at(200)) == 1 and f.is_summarized("r2")
    assert [u.nacks for u in f.unverified()] == [0]


async def test_the_leader_folds_its_own_commands_as_its_standbys_read_them() -> None:
    """The controller folds what it wrote at once (not waiting for the follower): a command
    its own store does not verify (here a path outside its key's roots) is unverified there
    too, so leader and standbys agree."""
    follower = Follower(SETTINGS, Fleet(), control=ControlState(), verifier=Verifier(STORE))
    await follower.stop()

    def verify(cmd: Command) -> None:
        verify_command(Verifier(STORE), cmd, command_object(cmd), max_ttl_s=7 * 86400.0)

    controller = Controller(SETTINGS, follower, lambda: None, signer=CI, verify=verify)
    outside = command("r3", "r3.a1").model_copy(
        update={"spec": ReloadWeightsSpec(path="/elsewhere/v3", version="v3")}
    )
    for own in (CI.sign(command("r2", "r2.a1")), CI.sign(outside)):
        controller._fold_own(own)
        follower.fold([Record(SETTINGS.topics.commands.name, 0, 0, None, encode(own), 0)])
    f = follower.fleet
    assert f.rollout_ids() == ["r2"] and f.status("r2", at(1)).anomalies == ()
    assert [(u.rollout_id, u.code) for u in f.unverified()] == [("r3", "SCOPE_DENIED")]
