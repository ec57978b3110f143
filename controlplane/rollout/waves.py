"""The wave planner: which workers each wave of a progressive rollout updates, in which batches.

Pure and deterministic: the same workers and strategy always give the same plan, so a resumed
controller (or a reader checking a plan) computes what the first one did. The plan is also written
into the rollout's state when the rollout starts, and followed from there.

- Workers are ordered by id; waves take them in that order, canary first.
- Each step is cumulative (``10%``, ``50%``, ``100%`` of the target's workers, rounded up); a step
  that adds no worker is skipped, so every wave has at least one worker and every worker lands
  in exactly one wave.
- A wave is applied in batches of at most ``max_unavailable`` workers, one batch at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from controlplane.wire.control import Strategy, step_count


def plan_waves(workers: Iterable[str], strategy: Strategy) -> list[list[str]]:
    """The waves over ``workers``: canary first, then each step; none empty."""
    ordered = sorted(set(workers))
    total = len(ordered)
    bounds = ([strategy.canary] if strategy.canary else []) + [
        step_count(step, total) for step in strategy.steps
    ]
    waves: list[list[str]] = []
    done = 0
    for bound in bounds:
        upto = min(max(bound, done), total)
        if upto > done:
            waves.append(ordered[done:upto])
            done = upto
    if done < total:  # the last step is 100%, so only a hand-made strategy gets here
        waves.append(ordered[done:])
    return waves


def batches(wave: Sequence[str], max_unavailable: int | None) -> list[list[str]]:
    """``wave`` in batches of at most ``max_unavailable`` (None: one batch)."""
    size = len(wave) if max_unavailable is None else max_unavailable
    return [list(wave[i : i + size]) for i in range(0, len(wave), max(1, size))]


def max_failures(strategy: Strategy, total: int) -> int:
    """Failed workers a rollout of ``total`` workers tolerates."""
    return step_count(strategy.max_failures, total)
