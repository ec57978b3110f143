"""Human output for the CLI: rollout and worker tables, progress lines. Pure formatting, no I/O decisions.

On a terminal rich draws tables; in CI logs the same tables come out as plain text. Data is
never read as rich markup (an error, a label or a config value with ``[/x]`` in it is shown as
it is, never a ``MarkupError``): cells and titles are :class:`~rich.text.Text` built from plain
strings and styles, and :func:`console` prints strings as they are.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from enum import StrEnum
from typing import Any

import yaml
from pydantic import BaseModel
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from controlplane.rollout.models import (
    RolloutPhase,
    RolloutStatus,
    WorkerDetail,
    WorkerLevel,
    WorkerState,
)
from controlplane.rollout.registry import WorkerView


class Output(StrEnum):
    """``-o``: a table (identical rows collapsed, with counts), every row (``wide``), or the
    data as JSON or YAML (the same fields either way)."""

    TABLE = "table"
    WIDE = "wide"
    JSON = "json"
    YAML = "yaml"

    @property
    def data(self) -> bool:
        """Machine-readable: no table, no progress lines on stdout."""
        return self in (Output.JSON, Output.YAML)


def dumped(value: BaseModel | Sequence[BaseModel] | Any, output: Output) -> str:
    """``value`` (a model, a list of them, or plain JSON data) as ``output`` says: one line
    of JSON, or a YAML document."""
    if isinstance(value, BaseModel):
        data: Any = value.model_dump(mode="json")
    elif isinstance(value, list | tuple):
        data = [v.model_dump(mode="json") if isinstance(v, BaseModel) else v for v in value]
    else:
        data = value
    if output is Output.YAML:
        return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True)).rstrip("\n")
    return json.dumps(data)


def titled(title: str | Text, table: Table) -> Group:
    """A table under its title, the title on its own line, as wide as the terminal: a rich
    table's own title wraps at the table's width (a narrow table cut ``rollout r-...
    (weights v2): failed`` in two on a 120-column terminal). A string title is plain text."""
    return Group(Text(title) if isinstance(title, str) else title, table)


def styled(text: str, style: str = "") -> Text:
    """``text`` as it is (never markup), in ``style``."""
    return Text(text, style=style)


def plain(*texts: str) -> list[Text]:
    """A table row's cells, each as it is (never markup)."""
    return [Text(t) for t in texts]


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
    """What the rollout rolls out; a dry run says so (it changed nothing)."""
    return _target(status) + (" (dry run)" if status.dry_run else "")


def _target(status: RolloutStatus) -> str:
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


def rollout_table(status: RolloutStatus, *, wide: bool = False) -> Group:
    """The rollout's workers: with ``wide``, a row each; else workers in the same state, on the
    same version, with the same error (code and message) share one row, with their count and
    a few of their ids (40 identical rejections are one row), the bad ones first."""
    title = Text.assemble(
        f"rollout {status.rollout_id} ({target(status)}): ",
        (status.phase.value, _PHASE_STYLE.get(status.phase, "white")),
    )
    if status.reason:
        title.append(f" [{status.reason.value}]")
    table = Table(title_justify="left")
    for col in ("worker" if wide else "workers", "state", "version", "duration", "error"):
        table.add_column(col)
    groups = [[w] for w in status.workers] if wide else _same_rows(status.workers)
    for group in groups:
        w = group[0]
        error = f"{w.error.code}: {w.error.message}" if w.error else ""
        state = w.state.value + (f" (then {w.late_state.value})" if w.late_state else "")
        ids = [g.worker_id for g in group]
        table.add_row(
            styled(ids[0] if len(ids) == 1 else f"{len(ids)}: {few(ids)}"),
            styled(state, _STATE_STYLE.get(w.state, "white")),
            styled(w.weights_version or "-"),
            _durations([g.duration_s for g in group]),
            styled(error[:160]),
        )
    for u in status.unexpected:
        table.add_row(
            styled(u.worker_id),
            styled(f"{u.state.value} (unexpected)"),
            styled(u.weights_version or "-"),
            "-",
            "",
        )
    return titled(title, table)


#: How many ids a table cell names before "and N more".
TABLE_NAMED = 3


def few(ids: list[str], shown: int = TABLE_NAMED) -> str:
    """``a, b, c and 37 more``: a table cell's worth of worker ids."""
    if len(ids) <= shown:
        return ", ".join(ids)
    return f"{', '.join(ids[:shown])} and {len(ids) - shown} more"


