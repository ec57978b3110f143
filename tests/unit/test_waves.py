"""The wave planner (controlplane/rollout/waves.py), property-tested: every worker lands in exactly
one wave, canary first, waves follow the cumulative steps, batches respect ``max_unavailable``,
and the plan depends on nothing but the set of workers and the strategy. Pure: no Kafka.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.rollout.waves import batches, max_failures, plan_waves
from controlplane.wire.control import Strategy
from tests.unit.strategies import fuzz

worker_ids = st.lists(st.from_regex(r"w[0-9a-z]{1,4}", fullmatch=True), max_size=60, unique=True)
percent_steps = st.integers(1, 100).map(lambda p: f"{p}%")
count_steps = st.integers(0, 80).map(str)
steps = st.lists(st.one_of(percent_steps, count_steps), max_size=6).map(lambda s: [*s, "100%"])
strategies = st.builds(
    Strategy,
    canary=st.integers(0, 12),
    steps=steps,
    max_unavailable=st.one_of(st.none(), st.integers(1, 8)),
)


def _wanted(step: str, total: int) -> int:
    """A step's worker count, computed apart from the code under test: percents round up."""
    if step.endswith("%"):
        return min(total, math.ceil(Fraction(int(step[:-1]), 100) * total))
    return min(total, int(step))


def _prefix_sizes(waves: list[list[str]]) -> list[int]:
    sizes, done = [], 0
    for wave in waves:
        done += len(wave)
        sizes.append(done)
    return sizes


@fuzz(100)
@given(workers=worker_ids, strategy=strategies)
def test_every_worker_lands_in_exactly_one_wave(workers: list[str], strategy: Strategy) -> None:
    waves = plan_waves(workers, strategy)
    flat = [w for wave in waves for w in wave]
    assert sorted(flat) == sorted(workers)
    assert len(flat) == len(set(flat))


@fuzz(100)
@given(workers=worker_ids, strategy=strategies)
def test_waves_are_never_empty(workers: list[str], strategy: Strategy) -> None:
    waves = plan_waves(workers, strategy)
    assert all(waves)
    assert (not waves) == (not workers)


@fuzz(100)
@given(workers=worker_ids, strategy=strategies)
def test_the_canary_is_the_first_wave(workers: list[str], strategy: Strategy) -> None:
    waves = plan_waves(workers, strategy)
    if strategy.canary > 0 and workers:
        assert len(waves[0]) == min(strategy.canary, len(workers))


@fuzz(100)
@given(workers=worker_ids, strategy=strategies)
def test_cumulative_sizes_follow_the_steps(workers: list[str], strategy: Strategy) -> None:
    """After the canary, each step's cumulative count (rounded up) ends a wave, unless it adds
    no worker to the waves before it; nothing else ends one."""
    total = len(workers)
    bounds = [min(strategy.canary, total)] if strategy.canary else []
    bounds += [_wanted(step, total) for step in strategy.steps]
    expected, reached = [], 0
    for bound in bounds:
        if bound > reached:
            reached = bound
            expected.append(reached)
    assert _prefix_sizes(plan_waves(workers, strategy)) == expected


@fuzz(100)
@given(workers=worker_ids, strategy=strategies, data=st.data())
def test_the_plan_is_deterministic_whatever_the_order_of_the_workers(
    workers: list[str], strategy: Strategy, data: st.DataObject
) -> None:
    shuffled = data.draw(st.permutations(workers))
    repeated = (
        shuffled + data.draw(st.lists(st.sampled_from(workers), max_size=5)) if workers else []
    )
    plan = plan_waves(workers, strategy)
    assert plan_waves(shuffled, strategy) == plan
    assert plan_waves(iter(repeated), strategy) == plan
    assert plan_waves(workers, Strategy.model_validate(strategy.model_dump())) == plan


@fuzz(100)
@given(workers=worker_ids, strategy=strategies)
def test_waves_take_the_workers_in_id_order(workers: list[str], strategy: Strategy) -> None:
    assert [w for wave in plan_waves(workers, strategy) for w in wave] == sorted(workers)


@fuzz(100)
@given(
    wave=st.lists(st.from_regex(r"w[0-9]{1,3}", fullmatch=True), max_size=40, unique=True),
    max_unavailable=st.one_of(st.none(), st.integers(1, 12)),
)
def test_batches_never_exceed_max_unavailable_and_cover_the_wave_in_order(
    wave: list[str], max_unavailable: int | None
) -> None:
    plan = batches(wave, max_unavailable)
    assert [w for batch in plan for w in batch] == wave
    assert all(plan)
    if max_unavailable is None:
        assert plan == ([wave] if wave else [])
    else:
        assert all(len(batch) <= max_unavailable for batch in plan)
        assert len(plan) == math.ceil(len(wave) / max_unavailable)


def test_the_issue_s_example_canary_then_10_50_100_percent() -> None:
    workers = [f"w{i:02}" for i in range(10)]
    strategy = Strategy(canary=1, steps=["10%", "50%", "100%"], max_unavailable=2)
    waves = plan_waves(reversed(workers), strategy)
    # 10% of 10 is the canary already: that step adds nobody and is skipped.
    assert waves == [["w00"], workers[1:5], workers[5:]]
    assert [batches(w, 2) for w in waves] == [
        [["w00"]],
        [["w01", "w02"], ["w03", "w04"]],
        [["w05", "w06"], ["w07", "w08"], ["w09"]],
    ]
    four = plan_waves(workers, Strategy(canary=1, steps=["20%", "50%", "100%"]))
    assert [len(w) for w in four] == [1, 1, 3, 5]


def test_a_canary_larger_than_the_target_takes_everyone() -> None:
    assert plan_waves(["b", "a"], Strategy(canary=5, steps=["50%", "100%"])) == [["a", "b"]]


def test_the_default_strategy_is_one_wave_of_everyone() -> None:
    assert plan_waves(["c", "a", "b"], Strategy()) == [["a", "b", "c"]]
    assert plan_waves([], Strategy()) == []


@pytest.mark.parametrize(
    ("max_failures_", "total", "tolerated"),
    [
        ("0", 10, 0),
        ("3", 10, 3),
        ("30", 10, 10),  # a count is capped at the target's size
        ("10%", 10, 1),
        ("10%", 11, 2),  # rounded up
        ("1%", 1, 1),
        ("50%", 0, 0),
        ("100%", 7, 7),
    ],
)
def test_max_failures_counts_and_percents(max_failures_: str, total: int, tolerated: int) -> None:
    assert max_failures(Strategy(max_failures=max_failures_), total) == tolerated


@fuzz(100)
@given(
    share=st.integers(1, 100),
    count=st.integers(0, 1000),
    total=st.integers(0, 1000),
)
def test_max_failures_is_a_count_capped_or_a_share_rounded_up(
    share: int, count: int, total: int
) -> None:
    assert max_failures(Strategy(max_failures=str(count)), total) == min(count, total)
    assert max_failures(Strategy(max_failures=f"{share}%"), total) == _wanted(f"{share}%", total)
