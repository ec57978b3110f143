"""Broker faults on the local 3-node KRaft cluster, with real processes: three fake-runner
worker agents, and the `controlplane` CLI as users run it, on RF-3 / min-ISR-2 topics made by
`controlplane topics ensure`.

- A SIGKILLed partition leader (of the commands, the acks or the heartbeats) mid-rollout: the
  verdict `--wait` gives is the true one (succeeded, exit 0, no traceback).
- Two of three brokers down (below min ISR): the CLI fails with a coded error or gives up
  within its wait, never hangs; the agents say they cannot publish and recover.
- A rolling restart (SIGKILL + restart, node by node) during back-to-back rollouts: every
  verdict true, and the same as `controlplane status` reads from the log afterwards.

After each: for every (command, worker) pair one terminal outcome in the acks topic and one
application in the worker's journal and log. The counts go to the terminal (one `[faults]`
line per test), to ``fault-counts.json`` in the test's tmp dir and to
``cluster-fault-counts.jsonl`` in pytest's base temp dir.

The workers run with the product's default heartbeat period. No sleeps and no clock readings:
every step waits for a condition with a generous deadline. Each test leaves all three nodes
running (the ``cluster`` fixture restarts any node a failing test left down).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from controlplane.kafka.broker import LocalCluster
from controlplane.wire.protocol import decode_command, decode_heartbeat
from tests.conftest import partition_leader, say
from tests.factories import heal
from tests.faults import (
    NODES,
    CliRun,
    Fleet,
    Tally,
    ack_partition,
    count_log,
    in_sync_everywhere,
    partition_leaders,
    read_topic,
    readable,
    report,
    set_min_insync,
    until,
    whole,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

#: How long a fake reload takes: long enough that a broker is crashed while it runs (the
#: workers have acked "running") and the terminal acks are written during the failover.
MID_ROLLOUT_RELOAD_S = 8.0
#: Rollouts back to back during the rolling restart: short, so that several overlap each crash.
ROLLING_RELOAD_S = 3.0
#: At least this many rollouts, and more while the rolling restart is not done.
ROLLING_MIN_ROLLOUTS = 6
ROLLING_MAX_ROLLOUTS = 12
#: A CLI that has not exited within this (far past any of its own timeouts) hangs.
HANG_S = 420.0


@pytest.fixture
def cluster(kafka_cluster: LocalCluster) -> Iterator[LocalCluster]:
    yield kafka_cluster
    heal(kafka_cluster, NODES)


@pytest.fixture
async def fleet(
    cluster: LocalCluster, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[Fleet]:
    reload_s = getattr(request, "param", MID_ROLLOUT_RELOAD_S)
    fleet = Fleet(cluster, tmp_path, f"f{uuid.uuid4().hex[:10]}", reload_s)
    failed_before = request.session.testsfailed
    try:
        await asyncio.to_thread(cluster.wait_for_brokers, NODES, timeout=180)
        await fleet.setup()
        yield fleet
    finally:
        await asyncio.to_thread(fleet.stop)
        if request.session.testsfailed != failed_before:
            say(
                request.config,
                f"\n[faults] logs of {request.node.name} in {tmp_path}\n{fleet.logs()}",
            )


def _record(request: pytest.FixtureRequest, tally: Tally, tmp_path: Path) -> None:
    basetemp = request.getfixturevalue("tmp_path_factory").getbasetemp()
    path = report(tally, tmp_path, basetemp)
    say(request.config, f"\n{tally.line()} ({path})")
    if tally.problems:
        say(request.config, "[faults] problems: " + "; ".join(tally.problems[:20]))


def _verdict(run: CliRun, tally: Tally) -> str | None:
    """The phase the CLI printed (its --json status), counted as a true verdict when it says
    succeeded with exit 0 and no traceback."""
    tally.runs += 1
    phase = None
    with contextlib.suppress(AssertionError):
        phase = run.json().get("phase")
    if run.rc == 0 and phase == "succeeded" and "Traceback" not in run.stderr:
        tally.true_verdicts += 1
    return phase


async def _status(fleet: Fleet, rollout_id: str) -> CliRun:
    return await fleet.cli_done(f"status-{rollout_id}", "status", rollout_id, "--json")


def _assert_nothing_lost_nothing_twice(tally: Tally, expected_pairs: int) -> None:
    assert tally.pairs == expected_pairs, tally.as_json()
    assert tally.pairs_with_one_outcome == tally.pairs, tally.problems
    assert tally.pairs_succeeded == tally.pairs, tally.problems
    assert tally.pairs_applied_once == tally.pairs, tally.problems


# --------------------------------------------------------------------------- 1. one leader lost


async def _leader_of(fleet: Fleet, target: str) -> tuple[int, str]:
    """The node to crash for ``target``, and what it leads."""
    bootstrap = fleet.bootstrap
    if target in ("commands", "workers"):
        leader: int | None = None

        async def led() -> bool:
            nonlocal leader
            leader = await partition_leader(bootstrap, fleet.topic(target), 0)
            return leader is not None

        await until(led, timeout=60, what=f"{target} has a leader")
        assert leader is not None
        return leader, f"{fleet.topic(target)}-0"
    # acks: the partitions the three workers write to; the node leading most of them.
    leaders: dict[int, int] = {}

    async def all_led() -> bool:
        nonlocal leaders
        leaders = await partition_leaders(bootstrap, fleet.topic("acks"))
        return len(leaders) == 6

    await until(all_led, timeout=60, what="every acks partition has a leader")
    mine = {wid: ack_partition(wid, len(leaders)) for wid in fleet.workers}
    by_node: dict[int, list[str]] = {}
    for wid, p in sorted(mine.items()):
        by_node.setdefault(leaders[p], []).append(f"{wid}->acks-{p}")
    node = max(by_node, key=lambda n: len(by_node[n]))
    return node, ", ".join(by_node[node])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("target", ["commands", "acks", "workers"])
async def test_sigkill_of_a_partition_leader_mid_rollout_gives_the_true_verdict(
    cluster: LocalCluster,
    fleet: Fleet,
    target: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    tally = Tally(f"leader-kill[{target}]")
    rollout_id = f"r-kill-{target}-{uuid.uuid4().hex[:6]}"
    # As a person runs it: the progress lines (stderr) show how the reader judged the workers.
    waiter = fleet.reload("reload-wait", f"v-{target}", rollout_id, as_json=False)
    command_id = ""

    async def published() -> bool:
        nonlocal command_id
        if waiter.poll() is not None:
            raise AssertionError(f"the CLI exited before the fault: {waiter}")
        commands = await read_topic(fleet.bootstrap, fleet.topic("commands"), decode_command)
        ours = [c for c in commands if c.rollout_id == rollout_id]
        command_id = ours[0].command_id if ours else ""
        return bool(ours)

    await until(published, timeout=120, what=f"rollout {rollout_id} is published")
    await fleet.wait_running(command_id)
    node, leads = await _leader_of(fleet, target)
    assert await asyncio.to_thread(cluster.stop_node, node, kill=True)
    tally.notes.append(f"SIGKILLed node {node} leading {leads} while 3 workers ran the reload")
    try:
        rc = await waiter.wait_async(HANG_S)
    finally:
        await asyncio.to_thread(cluster.start_node, node, timeout=180)
    tally.runs += 1
    printed = _printed_verdict(waiter)
    if rc == 0 and printed == "succeeded" and "Traceback" not in waiter.stderr:
        tally.true_verdicts += 1
    # A live worker shown lost while the cluster failed over (the reader's view was stale).
    lost_lines = [line for line in waiter.stderr.splitlines() if re.search(r"\b\d+ lost\b", line)]
    tally.notes.append(
        f"--wait exit {rc}, printed {printed}; progress lines showing lost workers: "
        f"{len(lost_lines)}"
    )
    await whole(cluster, [fleet.topic(t) for t in ("commands", "acks", "workers")])

    # What the log says afterwards (all three nodes back): the same.
    await fleet.wait_published([command_id])
    status = await _status(fleet, rollout_id)
    await count_log(fleet, tally)
    _record(request, tally, tmp_path)

    assert rc is not None, f"--wait did not return within {HANG_S:.0f}s: {waiter}"
    assert "Traceback" not in waiter.stderr, str(waiter)
    assert rc == 0, str(waiter)
    assert printed == "succeeded", str(waiter)
    assert not lost_lines, f"live workers shown lost during the failover: {lost_lines}"
    assert status.rc == 0 and status.json()["phase"] == "succeeded", str(status)
    _assert_nothing_lost_nothing_twice(tally, expected_pairs=3)


# --------------------------------------------------------------------------- 2. below min ISR


def _coded_failure(run: CliRun) -> bool:
    """Exit 4 (Kafka unreachable: nothing published) or 6 (outcome unknown), one coded line."""
    codes = ("BROKER_UNAVAILABLE", "PUBLISH_OUTCOME_UNKNOWN")
    return run.rc in (4, 6) and any(f"error: {c}" in run.stderr for c in codes)


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("how", ["two-nodes-sigkilled", "below-min-isr"])
async def test_two_of_three_brokers_down_fails_coded_never_hangs_and_recovers(
    cluster: LocalCluster,
    fleet: Fleet,
    how: str,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """Writes impossible mid-rollout, two ways.

    ``two-nodes-sigkilled``: two of the three nodes crash. No quorum is left to elect leaders,
    so the partitions they led have none: reads of them fail as well as every write.
    ``below-min-isr``: one node crashes and is fenced (two in-sync replicas left), then the
    product topics' ``min.insync.replicas`` is raised to 3: the cluster answers every read and
    refuses every acks=all write with the retriable NOT_ENOUGH_REPLICAS (what one broker left
    of three does to a min-ISR-2 topic, with the quorum still up): an idempotent producer
    retries that for ever, so only the product's own bounds end a publish.
    """
    tally = Tally(f"two-brokers-down[{how}]")
    rollout_id = f"r-minisr-{uuid.uuid4().hex[:6]}"
    waiter = fleet.reload("reload-wait", "v-before-outage", rollout_id)
    # A second rollout, queued behind the first on every worker, whose --wait runs out during
    # the outage: it must return on its own without a verdict (the rollout has none yet).
    short_id = f"r-minisr-short-{uuid.uuid4().hex[:6]}"
    short_wait = None
    command_id = ""

    async def published() -> bool:
        nonlocal command_id, short_wait
        for run in (waiter, short_wait):
            if run is not None and run.poll() is not None:
                raise AssertionError(f"the CLI exited before the fault: {run}")
        commands = await read_topic(fleet.bootstrap, fleet.topic("commands"), decode_command)
        ours = [c for c in commands if c.rollout_id == rollout_id]
        command_id = ours[0].command_id if ours else ""
        if ours and short_wait is None:
            short_wait = fleet.reload(
                "reload-short-wait", "v-queued", short_id, "--wait", "--wait-timeout", "45"
            )
        return bool(ours) and short_id in {c.rollout_id for c in commands}

    await until(published, timeout=120, what=f"rollouts {rollout_id}, {short_id} are published")
    assert short_wait is not None
    await fleet.wait_running(command_id)
    topics = [fleet.topic(t) for t in ("commands", "acks", "workers")]
    # The commands partition's leader is crashed either way (a failover besides).
    leader = await partition_leader(fleet.bootstrap, fleet.topic("commands"), 0) or 1
    if how == "two-nodes-sigkilled":
        down = [leader, leader % NODES + 1]
        for node in down:
            assert await asyncio.to_thread(cluster.stop_node, node, kill=True)
        tally.notes.append(f"SIGKILLed nodes {down} while 3 workers ran the reload")
    else:
        down = [leader]
        assert await asyncio.to_thread(cluster.stop_node, leader, kill=True)
        await asyncio.to_thread(cluster.wait_for_brokers, NODES - 1, timeout=180)
        await until(
            lambda: in_sync_everywhere(fleet.bootstrap, topics, NODES - 1),
            timeout=120,
            what=f"node {leader} is out of every ISR",
        )
        # The new leaders' high watermarks are established (with min ISR 3 and two in sync
        # they could no longer advance, and reads of the end would fail too).
        await until(
            lambda: readable(fleet.bootstrap, topics),
            timeout=120,
            what="every partition answers reads after the failover",
        )
        await set_min_insync(fleet, 3)
        tally.notes.append(
            f"SIGKILLed node {leader}, then min.insync.replicas 3 with 2 in sync, while 3 "
            "workers ran the reload"
        )
    publish_only = wait_bounded = None
    try:
        # A publish now: a coded error within its own timeout, and nothing claimed falsely.
        new_id = f"r-outage-{uuid.uuid4().hex[:6]}"
        publish_only = fleet.reload("reload-during", "v-during", new_id, wait=False)
        waited_id = f"r-outage-wait-{uuid.uuid4().hex[:6]}"
        wait_bounded = fleet.reload(
            "reload-during-wait", "v-during-wait", waited_id, "--wait", "--wait-timeout", "60"
        )
        rc_publish = await publish_only.wait_async(HANG_S)
        rc_wait = await wait_bounded.wait_async(HANG_S)
        rc_short = await short_wait.wait_async(HANG_S)
        short_phase = _printed_phase(short_wait)
        tally.notes.append(
            f"--wait --wait-timeout 45 of a rollout queued before the outage: exit {rc_short}, "
            f"printed phase {short_phase}"
        )
        tally.notes.append(
            f"publish during the outage: exit {rc_publish}, {len(publish_only.stderr.splitlines())}"
            f" stderr lines; with --wait --wait-timeout 60: exit {rc_wait}, "
            f"{len(wait_bounded.stderr.splitlines())} stderr lines"
        )

        # The agents say, in their own words, that they cannot publish.
        def said_so() -> bool:
            return all(
                _cannot_publish(w.log.read_text(errors="replace")) for w in fleet.workers.values()
            )

        said = True
        try:
            await until(said_so, timeout=180, what="every agent logs that it cannot publish")
        except AssertionError:
            said = False
        tally.notes.append(f"every agent logged it cannot publish: {said}")
    finally:
        if how == "below-min-isr":
            await set_min_insync(fleet, 2)
        for node in down:
            await asyncio.to_thread(cluster.start_node, node, timeout=240)
    await whole(cluster, [fleet.topic(t) for t in ("commands", "acks", "workers")])
    rc = await waiter.wait_async(HANG_S)
    phase = _verdict(waiter, tally)
    tally.notes.append(f"the rollout's --wait (begun before the outage): exit {rc}, phase {phase}")

    # After the recovery: heartbeats that got through say the agents could not publish.
    beats = await read_topic(fleet.bootstrap, fleet.topic("workers"), decode_heartbeat)
    # (getattr: the suite also runs against builds older than these fields, to see it fail)
    reported = {
        hb.worker_id
        for hb in beats
        if getattr(hb, "publish_failing_since", None) is not None
        or getattr(hb, "acks_unpublished", 0) > 0
    }
    tally.notes.append(f"workers whose heartbeats reported the outage: {sorted(reported)}")

    commands = await read_topic(fleet.bootstrap, fleet.topic("commands"), decode_command)
    in_log = {c.rollout_id for c in commands}
    tally.notes.append(
        f"published during the outage and in the log after: {new_id in in_log} (exit "
        f"{rc_publish}), {waited_id in in_log} (exit {rc_wait})"
    )
    # A command of the outage that did reach the log runs like any other.
    later = [c.command_id for c in commands]
    await fleet.wait_published(later)
    others = [await _status(fleet, rid) for rid in sorted(in_log - {rollout_id, short_id})]
    short_status = await _status(fleet, short_id)
    tally.notes.append(
        f"the queued rollout's status after the recovery: exit {short_status.rc}, "
        f"{_printed_phase(short_status)}"
    )
    status = await _status(fleet, rollout_id)
    await count_log(fleet, tally)
    _record(request, tally, tmp_path)

    assert publish_only is not None and wait_bounded is not None
    assert rc_publish is not None, f"the publish hung: {publish_only}"
    assert rc_wait is not None, f"--wait --wait-timeout 60 hung: {wait_bounded}"
    for run in (publish_only, wait_bounded):
        assert "Traceback" not in run.stderr, str(run)
    assert _coded_failure(publish_only), str(publish_only)
    for other in others:
        assert other.rc == 0, str(other)
    # The wait that ran out: no verdict claimed (2: gave up waiting, 4: Kafka unreachable).
    assert rc_short is not None, f"--wait --wait-timeout 45 hung: {short_wait}"
    assert "Traceback" not in short_wait.stderr, str(short_wait)
    assert rc_short in (2, 4), str(short_wait)
    assert short_phase in (None, "pending", "progressing"), str(short_wait)
    assert short_status.rc == 0 and short_status.json()["phase"] == "succeeded", str(short_status)
    # With --wait: a coded failure, or (published after all) gave up waiting: exit 2.
    assert _coded_failure(wait_bounded) or wait_bounded.rc == 2, str(wait_bounded)
    # Exit 4 claims nothing was published: then it is not in the log.
    if rc_publish == 4:
        assert new_id not in in_log, str(publish_only)
    if rc_wait == 4:
        assert waited_id not in in_log, str(wait_bounded)
    assert said, "an agent never logged that it cannot publish:\n" + fleet.logs()
    assert reported == set(fleet.workers), (
        f"heartbeats with publish_failing_since/acks_unpublished only from {sorted(reported)}"
    )
    assert rc == 0 and phase == "succeeded", str(waiter)
    assert "Traceback" not in waiter.stderr, str(waiter)
    assert status.rc == 0 and status.json()["phase"] == "succeeded", str(status)
    _assert_nothing_lost_nothing_twice(tally, expected_pairs=3 * len(commands))


def _printed_verdict(run: CliRun) -> str | None:
    """The phase in the title of the rollout table the CLI printed (without --json)."""
    match = re.search(r"^rollout \S+ \([^)]*\):\s+(\w+)", run.stdout, re.MULTILINE)
    return match.group(1) if match else None


def _printed_phase(run: CliRun) -> str | None:
    """The phase in the status a --json CLI printed, or None when it printed none."""
    try:
        return str(run.json().get("phase"))
    except AssertionError:
        return None


def _cannot_publish(log: str) -> bool:
    """The agent's own line that it cannot publish (not aiokafka's retries)."""
    return any(
        "workers.agent.loop" in line and "cannot publish" in line.lower()
        for line in log.splitlines()
    )


# --------------------------------------------------------------------------- 3. rolling restart


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fleet", [ROLLING_RELOAD_S], indirect=True)
async def test_rolling_restart_during_back_to_back_rollouts_every_verdict_true(
    cluster: LocalCluster, fleet: Fleet, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tally = Tally("rolling-restart")
    topics = [fleet.topic(t) for t in ("commands", "acks", "workers")]
    restarted = asyncio.Event()
    runs: list[tuple[str, CliRun]] = []
    #: Nodes crashed so far, and whether one is down now: which rollouts overlapped a crash.
    crashes = 0
    node_down = False
    overlapped = 0

    async def rollouts() -> None:
        nonlocal overlapped
        n = 0
        while n < ROLLING_MAX_ROLLOUTS and (n < ROLLING_MIN_ROLLOUTS or not restarted.is_set()):
            n += 1
            rid = f"r-roll-{n:02d}-{uuid.uuid4().hex[:6]}"
            run = fleet.reload(f"reload-{n:02d}", f"v-roll-{n}", rid)
            runs.append((rid, run))
            crashes_before, down_before = crashes, node_down
            await run.wait_async(HANG_S)
            overlapped += int(down_before or node_down or crashes > crashes_before)

    async def rolling_restart() -> None:
        nonlocal crashes, node_down
        try:
            # The first rollout is under way before the first crash.
            await until(lambda: bool(runs), timeout=60, what="the first rollout started")
            for node in range(1, NODES + 1):
                await whole(cluster, topics)
                node_down = True
                crashes += 1
                assert await asyncio.to_thread(cluster.stop_node, node, kill=True)
                await asyncio.to_thread(cluster.wait_for_brokers, NODES - 1, timeout=180)
                await asyncio.to_thread(cluster.start_node, node, timeout=180)
                node_down = False
            await whole(cluster, topics)
        finally:
            restarted.set()

    await asyncio.gather(rollouts(), rolling_restart())
    tally.notes.append(
        f"{len(runs)} rollouts back to back, {overlapped} of them while a node was down or "
        f"crashed ({crashes} SIGKILLs: nodes 1, 2, 3 in turn, each restarted)"
    )

    verdicts: list[str] = []
    mismatches: list[str] = []
    for rid, run in runs:
        phase = _verdict(run, tally)
        status = await _status(fleet, rid)
        final = status.json().get("phase") if status.rc in (0, 1, 2) else None
        verdicts.append(f"{rid}: exit {run.rc} {phase} / status exit {status.rc} {final}")
        if (run.rc, phase) != (status.rc, final):
            mismatches.append(verdicts[-1])
    commands = await read_topic(fleet.bootstrap, fleet.topic("commands"), decode_command)
    await fleet.wait_published([c.command_id for c in commands])
    await count_log(fleet, tally)
    _record(request, tally, tmp_path)

    for _, run in runs:
        assert run.rc is not None, f"hung: {run}"
        assert "Traceback" not in run.stderr, str(run)
    assert not mismatches, mismatches
    assert tally.true_verdicts == tally.runs, verdicts
    _assert_nothing_lost_nothing_twice(tally, expected_pairs=3 * len(runs))
