"""The worker's local journal: durable, replayable, tolerant of a torn last line, compacted."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

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
    st.close()
    lines = (tmp_path / "state.jsonl").read_text().splitlines()
    assert len(lines) <= 2 * 10 + 100 + 1
    again = WorkerState.open(tmp_path)
    assert list(again.outcomes) == [f"c{i}" for i in range(50, 60)]
    assert again.next_offset == 60
    again.close()
