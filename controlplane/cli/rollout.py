"""CLI commands for CI and people: publish rollouts, wait for them, show status and workers.

Works without a coordinator: status is computed from the topics with the same pure module the
coordinator uses (Follower + Fleet). Exit codes: 0 succeeded, 1 failed, 2 timed out, 3 invalid
input (including no matching worker, a rollout id already in the log, a TTL over 7 days),
4 Kafka unreachable (a publish that failed so was not published), 6 publish outcome unknown
(not confirmed within ``--delivery-timeout``: the command may be in the log; the error line
names the rollout to check with ``controlplane status``).

A publish whose outcome is unknown under ``--wait`` is not given up at once: the producer keeps
retrying the same record (never a second copy) while the log is followed, until the record is
confirmed or read back (then the rollout is followed to its real verdict), or until
``--wait-timeout`` (without one, the command's expiry) passes: exit 6.

``--wait`` judges the rollout at the follower's ``current_as_of()``: the time up to which it has
read everything. During a Kafka outage that time stands still, so no worker is judged lost for
a silence the reader could not hear; ``--wait`` says once that Kafka is unreachable and keeps
waiting, and exits 4 only when ``--wait-timeout`` passes with Kafka still unreachable.
"""

from __future__ import annotations

import getpass
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import JsonValue

from controlplane.cli.common import (
    BootstrapOpt,
    Exit,
    PrefixOpt,
    app,
    fail,
    kafka_settings,
    run,
)
from controlplane.cli.render import (
    console,
    progress_line,
    rollout_table,
    rollouts_table,
    workers_table,
)
from controlplane.coordinator.follower import Follower
from controlplane.coordinator.publisher import (
    PublishUnconfirmed,
    RolloutRequest,
    check_ttl,
    prepare_rollout,
    publish,
)
from controlplane.kafka.bus import Producer, health
from controlplane.kafka.settings import DEFAULT_BOOTSTRAP, KafkaSettings
from controlplane.rollout.models import RolloutStatus
from controlplane.wire.errors import BusError, CommandRejected, ControlPlaneError, ErrorCode
from controlplane.wire.exits import PHASE_EXITS
from controlplane.wire.protocol import (
    Command,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    utcnow,
)

SelectorOpt = Annotated[
    list[str] | None, typer.Option("--selector", "-s", help="Label match key=value, repeatable.")
]
WorkerOpt = Annotated[
    list[str] | None, typer.Option("--worker", "-w", help="Worker id, repeatable.")
]
AllOpt = Annotated[bool, typer.Option("--all", help="Every live worker (an explicit choice).")]
WaitOpt = Annotated[
    bool, typer.Option("--wait", help="Follow until the rollout ends; exit with its outcome.")
]
WaitTimeoutOpt = Annotated[
    float | None,
    typer.Option("--wait-timeout", help="Give up waiting after this many seconds (exit 2)."),
]
TtlOpt = Annotated[
    float,
    typer.Option(
        "--ttl", help="Seconds until the command expires (rollout deadline); at most 7 days."
    ),
]
TimeoutOpt = Annotated[
    float | None, typer.Option("--timeout", help="Per-worker seconds to apply the command.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output.")]
RolloutIdOpt = Annotated[
    str | None,
    typer.Option("--rollout-id", help="Choose the rollout id (one not already in the log)."),
]
DeliveryTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--delivery-timeout",
        envvar="FLEET_DELIVERY_TIMEOUT",
        min=1.0,
        help="Seconds the cluster has to confirm the publish (default 30); past it the outcome "
        "is unknown: exit 6, or with --wait, keep waiting for it until --wait-timeout.",
    ),
]


def _selector(labels: list[str] | None, workers: list[str] | None, everyone: bool) -> Selector:
    if not labels and not workers and not everyone:
        raise typer.BadParameter("choose workers: --selector key=value, --worker ID, or --all")
    pairs: dict[str, str] = {}
    for item in labels or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"selector {item!r} must look like key=value")
        pairs[key] = value
    return Selector(worker_ids=sorted(workers) if workers else None, labels=pairs)


