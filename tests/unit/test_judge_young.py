"""A rollout younger than its progress deadline cannot have stalled: the judgments from the acks
alone (``unended_by_acks``, ``settled_end``) and ``first_stall`` do not gather or sort progress
instants for it (a 10,000-worker rollout in a burst of acks is judged once a fetch: 20,000
instants sorted each time), and say what they said before."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

from controlplane.rollout.judge import settled_end, unended_by_acks
from controlplane.rollout.ledger import CommandLedger
from controlplane.rollout.track import first_stall
from tests.factories import A, S, ack, at, command

DEADLINE = timedelta(seconds=600)


class Counted(dict[str, object]):
    """A ledger's workers that count the lookups made in them."""

    looked = 0

    def get(self, key: str, default: object = None) -> object:
        self.looked += 1
        return super().get(key, default)


def _ledger(ids: list[str], terminal: set[str]) -> tuple[CommandLedger, Counted]:
    ledger = CommandLedger("r1", "c1")
    for w in ids:
        ledger.add(ack(w, A, 1.0))
        if w in terminal:
            ledger.add(ack(w, S, 2.0))
    counted = Counted(ledger.workers)
    ledger.workers = counted  # type: ignore[assignment]
    return ledger, counted


def test_first_stall_of_a_young_rollout_reads_no_instant() -> None:
    def never() -> Iterator[tuple[datetime, datetime]]:
        raise AssertionError("progress instants read")
        yield  # pragma: no cover

    assert first_stall(never(), at(0), at(600), DEADLINE) is None
    assert first_stall([], at(0), at(601), DEADLINE) == at(600)  # older: judged as ever


def test_a_young_rollout_in_progress_is_found_unended_at_its_first_unfinished_worker() -> None:
    ids = [f"w{i:04d}" for i in range(1000)]
    cmd = command(workers=ids)
    ledger, counted = _ledger(ids, terminal=set(ids[1:]))  # all but w0000 done
    assert unended_by_acks(cmd, ledger, now=at(60), progress_deadline=DEADLINE, abort=None)
    assert counted.looked == 1  # no instant gathered from the 999 others
    done, counted = _ledger(ids, terminal=set(ids))
    assert not unended_by_acks(cmd, done, now=at(60), progress_deadline=DEADLINE, abort=None)
    end = settled_end(cmd, done, now=at(60), progress_deadline=DEADLINE, abort=None)
    assert end is not None and end.at == at(2.0)
    # Older than its deadline with a silent stretch: judged on its instants as before.
    late = command(workers=ids[:2])
    stale, _ = _ledger(ids[:2], terminal=set())
    assert not unended_by_acks(late, stale, now=at(700), progress_deadline=DEADLINE, abort=None)
