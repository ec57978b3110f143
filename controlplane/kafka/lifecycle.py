"""The async context-manager shape shared by every long-lived component: start(), stop(), ``async with``.

A failed start() is followed by stop(), so stop() must work from any state. No I/O here.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self


class AsyncService:
    """Subclasses implement ``start()`` and an idempotent ``stop()``; this adds ``async with``."""

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()