async def _publish_and_maybe_wait(
    settings: KafkaSettings,
    request: RolloutRequest,
    *,
    wait: bool,
    wait_timeout: float | None,
    as_json: bool,
) -> int:
    out = console()
    async with Follower(settings, probe=wait) as follower:
        await _catch_up(follower, settings)
        now = utcnow()
        # The log is read: a rollout id in it is not new. Liveness as of what the reader
        # knows (see Follower.current_as_of), not the coordinator's clock.
        command = prepare_rollout(
            request,
            follower.fleet,
            as_of=_as_of(follower),
            now=now,
            issuer=f"{getpass.getuser()}@cli",
        )
        pinned = command.selector
        started = time.monotonic()
        # Open until the wait ends: an unconfirmed record is still being retried meanwhile.
        # Closing gives a record still unconfirmed 1 s more (not the usual 5): its outcome
        # is reported unknown either way.
        async with Producer(settings, stop_timeout_s=1.0) as producer:
            offset: int | None
            try:
                offset = await publish(settings, command, producer)
                late = ""
            except PublishUnconfirmed as exc:
                if not wait:
                    raise
                offset = await _await_unconfirmed(
                    follower, exc, _wait_deadline(started, wait_timeout, command)
                )
                late = f" after {time.monotonic() - started:.0f} s"
            if not as_json:
                where = f"offset {offset}" if offset is not None else "read back from the log"
                out.print(
                    f"published rollout {command.rollout_id} (command {command.command_id}, "
                    f"{where}){late} to {len(pinned.worker_ids or [])} worker(s): "
                    f"{', '.join(pinned.worker_ids or [])}"
                )
            if not wait:
                if as_json:
                    typer.echo(command.model_dump_json())
                return Exit.OK
            left = None
            if wait_timeout is not None:
                left = max(0.001, wait_timeout - (time.monotonic() - started))
            try:
                status = await _follow(follower, command.rollout_id, left, as_json)
            except BusError as exc:
                if exc.code is not ErrorCode.BROKER_UNAVAILABLE:
                    raise
                # Published, then Kafka went away: exit 4 would say "not published".
                typer.echo(f"error: {exc.code}: {exc.message}", err=True)
                typer.echo(
                    f"gave up waiting: rollout {command.rollout_id} was published; "
                    f"check `controlplane status {command.rollout_id}`",
                    err=True,
                )
                return Exit.TIMED_OUT
    if status is None:
        typer.echo(f"gave up waiting: rollout {command.rollout_id} not read back yet", err=True)
        return Exit.TIMED_OUT
    return _finish(status, as_json, waited_out=not status.terminal)


def _wait_deadline(
    started: float, wait_timeout: float | None, command: Command
) -> tuple[float, str]:
    """When ``--wait`` stops waiting for an unconfirmed publish (a ``time.monotonic()``) and
    what that limit is called: ``--wait-timeout`` after the publish began, else the command's
    expiry (a record that lands later is refused by the workers as expired anyway)."""
    if wait_timeout is not None:
        return started + wait_timeout, f"--wait-timeout {wait_timeout:g} s"
    left = max(0.0, (command.expires_at - utcnow()).total_seconds())
    return time.monotonic() + left, f"the command's expiry ({_clock(command.expires_at)})"


