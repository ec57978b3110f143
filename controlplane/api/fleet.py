"""The fleet event stream (GET /api/v1/events) and ETags: what lets the dashboard read only
what changed.

:class:`FleetFeed` judges the fleet in counts once per change of the log (or tick), shared by
every stream: the fleet summary, the newest command rollouts, the progressive rollouts and
the targets (no worker rows: a page of workers is read, paginated and with its ETag, when the
counts say it changed). Each stream gets a ``snapshot`` first, then a ``delta`` with only the
items that changed (as_of aside), under monotonic ids; a client reconnecting with
``Last-Event-ID`` gets the deltas it missed, or a fresh snapshot when they are no longer held.

:class:`ETags` gives every JSON GET under /api/v1 a weak ETag and answers a matching
``If-None-Match`` with 304.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

from pydantic import BaseModel
from sse_starlette import EventSourceResponse, ServerSentEvent
from sse_starlette.sse import SendTimeoutError
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.models import (
    API,
    ProgressiveOverview,
    TargetOverview,
    rollout_out,
)
from controlplane.coordinator.service import Coordinator
from controlplane.coordinator.summary import Budget, Summaries
from controlplane.rollout.desired import target_status
from controlplane.rollout.targets import Target

log = logging.getLogger(__name__)

#: Command rollouts the stream carries: the newest ones (older ones: GET /rollouts, paginated).
ROLLOUTS_SHOWN: Final = 50
#: Progressive rollouts the stream carries: the newest ones.
PROGRESSIVE_SHOWN: Final = 50
#: Deltas held for a client reconnecting with Last-Event-ID.
KEEP_DELTAS: Final = 256
#: The sections of a snapshot, each a list of items keyed by ``ID_OF[section]``.
SECTIONS: Final = ("rollouts", "progressive", "targets")
ID_OF: Final = {"rollouts": "rollout_id", "progressive": "rollout_id", "targets": "name"}
#: Fields that say when something was judged, not what it is: not a change by themselves.
JUDGED_AT: Final = frozenset({"as_of", "in_sync_as_of", "oldest_as_of"})
#: A stream whose send stays blocked this long (its client stopped reading: the socket's
#: buffers full) is dropped, its generator closed (a fleet feed read by nobody stops judging).
SEND_TIMEOUT_S: Final = 30.0


def target_overview(coordinator: Coordinator, target: Target, now: datetime) -> TargetOverview:
    """``target`` in counts, as the stream and GET /summary/targets show it."""
    status = target_status(coordinator.control, coordinator.fleet, target, now)
    return TargetOverview.of(status, undo_available=target.previous is not None)


def _without_judged_at(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_judged_at(v) for k, v in value.items() if k not in JUDGED_AT}
    if isinstance(value, list):
        return [_without_judged_at(v) for v in value]
    return value


def _item(model: BaseModel) -> tuple[str, dict[str, Any]]:
    """A model as JSON data, and what tells whether it changed (its JSON, as_of aside)."""
    data: dict[str, Any] = model.model_dump(mode="json")
    return json.dumps(_without_judged_at(data), sort_keys=True), data


@dataclass
class FleetView:
    """The fleet in counts at one instant: the summary, and each section's items in order."""

    summary: tuple[str, dict[str, Any]]
    sections: dict[str, dict[str, tuple[str, dict[str, Any]]]] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"summary": self.summary[1]}
        for name in SECTIONS:
            out[name] = [data for _, data in self.sections[name].values()]
        return out

    def delta(self, before: FleetView) -> dict[str, Any]:
        """What changed since ``before``: the summary if it did; per section the items new or
        changed and, when the items or their order differ, ``<section>_order`` (their ids)."""
        out: dict[str, Any] = {}
        if self.summary[0] != before.summary[0]:
            out["summary"] = self.summary[1]
        for name in SECTIONS:
            now, then = self.sections[name], before.sections[name]
            changed = [data for key, (sig, data) in now.items() if then.get(key, ("",))[0] != sig]
            if changed:
                out[name] = changed
            if list(now) != list(then):
                out[f"{name}_order"] = list(now)
        return out