#: Worker states shown first in a rollout's table: what went wrong.
_BAD_FIRST = (WorkerState.FAILED, WorkerState.REJECTED, WorkerState.LOST)


def _same_rows(workers: Sequence[WorkerDetail]) -> list[list[WorkerDetail]]:
    """Workers that would show the same row but for their id and duration, grouped: the bad
    states first, then in the order met."""
    groups: dict[tuple[object, ...], list[WorkerDetail]] = {}
    for w in workers:
        key = (
            w.state,
            w.late_state,
            w.weights_version,
            (w.error.code, w.error.message) if w.error else None,
        )
        groups.setdefault(key, []).append(w)
    return sorted(groups.values(), key=lambda g: g[0].state not in _BAD_FIRST)


def _durations(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "-"
    low, high = min(known), max(known)
    return f"{low:.2f}s" if len(values) == 1 or low == high else f"{low:.2f}-{high:.2f}s"


def rollouts_table(statuses: list[RolloutStatus]) -> Group:
    table = Table()
    for col in ("rollout", "target", "phase", "done", "issued", "duration"):
        table.add_column(col)
    for s in statuses:
        c = s.counts
        done = c.succeeded + c.failed + c.rejected + c.lost
        table.add_row(
            styled(s.rollout_id),
            styled(target(s)),
            Text.assemble(
                (s.phase.value, _PHASE_STYLE.get(s.phase, "white")),
                f" {s.reason.value}" if s.reason else "",
            ),
            f"{c.succeeded}/{s.expected}"
            + (f" ({done - c.succeeded} bad)" if done > c.succeeded else ""),
            _short_time(s.issued_at),
            f"{s.duration_s:.2f}s" if s.duration_s is not None else "-",
        )
    return titled("rollouts", table)


def workers_table(workers: list[WorkerView], levels: list[WorkerLevel]) -> Group:
    by_id = {lv.worker_id: lv for lv in levels}
    table = Table()
    for col in ("worker", "labels", "runner", "device", "status", "version", "desired", "alive"):
        table.add_column(col)
    for w in workers:
        lv = by_id.get(w.worker_id)
        desired = lv.desired_version if lv and lv.desired_version else "-"
        sync = "" if lv is None or lv.in_sync else " (out of sync)"
        table.add_row(
            styled(w.worker_id),
            styled(",".join(f"{k}={v}" for k, v in sorted(w.labels.items()))),
            styled(w.runner),
            styled(w.device),
            styled(w.status.value + (f" {w.in_flight.command_id}" if w.in_flight else "")),
            Text.assemble(w.weights_version or "-", (sync, "yellow")),
            styled(desired),
            Text.assemble(("yes", "") if w.alive else ("no", "red"), (_publishing(w), "yellow")),
        )
    return titled("workers", table)


def worker_rows(workers: list[WorkerView], levels: list[WorkerLevel]) -> list[dict[str, Any]]:
    """``workers -o json|yaml``: each worker's latest heartbeat, with what it should run
    (``desired_version``, ``desired_rollout_id``) and whether it does (``in_sync``), as the
    API's /api/v1/workers says."""
    by_id = {lv.worker_id: lv for lv in levels}
    rows: list[dict[str, Any]] = []
    for w in workers:
        row = w.model_dump(mode="json")
        lv = by_id.get(w.worker_id)
        row["desired_version"] = lv.desired_version if lv else None
        row["desired_rollout_id"] = lv.desired_rollout_id if lv else None
        row["in_sync"] = lv.in_sync if lv else True
        rows.append(row)
    return rows


def _publishing(w: WorkerView) -> str:
    """What a worker's latest heartbeat said of its publishes to Kafka (nothing when fine)."""
    if w.publish_failing_since is None and not w.acks_unpublished:
        return ""
    since = (
        f" since {_short_time(w.publish_failing_since)}"
        if w.publish_failing_since is not None
        else ""
    )
    return f" (cannot publish{since}: {w.acks_unpublished} ack(s) waiting)"


def _short_time(when: datetime) -> str:
    return when.strftime("%H:%M:%S")


def console(*, stderr: bool = False) -> Console:
    """The CLI's console: strings print as they are (``markup=False``: a rollout id, a label
    or an error message is data, never markup); styles come as :class:`~rich.text.Text`."""
    return Console(
        stderr=stderr,
        highlight=False,
        markup=False,
        width=None if Console().is_terminal else 160,
    )
