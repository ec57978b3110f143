"""The worker's local journal: durable, replayable, tolerant of a torn last line, compacted."""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
from datetime import UTC, datetime
from pathlib import Path

import pytest

from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
from controlplane.wire.protocol import Ack, AckError, AckState, ReloadWeightsSpec, Timings
from workers.agent import journal as state_module
from workers.agent.journal import WorkerState

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
    st.close()
    again = WorkerState.open(tmp_path)
    assert again.outcome("c1") is not None and again.outcome("c1").published is True
    assert again.next_offset == 8 and again.weights is not None
    again.close()


def test_a_crash_before_the_sync_loses_only_the_staged_mutations(tmp_path: Path) -> None:
    st = WorkerState.open(tmp_path)
    st.record(ack("c1"), published=False)
    st.sync()
    st.mark_published("c1")
    st.set_offset(3)
    # The process dies here: no sync, its memory is gone, its lock released with it.
    st._pending.clear()
    st.close()
    after_crash = WorkerState.open(tmp_path)
    assert after_crash.outcome("c1") is not None and after_crash.outcome("c1").published is False
    assert after_crash.next_offset is None
    after_crash.close()


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
    st.close()
    again = WorkerState.open(tmp_path)
    assert again.next_offset == 400
    assert list(again.outcomes) == [f"c{i}" for i in range(350, 400)]
    assert all(o.published for o in again.outcomes.values())
    again.close()


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
    with pytest.raises(ControlPlaneError) as failed:
        st.sync()
    assert failed.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert "Input/output error" in failed.value.message and str(tmp_path) in failed.value.message
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


# ---------------------------------------------------------------------- one agent per directory


def test_a_second_open_of_the_directory_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = WorkerState.open(tmp_path)
    with pytest.raises(ControlPlaneError) as refused:
        WorkerState.open(tmp_path)
    assert refused.value.code is LocalCode.STATE_DIR_LOCKED
    assert str(tmp_path) in refused.value.message
    assert f"pid {os.getpid()}" in refused.value.message
    first.record(ack("c1"), published=False)  # the holder is untouched
    first.sync()
    first.close()
    second = WorkerState.open(tmp_path)
    assert list(second.outcomes) == ["c1"] and second.incarnation == 2
    second.close()


def test_the_lock_is_held_by_another_process_until_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from workers.agent.journal import WorkerState;"
            f" WorkerState.open(Path({str(tmp_path)!r})); print('open', flush=True);"
            " sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        with pytest.raises(ControlPlaneError, match=f"pid {holder.pid}") as refused:
            WorkerState.open(tmp_path)
        assert refused.value.code is LocalCode.STATE_DIR_LOCKED
    finally:
        holder.kill()  # no close(): the kernel releases the lock with the process
        holder.communicate()
    again = WorkerState.open(tmp_path)
    assert again.incarnation == 2
    again.close()


def test_an_open_that_fails_leaves_the_directory_unlocked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(ControlPlaneError) as failed:
        WorkerState.open(tmp_path)
    assert failed.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert "No space left on device" in failed.value.message
    monkeypatch.undo()
    st = WorkerState.open(tmp_path)
    assert st.incarnation == 1
    st.close()


# ---------------------------------------------------------------------- a disk that fails


