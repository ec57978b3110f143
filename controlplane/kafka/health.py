"""Kafka's reachability: one state per process (:data:`health`), and the filter on aiokafka's loggers.

aiokafka logs every failed connection attempt, fetch and metadata refresh (about 70 ERROR lines
a second during an outage), so a filter on its loggers drops those and logs one line when the
state changes ("Kafka unreachable: ...", "Kafka reachable again after N s"). A successful
fetch, produce or admin request is what makes Kafka reachable again.
"""

from __future__ import annotations

import logging
import threading
import time

from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    NodeNotReadyError,
    RequestTimedOutError,
)

#: The logger every part of the Kafka seam writes to (its name shows in the logs: kept from
#: when the seam was one module).
log = logging.getLogger("controlplane.kafka.bus")


class KafkaHealth:
    """Whether this process can reach Kafka: one state, changed by what its clients see.

    Kafka is unreachable once failures have gone on for ``grace_s`` without a success between
    them (a broker closing its connections as it shuts down, then answering once more, is no
    outage yet); one line is logged when that happens and one when a request succeeds again.
    ``unreachable_since`` (a ``time.time()``: the first failure) is None while reachable.
    """

    def __init__(self, *, grace_s: float = 1.0) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self.unreachable_since: float | None = None
        #: Why, in aiokafka's words, the first time it failed.
        self.reason = ""
        #: No log lines (for a caller that reports outages in its own words, as `--wait` does).
        self.quiet = False

    @property
    def reachable(self) -> bool:
        return self.unreachable_since is None

    def failed(self, reason: str) -> None:
        now = time.time()
        with self._lock:
            if self.unreachable_since is not None:
                return
            if self._failing_since is None:
                self._failing_since, self.reason = now, reason
                return
            if now - self._failing_since < self.grace_s:
                return
            self.unreachable_since = self._failing_since
            reason = self.reason
        if not self.quiet:
            log.warning("Kafka unreachable: %s", reason)

    def succeeded(self) -> None:
        if self._failing_since is None:  # the common case: no lock
            return
        with self._lock:
            since, self.unreachable_since = self.unreachable_since, None
            self._failing_since = None
        if since is not None and not self.quiet:
            log.warning("Kafka reachable again after %.0f s", time.time() - since)


#: The process's view of Kafka (every client of this module reports to it).
health = KafkaHealth()

#: Exceptions in an aiokafka log record's arguments that mean "could not reach the broker".
_CONNECTION_ERRORS = (
    KafkaConnectionError,
    NodeNotReadyError,
    RequestTimedOutError,
    KafkaTimeoutError,
    OSError,
    TimeoutError,
)
#: aiokafka's own messages (format strings) for the same.
_CONNECTION_MESSAGES = (
    "Unable connect to",
    "Unable to update metadata from",
    "Unable to request metadata from",
)
#: The loggers aiokafka writes to (a filter applies only to records logged on its own logger).
_AIOKAFKA_LOGGERS = (
    "aiokafka",
    "aiokafka.conn",
    "aiokafka.cluster",
    "aiokafka.consumer.consumer",
    "aiokafka.consumer.fetcher",
    "aiokafka.consumer.group_coordinator",
    "aiokafka.producer.producer",
    "aiokafka.producer.sender",
    "aiokafka.admin.client",
)


class ConnectionLogFilter(logging.Filter):
    """Drops aiokafka's per-retry connection failures and turns them into :data:`health` state.

    Other records pass, except that a message (by its format string) repeated within
    ``repeat_s`` is dropped: a retry loop logs one line per ``repeat_s``, not one per retry.
    """

    def __init__(self, state: KafkaHealth, *, repeat_s: float = 60.0) -> None:
        super().__init__()
        self.state = state
        self.repeat_s = repeat_s
        self.dropped = 0
        self._last: dict[tuple[str, str], float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if _is_connection_failure(record):
            self.dropped += 1
            self.state.failed(_one_line(record))
            return False
        if record.levelno < logging.WARNING:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.repeat_s:
            self.dropped += 1
            return False
        if len(self._last) > 1000:  # bounded: messages are format strings, but be safe
            self._last.clear()
        self._last[key] = now
        return True


def _is_connection_failure(record: logging.LogRecord) -> bool:
    msg = str(record.msg)
    if msg.startswith(_CONNECTION_MESSAGES):
        return True
    args = record.args if isinstance(record.args, tuple) else ()
    return any(isinstance(a, _CONNECTION_ERRORS) for a in args)


def _one_line(record: logging.LogRecord) -> str:
    try:
        text = record.getMessage()
    except Exception:  # a record that does not format: still one line
        text = str(record.msg)
    return " ".join(text.split())[:300]


def install_log_filter() -> ConnectionLogFilter:
    """Put the (one) :class:`ConnectionLogFilter` on aiokafka's loggers; idempotent."""
    for name in _AIOKAFKA_LOGGERS:
        for existing in logging.getLogger(name).filters:
            if isinstance(existing, ConnectionLogFilter):
                return existing
    log_filter = ConnectionLogFilter(health)
    for name in _AIOKAFKA_LOGGERS:
        logging.getLogger(name).addFilter(log_filter)
    return log_filter


log_filter = install_log_filter()
