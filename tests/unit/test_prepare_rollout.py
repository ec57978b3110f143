"""The one create-rollout path (publisher.prepare_rollout), shared by the CLI and the coordinator:
no I/O, liveness judged at the caller's ``as_of``, the command issued at its ``now``."""

from __future__ import annotations

import pytest

from controlplane.coordinator.publisher import RolloutRequest, build_command, prepare_rollout
from controlplane.rollout.fleet import Fleet
from controlplane.wire.errors import CommandRejected, LocalCode, WireCode
from controlplane.wire.protocol import ReloadWeightsSpec, Selector
from tests.factories import at, heartbeat

SPEC = ReloadWeightsSpec(path="/ckpt/model.safetensors", version="v2")


def fleet() -> Fleet:
    """w1 and w2 (model=tiny) heard at 0 s, w3 (model=big) too; 5 s heartbeats, no lease."""
    out = Fleet()
    for worker_id, model in (("w1", "tiny"), ("w2", "tiny"), ("w3", "big")):
        out.observe_heartbeat(heartbeat(worker_id, 0.0, labels={"model": model}))
    return out


def test_the_selector_is_pinned_to_the_workers_alive_at_as_of() -> None:
    request = RolloutRequest(SPEC, Selector(labels={"model": "tiny"}), ttl_s=60, timeout_s=9)
    command = prepare_rollout(request, fleet(), as_of=at(1), now=at(500), issuer="me@cli")
    assert command.selector.worker_ids == ["w1", "w2"]
    assert command.selector.labels == {"model": "tiny"}
    assert (command.issued_at, command.expires_at) == (at(500), at(560))
    assert (command.issuer, command.timeout_s, command.spec) == ("me@cli", 9, SPEC)


def test_liveness_is_judged_at_as_of_not_at_now() -> None:
    request = RolloutRequest(SPEC, Selector(labels={"model": "tiny"}))
    with pytest.raises(CommandRejected) as caught:
        prepare_rollout(request, fleet(), as_of=at(500), now=at(1), issuer="me@cli")
    assert caught.value.code is LocalCode.NO_MATCHING_WORKERS


def test_a_rollout_id_in_the_log_is_refused_before_anything_else() -> None:
    known = fleet()
    old = build_command(
        SPEC, Selector(worker_ids=["w1"]), issuer="x", rollout_id="r-old", now=at(0)
    )
    known.observe_command(old)
    request = RolloutRequest(SPEC, Selector(labels={"model": "nobody"}), rollout_id="r-old")
    with pytest.raises(CommandRejected) as caught:
        prepare_rollout(request, known, as_of=at(1), now=at(1), issuer="me@cli")
    assert caught.value.code is LocalCode.ROLLOUT_EXISTS
    fresh = RolloutRequest(SPEC, Selector(worker_ids=["w3"]), rollout_id="r-new")
    command = prepare_rollout(fresh, known, as_of=at(1), now=at(1), issuer="me@cli")
    assert (command.rollout_id, command.selector.worker_ids) == ("r-new", ["w3"])
    assert command.command_id.startswith("r-new.c-")


def test_a_ttl_over_the_maximum_is_refused() -> None:
    request = RolloutRequest(SPEC, Selector(worker_ids=["w1"]), ttl_s=1e9)
    with pytest.raises(CommandRejected) as caught:
        prepare_rollout(request, fleet(), as_of=at(1), now=at(1), issuer="me@cli")
    assert caught.value.code is WireCode.TTL_TOO_LONG
