"""The fault suite's count of what a fault left in the log: per command and worker, terminal
acks, distinct outcomes and applications (``Tally``), written as JSON for the session.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from controlplane.wire.protocol import (
    Ack,
    AckState,
    Command,
    decode_ack,
    decode_command,
)
from tests.faults.processes import Fleet
from tests.faults.reading import JSON, read_topic

# --------------------------------------------------------------------------- counting


@dataclass
class Tally:
    """What one test's log says: pairs, terminal acks, outcomes per pair, verdicts."""

    test: str
    pairs: int = 0
    terminal_acks: int = 0
    pairs_with_one_outcome: int = 0
    pairs_succeeded: int = 0
    pairs_applied_once: int = 0
    runs: int = 0
    true_verdicts: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"[faults] {self.test}: {self.pairs} (command, worker) pairs, "
            f"{self.terminal_acks} terminal acks, {self.pairs_with_one_outcome}/{self.pairs} "
            f"pairs with exactly one terminal outcome, {self.pairs_applied_once}/{self.pairs} "
            f"applied once, true verdicts {self.true_verdicts}/{self.runs} runs"
            + (f"; {'; '.join(self.notes)}" if self.notes else "")
        )

    def as_json(self) -> JSON:
        return {
            "test": self.test,
            "pairs": self.pairs,
            "terminal_acks": self.terminal_acks,
            "pairs_with_one_terminal_outcome": self.pairs_with_one_outcome,
            "pairs_succeeded": self.pairs_succeeded,
            "pairs_applied_once": self.pairs_applied_once,
            "runs": self.runs,
            "true_verdicts": self.true_verdicts,
            "notes": self.notes,
            "problems": self.problems,
        }


async def count_log(fleet: Fleet, tally: Tally) -> tuple[list[Command], list[Ack]]:
    """Fill ``tally`` from the topics and the journals: for every command in the log and every
    worker it pinned, its terminal acks, distinct terminal outcomes, and applications."""
    commands: list[Command] = await read_topic(
        fleet.bootstrap, fleet.topic("commands"), decode_command
    )
    acks: list[Ack] = await read_topic(fleet.bootstrap, fleet.topic("acks"), decode_ack)
    terminal: dict[tuple[str, str], list[Ack]] = defaultdict(list)
    for a in acks:
        if a.state.terminal:
            terminal[(a.command_id, a.worker_id)].append(a)
    journals = {wid: w.outcomes() for wid, w in fleet.workers.items()}
    applied = {wid: w.applied() for wid, w in fleet.workers.items()}
    for command in commands:
        for wid in command.selector.worker_ids or []:
            pair = (command.command_id, wid)
            tally.pairs += 1
            finals = terminal.get(pair, [])
            tally.terminal_acks += len(finals)
            states = {a.state for a in finals}
            if len(states) == 1:
                tally.pairs_with_one_outcome += 1
            else:
                tally.problems.append(
                    f"{pair}: terminal outcomes {sorted(s.value for s in states)}"
                )
            if states == {AckState.SUCCEEDED}:
                tally.pairs_succeeded += 1
            else:
                tally.problems.append(f"{pair}: not succeeded: {sorted(s.value for s in states)}")
            recorded = journals.get(wid, Counter())[command.command_id]
            started = applied.get(wid, Counter())[command.command_id]
            if recorded == 1 and started == 1:
                tally.pairs_applied_once += 1
            else:
                tally.problems.append(
                    f"{pair}: {recorded} journal outcomes, {started} 'applying' log lines"
                )
    return commands, acks


def report(tally: Tally, out_dir: Path, basetemp: Path) -> Path:
    """Write the tally to ``out_dir/fault-counts.json`` and append it to the session's
    ``basetemp/cluster-fault-counts.jsonl``; returns the first."""
    path = out_dir / "fault-counts.json"
    path.write_text(json.dumps(tally.as_json(), indent=2) + "\n")
    with open(basetemp / "cluster-fault-counts.jsonl", "a") as all_tests:
        all_tests.write(json.dumps(tally.as_json()) + "\n")
    return path
