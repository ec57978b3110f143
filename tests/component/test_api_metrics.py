"""The HTTP API in process: Prometheus metrics (acks, phases, workers, ack latency).

No Kafka: a Coordinator that is never started, fixtures in tests/component/conftest.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from controlplane.api.app import create_app
from controlplane.coordinator.metrics import AckLatency
from controlplane.coordinator.service import (
    Coordinator,
)
from controlplane.wire.protocol import (
    AckState,
    Command,
)
from tests.component.conftest import T0, Clock, ack, command, feed, heartbeat, sample, succeeded

# --------------------------------------------------------------------------- metrics


async def test_metrics_count_acks_phases_workers_and_latency(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert sample(text, "controlplane_rollouts", phase="succeeded") == 1
    assert sample(text, "controlplane_rollouts", phase="progressing") == 1
    assert sample(text, "controlplane_rollouts", phase="failed") == 0
    assert sample(text, "controlplane_acks_total", state="succeeded", code="") == 2
    assert sample(text, "controlplane_acks_total", state="rejected", code="CHECKSUM_MISMATCH") == 1
    assert sample(text, "controlplane_acks_total", state="running", code="") == 3
    assert sample(text, "controlplane_workers") == 2
    assert sample(text, "controlplane_workers_alive") == 2
    assert sample(text, "controlplane_workers_in_sync") == 0
    assert sample(text, "controlplane_messages_total", kind="heartbeat") == 4
    assert sample(text, "controlplane_ready") == 1
    # r-old: issued at 1 s, both succeeded at 4 s; r-new: w1 rejected at 7 s, issued at 6 s.
    count = "controlplane_command_ack_latency_seconds_count"
    total = "controlplane_command_ack_latency_seconds_sum"
    assert sample(text, count, kind="reload_weights", state="succeeded") == 2
    assert sample(text, total, kind="reload_weights", state="succeeded") == pytest.approx(6.0)
    assert sample(text, count, kind="reload_weights", state="rejected") == 1
    assert "controlplane_records_undecodable_total 0.0" in text


async def test_each_app_has_its_own_registry(coordinator: Coordinator, app: FastAPI) -> None:
    other = create_app(coordinator)  # a second app on the same coordinator must not collide
    assert other.state.metrics.registry is not app.state.metrics.registry
    feed(coordinator, heartbeat("w1", 9.0))
    assert sample(other.state.metrics.render().decode(), "controlplane_workers") == 1


def test_latency_pairs_acks_and_commands_in_any_order_once_per_worker() -> None:
    cmd = command("r1", issued=0.0)
    first_w1, late_w1 = (
        ack(cmd, "w1", AckState.SUCCEEDED, 3.0),
        ack(cmd, "w1", AckState.SUCCEEDED, 9.0),
    )
    tracker = AckLatency()
    # Replay order: acks (out of order, redelivered) before their command.
    assert tracker.ack(late_w1) == [] and tracker.ack(first_w1) == [] and tracker.ack(late_w1) == []
    assert tracker.ack(ack(cmd, "w2", AckState.RUNNING, 1.0)) == []  # not terminal
    assert tracker.waiting == 1
    assert [s.seconds for s in tracker.command(cmd)] == [3.0]  # the earliest sent counts
    assert tracker.command(cmd) == []  # the command again: nothing more
    assert tracker.ack(late_w1) == []  # already sampled
    [w2] = tracker.ack(ack(cmd, "w2", AckState.FAILED, 4.0))
    assert (w2.kind, w2.state, w2.seconds) == ("reload_weights", "failed", 4.0)
    assert tracker.ack(ack(cmd, "w2", AckState.FAILED, 5.0)) == [] and tracker.waiting == 0


async def test_latency_is_observed_when_the_command_arrives_after_its_acks(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    cmd = command("r1", workers=["w1"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.5), ack(cmd, "w1", AckState.SUCCEEDED, 3.5))
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_ack_latency_waiting") == 1
    feed(coordinator, cmd)
    text = (await client.get("/metrics")).text
    assert (
        sample(
            text,
            "controlplane_command_ack_latency_seconds_sum",
            kind="reload_weights",
            state="succeeded",
        )
        == 2.5
    )
    assert sample(text, "controlplane_ack_latency_waiting") == 0


def test_latency_tracking_is_bounded() -> None:
    tracker = AckLatency(max_commands=3)
    for i in range(10):
        cmd = command(f"r{i}", issued=0.0)
        tracker.command(cmd)
        tracker.ack(ack(cmd, "w1", AckState.SUCCEEDED, 1.0))
        orphan = command(f"x{i}", issued=0.0)
        tracker.ack(ack(orphan, "w1", AckState.SUCCEEDED, 1.0))  # its command never comes
    assert tracker.tracked == 6 and tracker.waiting == 3


async def test_unknown_error_codes_are_one_label_value(
    coordinator: Coordinator, client: httpx.AsyncClient
) -> None:
    cmd = command("r1", workers=["w1"], issued=1.0)
    feed(coordinator, heartbeat("w1", 0.5), cmd)
    for i in range(5):  # a worker (or a forger) inventing codes: no new time series each
        feed(coordinator, ack(cmd, f"w{i}", AckState.FAILED, 2.0, code=f"MADE_UP_{i}"))
    feed(coordinator, ack(cmd, "w9", AckState.FAILED, 2.0, code="RUNNER_FAILED"))
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_acks_total", state="failed", code="OTHER") == 5
    assert sample(text, "controlplane_acks_total", state="failed", code="RUNNER_FAILED") == 1
    assert "MADE_UP" not in text


async def test_metrics_show_the_controller_and_each_target_against_its_desired_state(
    client: httpx.AsyncClient, coordinator: Coordinator
) -> None:
    from controlplane.wire.control import Desired, RolloutSpec, TargetSpec, WeightsRef

    stable = Desired(weights=WeightsRef(path="/ckpt/v1", version="v1"))
    coordinator.control.observe(
        TargetSpec(name="tiny", selector={"model": "tiny"}, stable=stable, issued_at=T0, issuer="t")
    )
    coordinator.control.observe(
        RolloutSpec(
            rollout_id="r-next",
            target="tiny",
            desired=Desired(weights=WeightsRef(path="/ckpt/v2", version="v2")),
            issued_at=T0,
            issuer="t",
        )
    )
    feed(
        coordinator,
        heartbeat("w1", 1, labels={"model": "tiny"}),
        heartbeat("w2", 1, version="v0", labels={"model": "tiny"}),
    )
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_controller_leading") == 0  # never started here
    assert sample(text, "controlplane_controller_fenced_total") == 0
    assert sample(text, "controlplane_progressive_rollouts", phase="pending") == 1
    assert sample(text, "controlplane_progressive_rollouts", phase="succeeded") == 0
    aligned = "controlplane_target_workers"
    assert sample(text, aligned, target="tiny", alignment="in_sync") == 1
    assert sample(text, aligned, target="tiny", alignment="drifting") == 1
    assert sample(text, aligned, target="tiny", alignment="lost") == 0


# --------------------------------------------------------------------------- issue 15's metrics


async def test_no_created_series_in_the_metrics_page(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    """Counters and histograms export no ``_created`` series (one per label set otherwise)."""
    text = (await client.get("/metrics")).text
    assert "controlplane_acks_total" in text  # counters are there...
    assert "controlplane_command_ack_latency_seconds_count" in text
    created = [
        line
        for line in text.splitlines()
        if line.split("{")[0].split(" ")[0].endswith("_created") or " _created" in line
    ]
    assert created == []  # ...without their creation timestamps


async def test_rollout_duration_is_observed_once_from_issue_to_verdict(
    client: httpx.AsyncClient, fleet_of_two: dict[str, Command]
) -> None:
    """r-old: issued at 1 s, succeeded at 4 s (3 s); r-new is still running: not observed."""
    name = "controlplane_rollout_duration_seconds"
    for _ in range(2):  # a second scrape observes nothing again
        text = (await client.get("/metrics")).text
        labels = {"type": "command", "phase": "succeeded"}
        assert sample(text, f"{name}_count", **labels) == 1
        assert sample(text, f"{name}_sum", **labels) == pytest.approx(3.0)
        assert sample(text, f"{name}_bucket", **labels, le="5.0") == 1
        assert sample(text, f"{name}_bucket", **labels, le="1.0") == 0
        assert sample(text, f"{name}_count", type="command", phase="failed") is None


async def test_rollout_duration_of_a_progressive_rollout_and_rollouts_by_phase(
    client: httpx.AsyncClient, coordinator: Coordinator
) -> None:
    from datetime import timedelta

    from controlplane.wire.control import (
        ControlPhase,
        Desired,
        RolloutSpec,
        RolloutState,
        TargetSpec,
        WeightsRef,
    )

    coordinator.control.observe(
        TargetSpec(name="tiny", selector={"model": "tiny"}, issued_at=T0, issuer="t")
    )
    coordinator.control.observe(
        RolloutSpec(
            rollout_id="r-prog",
            target="tiny",
            desired=Desired(weights=WeightsRef(path="/ckpt/v2", version="v2")),
            issued_at=T0,
            issuer="t",
        )
    )
    feed(coordinator, heartbeat("w1", 1.0))
    name = "controlplane_rollout_duration_seconds"
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_progressive_rollouts", phase="pending") == 1
    assert sample(text, f"{name}_count", type="progressive", phase="succeeded") is None
    coordinator.control.observe(
        RolloutState(
            rollout_id="r-prog",
            target="tiny",
            revision=1,
            phase=ControlPhase.SUCCEEDED,
            started_at=T0 + timedelta(seconds=1),
            updated_at=T0 + timedelta(seconds=90),
            ended_at=T0 + timedelta(seconds=90),
        )
    )
    text = (await client.get("/metrics")).text
    assert sample(text, "controlplane_progressive_rollouts", phase="succeeded") == 1
    assert sample(text, f"{name}_count", type="progressive", phase="succeeded") == 1
    assert sample(text, f"{name}_sum", type="progressive", phase="succeeded") == 90.0


async def test_workers_by_weights_version_fleet_wide_and_per_target(
    client: httpx.AsyncClient, coordinator: Coordinator
) -> None:
    from controlplane.wire.control import Desired, TargetSpec, WeightsRef

    stable = Desired(weights=WeightsRef(path="/ckpt/v1", version="v1"))
    coordinator.control.observe(
        TargetSpec(name="tiny", selector={"model": "tiny"}, stable=stable, issued_at=T0, issuer="t")
    )
    feed(
        coordinator,
        heartbeat("w1", 1, labels={"model": "tiny"}),
        heartbeat("w2", 1, version="v0", labels={"model": "tiny"}),
        heartbeat("w3", 1, version="v0", labels={"model": "tiny"}),
        heartbeat("x1", 1, version="v0", labels={"model": "other"}),
    )
    text = (await client.get("/metrics")).text
    by_target = "controlplane_target_workers_by_version"
    assert sample(text, by_target, target="tiny", version="v1") == 1
    assert sample(text, by_target, target="tiny", version="v0") == 2
    assert sample(text, by_target, target="other", version="v0") is None  # no such target
    fleet = "controlplane_workers_by_version"
    assert sample(text, fleet, version="v0") == 3
    assert sample(text, fleet, version="v1") == 1


def dashboard_queries() -> set[str]:
    """Every controlplane_* name the Grafana dashboards in docs/grafana/ query."""
    folder = Path(__file__).resolve().parents[2] / "docs" / "grafana"
    queried: set[str] = set()
    for path in sorted(folder.glob("*.json")):
        dashboard = json.loads(path.read_text())
        exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
        exprs += [v["definition"] for v in dashboard["templating"]["list"] if v.get("definition")]
        for expr in exprs:
            queried.update(re.findall(r"\bcontrolplane_[a-z_]+", expr))
    return queried


async def test_every_metric_the_grafana_dashboard_queries_is_served(
    client: httpx.AsyncClient, coordinator: Coordinator, fleet_of_two: dict[str, Command]
) -> None:
    """docs/grafana/*.json names only series a real /metrics page has (a renamed metric would
    leave a panel empty without an error)."""
    from controlplane.wire.control import Desired, TargetSpec, WeightsRef

    stable = Desired(weights=WeightsRef(path="/ckpt/v2", version="v2"))
    coordinator.control.observe(
        TargetSpec(name="tiny", selector={"model": "tiny"}, stable=stable, issued_at=T0, issuer="t")
    )
    text = (await client.get("/metrics")).text
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}
    queried = dashboard_queries()
    assert len(queried) >= 15
    assert sorted(queried - served) == []


async def test_metrics_need_no_token_when_reads_do() -> None:
    """Prometheus scrapes without credentials (deploy/prometheus/prometheus.yml) even where the
    API's reads need the read token."""
    from pydantic import SecretStr

    from controlplane.coordinator.service import CoordinatorSettings
    from controlplane.kafka.settings import KafkaSettings

    settings = CoordinatorSettings(
        kafka=KafkaSettings(bootstrap_servers="127.0.0.1:9"),
        api_token=SecretStr("w"),
        api_read_token=SecretStr("r"),
    )
    coordinator = Coordinator(settings)
    coordinator.follower.caught_up.set()
    try:
        transport = httpx.ASGITransport(app=create_app(coordinator))
        async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as c:
            assert (await c.get("/api/v1/workers")).status_code == 401
            r = await c.get("/metrics")
            assert r.status_code == 200 and "controlplane_ready" in r.text
    finally:
        await coordinator.stop()


async def test_rollout_duration_leaves_dry_runs_out(
    client: httpx.AsyncClient, coordinator: Coordinator
) -> None:
    """A dry run (``Command.dry_run``) applies nothing: its verdict is no rollout's duration,
    neither while its command is held nor once it is summarized (review LOW-9)."""
    dry = command("r-dry", issued=1.0).model_copy(update={"dry_run": True})
    real = command("r-real", issued=2.0)
    feed(coordinator, heartbeat("w1", 0.0), heartbeat("w2", 0.0), dry, real)
    feed(coordinator, *succeeded(dry, "w1", "w2", sent=4.0), *succeeded(real, "w1", "w2", sent=4.0))
    name = "controlplane_rollout_duration_seconds"
    text = (await client.get("/metrics")).text
    assert sample(text, f"{name}_count", type="command", phase="succeeded") == 1  # r-real only
    assert sample(text, f"{name}_sum", type="command", phase="succeeded") == pytest.approx(2.0)


async def test_a_summarized_dry_run_is_left_out_of_the_rollout_duration(
    coordinator: Coordinator,
) -> None:
    dry = command("r-dry", issued=1.0).model_copy(update={"dry_run": True})
    feed(coordinator, heartbeat("w1", 0.0), heartbeat("w2", 0.0), dry)
    feed(coordinator, *succeeded(dry, "w1", "w2", sent=4.0))
    now = coordinator.judge_time()
    assert now is not None and coordinator.fleet.check_ended("r-dry", now) is not None
    coordinator.fleet.summarize("r-dry", now)
    assert coordinator.fleet.is_summarized("r-dry")
    text = create_app(coordinator).state.metrics.render().decode()
    name = "controlplane_rollout_duration_seconds"
    assert sample(text, f"{name}_count", type="command", phase="succeeded") is None


async def test_rollout_duration_after_a_restart_observes_each_ended_rollout_once(
    clock: Clock, fleet_of_two: dict[str, Command], coordinator: Coordinator
) -> None:
    """The documented contract: each ended rollout the fold holds is observed once per process;
    a restart (a replay of the log, or a restored snapshot of the fold) observes it again, once."""
    name = "controlplane_rollout_duration_seconds"
    labels = {"type": "command", "phase": "succeeded"}
    first = create_app(coordinator).state.metrics
    assert sample(first.render().decode(), f"{name}_count", **labels) == 1
    assert sample(first.render().decode(), f"{name}_count", **labels) == 1
    settings = coordinator.settings
    restarted = Coordinator(settings, clock=clock, current_as_of=clock)
    restarted.follower.caught_up.set()
    try:
        metrics = create_app(restarted).state.metrics
        restarted.fleet.restore(coordinator.fleet.fold_state())  # the snapshot restore
        text = metrics.render().decode()
        assert sample(text, f"{name}_count", **labels) == 1
        assert sample(text, f"{name}_sum", **labels) == pytest.approx(3.0)
        assert sample(text, "controlplane_acks_total", state="succeeded", code="") is None
        assert sample(metrics.render().decode(), f"{name}_count", **labels) == 1
    finally:
        await restarted.stop()
