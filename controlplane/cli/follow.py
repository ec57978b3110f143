"""How the CLI reads the log: catch up, wait for an unconfirmed publish, follow a rollout.

A command about one rollout reads only what that rollout needs, never the fleet's history
(:func:`read_rollout`): the workers topic (compacted: about one record per worker), the
commands topic (one small record per rollout; only records whose bytes name the rollout are
decoded), and the acks from the offsets at the rollout's first command record, less
:data:`ACKS_CLOCK_MARGIN_S`. A publish reads the workers topic and only what is appended
after it started (see ``rollout._publish_and_maybe_wait``). ``status`` (all) and ``workers``
still fold the whole log (:func:`read_log`): every rollout's verdict and every worker's
desired version need it.

``--wait``, ``status``, ``workers`` and a publish resolving its selector judge at the follower's
``current_as_of()``: the time up to which it has read everything, never the clock at the end of
a long replay. During a Kafka outage that time stands still, so no worker is judged lost for a
silence the reader could not hear; the outage is said once, each way.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from typing import Any

from controlplane.cli.common import UNREACHABLE_HINT
from controlplane.cli.render import console, progress_line
from controlplane.coordinator.follower import DEFAULT_MAX_TTL_S, Follower
from controlplane.coordinator.publisher import PublishUnconfirmed
from controlplane.kafka.bus import health
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutStatus
from controlplane.wire.channels import ACKS, COMMANDS
from controlplane.wire.errors import BusError, LocalCode
from controlplane.wire.protocol import Command, utcnow
from controlplane.wire.signing import Verifier

#: The longest TTL a command that a reader's trust store verifies may claim (the coordinator's).
MAX_TTL_S = DEFAULT_MAX_TTL_S


class PublishedFleet(Fleet):
    """A publisher's fold: of the rollout it publishes (once :meth:`publishing` named its
    command), only that very command. Another command under that rollout id (a forgery that
    copies its ids with an earlier ``issued_at`` and fewer workers, which would otherwise be
    the rollout judged, or a reuse of the id) is never folded into it, with or without a trust
    store: it is kept in :attr:`ignored` (once each) for the publisher to say so."""

    def __init__(self) -> None:
        super().__init__()
        self.published: Command | None = None
        self._published: dict[str, Any] = {}
        self.ignored: list[Command] = []

    def publishing(self, command: Command) -> None:
        self.published = command
        self._published = command.model_dump(mode="json")

    def observe_command(self, command: Command) -> None:
        mine = self.published
        if (
            mine is not None
            and command.rollout_id == mine.rollout_id
            and command.model_dump(mode="json") != self._published
        ):
            if command not in self.ignored:
                self.ignored.append(command)
            return
        super().observe_command(command)


def wait_deadline(
    started: float, wait_timeout: float | None, command: Command
) -> tuple[float, str]:
    """When ``--wait`` stops waiting for an unconfirmed publish (a ``time.monotonic()``) and
    what that limit is called: ``--wait-timeout`` after the publish began, else the command's
    expiry (a record that lands later is refused by the workers as expired anyway)."""
    if wait_timeout is not None:
        return started + wait_timeout, f"--wait-timeout {wait_timeout:g} s"
    left = max(0.0, (command.expires_at - utcnow()).total_seconds())
    return time.monotonic() + left, f"the command's expiry ({hms(command.expires_at)})"


async def await_unconfirmed(
    follower: Follower, unconfirmed: PublishUnconfirmed, deadline: tuple[float, str]
) -> int | None:
    """After PUBLISH_OUTCOME_UNKNOWN under ``--wait``: the producer goes on retrying the same
    record while the log is read, until the cluster confirms it (its offset), the rollout is
    read back (its offset if the confirmation follows at once, else None), or the deadline
    passes (PUBLISH_OUTCOME_UNKNOWN again: exit 6). A record the producer gave up on was not
    written: that error is raised as it is."""
    entered = time.monotonic()
    until, limit = deadline
    rollout_id, delivery = unconfirmed.rollout_id, unconfirmed.delivery
    say(
        console(stderr=True),
        None,
        f"rollout {rollout_id} (command {unconfirmed.command_id}) not confirmed within "
        f"{unconfirmed.timeout_s:g} s; still trying, and reading the log for it until {limit}",
    )
    while True:
        if delivery.done:
            return (await delivery.wait(0)).offset
        if rollout_id in follower.fleet:  # in the log: published, whatever the producer says
            try:
                return (await delivery.wait(2.0)).offset
            except BusError:
                return None
        left = until - time.monotonic()
        if left <= 0:
            raise PublishUnconfirmed(
                unconfirmed.command,
                delivery,
                f"{unconfirmed.why}, and it was neither confirmed nor read back from the log "
                f"before {limit}",
                unconfirmed.timeout_s + time.monotonic() - entered,
            )
        await follower.poll(timeout_s=min(0.25, left))


async def catch_up(follower: Follower, settings: KafkaSettings) -> None:
    """Read the whole log; BROKER_UNAVAILABLE (exit 4) when Kafka stays unreachable for a
    request timeout meanwhile, instead of waiting forever. A probing follower then waits (a
    little) for its first probe to come back: see :func:`settle`."""
    patience = settings.request_timeout_ms / 1000
    while not follower.caught_up.is_set():
        await follower.poll(timeout_s=0.5)
        since = follower.unreachable_since()
        if since is not None and (utcnow() - since).total_seconds() > patience:
            raise BusError(
                f"Kafka unreachable since {hms(since)} while reading the log "
                f"({follower.settings.bootstrap_servers}); {UNREACHABLE_HINT}",
                code=LocalCode.BROKER_UNAVAILABLE,
            )
    if follower.probe:
        await settle(follower, min(PROBE_PATIENCE_S, settings.delivery_timeout_ms / 1000))


#: How long a probing reader waits for its first probe to be read back before it judges.
PROBE_PATIENCE_S = 5.0


async def settle(follower: Follower, patience_s: float) -> None:
    """Until this reader has read back a probe of its own (at most ``patience_s``): before,
    ``current_as_of()`` is only the last append it read on the workers topic, which may be
    long ago. If none comes back, Kafka is holding writes back (a broker failover, fewer
    in-sync replicas than min.insync.replicas) or unreachable: say so once, and judge as of
    what was read (heartbeats held back are not silence)."""
    deadline = time.monotonic() + patience_s
    while follower.probes_read == 0 and time.monotonic() < deadline:
        await follower.poll(timeout_s=0.1)
    if follower.probes_read == 0 and follower.unreachable_since() is None:
        as_of = follower.current_as_of()
        when = hms(as_of) if as_of is not None else "the last record read"
        say(
            console(stderr=True),
            None,
            f"Kafka is not confirming writes (no probe read back within {patience_s:g} s): "
            f"liveness judged as of {when}",
        )


@asynccontextmanager
async def read_log(
    settings: KafkaSettings, verifier: Verifier | None = None
) -> AsyncIterator[tuple[Follower, datetime]]:
    """A probing reader that has read the whole log (:func:`catch_up`), and the time to judge
    at (:func:`judge_time`); it stops reading when the block ends. ``verifier``: fold only
    the commands it verifies (see the module's docstring)."""
    async with Follower(settings, probe=True, verifier=verifier, max_ttl_s=MAX_TTL_S) as follower:
        await catch_up(follower, settings)
        yield follower, judge_time(follower)


#: How far before its first command record a rollout's acks are read from (seconds). An ack's
#: record timestamp is its agent's clock when it sent it (the acks topic is CreateTime), after
#: the agent read the command; the command's is its publisher's clock (and its ``issued_at``,
#: taken just before): an ack falls before it only when the agent's clock is behind the
#: publisher's by more than the time from publish to ack. Kafka answers a time with the first
#: offset at or after it, so an ack stamped earlier is still read unless every record before it
#: in its partition is older too. Two minutes covers any host whose clock is kept by NTP (skew
#: of milliseconds) and an unsynchronized one by far; each second of it costs only the acks
#: appended in that second before the rollout.
ACKS_CLOCK_MARGIN_S = 120.0


async def acks_start(
    settings: KafkaSettings,
    rollout_id: str,
    *,
    margin_s: float = ACKS_CLOCK_MARGIN_S,
    verifier: Verifier | None = None,
) -> dict[tuple[str, int], int] | None:
    """Where the acks of ``rollout_id`` begin: per acks partition, the first offset at or
    after its first command record (the earliest record timestamp or ``issued_at`` of any
    command record naming it, decoded or not), less ``margin_s``. None: no command record
    names it (not on the commands topic, or gone by retention). ``verifier``: as the reader
    that follows (an unverified command still names the rollout: its NACKs are read)."""
    issued: list[datetime] = []
    # The acks topic is followed from its end (nothing before is read): assigned, so that
    # its partitions are known to be asked for by time.
    async with Follower(
        settings,
        channels=(COMMANDS, ACKS),
        rollouts=(rollout_id,),
        tail=(ACKS,),
        verifier=verifier,
        max_ttl_s=MAX_TTL_S,
    ) as follower:
        follower.listeners.append(lambda batch: issued.extend(c.issued_at for c in batch.commands))
        await catch_up(follower, settings)
        first = follower.command_times.get(rollout_id)
        if first is None:
            return None
        since = min([first / 1000, *(at.timestamp() for at in issued)]) - margin_s
        return await follower.offsets_for_times(ACKS, max(0, int(since * 1000)))


@asynccontextmanager
async def read_rollout(
    settings: KafkaSettings,
    rollout_id: str,
    *,
    margin_s: float = ACKS_CLOCK_MARGIN_S,
    verifier: Verifier | None = None,
) -> AsyncIterator[tuple[Follower, datetime]]:
    """:func:`read_log` for one rollout: a probing reader that folds only ``rollout_id``'s
    commands and acks, its acks read from :func:`acks_start` on (from the beginning, every
    ack undecoded unless its bytes name the rollout, when no command record names it: a
    rollout known only from NACKs, or none), and the whole workers topic; judged exactly as
    a full replay judges it. ``verifier``: fold only the commands it verifies."""
    start = await acks_start(settings, rollout_id, margin_s=margin_s, verifier=verifier)
    async with Follower(
        settings,
        probe=True,
        rollouts=(rollout_id,),
        start_at=start,
        verifier=verifier,
        max_ttl_s=MAX_TTL_S,
    ) as follower:
        await catch_up(follower, settings)
        yield follower, judge_time(follower)


def judge_time(follower: Follower) -> datetime:
    """The time to judge at: when the reader's view of the log was current
    (:meth:`Follower.current_as_of`), however long its replay took. A reader that has caught
    up always has one; the clock only answers for one that has not (nothing is judged then)."""
    return follower.current_as_of() or utcnow()


def hms(when: datetime) -> str:
    """HH:MM:SS in UTC, like the progress lines."""
    return when.astimezone(UTC).strftime("%H:%M:%S")


#: --wait spends at most 1/(1+this) of its time judging: after a judgement that took t seconds,
#: the next waits t * this (small fleets: at once; 500 workers: a few hundred ms).
JUDGE_COST_FACTOR = 5.0


async def follow(
    follower: Follower, rollout_id: str, wait_timeout: float | None, as_json: bool
) -> RolloutStatus | None:
    """Poll the log until the rollout is terminal (or the wait times out); print progress.

    The rollout is judged at ``follower.current_as_of()``, never at the wall clock: while Kafka
    is unreachable that time stands still and nothing is concluded from missing heartbeats.
    Raises BROKER_UNAVAILABLE when the wait times out with Kafka unreachable; None when it
    times out before the rollout was even read back."""
    out = console(stderr=True)
    deadline = time.monotonic() + wait_timeout if wait_timeout else None
    last = ""
    bar = None
    if out.is_terminal and not as_json:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description}", markup=False),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
            console=out,
            transient=True,
        )
        bar.start()
        task = bar.add_task(rollout_id, total=1)
    # Judge the rollout when a batch touched it, throttled by what judging costs, and at least
    # every second (deadlines pass and workers go silent without any record).
    judged_at = -1.0
    gap = 0.0
    touched = True
    status: RolloutStatus | None = None
    announced: datetime | None = None  # the outage already reported
    health.quiet = True  # outages are reported below, in the progress's own words
    told: set[tuple[str, str]] = set()  # the foreign commands already reported
    news = True
    try:
        while True:
            if news:
                for line in foreign_commands(follower, rollout_id, told):
                    say(out, bar, line)
            now_m = time.monotonic()
            announced = outage_news(follower, announced, out, bar)
            as_of = follower.current_as_of()
            if (
                as_of is not None
                and rollout_id in follower.fleet
                and ((touched and now_m - judged_at >= gap) or now_m - judged_at >= 1.0)
            ):
                judged_at, touched = now_m, False
                status = follower.fleet.status(rollout_id, as_of)
                gap = min(0.25, (time.monotonic() - now_m) * JUDGE_COST_FACTOR)
                line = progress_line(status)
                if bar is not None:
                    c = status.counts
                    bar.update(
                        task,
                        total=max(status.expected, 1),
                        description=line,
                        completed=c.succeeded + c.failed + c.rejected + c.lost,
                    )
                elif line != last and not as_json:
                    out.print(f"[{utcnow().strftime('%H:%M:%S')}] {line}")
                last = line
                if status.terminal:
                    return status
            if deadline is not None and time.monotonic() > deadline:
                down = follower.unreachable_since()
                if down is not None:
                    phase = f" (the rollout is still {status.phase.value})" if status else ""
                    raise BusError(
                        f"Kafka unreachable since {hms(down)}: gave up waiting for rollout "
                        f"{rollout_id} after {wait_timeout:g} s{phase}",
                        code=LocalCode.BROKER_UNAVAILABLE,
                    )
                if status is None and as_of is not None and rollout_id in follower.fleet:
                    status = follower.fleet.status(rollout_id, as_of)
                return status
            # While news waits to be judged, poll only until the next allowed moment (never 0 s:
            # that starves aiokafka's fetcher).
            wait_s = 0.25
            if touched:
                wait_s = max(0.02, gap - (time.monotonic() - judged_at))
            batch = await follower.poll(timeout_s=min(wait_s, 0.25))
            news = rollout_id in batch.rollout_ids
            touched = touched or news or bool(batch.heartbeats)
    finally:
        health.quiet = False
        if bar is not None:
            bar.stop()


