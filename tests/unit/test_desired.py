"""Desired against actual per target (controlplane.rollout.desired): what `controlplane targets`
and the API show, from the controller topic's fold and the fleet's (issue 12)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.rollout.desired import Alignment, target_status, targets_status
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.progressive import conflicts, reconcile
from controlplane.rollout.targets import ControlState
from controlplane.wire.control import Desired, TargetSpec, WeightsRef
from controlplane.wire.protocol import WorkerStatus
from tests.factories import T0, at, heartbeat


def target(name: str, selector: dict[str, str], version: str = "v1") -> TargetSpec:
    return TargetSpec(
        name=name,
        selector=selector,
        stable=Desired(weights=WeightsRef(path="/ckpt", version=version)),
        issued_at=T0,
        issuer="tests",
    )


def test_each_worker_is_in_sync_drifting_updating_lost_or_in_conflict() -> None:
    control = ControlState()
    control.observe(target("llama", {"model": "llama"}))
    control.observe(target("zone-a", {"zone": "a"}))
    fleet = Fleet()
    for hb in (
        heartbeat("w-sync", 10),
        heartbeat("w-old", 10, version="v0"),
        heartbeat("w-busy", 10, version="v0", status=WorkerStatus.BUSY),
        heartbeat("w-dead", -30),  # silent for 40 s: 3 periods of 5 s have passed
        heartbeat("w-both", 10, labels={"model": "llama", "zone": "a"}),
    ):
        fleet.observe_heartbeat(hb)
    now = at(12)
    llama = control.target("llama")
    assert llama is not None
    shown = target_status(control, fleet, llama, now)
    alignment = {m.worker_id: m.alignment for m in shown.members}
    assert alignment == {
        "w-both": Alignment.CONFLICT,
        "w-busy": Alignment.UPDATING,
        "w-dead": Alignment.LOST,
        "w-old": Alignment.DRIFTING,
        "w-sync": Alignment.IN_SYNC,
    }
    (both,) = [m for m in shown.members if m.worker_id == "w-both"]
    assert both.code == "TARGET_CONFLICT" and both.targets == ("llama", "zone-a")
    assert (shown.workers, shown.at_stable, shown.drifting, shown.lost, shown.conflicts) == (
        3,
        1,
        1,
        1,
        1,
    )
    assert conflicts(control, fleet, now) == {"w-both": ["llama", "zone-a"]}
    # the controller leaves the conflicted worker alone, and syncs only the idle drifting one
    commands = reconcile(control, fleet, now)
    assert [c.selector.worker_ids for c in commands] == [["w-old"]]
    assert [s.name for s in targets_status(control, fleet, now)] == ["llama", "zone-a"]


# --------------------------------------------------------------------------- drain and cache policy


def test_a_desired_states_drain_and_cache_policy_reach_every_reload_it_makes() -> None:
    """issue 14: a target's or a rollout's reload policy is in each command made from it (a
    wave's, with or without the probe; a drift sync's; a rollback's, from the state it goes
    back to), omitted on the wire when not given."""
    from controlplane.rollout.decisions import change_spec, reload_spec
    from controlplane.rollout.rollback import rollback_spec
    from controlplane.wire.control import ProbeGate
    from controlplane.wire.messages import DrainPolicy, ReloadWeightsSpec

    policy = DrainPolicy(mode="abort", timeout_s=7.0)
    ref = WeightsRef(path="/ckpt/v2", version="v2", drain=policy, reset_cache=False)
    desired = Desired(weights=ref)
    for spec in (
        reload_spec(desired),
        change_spec(desired),
        change_spec(desired, ProbeGate(prompt="hi")),
        rollback_spec(desired, Desired(weights=WeightsRef(path="/ckpt/v3", version="v3"))),
    ):
        assert isinstance(spec, ReloadWeightsSpec)
        assert (spec.drain, spec.reset_cache) == (policy, False)
        wire = spec.model_dump(mode="json")
        assert wire["drain"] == {"mode": "abort", "timeout_s": 7.0}
        assert wire["reset_cache"] is False
    plain = reload_spec(Desired(weights=WeightsRef(path="/ckpt/v1", version="v1")))
    assert (plain.drain, plain.reset_cache) == (None, None)
    assert {"drain", "reset_cache"}.isdisjoint(plain.model_dump(mode="json"))
    assert (plain.drain_policy, plain.resets_cache) == (DrainPolicy(), True)  # the defaults


def test_a_weights_ref_without_a_policy_is_written_as_before() -> None:
    """Records (targets, rollouts, states) written before drain policies read the same, and a
    ref without one is written without the fields (a reader built before reads it too)."""
    from controlplane.wire.messages import DrainPolicy

    ref = WeightsRef(path="/ckpt", version="v1")
    assert ref.model_dump(mode="json") == {
        "path": "/ckpt",
        "version": "v1",
        "sha256": {},
        "strict": True,
    }
    given = WeightsRef.model_validate_json(
        '{"path": "/ckpt", "version": "v1", "drain": {"mode": "keep"}, "reset_cache": true}'
    )
    assert (given.drain, given.reset_cache) == (DrainPolicy(mode="keep"), True)


def test_the_cli_builds_the_policy_as_reload_weights_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`targets set` / `rollout start`: --drain, --drain-timeout, --no-reset-cache, as
    `reload-weights` has them; without them nothing is written; a bad value is SCHEMA_INVALID;
    without --weights they are refused (a config change reloads nothing)."""
    import typer

    from controlplane.cli.progressive import _desired
    from controlplane.cli.rollout import DrainChoice
    from controlplane.wire.messages import DrainPolicy

    d = _desired("/ckpt", "v2", None, False, [], DrainChoice.ABORT, 7.0, True)
    assert d.weights is not None
    assert (d.weights.drain, d.weights.reset_cache) == (
        DrainPolicy(mode="abort", timeout_s=7),
        False,
    )
    only_timeout = _desired("/ckpt", "v2", None, False, [], None, 3.0, False)
    assert only_timeout.weights is not None
    assert only_timeout.weights.drain == DrainPolicy(mode="wait", timeout_s=3.0)
    plain = _desired("/ckpt", "v2", None, False, [])
    assert plain.weights is not None and (plain.weights.drain, plain.weights.reset_cache) == (
        None,
        None,
    )
    bad: list[tuple[Any, ...]] = [
        ("/ckpt", "v2", None, False, [], None, 0.0, False),  # a deadline must be > 0
        (None, None, None, False, ["k=1"], DrainChoice.WAIT, None, False),  # no weights
        (None, None, None, False, ["k=1"], None, None, True),
    ]
    for args in bad:
        with pytest.raises(typer.Exit) as exc:
            _desired(*args)
        assert exc.value.exit_code != 0, args
        assert "SCHEMA_INVALID" in capsys.readouterr().err, args


def test_the_apis_bodies_take_the_policy_in_the_desired_state() -> None:
    """PUT /targets/{name} and POST /targets/{name}/rollouts take Desired as it is: the policy
    goes in ``weights.drain`` / ``weights.reset_cache``, checked as the wire checks it."""
    from pydantic import ValidationError

    from controlplane.api.models import ROLLOUT_START_REQUEST, TARGET_REQUEST
    from controlplane.wire.messages import DrainPolicy

    weights = {"path": "/ckpt", "version": "v2", "drain": {"mode": "abort"}, "reset_cache": False}
    start = ROLLOUT_START_REQUEST.validate_python({"desired": {"weights": weights}})
    assert start.desired.weights is not None
    assert start.desired.weights.drain == DrainPolicy(mode="abort")
    target = TARGET_REQUEST.validate_python(
        {"selector": {"m": "x"}, "stable": {"weights": weights}}
    )
    assert target.stable is not None and target.stable.weights is not None
    assert target.stable.weights.reset_cache is False
    with pytest.raises(ValidationError):
        ROLLOUT_START_REQUEST.validate_python(
            {"desired": {"weights": {**weights, "drain": {"mode": "later"}}}}
        )
