"""The coordinator with the workers' trust store, against a real broker, real agents and its
real API: a command it does not verify never becomes or changes a rollout (the hijack: a forgery
issued earlier than the real command would otherwise be the rollout), and the commands it
writes itself (API posts, progressive waves) are signed with its key and applied by workers that
take signed commands only. Start-up refuses a key its own store does not trust."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from pydantic import SecretStr
from typer.testing import CliRunner

from controlplane.api.app import create_app
from controlplane.api.server import ApiServer
from controlplane.cli import main as _registered  # noqa: F401  (registers the commands)
from controlplane.cli.common import app as cli
from controlplane.coordinator.publisher import RolloutRequest
from controlplane.coordinator.service import Coordinator, CoordinatorSettings
from controlplane.coordinator.snapshots import FORMAT, Manifest, SnapshotError, check
from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.models import AnomalyCode
from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode
from controlplane.wire.protocol import ReloadWeightsSpec, Selector
from controlplane.wire.signing import Signer, private_key_pem, public_key_text
from tests.factories import at, heartbeat, running_agent
from tests.fleet import make_command, publish
from tests.integration.test_coordinator_api import until
from tests.integration.test_progressive import commands_on_the_topic
from workers.runners.fake_runner import FakeRunner

pytestmark = pytest.mark.kafka

TOKEN = "integration-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
TINY = Selector(labels={"model": "tiny"})


class Keys:
    """ci (CI's key) and coordinator (the coordinator's), both trusted for reloads and config
    updates of weights under ``ckpts``; stranger, a key the store does not hold."""

    def __init__(self, tmp_path: Path) -> None:
        self.ckpts = tmp_path / "ckpts"
        self.ckpts.mkdir()
        (self.ckpts / "model.safetensors").write_bytes(b"\0" * 64)
        self.ci = Signer(Ed25519PrivateKey.generate(), "ci")
        self.coordinator = Signer(Ed25519PrivateKey.generate(), "coordinator")
        self.stranger = Signer(Ed25519PrivateKey.generate(), "stranger")
        self.store = tmp_path / "trust.json"
        self.write_store(["reload_weights", "update_config"])
        self.key = tmp_path / "coordinator.pem"
        self.key.write_bytes(private_key_pem(self.coordinator.key))

    def write_store(self, coordinator_kinds: list[str]) -> None:
        def entry(signer: Signer, kinds: list[str]) -> dict[str, Any]:
            scope = {"kinds": kinds, "path_roots": [str(self.ckpts)]}
            return {"public_key": public_key_text(signer.key.public_key()), "scope": scope}

        both = ["reload_weights", "update_config"]
        keys = {
            "ci": entry(self.ci, both),
            "coordinator": entry(self.coordinator, coordinator_kinds),
        }
        self.store.write_text(json.dumps({"keys": keys}))

    @property
    def weights(self) -> str:
        return str(self.ckpts / "model.safetensors")

    def settings(self, kafka: KafkaSettings, **kw: Any) -> CoordinatorSettings:
        return CoordinatorSettings(
            kafka=kafka,
            api_token=SecretStr(TOKEN),
            trust_store=self.store,
            signing_key=self.key,
            signing_key_id="coordinator",
            controller_session_timeout_ms=6000,
            **kw,
        )


@asynccontextmanager
async def serving(settings: CoordinatorSettings) -> AsyncIterator[httpx.AsyncClient]:
    coordinator = Coordinator(settings)
    app = create_app(coordinator, sse_tick_s=0.2)
    async with coordinator:
        await coordinator.wait_ready(60)
        async with (
            ApiServer(coordinator, "127.0.0.1", 0, app=app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30, headers=AUTH) as client,
        ):
            yield client


@asynccontextmanager
async def signed_fleet(
    kafka: KafkaSettings, tmp_path: Path, n: int
) -> AsyncIterator[tuple[Keys, httpx.AsyncClient]]:
    """``n`` agents holding the trust store (w0, w1, ...: model=tiny, at v1), alive, and the
    API of a coordinator holding it too and signing with its key."""
    keys = Keys(tmp_path)
    async with AsyncExitStack() as stack, serving(keys.settings(kafka)) as api:
        await agents(stack, kafka, tmp_path, keys, n)
        await until(api, "/api/v1/workers", lambda ws: sum(w["alive"] for w in ws) == n)
        yield keys, api


async def agents(
    stack: AsyncExitStack, kafka: KafkaSettings, tmp_path: Path, keys: Keys, n: int
) -> None:
    for i in range(n):
        await stack.enter_async_context(
            running_agent(
                kafka,
                tmp_path,
                FakeRunner({"initial_version": "v1"}),
                worker_id=f"w{i}",
                state_dir=tmp_path / f"state-w{i}",
                trust_store=keys.store,
                runner="fake",
            )
        )


async def test_forged_command_does_not_take_over_a_rollout(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with signed_fleet(kafka, tmp_path, 1) as (keys, api):
        # Issued once the worker is alive: a label selector expects the workers alive then.
        spec = ReloadWeightsSpec(path=keys.weights, version="v2")
        evil = ReloadWeightsSpec(path=keys.weights, version="v-evil")
        real = keys.ci.sign(
            make_command(spec, selector=TINY, rollout_id="r-1", command_id="c-real")
        )
        earlier: dict[str, Any] = {
            "issued_at": real.issued_at - timedelta(minutes=1),
            "expires_at": real.expires_at,
        }
        unsigned = make_command(
            evil, selector=TINY, rollout_id="r-1", command_id="c-unsigned", **earlier
        )
        unknown = keys.stranger.sign(
            make_command(evil, selector=TINY, rollout_id="r-1", command_id="c-stranger", **earlier)
        )
        only = make_command(evil, selector=TINY, rollout_id="r-2", command_id="c-only", **earlier)
        await publish(kafka, unsigned, unknown, real, only)

        def refused_by_the_worker_too(body: Any) -> bool:
            return len(body) == 3 and all(u["nacks"] == 1 for u in body)

        listed = await until(api, "/api/v1/commands/unverified", refused_by_the_worker_too)
        assert [(u["rollout_id"], u["command_id"], u["code"], u["key_id"]) for u in listed] == [
            ("r-1", "c-stranger", "KEY_UNKNOWN", "stranger"),
            ("r-1", "c-unsigned", "SIGNATURE_MISSING", None),
            ("r-2", "c-only", "SIGNATURE_MISSING", None),
        ]
        r1 = await until(api, "/api/v1/rollouts/r-1", lambda b: b.get("phase") == "succeeded")
        assert (r1["command_id"], r1["target_version"]) == ("c-real", "v2")
        assert [(a["code"], a["command_id"]) for a in r1["anomalies"]] == [
            (AnomalyCode.COMMAND_UNVERIFIED, "c-stranger"),
            (AnomalyCode.COMMAND_UNVERIFIED, "c-unsigned"),
        ]
        assert (await api.get("/api/v1/rollouts/r-2")).status_code == 404
        assert [r["rollout_id"] for r in (await api.get("/api/v1/rollouts")).json()] == ["r-1"]
        w0 = (await api.get("/api/v1/workers/w0")).json()
        assert w0["reported_version"] == "v2"


async def test_api_post_and_progressive_rollout_apply_on_workers_with_a_trust_store(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    async with signed_fleet(kafka, tmp_path, 2) as (keys, api):
        body = {
            "kind": "reload_weights",
            "path": keys.weights,
            "version": "v2",
            "selector": {"labels": {"model": "tiny"}},
            "rollout_id": "r-post",
        }
        # Outside its key's path_roots: refused before publishing (it would be no rollout).
        outside = {**body, "path": str(tmp_path / "elsewhere.safetensors"), "rollout_id": "r-out"}
        denied = await api.post("/api/v1/rollouts", json=outside)
        assert denied.status_code == 400 and denied.json()["error"]["code"] == "SCOPE_DENIED"
        created = await api.post("/api/v1/rollouts", json=body)
        assert created.status_code == 201, created.text
        assert created.json()["command"]["signature"]["key_id"] == "coordinator"
        done = await until(api, "/api/v1/rollouts/r-post", lambda b: b.get("phase") != "pending")
        await until(api, "/api/v1/rollouts/r-post", lambda b: b.get("phase") == "succeeded")

        put = await api.put("/api/v1/targets/tiny", json={"selector": {"model": "tiny"}})
        assert put.status_code == 201, put.text
        desired = {"weights": {"path": keys.weights, "version": "v3"}}
        strategy = {"canary": 1, "steps": ["100%"], "pause": 0}
        started = await api.post(
            "/api/v1/targets/tiny/rollouts",
            json={"desired": desired, "strategy": strategy, "rollout_id": "r-prog"},
        )
        assert started.status_code == 201, started.text
        await until(
            api,
            "/api/v1/progressive-rollouts/r-prog",
            lambda b: b.get("phase") in ("succeeded", "failed", "aborted"),
            timeout=120,
        )
        final = (await api.get("/api/v1/progressive-rollouts/r-prog")).json()
        assert final["phase"] == "succeeded", final
        levels = (await api.get("/api/v1/workers")).json()
        assert sorted(w["reported_version"] for w in levels) == ["v3", "v3"]
        assert (await api.get("/api/v1/commands/unverified")).json() == []
        written = await commands_on_the_topic(kafka)
        assert done["command_id"] in {c.command_id for c in written}
        assert "r-out" not in {c.rollout_id for c in written}
        waves = [c for c in written if c.rollout_id.startswith("r-prog.")]
        assert waves and all(c.signature and c.signature.key_id == "coordinator" for c in written)
        for wave in waves:  # folded once by the controller, once read back: one command
            shown = (await api.get(f"/api/v1/rollouts/{wave.rollout_id}")).json()
            assert (shown["phase"], shown["anomalies"]) == ("succeeded", []), shown


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"coordinator_kinds": ["reload_weights"]}, "may not sign update_config"),
        ({"signing_key_id": "ci"}, "is not the key 'ci'"),
        ({"signing_key_id": "nobody"}, "is not in its own trust store"),
        ({"trust_store": None}, "signing_key without trust_store"),
        ({"signing_key": None}, "signing_key_id without signing_key"),
    ],
)
def test_a_signing_key_its_own_store_does_not_trust_stops_the_coordinator_with_a_code(
    tmp_path: Path, change: dict[str, Any], says: str
) -> None:
    keys = Keys(tmp_path)
    kinds = change.pop("coordinator_kinds", None)
    if kinds is not None:
        keys.write_store(kinds)
    settings = keys.settings(KafkaSettings(bootstrap_servers="127.0.0.1:9")).model_copy(
        update=change
    )
    with pytest.raises(ControlPlaneError) as exc:
        Coordinator(settings)
    assert exc.value.code is LocalCode.SETTINGS_INVALID and says in exc.value.message
    env = {
        "FLEET_COORDINATOR_TRUST_STORE": str(keys.store),
        "FLEET_COORDINATOR_SIGNING_KEY": str(keys.key),
        "FLEET_COORDINATOR_SIGNING_KEY_ID": "nobody",
    }
    result = CliRunner().invoke(cli, ["coordinator", "--bootstrap", "127.0.0.1:9"], env=env)
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "SETTINGS_INVALID" in result.output


async def test_a_snapshot_folded_under_another_trust_store_is_not_restored(
    tmp_path: Path,
) -> None:
    """The commands a snapshot holds were verified by one store: the manifest's fold settings
    carry its sha256, so a coordinator holding another (or none) replays the log instead."""
    keys = Keys(tmp_path)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    signed = Coordinator(keys.settings(kafka))
    plain = Coordinator(CoordinatorSettings(kafka=kafka))
    keys.store.write_text(json.dumps(json.loads(keys.store.read_text()), indent=4))
    same = Coordinator(keys.settings(kafka))  # the same store, written otherwise
    keys.write_store(["update_config", "reload_weights"])  # another scope: another store
    other = Coordinator(keys.settings(kafka))
    digest = signed.trust.digest
    assert digest is not None and signed.snapshots.fold["trust_store"] == digest
    assert "trust_store" not in plain.snapshots.fold
    assert other.snapshots.fold["trust_store"] != digest
    for coordinator in (signed, plain, same, other):
        await coordinator.stop()  # never started: closes its clients
    assert same.snapshots.fold == signed.snapshots.fold
    manifest = Manifest(
        format=FORMAT,
        writer="a",
        snapshot_id="s",
        written_at=0.0,
        offsets=[],
        chunks=[],
        size=0,
        fold=dict(signed.snapshots.fold),
    )
    for reader in (plain, other):
        with pytest.raises(SnapshotError) as exc:
            check(manifest, {}, fold=reader.snapshots.fold, partitions=set(), starts={}, ends={})
        assert exc.value.code is LocalCode.SNAPSHOT_MISMATCH


async def test_a_progressive_rollout_its_key_may_not_sign_ends_aborted_and_publishes_nothing(
    kafka: KafkaSettings, tmp_path: Path
) -> None:
    """Weights outside its key's path_roots: the controller's wave command would be refused
    by its own store and every worker, and published again at every decision (601 times in
    ten minutes); it ends the rollout aborted with SCOPE_DENIED instead, publishing nothing."""
    async with signed_fleet(kafka, tmp_path, 1) as (_keys, api):
        put = await api.put("/api/v1/targets/tiny", json={"selector": {"model": "tiny"}})
        assert put.status_code == 201, put.text
        outside = tmp_path / "elsewhere.safetensors"
        outside.write_bytes(b"\0" * 64)
        started = await api.post(
            "/api/v1/targets/tiny/rollouts",
            json={
                "desired": {"weights": {"path": str(outside), "version": "v3"}},
                "strategy": {"canary": 1, "steps": ["100%"], "pause": 0},
                "rollout_id": "r-outside",
            },
        )
        assert started.status_code == 201, started.text
        final = await until(
            api,
            "/api/v1/progressive-rollouts/r-outside",
            lambda b: b.get("phase") in ("succeeded", "failed", "aborted", "rolled_back"),
            timeout=60,
        )
        assert (final["phase"], final["code"]) == ("aborted", "SCOPE_DENIED"), final
        assert "may not name weights" in final["message"]
        written = await commands_on_the_topic(kafka)
        assert not [c for c in written if c.rollout_id.startswith("r-outside")]
        assert (await api.get("/api/v1/commands/unverified")).json() == []


async def test_a_store_without_a_signing_key_refuses_api_posts_before_publishing(
    tmp_path: Path,
) -> None:
    """With a trust store and no key, a post's command is unsigned: its own store (and every
    worker) refuses it. Refused before publishing (400 SIGNATURE_MISSING), not a 201 for a
    rollout that never shows. No broker: the refusal comes before the producer is used."""
    keys = Keys(tmp_path)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    settings = keys.settings(kafka).model_copy(update={"signing_key": None, "signing_key_id": None})
    coordinator = Coordinator(settings, clock=lambda: at(10))
    coordinator.fleet.observe_heartbeat(heartbeat("w0", 9))  # alive: the post is otherwise fine
    try:
        request = RolloutRequest(
            ReloadWeightsSpec(path=keys.weights, version="v2"),
            Selector(worker_ids=["w0"]),
            rollout_id="r-unsigned",
        )
        with pytest.raises(CommandRejected) as exc:
            await coordinator.publish_rollout(request)
        assert exc.value.code == "SIGNATURE_MISSING"
        assert "no signing key" in exc.value.message
    finally:
        await coordinator.stop()


async def test_a_snapshot_folded_under_another_max_ttl_is_not_restored(tmp_path: Path) -> None:
    """max_ttl_s decides which commands verify: it is part of the fold's settings (with a
    store; without one nothing is verified)."""
    keys = Keys(tmp_path)
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:9")
    coordinators = [
        Coordinator(keys.settings(kafka)),
        Coordinator(keys.settings(kafka, max_ttl_s=86400.0)),
        Coordinator(CoordinatorSettings(kafka=kafka, max_ttl_s=86400.0)),
    ]
    for coordinator in coordinators:
        await coordinator.stop()  # never started: closes its clients
    week, day, plain = (c.snapshots.fold for c in coordinators)
    assert week["max_ttl_s"] == 7 * 86400.0 and day["max_ttl_s"] == 86400.0
    assert "max_ttl_s" not in plain
    manifest = Manifest(
        format=FORMAT,
        writer="a",
        snapshot_id="s",
        written_at=0.0,
        offsets=[],
        chunks=[],
        size=0,
        fold=dict(week),
    )
    with pytest.raises(SnapshotError) as exc:
        check(manifest, {}, fold=day, partitions=set(), starts={}, ends={})
    assert exc.value.code is LocalCode.SNAPSHOT_MISMATCH