class FleetFeed:
    """The fleet judged in counts on every change of the log (at most every ``min_interval_s``),
    once for every stream reading it; judged only while a stream reads it."""

    def __init__(
        self,
        coordinator: Coordinator,
        summaries: Summaries,
        closing: asyncio.Event,
        *,
        tick_s: float,
        min_interval_s: float = 0.0,
        keep: int = KEEP_DELTAS,
    ) -> None:
        self._coordinator = coordinator
        self._summaries = summaries
        self._closing = closing
        self._tick_s = tick_s
        self._min_interval_s = min_interval_s
        #: Event ids go on from the wall clock's microseconds: a restarted coordinator's ids are
        #: above the ones a client held, so its Last-Event-ID never resumes the wrong history.
        self.seq = time.time_ns() // 1000
        self.view: FleetView | None = None
        self._history: collections.deque[tuple[int, dict[str, Any]]] = collections.deque(
            maxlen=max(1, keep)
        )
        self._news = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._readers = 0
        #: Views judged (tests count them).
        self.judged = 0

    # ------------------------------------------------------------------ judging

    async def judge(self) -> FleetView:
        """The fleet now, in counts (what a snapshot carries)."""
        coordinator, summaries = self._coordinator, self._summaries
        budget = Budget()
        await summaries.prepare(budget)
        summary = _item(summaries.fleet())
        rollouts: dict[str, tuple[str, dict[str, Any]]] = {}
        for _, rollout_id in reversed(coordinator.fleet.rollout_keys()[-ROLLOUTS_SHOWN:]):
            overview = await summaries.overview(rollout_id, budget=budget, checked=True)
            rollouts[rollout_id] = _item(overview)
        control = coordinator.control
        progressive = {
            r.rollout_id: _item(ProgressiveOverview.of(rollout_out(r)))
            for r in list(reversed(control.rollouts()))[:PROGRESSIVE_SHOWN]
        }
        now = coordinator.now()
        targets = {t.name: _item(target_overview(coordinator, t, now)) for t in control.targets()}
        self.judged += 1
        return FleetView(
            summary, {"rollouts": rollouts, "progressive": progressive, "targets": targets}
        )

    async def _update(self) -> None:
        view = await self.judge()
        before = self.view
        if before is None:  # the first judgment: what snapshots start from
            self.seq += 1
            self.view = view
        else:
            delta = view.delta(before)
            self.view = view
            if not delta:
                return
            self.seq += 1
            self._history.append((self.seq, delta))
        self._announce()

    def _announce(self) -> None:
        """Wake every reader waiting; later waits are on a new event."""
        news, self._news = self._news, asyncio.Event()
        news.set()

    async def _run(self) -> None:
        try:
            async with contextlib.aclosing(self._coordinator.changes(self._tick_s)) as feed:
                while not self._closing.is_set():
                    await self._update()
                    if self._min_interval_s > 0:  # changes coming meanwhile are judged at once
                        await asyncio.sleep(self._min_interval_s)
                    try:
                        await anext(feed)
                    except StopAsyncIteration:  # the coordinator stopped
                        return
        except Exception:
            log.exception("the fleet event stream stopped judging the fleet")
            raise
        finally:
            self._announce()  # readers see the task done and end

    # ------------------------------------------------------------------ reading

    def _resumable(self, last: int) -> bool:
        """Whether the deltas after the event ``last`` are all held."""
        if last == self.seq:
            return True
        return bool(self._history) and self._history[0][0] <= last + 1 and last < self.seq

    async def events(
        self, last_event_id: str | None, *, once: bool = False
    ) -> AsyncIterator[ServerSentEvent]:
        """``snapshot`` (or, after ``last_event_id``, the deltas missed), then every ``delta``,
        until the server closes or the coordinator stops; ``once``: the snapshot only."""
        self._readers += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="fleet-feed")
        task = self._task
        try:
            while self.view is None:
                if task.done():
                    return
                await self._wait()
            last = _event_id(last_event_id)
            if last is None or not self._resumable(last):
                yield _event("snapshot", self.view.snapshot(), self.seq)
                last = self.seq
            while not self._closing.is_set() and not once:
                if last != self.seq:
                    missed = [(seq, delta) for seq, delta in self._history if seq > last]
                    if not self._resumable(last) or not missed or missed[0][0] != last + 1:
                        assert self.view is not None  # fell behind what is held: start over
                        yield _event("snapshot", self.view.snapshot(), self.seq)
                        last = self.seq
                        continue
                    for seq, delta in missed:
                        yield _event("delta", delta, seq)
                        last = seq
                    continue
                if task.done():
                    return
                await self._wait()
        finally:
            self._readers -= 1
            if self._readers == 0 and self._task is not None:
                # Detached before waiting for it: a reader arriving meanwhile starts a new
                # feed, never this cancelled one (it would end at once).
                stopping, self._task = self._task, None
                stopping.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await stopping
                # The view and the deltas stay: a client reconnecting resumes from them, and
                # the next judgment is a delta against that view.

    async def _wait(self) -> None:
        """Until the next judgment announces itself, at most a tick."""
        news = self._news
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._tick_s):
                await news.wait()

    @property
    def readers(self) -> int:
        return self._readers