class Disk:
    """os.write and os.fsync that fail on demand (ENOSPC), the first write possibly half done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.full = False
        self.half_written = False
        self.real_write = os.write
        monkeypatch.setattr(os, "write", self.write)

    def write(self, fd: int, data: bytes | memoryview) -> int:
        if self.full:
            if self.half_written:
                self.half_written = False
                return self.real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real_write(fd, data)


@pytest.mark.parametrize("half_written", [False, True], ids=["nothing-written", "torn"])
def test_a_full_disk_is_a_coded_error_and_the_retry_replays_to_the_same_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, half_written: bool
) -> None:
    st = WorkerState.open(tmp_path)
    disk = Disk(monkeypatch)
    st.record(ack("c1"), published=False)
    st.set_offset(1)
    disk.full, disk.half_written = True, half_written
    with pytest.raises(ControlPlaneError) as failed:
        st.sync()
    assert failed.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert "No space left on device" in failed.value.message
    assert st.dirty
    with pytest.raises(ControlPlaneError):  # still full: still staged
        st.sync()
    disk.full = False
    st.mark_published("c1")
    st.sync()
    assert not st.dirty
    st.close()
    again = WorkerState.open(tmp_path)
    assert list(again.outcomes) == ["c1"] and again.outcomes["c1"].published
    assert again.next_offset == 1
    again.close()


def test_close_never_raises_logs_what_it_lost_and_unlocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    st = WorkerState.open(tmp_path)
    disk = Disk(monkeypatch)
    st.record(ack("c-lost"), published=False)
    disk.full = True
    # The error that made the caller close is the one that propagates.
    with pytest.raises(KeyError, match="the first error"):
        try:
            raise KeyError("the first error")
        finally:
            error = st.close()
    assert error is not None and error.code is WireCode.JOURNAL_WRITE_FAILED
    assert "1 journal line(s) not written" in caplog.text and "c-lost" in caplog.text
    assert st.close() is None  # closed: nothing more to do
    disk.full = False
    again = WorkerState.open(tmp_path)  # unlocked although the write failed
    assert again.outcome("c-lost") is None and again.incarnation == 2
    again.close()


def test_a_failed_compaction_keeps_the_journal_and_what_was_staged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    st = WorkerState.open(tmp_path)
    st.record(ack("c1"), published=True)
    st.sync()
    disk = Disk(monkeypatch)
    st.set_offset(7)
    disk.full = True
    with pytest.raises(ControlPlaneError) as failed:
        st.compact()
    assert failed.value.code is WireCode.JOURNAL_WRITE_FAILED
    assert st.dirty and not (tmp_path / "state.tmp").exists()
    disk.full = False
    st.sync()
    st.close()
    again = WorkerState.open(tmp_path)
    assert list(again.outcomes) == ["c1"] and again.next_offset == 7
    again.close()


# ---------------------------------------------------------------------- directory fsyncs


class Fsyncs:
    """Records every fsync: (is a directory, inode) of the descriptor, at the time of the call."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[bool, int]] = []
        self.real = os.fsync
        monkeypatch.setattr(os, "fsync", self.fsync)

    def fsync(self, fd: int) -> None:
        st = os.fstat(fd)
        self.calls.append((stat.S_ISDIR(st.st_mode), st.st_ino))
        self.real(fd)

    def of_dir(self, path: Path) -> list[int]:
        """Indexes of the fsyncs of directory ``path``."""
        ino = path.stat().st_ino
        return [i for i, call in enumerate(self.calls) if call == (True, ino)]


def test_the_directory_is_fsynced_when_the_journal_is_created_and_compacted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fsyncs = Fsyncs(monkeypatch)
    directory = tmp_path / "workers" / "w1"
    st = WorkerState.open(directory)
    assert fsyncs.of_dir(directory), "the new journal's directory entry was not fsynced"
    assert fsyncs.of_dir(directory.parent), "the new directory's entry was not fsynced"
    st.record(ack("c1"), published=True)
    st.sync()
    fsyncs.calls.clear()
    st.compact()
    # The temp file first, then (after the rename) its directory.
    (file_sync,) = [i for i, (is_dir, _) in enumerate(fsyncs.calls) if not is_dir]
    assert fsyncs.of_dir(directory) and fsyncs.of_dir(directory)[0] > file_sync
    st.close()
    fsyncs.calls.clear()
    again = WorkerState.open(directory)  # the journal exists: no directory fsync needed
    assert not fsyncs.of_dir(directory) and list(again.outcomes) == ["c1"]
    again.close()


def test_a_forked_child_does_not_keep_the_directory_locked(tmp_path: Path) -> None:
    """A runner's forked worker process outliving the agent must not lock its restart out."""
    st = WorkerState.open(tmp_path)
    read_end, write_end = os.pipe()
    started_read, started_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child (fork hooks done): says so, lives until the parent lets it go
        try:
            os.close(write_end)
            os.write(started_write, b"1")
            os.read(read_end, 1)
        finally:
            os._exit(0)
    try:
        os.close(read_end)
        os.close(started_write)
        assert os.read(started_read, 1) == b"1"
        os.close(started_read)
        st._release()  # the agent dies (no journal write), its child lives on
        again = WorkerState.open(tmp_path)
        assert again.incarnation == 2
        again.close()
    finally:
        os.close(write_end)
        os.waitpid(pid, 0)
