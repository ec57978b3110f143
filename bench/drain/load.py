"""The client side: threads sending greedy requests back to back, what each got, and the
timeline of token arrivals (the gap in it around a reload is the pause a user sees)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


class TokenClock:
    """Monotonic times at which a token was produced, by any request (appends are atomic)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def tick(self) -> None:
        self.times.append(time.monotonic())

    def between(self, start: float, end: float) -> list[float]:
        return [t for t in self.times if start <= t <= end]


#: The clock the timed engines tick (one engine per process at a time).
CLOCK = TokenClock()


@dataclass(frozen=True)
class Outcome:
    """One request: when it ran, whether it returned tokens, why not (an error code or vLLM's
    finish reason), and the versions it was generated with (None: not known from the engine)."""

    start: float
    end: float
    ok: bool
    why: str
    tokens: tuple[int, ...]
    versions: tuple[str, ...] | None = None
    detail: str = ""  # a failure's message


Request = Callable[[], Outcome]


class Clients:
    """``count`` threads, each sending ``request`` back to back until :meth:`finish`."""

    def __init__(self, request: Request, count: int) -> None:
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._done = threading.Condition()
        self._request = request
        self._threads = [
            threading.Thread(target=self._loop, name=f"client-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            outcome = self._request()
            with self._done:
                self.outcomes.append(outcome)
                self._done.notify_all()

    def wait_for(self, count: int, timeout: float = 600.0) -> None:
        """Block until ``count`` requests have ended in all (RuntimeError past ``timeout``)."""
        with self._done:
            if not self._done.wait_for(lambda: len(self.outcomes) >= count, timeout):
                raise RuntimeError(f"clients: {len(self.outcomes)} of {count} requests in time")

    def finish(self) -> list[Outcome]:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=600)
        return list(self.outcomes)


def longest_gap(ticks: Sequence[float], start: float, end: float) -> float | None:
    """The longest interval between two consecutive ticks that overlaps ``[start, end]``
    (None without a tick on each side of the window)."""
    ordered = sorted(ticks)
    best: float | None = None
    for before, after in itertools.pairwise(ordered):
        if after > start and before < end:
            gap = after - before
            best = gap if best is None else max(best, gap)
    if not ordered or ordered[0] > start or ordered[-1] < end:
        return None
    return best


def gaps_outside(ticks: Sequence[float], windows: Sequence[tuple[float, float]]) -> list[float]:
    """Intervals between consecutive ticks that overlap none of ``windows``: the normal
    spacing of tokens while no reload runs."""
    ordered = sorted(ticks)
    out = []
    for before, after in itertools.pairwise(ordered):
        if not any(after > s and before < e for s, e in windows):
            out.append(after - before)
    return out
