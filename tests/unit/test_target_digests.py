"""Weights-digest agreement per target (issue 13): heartbeats carry the digest of the weights a
worker holds, the registry keeps it, and a target's status groups its live members by (version,
digest) and counts the versions whose workers disagree; the CLI shows it compactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator
from pydantic import JsonValue

from controlplane.cli.progressive import digest_agreement, targets_table
from controlplane.rollout.desired import DigestGroup, TargetStatus, target_status
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.targets import ControlState
from controlplane.wire.control import Desired, TargetSpec, WeightsRef
from controlplane.wire.errors import ProtocolError
from controlplane.wire.protocol import Heartbeat, ReloadWeightsSpec, encode, json_schemas
from tests.factories import T0, at
from tests.factories import heartbeat as fold_heartbeat
from tests.unit.conftest import DECODERS
from tests.unit.conftest import heartbeat as wire_heartbeat
from workers.runners.base import RunnerDescription
from workers.runners.fake_runner import FakeRunner, fake_weights_digest

A, B, C = "a" * 64, "b" * 64, "c" * 64


def beat(worker: str, digest: str | None, *, version: str = "v1", sent: float = 10) -> Heartbeat:
    return fold_heartbeat(worker, sent, version=version).model_copy(
        update={"weights_digest": digest}
    )


def status(*beats: Heartbeat, now: float = 12) -> TargetStatus:
    control = ControlState()
    control.observe(
        TargetSpec(
            name="llama",
            selector={"model": "llama"},
            stable=Desired(weights=WeightsRef(path="/ckpt", version="v1")),
            issued_at=T0,
            issuer="tests",
        )
    )
    fleet = Fleet()
    for hb in beats:
        fleet.observe_heartbeat(hb)
    target = control.target("llama")
    assert target is not None
    return target_status(control, fleet, target, at(now))


def group(version: str | None, digest: str | None, *workers: str) -> DigestGroup:
    return DigestGroup(version=version, digest=digest, workers=len(workers), worker_ids=workers)


# --------------------------------------------------------------------------- agreement


def test_an_agreeing_fleet_is_one_group() -> None:
    shown = status(beat("w1", A), beat("w2", A), beat("w3", A))
    assert shown.digests == (group("v1", A, "w1", "w2", "w3"),)
    assert shown.digests_disagree == 0
    assert {m.worker_id: m.weights_digest for m in shown.members} == {"w1": A, "w2": A, "w3": A}
    assert digest_agreement(shown).plain == f"3 at {'a' * 12}…"
    assert digest_agreement(shown).style == ""


def test_a_disagreeing_worker_is_flagged() -> None:
    shown = status(beat("w1", A), beat("w2", B), beat("w3", A))
    assert shown.digests == (group("v1", A, "w1", "w3"), group("v1", B, "w2"))
    assert shown.digests_disagree == 1
    text = digest_agreement(shown)
    assert text.plain == f"2 at {'a' * 12}…, 1 at {'b' * 12}… (DISAGREE)"
    assert "red" in str(text.style)


def test_different_versions_are_not_a_disagreement() -> None:
    shown = status(beat("w1", A), beat("w2", A), beat("w3", B, version="v2"))
    assert shown.digests == (group("v1", A, "w1", "w2"), group("v2", B, "w3"))
    assert shown.digests_disagree == 0
    assert digest_agreement(shown).plain == f"2 at {'a' * 12}… on v1, 1 at {'b' * 12}… on v2"
    # one version disagreeing among two is counted once
    both = status(beat("w1", A), beat("w2", C), beat("w3", B, version="v2"))
    assert both.digests_disagree == 1


def test_lost_workers_are_left_out() -> None:
    # w-dead was silent for 40 s (3 periods of 5 s have passed): its other digest is not shown
    shown = status(beat("w1", A), beat("w2", A), beat("w-dead", B, sent=-30))
    assert [m.worker_id for m in shown.members if not m.alive] == ["w-dead"]
    assert shown.digests == (group("v1", A, "w1", "w2"),)
    assert shown.digests_disagree == 0


def test_a_worker_reporting_no_digest_disagrees_with_no_one() -> None:
    shown = status(beat("w1", A), beat("w2", None))
    assert shown.digests == (group("v1", A, "w1"), group("v1", None, "w2"))
    assert shown.digests_disagree == 0
    assert digest_agreement(shown).plain == f"1 at {'a' * 12}…, 1 at no digest"


def test_the_latest_heartbeat_s_digest_counts() -> None:
    shown = status(beat("w1", A), beat("w2", B, sent=5), beat("w2", A, sent=10))
    assert shown.digests == (group("v1", A, "w1", "w2"),)


def test_the_targets_table_has_the_agreement_column() -> None:
    table = targets_table([status(beat("w1", A), beat("w2", B))])
    column = table.columns[-1]
    assert column.header == "weights digests"
    (cell,) = column.cells
    assert "(DISAGREE)" in str(cell)


def test_the_api_model_carries_the_agreement() -> None:
    shown = status(beat("w1", A), beat("w2", B))
    out = json.loads(shown.model_dump_json())
    assert out["digests_disagree"] == 1
    assert out["digests"][0] == {"version": "v1", "digest": A, "workers": 1, "worker_ids": ["w1"]}


# --------------------------------------------------------------------------- the wire


def test_heartbeat_weights_digest_round_trips_and_validates() -> None:
    schema = Draft202012Validator(json_schemas()["heartbeat"])
    for digest in (A, "sha256:" + B, "0123456789abcdef"):
        hb = wire_heartbeat(weights_digest=digest)
        raw = encode(hb)
        assert list(schema.iter_errors(json.loads(raw))) == []
        assert DECODERS["heartbeat"](raw).weights_digest == digest
    # an older worker's heartbeat (no digest) still decodes
    old = json.loads(encode(wire_heartbeat()))
    old.pop("weights_digest", None)
    assert DECODERS["heartbeat"](json.dumps(old).encode()).weights_digest is None


@pytest.mark.parametrize("digest", ["ABCDEF0123456789", "abc", "sha256:", "x" * 64, "a" * 129])
def test_a_malformed_weights_digest_is_refused_by_schema_and_decoder(digest: str) -> None:
    instance = json.loads(encode(wire_heartbeat()))
    instance["weights_digest"] = digest
    assert list(Draft202012Validator(json_schemas()["heartbeat"]).iter_errors(instance))
    with pytest.raises(ProtocolError):
        DECODERS["heartbeat"](json.dumps(instance).encode())


# --------------------------------------------------------------------------- runners


def test_the_description_reports_a_well_formed_digest_only() -> None:
    def desc(digest: JsonValue) -> RunnerDescription:
        return RunnerDescription(
            "t", "cpu", True, "v1", {}, "0", {}, extra={"weights_digest": digest}
        )

    assert desc(A).weights_digest == A
    assert desc(None).weights_digest is None
    assert desc("not hex").weights_digest is None  # a heartbeat could not carry it
    assert desc(5).weights_digest is None


def test_the_fake_runner_reports_the_digest_in_force(tmp_path: Path) -> None:
    ckpt = tmp_path / "model.safetensors"
    ckpt.write_bytes(b"\0" * 10)
    runner = FakeRunner({"digest_salt": "s"})
    assert runner.describe().weights_digest is None  # nothing loaded
    runner.load()
    assert runner.describe().weights_digest == fake_weights_digest("init", "s")
    result = runner.reload_weights(ReloadWeightsSpec(path=str(ckpt), version="v2"), ckpt)
    assert (
        runner.describe().weights_digest == result.weights_digest == fake_weights_digest("v2", "s")
    )
    with pytest.raises(Exception, match="corruption"):
        runner.reload_weights(ReloadWeightsSpec(path=str(ckpt), version="corrupt-3"), ckpt)
    assert runner.describe().weights_digest is None  # a mix of two versions has no digest