async def _await_unconfirmed(
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
    _say(
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


async def _catch_up(follower: Follower, settings: KafkaSettings) -> None:
    """Read the whole log; BROKER_UNAVAILABLE (exit 4) when Kafka stays unreachable for a
    request timeout meanwhile, instead of waiting forever. A probing follower then waits (a
    little) for its first probe to come back: see :func:`_settle`."""
    patience = settings.request_timeout_ms / 1000
    while not follower.caught_up.is_set():
        await follower.poll(timeout_s=0.5)
        since = follower.unreachable_since()
        if since is not None and (utcnow() - since).total_seconds() > patience:
            raise BusError(
                f"Kafka unreachable since {_clock(since)} while reading the log "
                f"({follower.settings.bootstrap_servers})",
                code=ErrorCode.BROKER_UNAVAILABLE,
            )
    if follower.probe:
        await _settle(follower, min(_PROBE_PATIENCE_S, settings.delivery_timeout_ms / 1000))


#: How long a probing reader waits for its first probe to be read back before it judges.
_PROBE_PATIENCE_S = 5.0


async def _settle(follower: Follower, patience_s: float) -> None:
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
        when = _clock(as_of) if as_of is not None else "the last record read"
        _say(
            console(stderr=True),
            None,
            f"Kafka is not confirming writes (no probe read back within {patience_s:g} s): "
            f"liveness judged as of {when}",
        )


def _as_of(follower: Follower) -> datetime:
    """The time to judge at: what the reader knows to be current (the wall clock only in the
    moment after catching up when no fetch has vouched for every partition yet)."""
    return follower.current_as_of() or utcnow()


def _clock(when: datetime) -> str:
    """HH:MM:SS in UTC, like the progress lines."""
    return when.astimezone(UTC).strftime("%H:%M:%S")


#: --wait spends at most 1/(1+this) of its time judging: after a judgement that took t seconds,
#: the next waits t * this (small fleets: at once; 500 workers: a few hundred ms).
_JUDGE_COST_FACTOR = 5.0


async def _follow(
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
            TextColumn("{task.description}"),
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
    try:
        while True:
            now_m = time.monotonic()
            down = follower.unreachable_since()
            if down is not None and announced is None:
                announced = down
                _say(out, bar, f"Kafka unreachable since {_clock(down)}, retrying")
            elif down is None and announced is not None:
                gone = (utcnow() - announced).total_seconds()
                _say(out, bar, f"Kafka reachable again after {gone:.0f} s")
                announced = None
            as_of = follower.current_as_of()
            if (
                as_of is not None
                and rollout_id in follower.fleet
                and ((touched and now_m - judged_at >= gap) or now_m - judged_at >= 1.0)
            ):
                judged_at, touched = now_m, False
                status = follower.fleet.status(rollout_id, as_of)
                gap = min(0.25, (time.monotonic() - now_m) * _JUDGE_COST_FACTOR)
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
                        f"Kafka unreachable since {_clock(down)}: gave up waiting for rollout "
                        f"{rollout_id} after {wait_timeout:g} s{phase}",
                        code=ErrorCode.BROKER_UNAVAILABLE,
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
            touched = touched or rollout_id in batch.rollout_ids or bool(batch.heartbeats)
    finally:
        health.quiet = False
        if bar is not None:
            bar.stop()


def _say(out: Any, bar: Any, text: str) -> None:
    """One line on stderr, above the progress bar when there is one."""
    line = f"[{utcnow().strftime('%H:%M:%S')}] {text}"
    if bar is not None:
        bar.console.print(line)
    else:
        out.print(line)


def _finish(status: RolloutStatus, as_json: bool, *, waited_out: bool = False) -> int:
    if as_json:
        typer.echo(status.model_dump_json())
    else:
        out = console()
        out.print(rollout_table(status))
        out.print(status.message)
        if waited_out:
            out.print(f"gave up waiting: the rollout is still {status.phase.value}")
    if waited_out:
        return Exit.TIMED_OUT
    return PHASE_EXITS.get(status.phase.value, Exit.INTERNAL)


def _run_exit(coro: Any) -> None:
    """Run a command's coroutine (``run``: our errors are one line and their exit) and exit
    with the code it returns."""
    raise typer.Exit(run(coro))


@app.command("reload-weights")
def reload_weights(
    path: Annotated[
        str,
        typer.Argument(
            help="Checkpoint: .safetensors file, directory, or index json (as the workers see it)."
        ),
    ],
    version: Annotated[
        str, typer.Option("--version", "-v", help="Version label the workers will report.")
    ],
    selector: SelectorOpt = None,
    worker: WorkerOpt = None,
    everyone: AllOpt = False,
    sha256: Annotated[
        Path | None,
        typer.Option("--sha256", help="JSON file {file: sha256hex} the workers verify."),
    ] = None,
    non_strict: Annotated[
        bool, typer.Option("--non-strict", help="Allow a partial checkpoint.")
    ] = False,
    ttl: TtlOpt = 3600.0,
    timeout: TimeoutOpt = None,
    rollout_id: RolloutIdOpt = None,
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    delivery_timeout: DeliveryTimeoutOpt = None,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Roll new weights out to the selected workers (validated on each worker before any copy)."""
    _check_ttl(ttl)
    manifest: dict[str, str] = {}
    if sha256 is not None:
        try:
            manifest = json.loads(sha256.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"--sha256: {exc}") from None
    try:
        spec = ReloadWeightsSpec(path=path, version=version, sha256=manifest, strict=not non_strict)
    except ValueError as exc:
        _invalid(exc)
    _run_exit(
        _publish_and_maybe_wait(
            kafka_settings(bootstrap, prefix, delivery_timeout_s=delivery_timeout),
            RolloutRequest(spec, _selector(selector, worker, everyone), ttl, timeout, rollout_id),
            wait=wait,
            wait_timeout=wait_timeout,
            as_json=as_json,
        )
    )


@app.command("update-config")
def update_config(
    set_: Annotated[
        list[str], typer.Option("--set", help="key=JSON value (or plain string), repeatable.")
    ],
    selector: SelectorOpt = None,
    worker: WorkerOpt = None,
    everyone: AllOpt = False,
    ttl: TtlOpt = 3600.0,
    timeout: TimeoutOpt = None,
    rollout_id: RolloutIdOpt = None,
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    delivery_timeout: DeliveryTimeoutOpt = None,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Roll runtime config overrides out, applied all or nothing on each worker."""
    _check_ttl(ttl)
    overrides: dict[str, JsonValue] = {}
    for item in set_:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r} must look like key=value")
        try:
            overrides[key] = json.loads(raw)
        except ValueError:
            overrides[key] = raw
    try:
        spec = UpdateConfigSpec(overrides=overrides)
    except ValueError as exc:
        _invalid(exc)
    _run_exit(
        _publish_and_maybe_wait(
            kafka_settings(bootstrap, prefix, delivery_timeout_s=delivery_timeout),
            RolloutRequest(spec, _selector(selector, worker, everyone), ttl, timeout, rollout_id),
            wait=wait,
            wait_timeout=wait_timeout,
            as_json=as_json,
        )
    )


def _invalid(exc: Exception) -> NoReturn:
    """A spec the model refuses: SCHEMA_INVALID, exit 3."""
    raise fail(ControlPlaneError(str(exc), code=ErrorCode.SCHEMA_INVALID))


def _check_ttl(ttl: float) -> None:
    """Before any Kafka: a TTL over the maximum is TTL_TOO_LONG, exit 3."""
    try:
        check_ttl(ttl)
    except CommandRejected as exc:
        raise fail(exc) from None


@app.command("status")
def status(
    rollout: Annotated[
        str | None, typer.Argument(help="A rollout id; all rollouts when omitted.")
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", help="Follow a rollout until it ends.")] = False,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Rollout status computed from the log (no coordinator needed). Exits with the rollout's code."""

    async def go() -> int:
        settings = kafka_settings(bootstrap, prefix)
        async with Follower(settings, probe=True) as follower:
            await _catch_up(follower, settings)
            now = _as_of(follower)
            if rollout is None:
                statuses = follower.fleet.rollouts(now)
                if as_json:
                    typer.echo(json.dumps([json.loads(s.model_dump_json()) for s in statuses]))
                else:
                    console().print(rollouts_table(statuses))
                return Exit.OK
            if rollout not in follower.fleet:
                typer.echo(f"error: no rollout {rollout!r} in the log", err=True)
                return Exit.INVALID
            if watch:
                watched = await _follow(follower, rollout, None, as_json)
                assert watched is not None  # no timeout: it returns a terminal status
                result = watched
            else:
                result = follower.fleet.status(rollout, now)
        if result.terminal:
            return _finish(result, as_json)
        _finish(result, as_json)
        return Exit.OK  # a rollout still in progress is not an error for `status`

    _run_exit(go())


@app.command("workers")
def workers(
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Every worker from its latest heartbeat: labels, device, version vs desired, liveness."""

    async def go() -> int:
        settings = kafka_settings(bootstrap, prefix)
        async with Follower(settings, probe=True) as follower:
            await _catch_up(follower, settings)
            now = _as_of(follower)
        views = follower.fleet.registry.workers(now)
        levels = follower.fleet.worker_levels(now)
        if as_json:
            typer.echo(json.dumps([json.loads(v.model_dump_json()) for v in views]))
        else:
            console().print(workers_table(views, levels))
        return Exit.OK

    _run_exit(go())
