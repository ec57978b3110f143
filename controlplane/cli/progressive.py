"""CLI commands for targets and progressive rollouts: `controlplane targets ...`, `controlplane rollout ...`.

Every command reads the log (the controller topic's fold and the fleet's) and, for a change,
appends an operator request to the controller topic; the elected coordinator's controller acts on
it. Nothing here talks to a coordinator. Requests are checked against the log first (an unknown
target or rollout, a rollout that ended, a target busy with another rollout: exit 3 with the
code); the controller checks them again when it starts a rollout (two operators may race).

Exit codes of ``--wait`` (and of ``status`` of an ended rollout): 0 succeeded, 7 aborted,
8 rolled back, 3 rejected, 2 gave up waiting (``--wait-timeout``).
"""

from __future__ import annotations

import getpass
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Final

import typer
from pydantic import JsonValue, ValidationError
from rich.table import Table
from rich.text import Text

from controlplane.cli.common import (
    BootstrapOpt,
    Exit,
    OutputOpt,
    PrefixOpt,
    app,
    fail,
    goes_on,
    kafka_settings,
    run,
)
from controlplane.cli.follow import catch_up, judge_time
from controlplane.cli.render import Output, console, dumped, plain
from controlplane.cli.rollout import DrainChoice
from controlplane.coordinator.follower import Follower
from controlplane.coordinator.publisher import publish_control
from controlplane.kafka.settings import DEFAULT_BOOTSTRAP, KafkaSettings
from controlplane.rollout.desired import TargetStatus, summary, target_status, targets_status
from controlplane.rollout.targets import ControlState, Rollout
from controlplane.wire.control import (
    ActionKind,
    Desired,
    ProbeGate,
    RolloutAction,
    RolloutSpec,
    Strategy,
    TargetSpec,
    WeightsRef,
)
from controlplane.wire.errors import ControlPlaneError, LocalCode, WireCode
from controlplane.wire.exits import CONTROL_PHASE_EXITS
from controlplane.wire.messages import DEFAULT_DRAIN_TIMEOUT_S, DrainPolicy
from controlplane.wire.validation import summarize

rollout_app = typer.Typer(
    help="Progressive rollouts of a target: waves, gates, pause, promote, abort, undo.",
    no_args_is_help=True,
)
targets_app = typer.Typer(
    help="Targets: groups of workers by label and the state they should run.",
    invoke_without_command=True,
)
app.add_typer(rollout_app, name="rollout")
app.add_typer(targets_app, name="targets")

JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (-o json).")]
WaitOpt = Annotated[
    bool, typer.Option("--wait", help="Follow until the rollout ends; exit with its outcome.")
]
WaitTimeoutOpt = Annotated[
    float | None,
    typer.Option("--wait-timeout", help="Give up waiting after this many seconds (exit 2)."),
]
#: The reload policy of the weights (as `reload-weights` has it): in the target's or the
#: rollout's desired state, so in every reload made from it (each wave's, a drift sync's, a
#: rollback to it).
DrainOpt = Annotated[
    DrainChoice | None,
    typer.Option(
        "--drain",
        help="Requests in flight on each worker during its reload: wait for them (default), "
        "abort them, or keep them paused across the reload (vLLM; torch waits). docs/wire.md.",
    ),
]
DrainTimeoutOpt = Annotated[
    float | None,
    typer.Option(
        "--drain-timeout",
        help=f"Seconds to wait for requests in flight (default {DEFAULT_DRAIN_TIMEOUT_S:g}); "
        "past it the reload fails COMMAND_TIMEOUT, weights untouched.",
    ),
]
NoResetCacheOpt = Annotated[
    bool,
    typer.Option("--no-reset-cache", help="Keep the server's prefix cache across each reload."),
]
_DURATION_RE: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)?$")
_UNITS: Final = {None: 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration(text: str, option: str) -> float:
    """``30s``, ``2m``, ``1h``, ``500ms`` or plain seconds."""
    match = _DURATION_RE.match(text.strip())
    if match is None:
        raise _invalid(f"{option} {text!r}: expected a duration like 30s, 2m, 1h or 500ms")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _invalid(message: str, code: WireCode | LocalCode = WireCode.SCHEMA_INVALID) -> typer.Exit:
    return fail(ControlPlaneError(message, code=code))


def _issuer() -> str:
    return f"{getpass.getuser()}@cli"


def _labels(items: list[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise _invalid(f"--selector {item!r} must look like key=value")
        pairs[key] = value
    return pairs


def _overrides(items: list[str]) -> dict[str, JsonValue]:
    overrides: dict[str, JsonValue] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise _invalid(f"--set {item!r} must look like key=value")
        try:
            overrides[key] = json.loads(raw)
        except ValueError:
            overrides[key] = raw
    return overrides


def _desired(
    weights: str | None,
    version: str | None,
    sha256: Path | None,
    non_strict: bool,
    set_: list[str],
    drain: DrainChoice | None = None,
    drain_timeout: float | None = None,
    no_reset_cache: bool = False,
) -> Desired:
    if (weights is None) != (version is None):
        raise _invalid("--weights and --version go together")
    policy: dict[str, Any] = {}
    if drain is not None:
        policy["mode"] = drain.value
    if drain_timeout is not None:
        policy["timeout_s"] = drain_timeout
    if weights is None and (policy or no_reset_cache):
        raise _invalid("--drain, --drain-timeout and --no-reset-cache go with --weights")
    manifest: dict[str, str] = {}
    if sha256 is not None:
        try:
            manifest = json.loads(sha256.read_text())
        except (OSError, ValueError) as exc:
            raise _invalid(f"--sha256: {exc}") from None
    try:
        ref = None
        if weights is not None:
            # Written only when asked for, as reload-weights does.
            ref = WeightsRef(
                path=weights,
                version=version,
                sha256=manifest,
                strict=not non_strict,
                drain=DrainPolicy.model_validate(policy) if policy else None,
                reset_cache=False if no_reset_cache else None,
            )
        return Desired(weights=ref, config=_overrides(set_))
    except ValidationError as exc:
        raise _invalid(summarize(exc)) from None


@asynccontextmanager
async def read_control(settings: KafkaSettings) -> AsyncIterator[tuple[Follower, datetime]]:
    """A reader of the whole log, the controller topic included, and the time to judge at."""
    async with Follower(settings, probe=True, control=ControlState()) as follower:
        await catch_up(follower, settings)
        yield follower, judge_time(follower)


def _control(follower: Follower) -> ControlState:
    assert follower.control is not None
    return follower.control


_LOOK = "; see `controlplane rollout status`"
_CREATE = "`controlplane targets set {name} --selector k=v`"


# ------------------------------------------------------------------ targets


@targets_app.callback()
def targets(
    ctx: typer.Context,
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Desired against actual per target: workers at stable, at the new version, updating,
    drifting, lost."""
    if ctx.invoked_subcommand is not None:
        return
    shown = Output.JSON if as_json else output

    async def go() -> int:
        async with read_control(kafka_settings(bootstrap, prefix)) as (follower, now):
            statuses = targets_status(_control(follower), follower.fleet, now)
        if shown.data:
            typer.echo(dumped(statuses, shown))
        else:
            console().print(targets_table(statuses))
        return Exit.OK

    raise typer.Exit(run(go()))


def targets_table(statuses: list[TargetStatus]) -> Table:
    table = Table(title=Text("targets"))
    for column in (
        "target",
        "selector",
        "stable",
        "rollout",
        "workers",
        "at stable",
        "at new",
        "updating",
        "drifting",
        "lost",
        "conflicts",
        "weights digests",
    ):
        table.add_column(column)
    for s in statuses:
        rollout = "-"
        if s.rollout is not None:
            phase = s.rollout.phase.value if s.rollout.phase is not None else "pending"
            rollout = f"{s.rollout.rollout_id} {phase} wave {s.rollout.wave}/{s.rollout.waves}"
        table.add_row(
            *plain(
                s.name,
                ",".join(f"{k}={v}" for k, v in s.selector.items()),
                s.stable_version or "-",
                rollout,
                *(str(n) for n in (s.workers, s.at_stable, s.at_new, s.updating, s.drifting)),
                str(s.lost),
                str(s.conflicts),
            ),
            digest_agreement(s),
        )
    return table


#: Hex digits of a weights digest the targets table shows.
DIGEST_SHOWN: Final = 12


def digest_agreement(status: TargetStatus) -> Text:
    """The live members by weights digest, compactly: "98 at abc123…, 2 at def456…", in red
    when workers on one version report different digests; "-" with no live member. With several
    versions each group says which: "98 at abc123… on v2, 2 at def456… on v1"."""
    groups = status.digests
    if not groups:
        return Text("-")
    versions = {g.version for g in groups}
    parts = []
    for g in groups:
        digest = "no digest" if g.digest is None else _short(g.digest)
        on = f" on {g.version or '-'}" if len(versions) > 1 else ""
        parts.append(f"{g.workers} at {digest}{on}")
    text = ", ".join(parts)
    if status.digests_disagree:
        return Text(f"{text} (DISAGREE)", style="bold red")
    return Text(text)


def _short(digest: str) -> str:
    algorithm, colon, hexdigits = digest.rpartition(":")
    if len(hexdigits) <= DIGEST_SHOWN:
        return digest
    return f"{algorithm}{colon}{hexdigits[:DIGEST_SHOWN]}…"


@targets_app.command("set")
def targets_set(
    name: Annotated[str, typer.Argument(help="The target's name.")],
    selector: Annotated[
        list[str], typer.Option("--selector", "-s", help="Label match key=value, repeatable.")
    ],
    weights: Annotated[
        str | None, typer.Option("--weights", help="Stable checkpoint (as workers see it).")
    ] = None,
    version: Annotated[str | None, typer.Option("--version")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Stable config key=value, repeatable.")
    ] = None,
    drain: DrainOpt = None,
    drain_timeout: DrainTimeoutOpt = None,
    no_reset_cache: NoResetCacheOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Create a target, or change its selector; with --weights/--version (or --set) also
    declare its stable state directly (no rollout: the controller converges drifting workers,
    each reload with the --drain / --no-reset-cache policy given here)."""
    stable = None
    asked = drain is not None or drain_timeout is not None or no_reset_cache
    if weights is not None or version is not None or set_ or asked:
        stable = _desired(
            weights, version, None, False, set_ or [], drain, drain_timeout, no_reset_cache
        )
    try:
        spec = TargetSpec(
            name=name,
            selector=_labels(selector),
            stable=stable,
            issued_at=datetime.now().astimezone(),
            issuer=_issuer(),
        )
    except ValidationError as exc:
        raise _invalid(summarize(exc)) from None

    async def go() -> int:
        offset = await publish_control(kafka_settings(bootstrap, prefix), spec)
        console().print(f"target {name} written (offset {offset})")
        return Exit.OK

    raise typer.Exit(run(go()))


# ------------------------------------------------------------------ rollouts


@rollout_app.command("start")
def start(
    target: Annotated[str, typer.Argument(help="The target to roll out to.")],
    weights: Annotated[
        str | None, typer.Option("--weights", help="Checkpoint path (as workers see it).")
    ] = None,
    version: Annotated[str | None, typer.Option("--version")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="Config key=JSON value, repeatable.")
    ] = None,
    sha256: Annotated[
        Path | None, typer.Option("--sha256", help="JSON file {file: sha256hex}.")
    ] = None,
    non_strict: Annotated[bool, typer.Option("--non-strict")] = False,
    drain: DrainOpt = None,
    drain_timeout: DrainTimeoutOpt = None,
    no_reset_cache: NoResetCacheOpt = False,
    canary: Annotated[int, typer.Option("--canary", min=0, help="Workers of the first wave.")] = 0,
    steps: Annotated[
        str, typer.Option("--steps", help="Cumulative waves after the canary, e.g. 10%,50%,100%.")
    ] = "100%",
    max_unavailable: Annotated[
        int | None, typer.Option("--max-unavailable", min=1, help="Workers applying at once.")
    ] = None,
    pause: Annotated[
        str, typer.Option("--pause", help="Between waves: a duration (30s) or 'manual'.")
    ] = "0",
    max_failures: Annotated[
        str, typer.Option("--max-failures", help="Failed workers tolerated: a count or N%.")
    ] = "0",
    bake: Annotated[
        str, typer.Option("--bake", help="How long a wave must stay healthy after it applied.")
    ] = "0",
    progress_deadline: Annotated[
        str, typer.Option("--progress-deadline", help="How long one wave may take.")
    ] = "600s",
    probe_prompt: Annotated[
        str | None, typer.Option("--probe-prompt", help="Probe gate: a fixed prompt.")
    ] = None,
    probe_max_tokens: Annotated[int, typer.Option("--probe-max-tokens", min=1, max=64)] = 8,
    probe_expect_tokens: Annotated[
        str | None, typer.Option("--probe-expect-tokens", help="e.g. 12,7,99")
    ] = None,
    probe_min_logprob: Annotated[float | None, typer.Option("--probe-min-logprob")] = None,
    no_rollback: Annotated[
        bool, typer.Option("--no-rollback", help="On abort, leave updated workers as they are.")
    ] = False,
    rollout_id: Annotated[str | None, typer.Option("--rollout-id")] = None,
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Start a progressive rollout of new weights (or config) to a target."""
    desired = _desired(
        weights, version, sha256, non_strict, set_ or [], drain, drain_timeout, no_reset_cache
    )
    try:
        probe = None
        if probe_prompt is not None:
            expect = None
            if probe_expect_tokens is not None:
                expect = [int(t) for t in probe_expect_tokens.split(",") if t.strip()]
            probe = ProbeGate(
                prompt=probe_prompt,
                max_tokens=probe_max_tokens,
                expect_tokens=expect,
                min_mean_logprob=probe_min_logprob,
            )
        strategy = Strategy(
            canary=canary,
            steps=[s.strip() for s in steps.split(",") if s.strip()],
            max_unavailable=max_unavailable,
            pause="manual" if pause == "manual" else duration(pause, "--pause"),
            max_failures=max_failures,
            bake_s=duration(bake, "--bake"),
            progress_deadline_s=duration(progress_deadline, "--progress-deadline"),
            probe=probe,
        )
        spec = RolloutSpec(
            rollout_id=rollout_id or f"r-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}",
            target=target,
            desired=desired,
            strategy=strategy,
            rollback=not no_rollback,
            issued_at=datetime.now().astimezone(),
            issuer=_issuer(),
        )
    except ValueError as exc:  # pydantic's ValidationError, or a token that is not a number
        text = summarize(exc) if isinstance(exc, ValidationError) else str(exc)
        raise _invalid(text) from None
    raise typer.Exit(
        run(_start(kafka_settings(bootstrap, prefix), spec, wait, wait_timeout, _shown(as_json)))
    )


async def _start(
    settings: KafkaSettings,
    spec: RolloutSpec,
    wait: bool,
    wait_timeout: float | None,
    output: Output,
) -> int:
    async with read_control(settings) as (follower, _):
        _control(follower).check_start(spec)
        offset = await publish_control(settings, spec)
        if not output.data:
            console(stderr=True).print(
                f"rollout {spec.rollout_id} of target {spec.target} requested (offset {offset})"
            )
        if not wait:
            if output is Output.JSON:
                typer.echo(spec.model_dump_json())
            elif output.data:
                typer.echo(dumped(spec, output))
            return Exit.OK
        return await _follow(follower, spec.rollout_id, wait_timeout, output)


def _shown(as_json: bool) -> Output:
    """A command with ``--json`` only: its output."""
    return Output.JSON if as_json else Output.TABLE


async def _follow(
    follower: Follower, rollout_id: str, wait_timeout: float | None, output: Output
) -> int:
    """Read the log until the rollout ends (or the wait times out); its exit code."""
    goes_on(f"the rollout goes on: controlplane rollout status {rollout_id}")
    deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
    control = _control(follower)
    err = console(stderr=True)
    last = ""
    while True:
        rollout = control.rollout(rollout_id)
        if rollout is not None:
            line = _progress(rollout)
            if line != last and not output.data:
                err.print(line)
                last = line
            if rollout.ended:
                return _finish(rollout, output)
        if deadline is not None and time.monotonic() >= deadline:
            if output.data and rollout is not None:
                _print_rollout(rollout, output)
            typer.echo(f"gave up waiting: rollout {rollout_id} is still running", err=True)
            return Exit.TIMED_OUT
        await follower.poll(timeout_s=0.5)


def _progress(rollout: Rollout) -> str:
    state = rollout.state
    if state is None:
        return f"{rollout.rollout_id}: waiting for a controller to start it"
    wave = min(state.wave + 1, len(state.waves))
    return f"{rollout.rollout_id}: {state.phase.value}, wave {wave}/{len(state.waves)}: {state.message}"


def _print_rollout(rollout: Rollout, output: Output) -> None:
    """``-o json|yaml``: the rollout's spec, state, actions and exit code."""
    typer.echo(
        _rollout_json(rollout) if output is Output.JSON else dumped(_rollout_data(rollout), output)
    )


def _rollout_json(rollout: Rollout) -> str:
    return json.dumps(_rollout_data(rollout))


def _rollout_data(rollout: Rollout) -> dict[str, Any]:
    body: dict[str, Any] = {
        "spec": json.loads(rollout.spec.model_dump_json()),
        "state": None if rollout.state is None else json.loads(rollout.state.model_dump_json()),
        "actions": [json.loads(a.model_dump_json()) for a in rollout.actions],
    }
    phase = None if rollout.state is None else rollout.state.phase.value
    body["exit_code"] = CONTROL_PHASE_EXITS.get(phase) if phase else None
    return body


def _finish(rollout: Rollout, output: Output) -> int:
    state = rollout.state
    assert state is not None
    if output.data:
        _print_rollout(rollout, output)
    else:
        show(rollout)
    return int(CONTROL_PHASE_EXITS.get(state.phase.value, Exit.INTERNAL))


def show(rollout: Rollout) -> None:
    """The rollout's table, then why it stands where it stands (one line, never wrapped into
    the table's width)."""
    out = console()
    out.print(rollout_table(rollout))
    state = rollout.state
    out.print(state.message if state is not None else "waiting for a controller to start it")


def rollout_table(rollout: Rollout) -> Table:
    spec, state = rollout.spec, rollout.state
    s = summary(state, rollout.rollout_id, spec.desired.version)
    title = f"rollout {rollout.rollout_id} of {spec.target}: {s.phase or 'pending'}"
    if s.code:
        title += f" ({s.code})"
    table = Table(title=Text(title))
    table.add_column("wave")
    table.add_column("workers")
    table.add_column("gates")
    if state is not None:
        for index, wave in enumerate(state.waves):
            gates = [
                f"{g.gate} {'ok' if g.passed else 'FAILED'}" for g in state.gates if g.wave == index
            ]
            marker = " <" if index == state.wave and not state.phase.terminal else ""
            table.add_row(*plain(f"{index + 1}{marker}", ", ".join(wave), "; ".join(gates)))
        if state.failed:
            table.add_row(*plain("failed", ", ".join(state.failed), ""))
        if state.rollback:
            rolled_back = ", ".join(w for b in state.rollback for w in b)
            table.add_row(*plain("rolled back", rolled_back, ""))
    return table


@rollout_app.command("status")
def status(
    rollout_id: Annotated[
        str | None, typer.Argument(help="A rollout id; all when omitted.")
    ] = None,
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """A progressive rollout's waves, gates and phase (all rollouts when no id is given)."""
    shown = Output.JSON if as_json else output

    async def go() -> int:
        async with read_control(kafka_settings(bootstrap, prefix)) as (follower, _):
            control = _control(follower)
            if rollout_id is None:
                rows = control.rollouts()
                if shown is Output.JSON:
                    typer.echo("[" + ",".join(_rollout_json(r) for r in rows) + "]")
                elif shown.data:
                    typer.echo(dumped([_rollout_data(r) for r in rows], shown))
                else:
                    console().print(history_table("progressive rollouts", rows))
                return Exit.OK
            rollout = control.known_rollout(rollout_id, hint=_LOOK)
            if wait:
                return await _follow(follower, rollout_id, wait_timeout, shown)
            if rollout.ended:
                return _finish(rollout, shown)
            if shown.data:
                _print_rollout(rollout, shown)
            else:
                show(rollout)
            return Exit.OK

    raise typer.Exit(run(go()))


def history_table(title: str, rollouts: list[Rollout]) -> Table:
    table = Table(title=Text(title))
    for column in ("rollout", "target", "version", "phase", "code", "started", "ended"):
        table.add_column(column)
    for r in rollouts:
        state = r.state
        table.add_row(
            *plain(
                r.rollout_id,
                r.spec.target,
                r.spec.desired.version or ",".join(r.spec.desired.config) or "-",
                "pending" if state is None else state.phase.value,
                (state.code if state is not None else None) or "",
                f"{state.started_at:%Y-%m-%d %H:%M:%S}" if state is not None else "",
                f"{state.ended_at:%Y-%m-%d %H:%M:%S}" if state and state.ended_at else "",
            )
        )
    return table


def _act(
    rollout_id: str,
    action: ActionKind,
    bootstrap: str,
    prefix: str,
    *,
    rollback: bool | None = None,
    reason: str = "",
) -> None:
    async def go() -> int:
        settings = kafka_settings(bootstrap, prefix)
        async with read_control(settings) as (follower, _):
            rollout = _control(follower).actionable(rollout_id, action.value, hint=_LOOK)
            record = RolloutAction(
                rollout_id=rollout_id,
                action_id=f"{action.value}-{uuid.uuid4().hex[:12]}",
                action=action,
                rollback=rollback,
                wave=rollout.action_wave(action),
                reason=reason,
                issued_at=datetime.now().astimezone(),
                issuer=_issuer(),
            )
            offset = await publish_control(settings, record)
        console().print(f"{action.value} of rollout {rollout_id} requested (offset {offset})")
        return Exit.OK

    raise typer.Exit(run(go()))


RolloutIdArg = Annotated[str, typer.Argument(help="The rollout id.")]


#: The operator's actions that take nothing but the rollout: command name, help.
_SIMPLE_ACTIONS: Final = {
    ActionKind.PAUSE: "Hold the rollout before its next batch (commands handed out finish).",
    ActionKind.RESUME: "Release an operator's pause.",
    ActionKind.PROMOTE: "Start the next wave of a rollout waiting at a manual pause.",
}


def _simple_action(action: ActionKind, help_: str) -> None:
    def command(
        rollout_id: RolloutIdArg,
        bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
        prefix: PrefixOpt = "fleet",
    ) -> None:
        _act(rollout_id, action, bootstrap, prefix)

    command.__doc__ = help_
    rollout_app.command(action.value)(command)


for _action, _help in _SIMPLE_ACTIONS.items():
    _simple_action(_action, _help)


@rollout_app.command("abort")
def abort(
    rollout_id: RolloutIdArg,
    no_rollback: Annotated[
        bool, typer.Option("--no-rollback", help="Leave updated workers as they are.")
    ] = False,
    reason: Annotated[str, typer.Option("--reason")] = "",
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Stop the rollout: no further wave starts; then (unless --no-rollback) every updated worker
    gets the target's stable state back."""
    _act(
        rollout_id,
        ActionKind.ABORT,
        bootstrap,
        prefix,
        rollback=False if no_rollback else None,
        reason=reason,
    )


@rollout_app.command("undo")
def undo(
    target: Annotated[str, typer.Argument(help="The target.")],
    wait: WaitOpt = False,
    wait_timeout: WaitTimeoutOpt = None,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """Roll the target back to its previous stable state (a new rollout, all at once)."""

    async def go() -> int:
        settings = kafka_settings(bootstrap, prefix)
        async with read_control(settings) as (follower, _):
            change, undo_of = (
                _control(follower).known_target(target, create=_CREATE.format(name=target)).undo()
            )
        spec = RolloutSpec(
            rollout_id=f"undo-{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}",
            target=target,
            desired=change,
            undo_of=undo_of,
            issued_at=datetime.now().astimezone(),
            issuer=_issuer(),
        )
        return await _start(settings, spec, wait, wait_timeout, _shown(as_json))

    raise typer.Exit(run(go()))


@rollout_app.command("history")
def history(
    target: Annotated[str, typer.Argument(help="The target.")],
    output: OutputOpt = Output.TABLE,
    as_json: JsonOpt = False,
    bootstrap: BootstrapOpt = DEFAULT_BOOTSTRAP,
    prefix: PrefixOpt = "fleet",
) -> None:
    """The target's rollouts and the stable states it had, oldest first."""
    shown = Output.JSON if as_json else output

    async def go() -> int:
        async with read_control(kafka_settings(bootstrap, prefix)) as (follower, _):
            control = _control(follower)
            found = control.known_target(target, create=_CREATE.format(name=target))
            rows = control.rollouts(target)
        if shown.data:
            body = {
                "stable": [
                    {
                        "desired": json.loads(e.desired.model_dump_json()),
                        "rollout_id": e.rollout_id,
                        "since": e.since.isoformat(),
                    }
                    for e in found.history
                ],
                "rollouts": [_rollout_data(r) for r in rows],
            }
            typer.echo(dumped(body, shown))
        else:
            out = console()
            out.print(history_table(f"rollouts of {target}", rows))
            for entry in found.history:
                what = entry.desired.version or ",".join(entry.desired.config) or "-"
                by = entry.rollout_id or "target set"
                out.print(f"stable {what} since {entry.since:%Y-%m-%d %H:%M:%S} ({by})")
        return Exit.OK

    raise typer.Exit(run(go()))


__all__ = ["duration", "read_control", "target_status"]
