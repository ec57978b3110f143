"""A cancellation that arrives as the awaited event is set must not be lost (Python 3.11's
``asyncio.wait_for`` loses it: the coordinator's stop then waited on its controller forever)."""

from __future__ import annotations

import asyncio

import pytest

from controlplane.coordinator.controller import Controller


class _Follower:
    def __init__(self) -> None:
        self.control = object()
        self.fleet = object()
        self.listeners: list[object] = []


async def test_the_controllers_wait_for_a_change_keeps_a_cancellation_that_comes_with_the_change() -> (
    None
):
    controller = Controller(
        settings=None,  # type: ignore[arg-type]
        follower=_Follower(),  # type: ignore[arg-type]
        now=lambda: None,
        tick_s=60.0,
    )

    async def waiter() -> None:
        while True:  # what the controller's loop does between decisions
            await controller._wait_change()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # it waits on the event now
    controller._changed.set()  # the change and the cancellation in the same loop iteration
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5.0)
