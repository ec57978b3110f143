"""Topic administration (create, check against what this version needs) and the cluster probe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int8, Int16, Int32, Schema, String

from controlplane.kafka.client import (
    ClientLifecycle,
    client_options,
    translate,
)
from controlplane.kafka.health import health
from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.errors import BusError, LocalCode, TopicMismatch
from controlplane.wire.topics import TUNED_IN_PLACE, Topics, TopicSpec

R = TypeVar("R")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnsureReport:
    created: list[str]
    existing: list[str]
    #: What the created topics got and the existing ones were checked against.
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    #: Configs of existing topics set in place (``TUNED_IN_PLACE``): "topic: key old -> new".
    altered: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Differing:
    """One config of an existing topic that is not what this version needs."""

    topic: str
    key: str
    have: str | None
    want: str

    def __str__(self) -> str:
        return f"{self.topic}: {self.key}={self.have}, expected {self.want}"


@dataclass(frozen=True)
class ClusterInfo:
    bootstrap: str
    brokers: int
    controller_id: int | None
    cluster_id: str | None


class Admin(ClientLifecycle):
    def __init__(self, settings: KafkaSettings) -> None:
        self._admin = AIOKafkaAdminClient(**client_options(settings))
        self._finish_bootstrap_when_cancelled(self._admin._client)
        #: How long a request is tried again while a broker is unavailable.
        self._retry_s = settings.request_timeout_ms / 1000

    async def _start(self) -> None:
        with translate("connecting the admin client"):
            await self._admin.start()
        health.succeeded()

    async def _stop(self) -> None:
        await self._admin.close()

    async def _retrying(self, what: str, call: Callable[[], Awaitable[R]]) -> R:
        """``call()``, tried again for up to the request timeout while Kafka is unavailable.

        A broker that died stays in the cluster's metadata until the cluster fences it (about
        9 s), and aiokafka sends an admin request to a random broker, or to the cached
        controller, where it waits for a connection for the whole request timeout: one dead node
        of three must not fail ``topics ensure``. So each attempt has at most a few seconds, and
        each retry refreshes the metadata first. (A create that timed out after it was sent is
        answered TOPIC_ALREADY_EXISTS when tried again.)
        """
        deadline = time.monotonic() + self._retry_s
        attempt_s = min(5.0, self._retry_s)
        failed = False
        while True:
            try:
                with translate(what):
                    async with asyncio.timeout(attempt_s):
                        result = await call()
            except BusError as exc:
                if exc.code is not LocalCode.BROKER_UNAVAILABLE or time.monotonic() >= deadline:
                    raise
                failed = True
            else:
                if failed:
                    health.succeeded()
                return result
            with contextlib.suppress(KafkaError, OSError, TimeoutError):
                await self._admin._client.force_metadata_update()
            await asyncio.sleep(0.25)

    async def ensure_topics(self, topics: Topics) -> EnsureReport:
        """Create missing topics; verify existing ones. Idempotent; raises TopicMismatch.

        A replication factor of None is the cluster's ``default.replication.factor`` (read from
        a broker); the topics are created with it and existing ones are checked against it, as
        are their partitions and configs (``min.insync.replicas`` included). A factor the
        cluster cannot give (more replicas than brokers) is a :class:`BusError` with the
        broker's own words.
        """
        if topics.replication_factor is None:
            topics = topics.resolved(await self._default_replication_factor())
        rf = topics.replication_factor
        assert rf is not None  # resolved above
        min_isr = topics.effective_min_insync_replicas
        if min_isr is not None and min_isr > rf:
            raise BusError(
                f"min.insync.replicas {min_isr} exceeds the replication factor {rf}: "
                "no write to these topics could ever be acknowledged",
                code=LocalCode.SETTINGS_INVALID,
            )
        specs = topics.ensured()
        existing = set(await self._retrying("listing topics", self._admin.list_topics))
        missing = [s for s in specs if s.name not in existing]
        if missing:
            new_topics = [
                NewTopic(
                    s.name,
                    num_partitions=s.partitions,
                    replication_factor=rf,
                    topic_configs=dict(s.config),
                )
                for s in missing
            ]
            # Tried again only when it was not answered: then a topic it did create comes
            # back as TOPIC_ALREADY_EXISTS and is checked like any existing one.
            resp = await self._retrying(
                "creating topics", lambda: self._admin.create_topics(new_topics)
            )
            failures: list[str] = []
            for name, code, message in _topic_errors(resp):
                if code == 36:  # TOPIC_ALREADY_EXISTS: listed late, or a concurrent creator won
                    existing.add(name)
                elif code != 0:
                    failures.append(f"{name}: {_kafka_error_name(code)}: {message or ''}".strip())
            if failures:
                # INVALID_REPLICATION_FACTOR (38, e.g. more replicas than brokers) and
                # INVALID_CONFIG (40) are settings the cluster cannot honour.
                raise BusError(
                    f"creating topics with replication factor {rf} failed:\n  "
                    + "\n  ".join(failures),
                    code=LocalCode.SETTINGS_INVALID
                    if {c for _, c, _ in _topic_errors(resp)} & {38, 40}
                    else LocalCode.KAFKA_ERROR,
                )
        # Whatever we did not create ourselves is checked against what we need; configs that
        # only tune segments and the cleaner are set in place, the rest is reported.
        present = [s for s in specs if s.name in existing]
        missing = [s for s in missing if s.name not in existing]
        differences, configs = await self._differences(present) if present else ([], [])
        tunable = [d for d in configs if d.key in TUNED_IN_PLACE]
        differences += [str(d) for d in configs if d.key not in TUNED_IN_PLACE]
        altered, refused = await self._alter_in_place(tunable) if tunable else ([], [])
        differences += refused
        if differences:
            hints = []
            if any("=" in d for d in differences):
                hints.append(
                    "a config can be changed in place: kafka-configs.sh --bootstrap-server "
                    "HOST:PORT --alter --entity-type topics --entity-name TOPIC "
                    "--add-config KEY=VALUE"
                )
            if any("replication factor" in d for d in differences):
                hints.append(
                    "a replication factor is changed by reassigning the partitions "
                    "(kafka-reassign-partitions.sh --bootstrap-server HOST:PORT "
                    "--reassignment-json-file FILE --execute), or by recreating the topic"
                )
            done = "".join(f"\n  set in place: {a}" for a in altered)
            raise TopicMismatch(
                "existing topics differ from what this version needs:\n  "
                + "\n  ".join(differences)
                + "".join(f"\n  {h}" for h in hints)
                + done,
                differences=differences,
            )
        return EnsureReport(
            created=[s.name for s in missing],
            existing=[s.name for s in present],
            replication_factor=rf,
            min_insync_replicas=min_isr,
            altered=altered,
        )

    async def _alter_in_place(self, configs: list[_Differing]) -> tuple[list[str], list[str]]:
        """Set ``configs`` (only ``TUNED_IN_PLACE`` ones: when segments roll and the cleaner
        runs) on their existing topics with IncrementalAlterConfigs, which changes only the
        keys named (the legacy AlterConfigs would reset every other override of the topic).
        Returns what was set ("topic: key old -> new") and, as differences to report, what the
        cluster refused (no ALTER_CONFIGS permission, a policy), with its reason."""
        by_topic: dict[str, list[_Differing]] = {}
        for d in configs:
            by_topic.setdefault(d.topic, []).append(d)
        request = _IncrementalAlterConfigs(
            [
                (int(ConfigResourceType.TOPIC), topic, [(d.key, _SET, d.want) for d in diffs])
                for topic, diffs in by_topic.items()
            ]
        )
        try:
            response = await self._retrying(
                "altering topic configs", lambda: self._admin._send_request(request)
            )
        except BusError as exc:
            return [], [f"{d} (not set in place: {exc.message})" for d in configs]
        errors = {
            name: (code, message) for code, message, _, name in response.responses if code != 0
        }
        altered: list[str] = []
        refused: list[str] = []
        for topic, diffs in by_topic.items():
            if topic in errors:
                code, message = errors[topic]
                why = f"{_kafka_error_name(code)}: {message or ''}".strip().rstrip(":")
                refused += [f"{d} (not set in place: {why})" for d in diffs]
                continue
            for d in diffs:
                altered.append(f"{d.topic}: {d.key} {d.have} -> {d.want}")
                log.warning("topic %s: %s set in place, %s -> %s", d.topic, d.key, d.have, d.want)
        return altered, refused

    async def _default_replication_factor(self) -> int:
        """The cluster's ``default.replication.factor``, as one of its brokers reports it."""
        key = "default.replication.factor"
        attempt = 0

        async def ask() -> list[Any]:
            nonlocal attempt
            cluster = await self._admin.describe_cluster()
            brokers = sorted(b["node_id"] for b in cluster.get("brokers", []))
            if not brokers:
                raise BusError("the cluster reports no brokers", code=LocalCode.BROKER_UNAVAILABLE)
            # Another broker on each attempt: the one asked may be dead and not fenced yet.
            broker = brokers[attempt % len(brokers)]
            attempt += 1
            resource = ConfigResource(ConfigResourceType.BROKER, str(broker), {key: None})
            return list(await self._admin.describe_configs([resource]))

        configs = await self._retrying("reading the cluster's default replication factor", ask)
        for resp in configs:
            for resource in resp.resources:
                error_code, error_message, name, entries = (
                    resource[0],
                    resource[1],
                    resource[3],
                    resource[4],
                )
                if error_code != 0:
                    raise BusError(
                        f"reading {key} of broker {name}: "
                        f"{_kafka_error_name(error_code)}: {error_message or ''}".strip()
                        + "; a replication factor set explicitly needs no such read"
                    )
                for entry in entries or []:
                    if entry[0] == key and entry[1] is not None:
                        return int(entry[1])
        raise BusError(f"the cluster did not report {key}")

    async def _differences(self, specs: list[TopicSpec]) -> tuple[list[str], list[_Differing]]:
        """How existing topics differ: partitions and replication (text), and configs."""
        # A topic created a moment ago (by someone else) may not be described yet: no partitions,
        # no configs. Wait for it briefly rather than report a mismatch that is not there.
        for _ in range(40):
            partitions, actual_cfg = await self._describe(specs)
            if all(partitions.get(s.name) and s.name in actual_cfg for s in specs):
                break
            await asyncio.sleep(0.25)
        diffs: list[str] = []
        configs: list[_Differing] = []
        for s in specs:
            replicas = partitions.get(s.name)
            if replicas and len(replicas) != s.partitions:
                diffs.append(f"{s.name}: {len(replicas)} partitions, expected {s.partitions}")
            if replicas and s.replication_factor is not None:
                # The weakest partition is what a broker's loss can cost.
                have_rf = min(replicas)
                if have_rf != s.replication_factor or max(replicas) != s.replication_factor:
                    have = (
                        str(have_rf)
                        if have_rf == max(replicas)
                        else f"{have_rf} to {max(replicas)}"
                    )
                    diffs.append(
                        f"{s.name}: replication factor {have}, expected {s.replication_factor}"
                    )
            for key, want in s.config.items():
                got = actual_cfg.get(s.name, {}).get(key)
                if got != want:
                    configs.append(_Differing(s.name, key, got, want))
        return diffs, configs

    async def _describe(
        self, specs: list[TopicSpec]
    ) -> tuple[dict[str, list[int]], dict[str, dict[str, str]]]:
        """Per topic: the replica count of each of its partitions, and its configs."""
        names = [s.name for s in specs]
        described = await self._retrying(
            "describing topics", lambda: self._admin.describe_topics(names)
        )
        configs = await self._retrying(
            "describing topic configs",
            lambda: self._admin.describe_configs(
                [ConfigResource(ConfigResourceType.TOPIC, name) for name in names]
            ),
        )
        partitions = {d["topic"]: [len(p["replicas"]) for p in d["partitions"]] for d in described}
        actual_cfg: dict[str, dict[str, str]] = {}
        for resp in configs:
            for resource in resp.resources:
                # (error_code, error_message, resource_type, resource_name, config_entries)
                error_code, name, entries = resource[0], resource[3], resource[4]
                if error_code == 0 and entries:
                    actual_cfg[name] = {e[0]: e[1] for e in entries}
        return partitions, actual_cfg


