"""A dry run in the coordinator's worker levels as the API serves them (``Summaries.levels``,
``controlplane/coordinator/summary.py``): a succeeded dry run desires nothing, as
``Fleet.worker_levels`` says (tests/unit/test_dry_run_fold.py). No Kafka: a Coordinator never
started, fed directly (fixtures in tests/component/conftest.py)."""

from __future__ import annotations

from controlplane.coordinator.service import Coordinator
from controlplane.coordinator.summary import Summaries
from tests.component.conftest import command, feed, heartbeat, succeeded


async def test_a_pinned_dry_run_desires_nothing_in_the_apis_levels(
    coordinator: Coordinator,
) -> None:
    real = command("r-real", workers=["w1", "w2"], issued=1.0, version="v2")
    dry = command("r-dry", workers=["w1", "w2"], issued=2.0, version="v3").model_copy(
        update={"dry_run": True}
    )
    feed(coordinator, heartbeat("w1", 9.0, version="v2"), heartbeat("w2", 9.0, version="v2"))
    feed(coordinator, real, *succeeded(real, "w1", "w2", sent=3.0))
    feed(coordinator, dry, *succeeded(dry, "w1", "w2", sent=4.0))
    fleet_levels = {
        lv.worker_id: (lv.desired_version, lv.desired_rollout_id)
        for lv in coordinator.fleet.worker_levels(coordinator.now())
    }
    assert fleet_levels == {"w1": ("v2", "r-real"), "w2": ("v2", "r-real")}
    summaries = Summaries(coordinator)
    try:
        got = (await summaries.levels()).desired
        assert {w: (d.version, d.rollout_id) for w, d in got.items()} == fleet_levels
    finally:
        summaries.close()
