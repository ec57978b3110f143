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

import dataclasses
import functools
import getpass
import inspect
import json
import time
from collections.abc import Callable
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from pydantic import BaseModel, JsonValue

from controlplane.cli.common import (
    ApiOpt,
    BootstrapOpt,
    Exit,
    OutputOpt,
    PrefixOpt,
    TrustStoreOpt,
    app,
    fail,
    goes_on,
    kafka_settings,
    run,
    verifier_from,
)
from controlplane.cli.follow import (
    MAX_TTL_S,
    PublishedFleet,
    await_unconfirmed,
    catch_up,
    follow,
    follow_all,
    judge_time,
    read_log,
    read_rollout,
    wait_deadline,
)
from controlplane.cli.keys import KeyIdOpt, SigningKeyOpt, signer_from
from controlplane.cli.render import (
    Output,
    console,
    dumped,
    few,
    progress_line,
    rollout_table,
    rollouts_table,
    worker_rows,
    workers_table,
)
from controlplane.coordinator.follower import Follower, verify_command
from controlplane.coordinator.publisher import (
    PublishUnconfirmed,
    RolloutRequest,
    check_new_rollout,
    check_ttl,
    new_id,
    prepare_rollout,
    publish,
)
from controlplane.kafka.bus import Producer
from controlplane.kafka.settings import DEFAULT_BOOTSTRAP, KafkaSettings
from controlplane.rollout.decisions import named
from controlplane.rollout.models import AnomalyCode, RolloutPhase, RolloutStatus, WorkerState
from controlplane.wire.channels import ACKS, COMMANDS
from controlplane.wire.codec import encode
from controlplane.wire.errors import (
    BusError,
    CommandRejected,
    ControlPlaneError,
    LocalCode,
    WireCode,
)
from controlplane.wire.exits import PHASE_EXITS, error_line
from controlplane.wire.messages import DEFAULT_DRAIN_TIMEOUT_S, DrainPolicy
from controlplane.wire.protocol import (
    Command,
    CommandSpec,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    utcnow,
)
from controlplane.wire.signing import Signer, Verifier, wire_object

SelectorOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--selector", "-s", metavar="KEY=VALUE", help="Label match key=value, repeatable."
    ),
]
WorkerOpt = Annotated[
    list[str] | None, typer.Option("--worker", "-w", metavar="ID", help="Worker id, repeatable.")
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
JsonOpt = Annotated[bool, typer.Option("--json", help="Same as -o json.")]
RolloutIdOpt = Annotated[
    str | None,
    typer.Option("--rollout-id", help="Choose the rollout id (one not already in the log)."),
]
DryRunOpt = Annotated[
    bool,
    typer.Option(
        "--dry-run",
        help="Preflight only: each matched worker checks everything the command would check "
        "and changes nothing; prints 'validated on N worker(s)' (exit 0) or the rejections "
        "by code with counts (exit 1). Always waits for the verdict.",
    ),
]
PreflightOpt = Annotated[
    bool,
    typer.Option(
        "--preflight",
        help="A dry run first; then the command itself, to the workers that validated it, "
        "only if every matched worker did.",
    ),
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


#: A rollout command's own arguments -> its spec (see :func:`_rollout_command`).
SpecMaker = Callable[..., CommandSpec]


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
    output: Output,
    signer: Signer | None = None,
    verifier: Verifier | None = None,
    dry_run: bool = False,
    validated: list[str] | None = None,
    documents: list[Any] | None = None,
) -> int:
    """Publish ``request`` (as a dry run when ``dry_run``: always followed to its end, then
    :func:`_dry_run_verdict`, the workers that validated it appended to ``validated``). Under
    ``-o json|yaml`` its document is printed, or appended to ``documents`` when given (as
    data: ``--preflight`` prints both of its steps' as one)."""
    out = console()
    wait = wait or dry_run
    # Only what this publish needs: the workers topic (the selector), and what is appended
    # after the start (its own command and acks, to read it back and follow it). A rollout id
    # of the user's is looked for on the commands topic, in records that name it.
    chosen = request.rollout_id is not None
    request = dataclasses.replace(request, rollout_id=request.rollout_id or new_id("r"))
    assert request.rollout_id is not None
    # Of its own rollout, only the command published is folded (a forgery copying its ids
    # never becomes the rollout judged); with a trust store, only verified commands at all
    # (a forgery that used a chosen id first does not make it taken).
    fleet = PublishedFleet()
    async with Follower(
        settings,
        fleet,
        # Probing, so the workers partition is current only once a record of its own was
        # appended and read back: a fetch's end says nothing of heartbeats Kafka holds back
        # (a broker slow to replicate), and the selector must not leave live workers out.
        probe=True,
        rollouts=(request.rollout_id,),
        tail=(ACKS,) if chosen else (ACKS, COMMANDS),
        verifier=verifier,
        max_ttl_s=MAX_TTL_S,
    ) as follower:
        await catch_up(follower, settings)
        now = utcnow()
        # The log is read: a rollout id in it is not new. Liveness as of what the reader
        # knows (see Follower.current_as_of), not the coordinator's clock.
        if chosen:
            check_new_rollout(
                request.rollout_id, {*follower.fleet.rollout_ids(), *follower.unreadable_commands}
            )
        command = prepare_rollout(
            request,
            follower.fleet,
            as_of=judge_time(follower),
            now=now,
            issuer=f"{getpass.getuser()}@cli",
            signer=None if dry_run else signer,
        )
        if dry_run:  # marked before it is signed: the signature covers it
            command = command.model_copy(update={"dry_run": True})
            command = command if signer is None else signer.sign(command)
        if verifier is not None:
            _check_own(verifier, command)
        fleet.publishing(command)
        goes_on(
            f"the {'dry run (it changes nothing)' if dry_run else 'rollout'} goes on: "
            f"controlplane status {command.rollout_id}"
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
                offset = await await_unconfirmed(
                    follower, exc, wait_deadline(started, wait_timeout, command)
                )
                late = f" after {time.monotonic() - started:.0f} s"
            if not output.data:
                where = f"offset {offset}" if offset is not None else "read back from the log"
                signed = "" if signer is None else f", signed by key {signer.key_id}"
                what = "dry run" if dry_run else "rollout"
                out.print(
                    f"published {what} {command.rollout_id} (command {command.command_id}, "
                    f"{where}{signed}){late} to {len(pinned.worker_ids or [])} worker(s): "
                    f"{named(pinned.worker_ids or [])}",
                    soft_wrap=True,  # one line, for a CI log's grep
                    markup=False,
                )
            if not wait:
                if output.data:
                    _emit(command, output, documents)
                return Exit.OK
            left = None
            if wait_timeout is not None:
                left = max(0.001, wait_timeout - (time.monotonic() - started))
            try:
                status = await follow(follower, command.rollout_id, left, output.data)
            except BusError as exc:
                if exc.code is not LocalCode.BROKER_UNAVAILABLE:
                    raise
                # Published, then Kafka went away: exit 4 would say "not published".
                typer.echo(error_line(exc), err=True)
                typer.echo(
                    f"gave up waiting: rollout {command.rollout_id} was published; "
                    f"check `controlplane status {command.rollout_id}`",
                    err=True,
                )
                return Exit.TIMED_OUT
    if status is None:
        typer.echo(f"gave up waiting: rollout {command.rollout_id} not read back yet", err=True)
        return Exit.TIMED_OUT
    if dry_run:
        return _dry_run_verdict(status, output, validated, documents)
    return _finish(status, output, waited_out=not status.terminal, documents=documents)


def _emit(value: BaseModel, output: Output, documents: list[Any] | None) -> None:
    """``-o json|yaml``: ``value``'s document on stdout, or appended to ``documents`` (as
    JSON data) when the caller prints one document of several."""
    if documents is None:
        typer.echo(dumped(value, output))
    else:
        documents.append(value.model_dump(mode="json"))


def _dry_run_verdict(
    status: RolloutStatus,
    output: Output,
    validated: list[str] | None,
    documents: list[Any] | None = None,
) -> int:
    """A dry run's outcome: "validated on N worker(s)" (exit 0), or the workers that did not
    validate it, collapsed by error code (or state) with their counts, a message and a few
    ids (exit 1; 2 when it timed out or the wait did). Nothing was applied either way."""
    ok = [w.worker_id for w in status.workers if w.state is WorkerState.SUCCEEDED]
    if validated is not None:
        validated.extend(ok)
    passed = status.phase is RolloutPhase.SUCCEEDED and len(ok) == status.expected
    code = Exit.OK
    if not passed:
        ended_in_time = status.terminal and status.phase is not RolloutPhase.TIMED_OUT
        code = Exit.FAILED if ended_in_time else Exit.TIMED_OUT
    if output.data:
        _emit(status, output, documents)
        return code
    out = console()
    if passed:
        out.print(
            f"dry run {status.rollout_id}: validated on {len(ok)} worker(s); nothing applied",
            markup=False,
            soft_wrap=True,
        )
    else:
        out.print(
            f"dry run {status.rollout_id}: not validated on {status.expected - len(ok)} of "
            f"{status.expected} worker(s); nothing applied",
            markup=False,
            soft_wrap=True,
        )
        for count, what, message, ids in _refusals(status):
            out.print(f"  {count} {what}: {message} ({few(ids)})", markup=False, soft_wrap=True)
    if output is Output.WIDE:
        out.print(rollout_table(status, wide=True))
    return code


def _refusals(status: RolloutStatus) -> list[tuple[int, str, str, list[str]]]:
    """The workers that did not validate a dry run, by error code (the state for those with
    none: lost, still pending), most first: (count, code, a message, their ids)."""
    groups: dict[str, tuple[str, list[str]]] = {}
    for w in status.workers:
        if w.state is WorkerState.SUCCEEDED:
            continue
        what = str(w.error.code) if w.error else w.state.value
        message = w.error.message if w.error else f"no verdict ({w.state.value})"
        groups.setdefault(what, (message, []))[1].append(w.worker_id)
    ordered = sorted(groups.items(), key=lambda item: -len(item[1][1]))
    return [(len(ids), what, message, ids) for what, (message, ids) in ordered]


def _check_own(verifier: Verifier, command: Command) -> None:
    """Before publishing under ``--trust-store``: the command must be one that store verifies,
    or this reader would fold it as unverified and never see its rollout (SETTINGS_INVALID
    naming the store's code, exit 3; nothing published)."""
    try:
        verify_command(verifier, command, wire_object(encode(command)), max_ttl_s=MAX_TTL_S)
    except CommandRejected as exc:
        raise ControlPlaneError(
            f"the command is not one --trust-store verifies, so nothing was published "
            f"({exc.code}: {exc.message})",
            code=LocalCode.SETTINGS_INVALID,
        ) from None


def _finish(
    status: RolloutStatus,
    output: Output,
    *,
    waited_out: bool = False,
    documents: list[Any] | None = None,
) -> int:
    if output is Output.JSON and documents is None:
        typer.echo(status.model_dump_json())
    elif output.data:
        _emit(status, output, documents)
    else:
        out = console()
        out.print(rollout_table(status, wide=output is Output.WIDE))
        out.print(status.message)
        for anomaly in status.anomalies:  # forgeries under its id (--trust-store): said
            if anomaly.code is AnomalyCode.COMMAND_UNVERIFIED:
                out.print(f"{anomaly.code.value}: {anomaly.message}", markup=False)
        if waited_out:
            out.print(f"gave up waiting: the rollout is still {status.phase.value}")
    if waited_out:
        return Exit.TIMED_OUT
    return PHASE_EXITS.get(status.phase.value, Exit.INTERNAL)


def _run_exit(coro: Any) -> None:
    """Run a command's coroutine (``run``: our errors are one line and their exit) and exit
    with the code it returns."""
    raise typer.Exit(run(coro))


def _roll_out(
    make_spec: Callable[[], CommandSpec],
    selector: SelectorOpt = None,
    worker: WorkerOpt = None,
    everyone: AllOpt = False,
    ttl: TtlOpt = 3600.0,
    timeout: TimeoutOpt = None,
    rollout_id: RolloutIdOpt = None,
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    delivery_timeout: DeliveryTimeoutOpt = None,
    signing_key: SigningKeyOpt = None,
    key_id: KeyIdOpt = None,
    trust_store: TrustStoreOpt = None,
    dry_run: DryRunOpt = False,
    preflight: PreflightOpt = False,
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """What every rollout command does with the options every rollout takes (declared once,
    here): the TTL is checked, then the spec is made (a spec the model refuses: exit 3) and
    the signing key read (exit 3 if it cannot be), then the command is published (signed
    with ``--signing-key``), and followed under ``--wait``."""
    _check_ttl(ttl)
    try:
        spec = make_spec()
    except ValueError as exc:
        _invalid(exc)
    try:
        signer = signer_from(signing_key, key_id)
    except ControlPlaneError as exc:
        raise fail(exc) from None
    verifier = verifier_from(trust_store)
    if dry_run and preflight:
        raise typer.BadParameter("--dry-run or --preflight, not both")
    request = RolloutRequest(spec, _selector(selector, worker, everyone), ttl, timeout, rollout_id)
    publishing = functools.partial(
        _publish_and_maybe_wait,
        kafka_settings(bootstrap, prefix, delivery_timeout_s=delivery_timeout),
        wait=wait,
        wait_timeout=wait_timeout,
        output=Output.JSON if as_json else output,
        signer=signer,
        verifier=verifier,
    )
    if preflight:
        _run_exit(_preflighted(publishing, request, Output.JSON if as_json else output))
    _run_exit(publishing(request, dry_run=dry_run))


async def _preflighted(
    publishing: Callable[..., Any], request: RolloutRequest, output: Output
) -> int:
    """``--preflight``: a dry run to the matched workers first (its own rollout id), then the
    command itself to exactly the workers that validated it, only if every one did. Under
    ``-o json|yaml`` one document: ``{"dry_run": <its status>, "rollout": <the command, or
    its status under --wait; null when not published>}``."""
    validated: list[str] = []
    documents: list[Any] | None = [] if output.data else None
    try:
        code: int = await publishing(
            dataclasses.replace(request, rollout_id=None),
            dry_run=True,
            validated=validated,
            documents=documents,
        )
        if code != Exit.OK:
            typer.echo("preflight failed: the command itself was not published", err=True)
            return code
        pinned = Selector(worker_ids=sorted(validated))
        real: int = await publishing(
            dataclasses.replace(request, selector=pinned), documents=documents
        )
        return real
    finally:
        if documents:  # the dry run's, at least (an error before it: only its line)
            steps = [*documents, None]
            typer.echo(dumped({"dry_run": steps[0], "rollout": steps[1]}, output))


#: The options of :func:`_roll_out`, as typer reads them: the first three choose the workers.
_ROLLOUT_OPTIONS = tuple(inspect.signature(_roll_out, eval_str=True).parameters.values())[1:]


def _rollout_command(name: str) -> Callable[[SpecMaker], SpecMaker]:
    """Register a spec maker (its own arguments -> the command's spec) as the rollout command
    ``name``: its required arguments, the worker choice, its other options, then the rest of
    the rollout options; its docstring is the command's help."""

    def register(make_spec: SpecMaker) -> SpecMaker:
        own = tuple(inspect.signature(make_spec, eval_str=True).parameters.values())
        required = [p for p in own if p.default is p.empty]
        optional = [p for p in own if p.default is not p.empty]
        choose, rest = _ROLLOUT_OPTIONS[:3], _ROLLOUT_OPTIONS[3:]

        @functools.wraps(make_spec)
        def command(**options: Any) -> None:
            mine = {p.name: options.pop(p.name) for p in own}
            _roll_out(lambda: make_spec(**mine), **options)

        parameters = [*required, *choose, *optional, *rest]
        command.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
        app.command(name)(command)
        return make_spec

    return register


class DrainChoice(StrEnum):
    """``--drain``: the wire's drain modes (messages.DRAIN_MODES), as choices."""

    WAIT = "wait"
    ABORT = "abort"
    KEEP = "keep"


@_rollout_command("reload-weights")
def reload_weights(
    path: Annotated[
        str,
        typer.Argument(
            help="Checkpoint: .safetensors file, directory, or index json (as the workers see it)."
        ),
    ],
    version: Annotated[
        str,
        typer.Option("--version", metavar="VERSION", help="Version label the workers will report."),
    ],
    sha256: Annotated[
        Path | None,
        typer.Option("--sha256", help="JSON file {file: sha256hex} the workers verify."),
    ] = None,
    non_strict: Annotated[
        bool, typer.Option("--non-strict", help="Allow a partial checkpoint.")
    ] = False,
    drain: Annotated[
        DrainChoice | None,
        typer.Option(
            "--drain",
            help="Requests in flight on each worker: wait for them (default), abort them, or "
            "keep them paused across the reload (vLLM; torch waits). docs/wire.md.",
        ),
    ] = None,
    drain_timeout: Annotated[
        float | None,
        typer.Option(
            "--drain-timeout",
            help=f"Seconds to wait for requests in flight (default "
            f"{DEFAULT_DRAIN_TIMEOUT_S:g}); past it the reload fails COMMAND_TIMEOUT, "
            "weights untouched.",
        ),
    ] = None,
    no_reset_cache: Annotated[
        bool,
        typer.Option("--no-reset-cache", help="Keep the server's prefix cache across the reload."),
    ] = False,
) -> ReloadWeightsSpec:
    """Roll new weights out to the selected workers (validated on each worker before any copy)."""
    manifest: dict[str, str] = {}
    if sha256 is not None:
        try:
            manifest = json.loads(sha256.read_text())
        except (OSError, ValueError) as exc:
            raise typer.BadParameter(f"--sha256: {exc}") from None
    policy: dict[str, Any] = {}
    if drain is not None:
        policy["mode"] = drain.value
    if drain_timeout is not None:
        policy["timeout_s"] = drain_timeout
    # Written only when asked for: a worker built before drain policies reads the rest.
    return ReloadWeightsSpec(
        path=path,
        version=version,
        sha256=manifest,
        strict=not non_strict,
        drain=DrainPolicy.model_validate(policy) if policy else None,
        reset_cache=False if no_reset_cache else None,
    )


@_rollout_command("update-config")
def update_config(
    set_: Annotated[
        list[str],
        typer.Option(
            "--set", metavar="KEY=VALUE", help="key=JSON value (or plain string), repeatable."
        ),
    ],
) -> UpdateConfigSpec:
    """Roll runtime config overrides out, applied all or nothing on each worker."""
    overrides: dict[str, JsonValue] = {}
    for item in set_:
        key, sep, raw = item.partition("=")
        if not sep:
            raise typer.BadParameter(f"--set {item!r} must look like key=value")
        try:
            overrides[key] = json.loads(raw)
        except ValueError:
            overrides[key] = raw
    return UpdateConfigSpec(overrides=overrides)


def _invalid(exc: Exception) -> NoReturn:
    """A spec the model refuses: SCHEMA_INVALID, exit 3."""
    raise fail(ControlPlaneError(str(exc), code=WireCode.SCHEMA_INVALID))


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
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="Follow the rollout until it ends; without an id, every rollout in progress "
            "until each has ended (exit: 0 if all succeeded, else the first other's).",
        ),
    ] = False,
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
    api: ApiOpt = None,
    trust_store: TrustStoreOpt = None,
) -> None:
    """Rollout status computed from the log (no coordinator needed), or asked of a coordinator
    (--api). Exits with the rollout's code."""
    shown = Output.JSON if as_json else output
    goes_on(
        "the rollouts go on: controlplane status"
        if rollout is None
        else f"the rollout goes on: controlplane status {rollout}"
    )
    if api:
        if rollout is None:
            raise typer.BadParameter(
                "--api shows one rollout: give its id (the status of every rollout reads the log)"
            )
        _run_exit(_status_from_api(api, rollout, watch=watch, output=shown))
    verifier = verifier_from(trust_store)

    async def go() -> int:
        settings = kafka_settings(bootstrap, prefix)
        reading = (
            read_log(settings, verifier)
            if rollout is None
            else read_rollout(settings, rollout, verifier=verifier)
        )
        async with reading as (follower, now):
            if rollout is None:
                if watch:
                    return await _watch_every(follower, now, shown)
                _print_rollouts(follower.fleet.rollouts(now), shown)
                return Exit.OK
            if rollout not in follower.fleet:
                forged = [u for u in follower.fleet.unverified() if u.rollout_id == rollout]
                why = "".join(
                    f"; command {u.command_id} under that id is not verified ({u.code})"
                    for u in forged
                )
                raise _unknown(rollout, f"in the log{why}")
            if watch:
                watched = await follow(follower, rollout, None, shown.data)
                assert watched is not None  # no timeout: it returns a terminal status
                result = watched
            else:
                result = follower.fleet.status(rollout, now)
        if result.terminal:
            return _finish(result, shown)
        _finish(result, shown)
        return Exit.OK  # a rollout still in progress is not an error for `status`

    _run_exit(go())


