"""`fleet-worker run` as a process on a real broker: how it stops when its journal cannot be written."""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path

import pytest

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import WorkerStatus
from tests.factories import worker_argv
from tests.fleet import heartbeats_tail

pytestmark = pytest.mark.kafka


async def test_a_full_disk_stops_the_worker_with_one_coded_line_and_exit_6(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_")}
    env["FLEET_FAILPOINTS"] = "journal_sync=enospc"  # every journal sync fails, as on a full disk
    argv = worker_argv(
        "w-disk",
        bootstrap=kafka.bootstrap_servers,
        prefix=kafka.topic_prefix,
        state_dir=tmp_path / "state",
        heartbeat_s="0.5",
    )
    done = await asyncio.to_thread(
        subprocess.run, argv, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 6, done.stderr
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: JOURNAL_WRITE_FAILED: "), done.stderr
    assert "No space left on device (failpoint journal_sync)" in last
    async with heartbeats_tail(kafka) as hbs:
        await hbs.until(lambda items: any(h.worker_id == "w-disk" for h in items))
    (said,) = [h for h in hbs.items if h.worker_id == "w-disk"]
    assert said.status is WorkerStatus.DEGRADED
    assert said.degraded is not None and said.degraded.code == "JOURNAL_WRITE_FAILED"