# --------------------------------------------------------------------------- IncrementalAlterConfigs
#
# aiokafka 0.14 speaks only the legacy AlterConfigs (API 33), which replaces a resource's
# whole set of overrides. IncrementalAlterConfigs (API 44, Kafka 2.3+) v0, as the protocol
# defines it (non-flexible: v1 is the flexible one).

#: The SET operation of an IncrementalAlterConfigs entry (1 DELETE, 2 APPEND, 3 SUBTRACT).
_SET = 0


class _IncrementalAlterConfigsResponse_v0(Response):  # type: ignore[misc]
    API_KEY = 44
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "responses",
            Array(
                ("error_code", Int16),
                ("error_message", String("utf-8")),
                ("resource_type", Int8),
                ("resource_name", String("utf-8")),
            ),
        ),
    )


class _IncrementalAlterConfigsRequest_v0(RequestStruct):  # type: ignore[misc]
    API_KEY = 44
    API_VERSION = 0
    RESPONSE_TYPE = _IncrementalAlterConfigsResponse_v0
    SCHEMA = Schema(
        (
            "resources",
            Array(
                ("resource_type", Int8),
                ("resource_name", String("utf-8")),
                (
                    "configs",
                    Array(
                        ("name", String("utf-8")),
                        ("config_operation", Int8),
                        ("value", String("utf-8")),
                    ),
                ),
            ),
        ),
        ("validate_only", Boolean),
    )


