"""What the page received, from Chromium's DevTools performance log, and when (issue 15).

Every response counts once, when it finished (``Network.loadingFinished``: bytes on the wire,
headers included); a request still open when the log is read (the event stream) counts chunk
by chunk (``Network.dataReceived``), or by its messages when Chromium reported no chunk.
Times are DevTools' monotonic seconds; :func:`clock_offset` maps the page's wall clock
(``performance.timeOrigin + performance.now()``) onto them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    url: str = ""
    kind: str = ""
    sent: float | None = None
    finished: tuple[float, int] | None = None
    chunks: list[tuple[float, int]] = field(default_factory=list)
    messages: list[tuple[float, int]] = field(default_factory=list)

    def transfers(self) -> list[tuple[float, int]]:
        if self.finished is not None:
            return [self.finished]
        return self.chunks or self.messages


@dataclass
class Transfer:
    at: float
    nbytes: int
    url: str
    kind: str


@dataclass
class NetworkLog:
    requests: dict[str, Request] = field(default_factory=dict)
    #: wall seconds minus DevTools seconds, from the last document request
    offset: float | None = None

    def feed(self, entries: list[dict[str, Any]]) -> None:
        """Take ``driver.get_log("performance")``'s entries (each read once: the log drains)."""
        for entry in entries:
            message = json.loads(entry["message"])["message"]
            method, params = message.get("method", ""), message.get("params", {})
            rid = params.get("requestId")
            if not method.startswith("Network.") or rid is None:
                continue
            request = self.requests.setdefault(rid, Request())
            if method == "Network.requestWillBeSent":
                request.url = params["request"]["url"]
                request.kind = params.get("type", "")
                request.sent = params["timestamp"]
                if request.kind == "Document":
                    self.offset = params["wallTime"] - params["timestamp"]
            elif method == "Network.responseReceived":
                request.kind = params.get("type", request.kind)
                request.url = request.url or params["response"]["url"]
            elif method == "Network.dataReceived":
                size = params.get("encodedDataLength") or params.get("dataLength", 0)
                request.chunks.append((params["timestamp"], int(size)))
            elif method == "Network.eventSourceMessageReceived":
                size = len(params.get("data", "").encode()) + len(params.get("eventName", ""))
                request.messages.append((params["timestamp"], size))
            elif method == "Network.loadingFinished":
                request.finished = (params["timestamp"], int(params["encodedDataLength"]))

    def transfers(self, after: float = float("-inf")) -> list[Transfer]:
        """Every transfer received after DevTools time ``after``, in order."""
        out = [
            Transfer(at, nbytes, r.url, r.kind)
            for r in self.requests.values()
            for at, nbytes in r.transfers()
            if at > after
        ]
        return sorted(out, key=lambda t: t.at)

    def devtools_time(self, wall_ms: float) -> float:
        """The DevTools time of the page's wall-clock instant ``wall_ms``."""
        if self.offset is None:
            raise RuntimeError("no document request in the performance log")
        return wall_ms / 1000 - self.offset


def per_update(transfers: list[Transfer], updates: list[float]) -> list[int]:
    """Bytes received up to each update since the previous one (``updates``: DevTools times,
    ascending): what each update cost. Bytes after the last update are not counted."""
    out, i = [], 0
    for at in updates:
        total = 0
        while i < len(transfers) and transfers[i].at <= at:
            total += transfers[i].nbytes
            i += 1
        out.append(total)
    return out
