"""The agent's journal in two durable phases, over a real WorkerState in a temporary directory."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.wire.errors import ControlPlaneError, WireCode
from controlplane.wire.protocol import Ack, AckState, ReloadWeightsSpec, Timings
from workers.agent import failpoints
from workers.agent.durable import ConfigApplied, Journal, journal_error
from workers.agent.journal import JOURNAL_NAME, WorkerState

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ack(command_id: str) -> Ack:
    return Ack(
        command_id=command_id,
        rollout_id="r1",
        worker_id="w1",
        state=AckState.SUCCEEDED,
        timings=Timings(received_at=T0),
        sent_at=T0,
    )


class Fsyncs:
    """Counts fsyncs (all of them go through ``os.fsync``); ``fail`` makes them raise ENOSPC."""

    def __init__(self) -> None:
        self.count = 0
        self.fail = False


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[Fsyncs]:
    seen = Fsyncs()
    real = os.fsync

    def fsync(fd: int) -> None:
        seen.count += 1
        if seen.fail:
            raise OSError(28, "No space left on device")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    yield seen


@pytest.fixture
def failures() -> list[ControlPlaneError]:
    return []


@pytest.fixture
def journal(tmp_path: Path, failures: list[ControlPlaneError]) -> Iterator[Journal]:
    def on_failure(error: ControlPlaneError) -> ControlPlaneError:
        failures.append(error)
        return failures[0]

    opened = Journal(WorkerState.open(tmp_path), tmp_path, on_failure=on_failure)
    yield opened
    opened.close()


def lines(directory: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (directory / JOURNAL_NAME).read_text().splitlines()]


async def test_phase_one_writes_what_was_applied_then_the_outcome_in_one_fsync(
    journal: Journal, fsyncs: Fsyncs, tmp_path: Path
) -> None:
    spec = ReloadWeightsSpec(path="/x", version="v9")
    await journal.commit_outcome(ack("c1"), spec)
    await journal.commit_outcome(ack("c2"), ConfigApplied({"max_new_tokens": 3}))
    await journal.commit_outcome(ack("c3"), None)
    assert fsyncs.count == 3
    assert [e["t"] for e in lines(tmp_path)[1:]] == [
        "weights",
        "outcome",
        "config",
        "outcome",
        "outcome",
    ]
    assert [a.command_id for a in journal.unpublished()] == ["c1", "c2", "c3"]
    assert journal.weights == spec
    assert journal.config_overrides == {"max_new_tokens": 3}
    journal.close()
    again = WorkerState.open(tmp_path)
    assert again.weights == spec and again.config_overrides == {"max_new_tokens": 3}
    prior = again.outcome("c1")
    assert prior is not None and not prior.published
    again.close()


async def test_phase_two_marks_published_before_the_offset_in_one_fsync(
    journal: Journal, fsyncs: Fsyncs, tmp_path: Path
) -> None:
    await journal.commit_outcome(ack("c1"), None)
    fsyncs.count = 0
    await journal.commit_published(["c1"], 8)
    assert fsyncs.count == 1
    assert lines(tmp_path)[-2:] == [{"t": "published", "id": "c1"}, {"t": "offset", "next": 8}]
    assert journal.unpublished() == [] and journal.next_offset == 8


async def test_phase_two_that_changes_nothing_costs_no_fsync(
    journal: Journal, fsyncs: Fsyncs
) -> None:
    await journal.commit_published((), 3)
    fsyncs.count = 0
    await journal.commit_published((), 3)  # same offset
    await journal.commit_published(["never-recorded"])
    await journal.commit_published()
    assert fsyncs.count == 0


async def test_a_failed_sync_is_reported_once_as_journal_write_failed(
    journal: Journal, fsyncs: Fsyncs, failures: list[ControlPlaneError]
) -> None:
    fsyncs.fail = True
    with pytest.raises(ControlPlaneError) as first:
        await journal.commit_outcome(ack("c1"), None)
    with pytest.raises(ControlPlaneError) as second:
        await journal.commit_published(["c1"], 2)
    assert [e.code for e in failures] == [WireCode.JOURNAL_WRITE_FAILED] * 2
    assert first.value is second.value is failures[0]  # what on_failure returns is raised
    assert isinstance(first.value.__cause__, ControlPlaneError)  # WorkerState's own error


async def test_the_journal_sync_failpoint_fails_like_a_full_disk(
    journal: Journal, monkeypatch: pytest.MonkeyPatch, failures: list[ControlPlaneError]
) -> None:
    monkeypatch.setenv(failpoints.ENV, "journal_sync=enospc")
    with pytest.raises(ControlPlaneError):
        await journal.commit_published((), 1)
    assert failures[0].code is WireCode.JOURNAL_WRITE_FAILED
    assert "No space left on device (failpoint journal_sync)" in failures[0].message


def test_journal_error_keeps_a_coded_one_and_wraps_anything_else(tmp_path: Path) -> None:
    coded = ControlPlaneError("disk", code=WireCode.JOURNAL_WRITE_FAILED)
    assert journal_error(coded, tmp_path) is coded
    wrapped = journal_error(ValueError("bad"), tmp_path)
    assert wrapped.code is WireCode.JOURNAL_WRITE_FAILED
    assert wrapped.message == f"cannot write the journal in {tmp_path}: ValueError: bad"
