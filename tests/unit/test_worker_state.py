"""The worker's local journal: durable, replayable, tolerant of a torn last line, compacted."""

from __future__ import annotations

import json
import os
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.protocol import Ack, AckError, AckState, ReloadWeightsSpec, Timings
from workers import state as state_module
from workers.state import WorkerState

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def ack(command_id: str, state: AckState = AckState.SUCCEEDED) -> Ack:
    error = None if state is AckState.SUCCEEDED else AckError(code="WEIGHTS_MISSING", message="x")
    return Ack(
        command_id=command_id,
        rollout_id="r1",
        worker_id="w1",
        state=state,
        timings=Timings(received_at=T0),
        sent_at=T0,
        error=error,
        weights_version="v1",
    )


def test_roundtrip_through_a_restart(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.set_offset(5)
    st.record(ack("c1"), published=False)
    st.record(ack("c2", AckState.REJECTED), published=False)
    st.mark_published("c2")
    st.set_weights(ReloadWeightsSpec(path="/x", version="v9"))
    st.add_config({"max_new_tokens": 3})
    st.close()
    again = WorkerState.open(tmp_path)
    assert again.next_offset == 5
    assert again.outcome("c1") is not None and again.outcome("c1").published is False
    assert again.outcome("c2") is not None and again.outcome("c2").published is True
    assert again.outcome("c2").ack.state is AckState.REJECTED
    assert again.weights is not None and again.weights.version == "v9"
    assert again.config_overrides == {"max_new_tokens": 3}
    assert again.outcome("nope") is None
    again.close()


def test_torn_last_line_is_ignored(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.record(ack("c1"), published=True)
    st.close()
    with open(tmp_path / "state.jsonl", "a") as fh:
        fh.write('{"t":"outcome","ack":{"command_id":"c2"')  # a crash mid-write
    again = WorkerState.open(tmp_path)
    assert list(again.outcomes) == ["c1"]
    again.close()


def test_compaction_bounds_the_journal_and_keeps_the_newest(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(state_module, "MAX_REMEMBERED", 10)
    st = WorkerState.open(tmp_path)
    for i in range(60):
        st.record(ack(f"c{i}"), published=True)
        st.set_offset(i + 1)
        st.sync()
    st.close()
    lines = (tmp_path / "state.jsonl").read_text().splitlines()
    assert len(lines) <= 2 * 10 + 100 + 1
    again = WorkerState.open(tmp_path)
    assert list(again.outcomes) == [f"c{i}" for i in range(50, 60)]
    assert again.next_offset == 60
    again.close()


def journal(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in (path / "state.jsonl").read_text().splitlines()]


def test_mutations_are_staged_until_one_sync_with_one_fsync(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        fsyncs.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", counting_fsync)
    st = WorkerState.open(tmp_path)
    st.set_weights(ReloadWeightsSpec(path="/x", version="v9"))
    st.record(ack("c1"), published=False)
    # Applied in memory at once, on disk only after the sync (a crash now loses both together).
    assert st.dirty and st.weights is not None and st.outcome("c1") is not None
    assert [e["t"] for e in journal(tmp_path)] == ["incarnation"]  # written by open()
    fsyncs.clear()
    st.sync()
    assert not st.dirty and len(fsyncs) == 1
    assert [e["t"] for e in journal(tmp_path)] == ["incarnation", "weights", "outcome"]
    st.mark_published("c1")
    st.set_offset(8)
    st.sync()
    st.sync()  # nothing staged: no write, no fsync
    assert len(fsyncs) == 2
    assert journal(tmp_path)[3:] == [{"t": "published", "id": "c1"}, {"t": "offset", "next": 8}]
    st.mark_published("c1")  # already published: nothing staged
    assert not st.dirty
    again = WorkerState.open(tmp_path)
    assert again.outcome("c1") is not None and again.outcome("c1").published is True
    assert again.next_offset == 8 and again.weights is not None
    again.close()
    st.close()


def test_a_crash_before_the_sync_loses_only_the_staged_mutations(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.record(ack("c1"), published=False)
    st.sync()
    st.mark_published("c1")
    st.set_offset(3)
    # The process dies here: no sync, no close (the file is what another process would read).
    after_crash = WorkerState.open(tmp_path)
    assert after_crash.outcome("c1") is not None and after_crash.outcome("c1").published is False
    assert after_crash.next_offset is None
    after_crash.close()
    st._pending.clear()  # the dead process's memory, gone with it
    st.close()


def test_close_syncs_what_is_staged(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.add_config({"max_new_tokens": 3})
    st.close()
    assert journal(tmp_path)[1:] == [{"t": "config", "overrides": {"max_new_tokens": 3}}]
    with pytest.raises(RuntimeError, match="closed"):
        st.sync()


def test_syncs_from_another_thread_keep_the_order_of_mutations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "MAX_REMEMBERED", 50)  # compactions happen meanwhile
    st = WorkerState.open(tmp_path)
    done = threading.Event()

    def syncer() -> None:
        while not done.is_set():
            st.sync()

    thread = threading.Thread(target=syncer)
    thread.start()
    try:
        for i in range(400):
            st.record(ack(f"c{i}"), published=False)
            st.mark_published(f"c{i}")
            st.set_offset(i + 1)
    finally:
        done.set()
        thread.join()
    st.sync()
    again = WorkerState.open(tmp_path)
    assert again.next_offset == 400
    assert list(again.outcomes) == [f"c{i}" for i in range(350, 400)]
    assert all(o.published for o in again.outcomes.values())
    again.close()
    st.close()


def test_a_failed_sync_stays_staged_and_the_retry_replays_to_the_same_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_fsync = os.fsync
    failures = [OSError(5, "Input/output error")]

    def flaky_fsync(fd: int) -> None:
        if failures:
            raise failures.pop()
        real_fsync(fd)

    st = WorkerState.open(tmp_path)
    monkeypatch.setattr(os, "fsync", flaky_fsync)
    st.add_config({"max_new_tokens": 3})
    st.record(ack("c1"), published=False)
    with pytest.raises(OSError):
        st.sync()
    assert st.dirty  # not known durable: staged again
    st.add_config({"max_new_tokens": 4})
    st.sync()
    st.close()
    again = WorkerState.open(tmp_path)
    assert again.config_overrides == {"max_new_tokens": 4}
    assert list(again.outcomes) == ["c1"]
    assert "ignored" not in caplog.text
    again.close()


def test_every_open_increments_a_durable_incarnation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_module, "MAX_REMEMBERED", 10)
    st = WorkerState.open(tmp_path)
    assert st.incarnation == 1
    st.close()
    st = WorkerState.open(tmp_path)
    assert st.incarnation == 2
    # Durable before open() returns: a crash right now (no sync, no close) keeps it.
    st._pending.clear()
    st.close()
    for i in range(60):  # compactions keep it
        st = WorkerState.open(tmp_path)
        st.record(ack(f"c{i}"), published=True)
        st.sync()
        st.close()
    assert any(e["t"] == "incarnation" for e in journal(tmp_path))
    again = WorkerState.open(tmp_path)
    assert again.incarnation == 63
    again.close()


def test_an_old_journal_without_the_counter_starts_at_one(tmp_path: Path) -> None:
    (tmp_path / "state.jsonl").write_text('{"t":"offset","next":4}\n')
    st = WorkerState.open(tmp_path)
    assert st.incarnation == 1 and st.next_offset == 4
    st.close()


def test_the_line_after_a_torn_last_line_is_kept(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.close()
    with open(tmp_path / "state.jsonl", "a") as fh:
        fh.write('{"t":"outcome","ack":{"command_id":"c2"')  # a crash mid-write
    st = WorkerState.open(tmp_path)  # its incarnation line must not extend the torn one
    assert st.incarnation == 2
    st.record(ack("c3"), published=True)
    st.close()
    again = WorkerState.open(tmp_path)
    assert again.incarnation == 3 and list(again.outcomes) == ["c3"]
    again.close()