def _event_id(value: str | None) -> int | None:
    if value is None or not value.strip().isdigit():
        return None
    return int(value.strip())


def _event(name: str, data: dict[str, Any], seq: int) -> ServerSentEvent:
    return ServerSentEvent(data=json.dumps(data, separators=(",", ":")), event=name, id=str(seq))


class EventStream(EventSourceResponse):
    """Server-sent events that drop a client that stopped reading: a send blocked for
    ``send_timeout`` seconds ends the stream (its generator closed, the connection closed), one
    warning logged instead of a traceback."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            client = scope.get("client")
            log.warning(
                "dropped the event stream %s of %s: it read nothing for %g s",
                scope.get("path"),
                f"{client[0]}:{client[1]}" if client else "a client",
                self.send_timeout,
            )


# --------------------------------------------------------------------------- ETags

_JUDGED_AT_JSON: Final = re.compile(rb'"(?:as_of|in_sync_as_of|oldest_as_of)":(?:"[^"]*"|null)')
#: Response headers that are part of what a page says (the next page's link): in its ETag.
REPRESENTATION_HEADERS: Final = ("link",)


def etag_of(body: bytes, headers: Headers | None = None) -> str:
    """A weak ETag of a JSON body and its :data:`REPRESENTATION_HEADERS`: equal for answers that
    differ only in when they were judged (their ``as_of`` fields), which are the same
    representation judged again; a page whose next-page link changed is another one."""
    digest = hashlib.sha256(_JUDGED_AT_JSON.sub(b"", body))
    for name in REPRESENTATION_HEADERS:
        for value in headers.getlist(name) if headers is not None else ():
            digest.update(b"\n" + name.encode() + b": " + value.encode())
    return f'W/"{digest.hexdigest()[:32]}"'


def _matches(if_none_match: str, tag: str) -> bool:
    """RFC 9110's weak comparison of ``If-None-Match`` against ``tag``."""
    if if_none_match.strip() == "*":
        return True
    opaque = tag.removeprefix("W/")
    return any(t.strip().removeprefix("W/") == opaque for t in if_none_match.split(","))


class ETags:
    """ASGI middleware: a 200 JSON answer to a GET under /api/v1 gets a weak ETag and
    ``Cache-Control: no-cache`` (a browser revalidates, and gets 304 Not Modified with no body
    when nothing changed). Streams (server-sent events) and errors pass untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in ("GET", "HEAD")
            or not str(scope["path"]).startswith(API)
        ):
            await self.app(scope, receive, send)
            return
        if_none_match = Headers(scope=scope).get("if-none-match")
        start: Message | None = None
        chunks: list[bytes] = []
        passing = False

        async def capture(message: Message) -> None:
            nonlocal start, passing
            if passing:
                await send(message)
                return
            if message["type"] == "http.response.start":
                kind = Headers(raw=message["headers"]).get("content-type", "")
                if message["status"] != 200 or not kind.startswith("application/json"):
                    passing = True
                    await send(message)
                    return
                start = message
                return
            if message["type"] != "http.response.body" or start is None:
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            headers = MutableHeaders(raw=list(start["headers"]))
            tag = etag_of(body, headers)
            headers["ETag"] = tag
            headers["Cache-Control"] = "no-cache"
            if if_none_match is not None and _matches(if_none_match, tag):
                del headers["content-length"]
                del headers["content-type"]
                await send({**start, "status": 304, "headers": headers.raw})
                await send({"type": "http.response.body", "body": b""})
                return
            await send({**start, "headers": headers.raw})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)
