"""A wave's gates (docs/progressive.md, "Gates"): health (ready, not degraded, on the new
version), agreement (one weights digest, one config digest) and the probe (every updated worker
answered the strategy's prompt alike, and as it expects). Pure.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

from controlplane.rollout.decisions import (
    Context,
    Gate,
    T,
    clip,
    named,
)
from controlplane.rollout.targets import Rollout
from controlplane.wire.control import (
    Desired,
    RolloutState,
)
from controlplane.wire.messages import (
    WorkerStatus,
)

#: How earlier waves show in a gate's message: what they agreed on, from their gate results.
EARLIER: Final = "earlier waves"


def gate_failure(
    ctx: Context,
    desired: Desired,
    rollout_id: str,
    updated: list[str],
    state: RolloutState,
    rollout: Rollout,
) -> tuple[Gate, str] | None:
    """A gate that failed for good: a degraded worker, disagreeing digests, a bad probe.

    Health and the config digest are judged on every updated worker (what they report now);
    the weights digest and the probe on the wave's own workers (what their batch's acks said),
    against what the earlier waves agreed on, as their passed gates recorded it: the acks of an
    early wave may be gone from the log (retention) by the time a late wave is judged."""
    registry = ctx.fleet.registry
    digests: dict[str, list[str]] = {}
    for worker in updated:
        view = registry.get(worker, ctx.now)
        if view is None:
            continue
        if view.degraded is not None:
            degraded = view.degraded
            return "health", clip(f"{worker} is degraded: {degraded.code}: {degraded.message}", 300)
        if desired.config and view.config_digest is not None and view.in_flight is None:
            digests.setdefault(view.config_digest, []).append(worker)
    if len(digests) > 1:
        shown = "; ".join(f"{d[:12]}: {named(ws)}" for d, ws in sorted(digests.items())[:5])
        return "agreement", (
            f"updated workers report {len(digests)} different config digests ({shown})"
        )
    wave = set(state.waves[state.wave]) if state.wave < len(state.waves) else set()
    fresh = [w for w in updated if w in wave]
    weights: dict[str, list[str]] = {}
    earlier = agreed(state, "agreement")
    if earlier is not None:
        weights[earlier] = [EARLIER]
    for worker in fresh:
        digest = batch_fact(ctx, ctx.digests, rollout, state, worker)
        if digest is not None:  # runners that cannot say (vLLM) are not judged on it
            weights.setdefault(digest, []).append(worker)
    if len(weights) > 1:
        shown = "; ".join(f"{d[:12]}: {named(ws)}" for d, ws in sorted(weights.items())[:5])
        return "agreement", f"updated workers hold {len(weights)} different weights ({shown})"
    probe = rollout.spec.strategy.probe
    if probe is None:
        return None
    answers: dict[tuple[int, ...], list[str]] = {}
    told = agreed(state, "probe")
    if told is not None:
        answers[_tokens(told)] = [EARLIER]
    for worker in fresh:
        answer = probe_of(ctx, rollout, state, worker)
        if answer is None:  # its reload succeeded, so its ack would carry the answer
            return "probe", f"{worker} applied the weights but sent no probe answer"
        if "unsupported" in answer:
            return "probe", f"{worker}'s runner cannot run a probe"
        if "error" in answer:
            return "probe", clip(f"{worker}'s probe failed: {answer['error']}", 300)
        reading = _reading(answer)
        if reading is None:
            return "probe", f"{worker}'s probe answer is malformed: {str(dict(answer))[:200]}"
        tokens, logprob = reading
        if len(tokens) > probe.max_tokens:  # not what was asked: the runner ignored max_tokens
            return "probe", (
                f"{worker} answered {len(tokens)} tokens, more than max_tokens {probe.max_tokens}"
            )
        if probe.expect_tokens is not None and list(tokens) != probe.expect_tokens:
            return "probe", clip(
                f"{worker} answered {list(tokens)}, expected {probe.expect_tokens}", 500
            )
        if probe.min_mean_logprob is not None and not logprob >= probe.min_mean_logprob:
            return "probe", (
                f"{worker}'s mean log-prob {logprob:.4g} is below {probe.min_mean_logprob:g}"
            )
        answers.setdefault(tokens, []).append(worker)
    if len(answers) > 1:
        shown = "; ".join(f"{list(t)[:16]}: {named(ws)}" for t, ws in list(answers.items())[:5])
        return "probe", f"updated workers answered the probe differently ({shown})"
    return None


def agreed(state: RolloutState, gate: Gate) -> str | None:
    """What the earlier waves agreed on, as the last passed ``gate`` with a value recorded it:
    the weights digest (agreement) or the probe's tokens as JSON (probe)."""
    for result in reversed(state.gates):
        if result.gate == gate and result.passed and result.value is not None:
            return result.value
    return None