async def follow_all(
    follower: Follower, rollout_ids: list[str], quiet: bool
) -> list[RolloutStatus]:
    """``status --watch`` without an id: poll the log until every rollout of ``rollout_ids``
    has ended; a progress line (stderr) each time one's changes, unless ``quiet``. Judged at
    ``current_as_of()`` like :func:`follow`; an outage is said once each way and waited out.
    Their final statuses, in the order given."""
    out = console(stderr=True)
    last: dict[str, str] = {}
    ended: dict[str, RolloutStatus] = {}
    announced: datetime | None = None
    health.quiet = True
    try:
        while True:
            announced = outage_news(follower, announced, out, None)
            as_of = follower.current_as_of()
            for rollout_id in rollout_ids:
                if as_of is None or rollout_id in ended:
                    continue
                status = follower.fleet.status(rollout_id, as_of)
                line = progress_line(status)
                if line != last.get(rollout_id) and not quiet:
                    say(out, None, line)
                last[rollout_id] = line
                if status.terminal:
                    ended[rollout_id] = status
            if len(ended) == len(rollout_ids):
                return [ended[r] for r in rollout_ids]
            await follower.poll(timeout_s=0.25)
    finally:
        health.quiet = False


def outage_news(
    follower: Follower, announced: datetime | None, out: Any, bar: Any
) -> datetime | None:
    """Say once that Kafka became unreachable and once that it is back (``announced``: the
    outage already said, None if none); the outage said now."""
    down = follower.unreachable_since()
    if down is not None and announced is None:
        say(out, bar, f"Kafka unreachable since {hms(down)}, retrying")
        return down
    if down is None and announced is not None:
        gone = (utcnow() - announced).total_seconds()
        say(out, bar, f"Kafka reachable again after {gone:.0f} s")
        return None
    return announced


