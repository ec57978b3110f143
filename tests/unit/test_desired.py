"""Desired against actual per target (controlplane.rollout.desired): what `controlplane targets`
and the API show, from the controller topic's fold and the fleet's (issue 12)."""

from __future__ import annotations

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