def _unknown(rollout_id: str, where: str) -> ControlPlaneError:
    """ROLLOUT_UNKNOWN (exit 3), saying where to look."""
    return ControlPlaneError(
        f"no rollout {rollout_id!r} {where}; hint: `controlplane status` lists the rollouts "
        "(same --bootstrap and --topic-prefix as the publish?)",
        code=LocalCode.ROLLOUT_UNKNOWN,
    )


def _print_rollouts(statuses: list[RolloutStatus], output: Output) -> None:
    if output.data:
        typer.echo(dumped(statuses, output))
    else:
        console().print(rollouts_table(statuses))


async def _watch_every(follower: Follower, now: datetime, output: Output) -> int:
    """``status --watch`` without an id: every rollout in progress now, followed until each
    has ended; then their table. 0 when every one succeeded, else the exit of the first (by
    id) that did not; none in progress: said, 0."""
    active = sorted(s.rollout_id for s in follower.fleet.rollouts(now) if not s.terminal)
    if not active:
        typer.echo("no rollout in progress", err=True)
        _print_rollouts([], output)
        return Exit.OK
    ended = await follow_all(follower, active, output.data)
    _print_rollouts(ended, output)
    for s in ended:
        if s.phase.value != "succeeded":
            return PHASE_EXITS.get(s.phase.value, Exit.INTERNAL)
    return Exit.OK


