"""Human output for the CLI: rollout and worker tables, progress lines. Pure formatting, no I/O decisions.

On a terminal rich draws tables; in CI logs the same tables come out as plain text.
"""

from __future__ import annotations

from datetime import datetime

from rich.console import Console
from rich.table import Table

from controlplane.rollout.models import RolloutPhase, RolloutStatus, WorkerLevel, WorkerState
from controlplane.rollout.registry import WorkerView

_PHASE_STYLE = {
    RolloutPhase.SUCCEEDED: "green",
    RolloutPhase.FAILED: "red",
    RolloutPhase.TIMED_OUT: "yellow",
    RolloutPhase.ABORTED: "red",
    RolloutPhase.PROGRESSING: "cyan",
    RolloutPhase.PENDING: "white",
}
_STATE_STYLE = {
    WorkerState.SUCCEEDED: "green",
    WorkerState.FAILED: "red",
    WorkerState.REJECTED: "red",
    WorkerState.LOST: "yellow",
}


def target(status: RolloutStatus) -> str:
    if status.target_version is not None:
        return f"weights {status.target_version}"
    if status.overrides is not None:
        return "config " + ", ".join(f"{k}={v}" for k, v in sorted(status.overrides.items()))
    if status.kind is None:  # known only from the workers' acks: the command did not decode
        return "unreadable command"
    return status.kind.value


def progress_line(status: RolloutStatus) -> str:
    c = status.counts
    done = c.succeeded + c.failed + c.rejected + c.lost
    parts = [f"{c.succeeded} succeeded"]
    for label, n in (
        ("failed", c.failed),
        ("rejected", c.rejected),
        ("lost", c.lost),
        ("running", c.running),
        ("accepted", c.accepted),
        ("pending", c.pending),
    ):
        if n:
            parts.append(f"{n} {label}")
    return (
        f"{status.rollout_id} {status.phase.value}: {done}/{status.expected} done "
        f"({', '.join(parts)})"
    )


def rollout_table(status: RolloutStatus) -> Table:
    title = (
        f"rollout {status.rollout_id} ({target(status)}): "
        f"[{_PHASE_STYLE.get(status.phase, 'white')}]{status.phase.value}[/]"
    )
    if status.reason:
        title += f" [{status.reason.value}]"
    table = Table(title=title, title_justify="left")
    for col in ("worker", "state", "version", "duration", "error"):
        table.add_column(col)
    for w in status.workers:
        error = f"{w.error.code}: {w.error.message}" if w.error else ""
        state = w.state.value + (f" (then {w.late_state.value})" if w.late_state else "")
        table.add_row(
            w.worker_id,
            f"[{_STATE_STYLE.get(w.state, 'white')}]{state}[/]",
            w.weights_version or "-",
            f"{w.duration_s:.2f}s" if w.duration_s is not None else "-",
            error[:160],
        )
    for w in status.unexpected:
        table.add_row(
            w.worker_id, f"{w.state.value} (unexpected)", w.weights_version or "-", "-", ""
        )
    return table


def rollouts_table(statuses: list[RolloutStatus]) -> Table:
    table = Table(title="rollouts", title_justify="left")
    for col in ("rollout", "target", "phase", "done", "issued", "duration"):
        table.add_column(col)
    for s in statuses:
        c = s.counts
        done = c.succeeded + c.failed + c.rejected + c.lost
        table.add_row(
            s.rollout_id,
            target(s),
            f"[{_PHASE_STYLE.get(s.phase, 'white')}]{s.phase.value}[/]"
            + (f" {s.reason.value}" if s.reason else ""),
            f"{c.succeeded}/{s.expected}"
            + (f" ({done - c.succeeded} bad)" if done > c.succeeded else ""),
            _short_time(s.issued_at),
            f"{s.duration_s:.2f}s" if s.duration_s is not None else "-",
        )
    return table


def workers_table(workers: list[WorkerView], levels: list[WorkerLevel]) -> Table:
    by_id = {lv.worker_id: lv for lv in levels}
    table = Table(title="workers", title_justify="left")
    for col in ("worker", "labels", "runner", "device", "status", "version", "desired", "alive"):
        table.add_column(col)
    for w in workers:
        lv = by_id.get(w.worker_id)
        desired = lv.desired_version if lv and lv.desired_version else "-"
        sync = "" if lv is None or lv.in_sync else " [yellow](out of sync)[/]"
        table.add_row(
            w.worker_id,
            ",".join(f"{k}={v}" for k, v in sorted(w.labels.items())),
            w.runner,
            w.device,
            w.status.value + (f" {w.in_flight.command_id}" if w.in_flight else ""),
            (w.weights_version or "-") + sync,
            desired,
            ("yes" if w.alive else "[red]no[/]") + _publishing(w),
        )
    return table


def _publishing(w: WorkerView) -> str:
    """What a worker's latest heartbeat said of its publishes to Kafka (nothing when fine)."""
    if w.publish_failing_since is None and not w.acks_unpublished:
        return ""
    since = (
        f" since {_short_time(w.publish_failing_since)}"
        if w.publish_failing_since is not None
        else ""
    )
    return f" [yellow](cannot publish{since}: {w.acks_unpublished} ack(s) waiting)[/]"


def _short_time(when: datetime) -> str:
    return when.strftime("%H:%M:%S")


def console(*, stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, width=None if Console().is_terminal else 160)