def foreign_commands(follower: Follower, rollout_id: str, told: set[tuple[str, str]]) -> list[str]:
    """A line for each command under ``rollout_id`` that is not judged and was not yet
    reported (added to ``told``): those the trust store did not verify, and, for a publisher,
    those that are not the command it published (:class:`PublishedFleet`)."""
    fleet = follower.fleet
    lines: list[str] = []
    for u in fleet.unverified():
        key = (u.command_id, f"unverified {u.issued_at.isoformat()}")
        if u.rollout_id == rollout_id and key not in told:
            told.add(key)
            lines.append(
                f"ignored command {u.command_id} of rollout {rollout_id} (issued "
                f"{u.issued_at.isoformat()} by {u.issuer!r}): not verified ({u.code})"
            )
    for c in fleet.ignored if isinstance(fleet, PublishedFleet) else ():
        key = (c.command_id, c.model_dump_json())
        if key not in told:
            told.add(key)
            lines.append(
                f"ignored command {c.command_id} of rollout {rollout_id} (issued "
                f"{c.issued_at.isoformat()} by {c.issuer!r}): not the command published "
                "(a forgery, or a reuse of its ids)"
            )
    return lines


def say(out: Any, bar: Any, text: str) -> None:
    """One line on stderr, above the progress bar when there is one."""
    line = f"[{utcnow().strftime('%H:%M:%S')}] {text}"
    if bar is not None:
        bar.console.print(line)
    else:
        out.print(line)
