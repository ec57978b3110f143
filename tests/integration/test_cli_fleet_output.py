"""The CLI's output at fleet scale, on the real broker through the installed entry point: 40
identical rejections are one row with a count (``-o wide``: a row each), a publish names a few
of its 40 workers and a count, titles stay on one line, ``-o json|yaml`` carry the same data
(``workers`` with what each worker should run and whether it does), ``status --watch`` with no
id follows every rollout in progress, and an unknown rollout id is a coded error.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.exits import CliExit
from controlplane.wire.protocol import (
    Ack,
    AckError,
    AckState,
    CommandKind,
    ReloadWeightsSpec,
    Selector,
    Timings,
    UpdateConfigSpec,
    utcnow,
)
from tests.factories import succeeded_acks
from tests.fleet import make_command, publish
from tests.integration.test_cli_one_rollout import beat, send_acks
from tests.integration.test_cli_usage import ENTRY, controlplane

pytestmark = pytest.mark.kafka

REPO = Path(__file__).resolve().parents[2]
FLEET = [f"fake-{i:03d}" for i in range(1, 41)]
#: Long enough that the rollout's title is wider than its table (not than the terminal).
LONG_SETTINGS = [f"setting_number_{i}=value-{i}" for i in range(3)]


def argv(settings: KafkaSettings, *args: str) -> list[str]:
    where = ("--bootstrap", settings.bootstrap_servers, "--topic-prefix", settings.topic_prefix)
    return [str(ENTRY), *args, *where]


def cli(settings: KafkaSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return controlplane(*argv(settings, *args)[1:])


def rejected(worker_id: str, rollout_id: str, command_id: str) -> Ack:
    """What every worker says of a key it does not know: the same code, the same message."""
    now = utcnow()
    return Ack(
        command_id=command_id,
        rollout_id=rollout_id,
        worker_id=worker_id,
        kind=CommandKind.UPDATE_CONFIG,
        state=AckState.REJECTED,
        error=AckError(code="CONFIG_KEY_REJECTED", message="unknown config key setting_number_0"),
        timings=Timings(received_at=now, finished_at=now),
        sent_at=now,
    )


async def test_forty_identical_rejections_are_one_row_with_a_count(kafka: KafkaSettings) -> None:
    await beat(kafka, FLEET)
    sets = [arg for item in LONG_SETTINGS for arg in ("--set", item)]
    published = await asyncio.to_thread(cli, kafka, "update-config", *sets, "--all")
    assert published.returncode == 0, published.stderr
    [line] = [ln for ln in published.stdout.splitlines() if ln.startswith("published")]
    assert line.endswith("to 40 worker(s): " + ", ".join(FLEET[:10]) + " and 30 more"), line
    match = re.search(r"published rollout (\S+) \(command (\S+),", line)
    assert match is not None, line
    rollout_id, command_id = match.groups()
    await send_acks(kafka, [rejected(w, rollout_id, command_id) for w in FLEET])

    table = await asyncio.to_thread(cli, kafka, "status", rollout_id)
    assert table.returncode == CliExit.FAILED, table.stderr
    assert table.stdout.count("CONFIG_KEY_REJECTED") == 1, table.stdout
    [row] = [ln for ln in table.stdout.splitlines() if "CONFIG_KEY_REJECTED" in ln]
    assert "40: fake-001, fake-002, fake-003 and 37 more" in row, row
    # The title on one line, however narrow the table under it.
    [title] = [ln for ln in table.stdout.splitlines() if ln.startswith(f"rollout {rollout_id}")]
    assert title.rstrip().endswith("): failed [WORKERS_FAILED]"), table.stdout
    assert "setting_number_2=value-2" in title, table.stdout

    wide = await asyncio.to_thread(cli, kafka, "status", rollout_id, "-o", "wide")
    assert wide.returncode == CliExit.FAILED, wide.stderr
    assert wide.stdout.count("CONFIG_KEY_REJECTED") == 40, wide.stdout

    as_json = await asyncio.to_thread(cli, kafka, "status", rollout_id, "-o", "json")
    alias = await asyncio.to_thread(cli, kafka, "status", rollout_id, "--json")
    as_yaml = await asyncio.to_thread(cli, kafka, "status", rollout_id, "-o", "yaml")
    assert as_json.returncode == alias.returncode == as_yaml.returncode == CliExit.FAILED
    judged = json.loads(as_json.stdout)
    assert judged["phase"] == "failed" and judged["counts"]["rejected"] == 40, judged
    for other in (json.loads(alias.stdout), yaml.safe_load(as_yaml.stdout)):
        assert {k: v for k, v in other.items() if k != "as_of"} == {
            k: v for k, v in judged.items() if k != "as_of"
        }

    every = await asyncio.to_thread(cli, kafka, "status", "-o", "yaml")
    assert every.returncode == 0, every.stderr
    assert [s["rollout_id"] for s in yaml.safe_load(every.stdout)] == [rollout_id]


async def test_workers_data_says_what_each_should_run_and_whether_it_does(
    kafka: KafkaSettings,
) -> None:
    await beat(kafka, FLEET[:4])
    pinned = FLEET[:2]
    command = make_command(
        ReloadWeightsSpec(path="/ckpts/v9", version="v9"),
        selector=Selector(worker_ids=pinned),
    )
    await publish(kafka, command)

    listed = await asyncio.to_thread(cli, kafka, "workers", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    rows = {row["worker_id"]: row for row in json.loads(listed.stdout)}
    assert sorted(rows) == FLEET[:4]
    for worker_id, row in rows.items():
        wanted = "v9" if worker_id in pinned else None
        assert row["desired_version"] == wanted, row
        assert row["desired_rollout_id"] == (command.rollout_id if wanted else None), row
        assert row["in_sync"] is (wanted is None), row
        assert row["alive"] is True and "labels" in row, row
    alias = await asyncio.to_thread(cli, kafka, "workers", "--json")
    as_yaml = await asyncio.to_thread(cli, kafka, "workers", "-o", "yaml")
    for other in (json.loads(alias.stdout), yaml.safe_load(as_yaml.stdout)):
        assert {r["worker_id"]: r["desired_version"] for r in other} == {
            w: r["desired_version"] for w, r in rows.items()
        }


async def test_status_watch_without_an_id_follows_every_rollout_in_progress(
    kafka: KafkaSettings,
) -> None:
    await beat(kafka, FLEET[:3])
    commands = [
        make_command(
            UpdateConfigSpec(overrides={"t": n}),
            rollout_id=f"r-watch-{n}",
            selector=Selector(worker_ids=FLEET[:3]),
        )
        for n in (1, 2)
    ]
    await publish(kafka, *commands)
    proc = await asyncio.create_subprocess_exec(
        *argv(kafka, "status", "--watch"),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None and proc.stdout is not None
    try:
        seen: set[str] = set()
        async with asyncio.timeout(120):
            while seen != {"r-watch-1", "r-watch-2"}:  # it is watching both
                line = (await proc.stderr.readline()).decode()
                assert line, "status --watch ended before following the rollouts"
                seen |= {r for r in ("r-watch-1", "r-watch-2") if f"] {r} " in line}
        for command in commands:
            acks = [
                a
                for w in FLEET[:3]
                for a in succeeded_acks(w, command.rollout_id, command.command_id)
            ]
            await send_acks(kafka, acks)
        async with asyncio.timeout(120):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, err.decode()
    assert "r-watch-1 succeeded: 3/3 done" in err.decode(), err.decode()
    assert "r-watch-2 succeeded: 3/3 done" in err.decode(), err.decode()
    assert "r-watch-1" in out.decode() and "r-watch-2" in out.decode()


async def test_status_watch_with_nothing_in_progress_says_so(kafka: KafkaSettings) -> None:
    proc = await asyncio.to_thread(cli, kafka, "status", "--watch")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "no rollout in progress\n"


async def test_an_unknown_rollout_is_a_coded_error(kafka: KafkaSettings) -> None:
    proc = await asyncio.to_thread(cli, kafka, "status", "r-nope")
    assert proc.returncode == CliExit.INVALID, proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ROLLOUT_UNKNOWN: no rollout 'r-nope' in the log; hint: "), line
    assert "controlplane status" in line, line