class _IncrementalAlterConfigs(Request[_IncrementalAlterConfigsRequest_v0]):  # type: ignore[misc]
    API_KEY = 44

    def __init__(self, resources: list[tuple[int, str, list[tuple[str, int, str]]]]) -> None:
        self._resources = resources

    def build(
        self, request_struct_class: type[_IncrementalAlterConfigsRequest_v0]
    ) -> _IncrementalAlterConfigsRequest_v0:
        return request_struct_class(self._resources, False)


def _kafka_error_name(code: int) -> str:
    """``INVALID_REPLICATION_FACTOR (38)``: the protocol's name of an error code, and the code."""
    name = getattr(for_code(code), "message", None)
    return f"{name} ({code})" if isinstance(name, str) and name else f"error {code}"


def _topic_errors(resp: Any) -> list[tuple[str, int, str | None]]:
    out = []
    for item in resp.topic_errors:
        name, code = item[0], item[1]
        message = item[2] if len(item) > 2 else None
        out.append((name, code, message))
    return out


async def probe(bootstrap: str, *, timeout: float = 10.0) -> ClusterInfo:
    """Ask the cluster for its metadata: proof that it is up and serving."""
    settings = KafkaSettings(
        bootstrap_servers=bootstrap, request_timeout_ms=max(1000, int(timeout * 1000))
    )
    admin = Admin(settings)
    try:
        async with asyncio.timeout(timeout):
            await admin.start()
            with translate("describing the cluster"):
                info = await admin._admin.describe_cluster()
    except TimeoutError:
        raise BusError(
            f"no metadata from {bootstrap} within {timeout}s", code=LocalCode.BROKER_UNAVAILABLE
        ) from None
    finally:
        await admin.stop()
    return ClusterInfo(
        bootstrap=bootstrap,
        brokers=len(info.get("brokers", [])),
        controller_id=info.get("controller_id"),
        cluster_id=info.get("cluster_id"),
    )


def probe_sync(bootstrap: str, *, timeout: float = 10.0) -> ClusterInfo:
    return asyncio.run(probe(bootstrap, timeout=timeout))