async def _status_from_api(api: str, rollout_id: str, *, watch: bool, output: Output) -> int:
    """``status <id>`` as the coordinator at ``api`` judges it (controlplane/cli/remote.py)."""
    from controlplane.cli.remote import Remote, RolloutNotFound

    out = console(stderr=True)
    last = ""

    def progress(status: RolloutStatus) -> None:
        nonlocal last
        line = progress_line(status)
        if line != last and not output.data:
            out.print(f"[{utcnow().strftime('%H:%M:%S')}] {line}")
        last = line

    async with Remote(api) as remote:
        try:
            if watch:
                result = await remote.watch(rollout_id, progress, json_out=output.data)
            else:
                result = await remote.status(rollout_id)
        except RolloutNotFound:
            raise _unknown(rollout_id, f"at {remote.url}") from None
    if result.terminal:
        return _finish(result, output)
    _finish(result, output)
    return Exit.OK


@app.command("workers")
def workers(
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
    api: ApiOpt = None,
    trust_store: TrustStoreOpt = None,
) -> None:
    """Every worker from its latest heartbeat: labels, device, version vs desired, liveness
    (desired versions from verified commands only, under --trust-store)."""
    verifier = None if api else verifier_from(trust_store)
    shown = Output.JSON if as_json else output

    async def go() -> int:
        if api:
            from controlplane.cli.remote import Remote

            async with Remote(api) as remote:
                views, levels = await remote.workers()
        else:
            async with read_log(kafka_settings(bootstrap, prefix), verifier) as (follower, now):
                pass  # read and closed: the table is printed from what was read
            views = follower.fleet.registry.workers(now)
            levels = follower.fleet.worker_levels(now)
        if shown.data:
            typer.echo(dumped(worker_rows(views, levels), shown))
        else:
            console().print(workers_table(views, levels))
        return Exit.OK

    _run_exit(go())
