"""Human output: a rollout known only from its acks (its command did not decode) renders."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from rich.console import Console

from controlplane.cli.render import target, workers_table
from controlplane.rollout.registry import WorkerView


def test_the_target_of_a_rollout_whose_command_no_worker_could_read() -> None:
    status = cast(Any, SimpleNamespace(target_version=None, overrides=None, kind=None))
    assert target(status) == "unreadable command"


def _worker(**fields: Any) -> WorkerView:
    from datetime import UTC, datetime

    from tests.factories import fake_heartbeat

    at = datetime(2026, 12, 1, 6, 30, tzinfo=UTC)
    return WorkerView.of(fake_heartbeat("w1", at, interval_s=3.0, **fields), at)


def _rendered(worker: WorkerView) -> str:
    out = Console(width=300, record=True, color_system=None)
    out.print(workers_table([worker], []))
    return out.export_text()


def test_a_worker_that_cannot_publish_says_so_in_the_workers_table() -> None:
    from datetime import UTC, datetime

    since = datetime(2026, 12, 1, 6, 29, 50, tzinfo=UTC)
    blocked = _worker(acks_unpublished=2, publish_failing_since=since, lease_s=30.0)
    assert blocked.lease_s == 30.0
    assert "cannot publish since 06:29:50: 2 ack(s) waiting" in _rendered(blocked)
    fine = _worker()
    assert fine.lease_s == 9.0  # no lease: three periods
    assert "cannot publish" not in _rendered(fine)