def agreement_now(
    ctx: Context, rollout: Rollout, state: RolloutState, workers: list[str]
) -> dict[Gate, str]:
    """What a wave whose gates passed agreed on (with the earlier waves'), to record in its
    gate results: the weights digest and the probe's tokens, when any worker said them."""
    out: dict[Gate, str] = {}
    for gate in ("agreement", "probe"):
        value = agreed(state, gate)
        if value is not None:
            out[gate] = value
    for worker in workers:
        if "agreement" not in out:
            digest = batch_fact(ctx, ctx.digests, rollout, state, worker)
            if digest is not None:
                out["agreement"] = digest
        if "probe" not in out:
            answer = probe_of(ctx, rollout, state, worker)
            reading = None if answer is None else _reading(answer)
            if reading is not None:
                out["probe"] = json.dumps(list(reading[0]))
    return out


def _tokens(value: str) -> tuple[int, ...]:
    """The tokens a probe gate recorded (written by :func:`agreement_now`); () if unreadable."""
    try:
        tokens = json.loads(value)
    except ValueError:
        return ()
    if isinstance(tokens, list) and all(type(t) is int for t in tokens):
        return tuple(tokens)
    return ()


def _reading(answer: Mapping[str, Any]) -> tuple[tuple[int, ...], float] | None:
    """(tokens, mean log-prob) of a probe answer, as a worker's ack carries it; None when it is
    not one (it is the worker's JSON: a bad one fails the gate, never the decision)."""
    tokens = answer.get("tokens")
    logprob = answer.get("mean_logprob")
    if not isinstance(tokens, list) or not tokens or not all(type(t) is int for t in tokens):
        return None
    if isinstance(logprob, bool) or not isinstance(logprob, int | float):
        return None
    return tuple(tokens), float(logprob)


def probe_of(
    ctx: Context, rollout: Rollout, state: RolloutState, worker: str
) -> Mapping[str, Any] | None:
    return batch_fact(ctx, ctx.probes, rollout, state, worker)


def batch_fact(
    ctx: Context,
    facts: Mapping[tuple[str, str], T],
    rollout: Rollout,
    state: RolloutState,
    worker: str,
) -> T | None:
    """What ``worker``'s succeeded ack for its batch of this rollout said (a probe, a digest)."""
    batch_id = ctx.batch_of(rollout, state).get(worker)
    return None if batch_id is None else facts.get((batch_id, worker))


def not_healthy(ctx: Context, desired: Desired, updated: list[str]) -> str | None:
    """Who keeps the health gate from passing yet (None: nobody)."""
    version = desired.version
    for worker in updated:
        view = ctx.fleet.registry.get(worker, ctx.now)
        if view is None or not view.alive:
            return f"{worker} (not alive)"
        if view.status is not WorkerStatus.READY or view.in_flight is not None:
            return f"{worker} ({view.status.value})"
        if version is not None and view.weights_version != version:
            return f"{worker} (reports {view.weights_version}, not {version})"
    return None
