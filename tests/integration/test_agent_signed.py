"""Signed commands against a real broker and a real agent holding a trust store: one test per
attack (unsigned, bad signature, unknown and revoked keys, kind, selector and path out of scope,
expired, issued in the future, TTL too long, replay, duplicate keys, a forged record carrying a
real command's id), each refused with its code while a signed command is applied."""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.kafka.settings import KafkaSettings
from controlplane.rollout.fleet import Fleet
from controlplane.rollout.models import RolloutPhase
from controlplane.wire.errors import ControlPlaneError, LocalCode
from controlplane.wire.protocol import (
    AckState,
    Command,
    ReloadWeightsSpec,
    Selector,
    UpdateConfigSpec,
    encode,
    utcnow,
)
from controlplane.wire.signing import Signer, public_key_text
from tests.factories import agent_settings, running_agent
from tests.fleet import acks_tail, has_terminal, make_command, publish, terminal
from tests.integration.conftest import RecordingRunner
from workers.agent.journal import WorkerState
from workers.agent.loop import Agent

pytestmark = pytest.mark.kafka

TINY = Selector(labels={"model": "tiny"})


class Keys:
    """Signers for the store's keys (ci: reloads and config under model=tiny, weights under
    ckpts/signed; config: config updates only; old: revoked) and one it does not hold."""

    def __init__(self, tmp_path: Path) -> None:
        self.ci = Signer(Ed25519PrivateKey.generate(), "ci")
        self.config = Signer(Ed25519PrivateKey.generate(), "config-only")
        self.old = Signer(Ed25519PrivateKey.generate(), "old")
        self.stranger = Signer(Ed25519PrivateKey.generate(), "stranger")
        self.signed_root = tmp_path / "ckpts" / "signed"
        self.store = tmp_path / "trust.json"
        self.store.write_text(json.dumps(self.document()))

    def document(self) -> dict[str, Any]:
        def entry(signer: Signer, scope: dict[str, Any]) -> dict[str, Any]:
            return {"public_key": public_key_text(signer.key.public_key()), "scope": scope}

        return {
            "keys": {
                "ci": entry(
                    self.ci,
                    {
                        "kinds": ["reload_weights", "update_config"],
                        "selectors": [{"labels": {"model": "tiny"}}],
                        "path_roots": [str(self.signed_root)],
                    },
                ),
                "config-only": entry(self.config, {"kinds": ["update_config"]}),
                "old": entry(self.old, {}),
            },
            "revoked": ["old"],
        }


@pytest.fixture
def keys(tmp_path: Path, weights: Path) -> Keys:
    made = Keys(tmp_path)
    made.signed_root.mkdir()
    (made.signed_root / "model.safetensors").write_bytes(b"\0" * 64)
    return made


def signed_reload(keys: Keys, version: str, signer: Signer | None = None, **kw: Any) -> Command:
    kw.setdefault("selector", TINY)
    path = kw.pop("path", str(keys.signed_root / "model.safetensors"))
    command = make_command(ReloadWeightsSpec(path=path, version=version), **kw)
    return (signer or keys.ci).sign(command)


def code_of(acks: list[Any], command: Command) -> str | None:
    (final,) = terminal(acks, command.command_id)
    assert final.state is AckState.REJECTED, final
    return None if final.error is None else str(final.error.code)


def remembered(tmp_path: Path, command_id: str) -> bool:
    state = WorkerState.open(tmp_path / "state" / "w1")
    try:
        return state.outcome(command_id) is not None
    finally:
        state.close()


async def test_each_attack_is_refused_with_its_code_and_a_signed_command_applies(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    runner = RecordingRunner()
    now = utcnow()
    tampered = signed_reload(keys, "v-tampered")
    assert tampered.signature is not None
    spec = tampered.spec.model_copy(update={"version": "v-evil"})
    attacks = {
        "SIGNATURE_MISSING": make_command(
            ReloadWeightsSpec(path=str(keys.signed_root / "model.safetensors"), version="v-u"),
            selector=TINY,
        ),
        "SIGNATURE_INVALID": tampered.model_copy(update={"spec": spec}),
        "KEY_UNKNOWN": signed_reload(keys, "v-stranger", keys.stranger),
        "KEY_REVOKED": signed_reload(keys, "v-old", keys.old),
        "SCOPE_DENIED kind": signed_reload(keys, "v-kind", keys.config),
        "SCOPE_DENIED selector": signed_reload(keys, "v-all", selector=Selector()),
        "SCOPE_DENIED worker ids": signed_reload(
            keys, "v-w1", selector=Selector(worker_ids=["w1"])
        ),
        "SCOPE_DENIED path": signed_reload(
            keys, "v-path", path=str(tmp_path / "ckpts" / "model.safetensors")
        ),
        "SCOPE_DENIED path escape": signed_reload(
            keys, "v-dots", path=str(keys.signed_root / ".." / "model.safetensors")
        ),
        "EXPIRED": signed_reload(
            keys,
            "v-expired",
            issued_at=now - timedelta(minutes=10),
            expires_at=now - timedelta(minutes=1),
        ),
        "ISSUED_IN_FUTURE": signed_reload(
            keys,
            "v-future",
            issued_at=now + timedelta(hours=1),
            expires_at=now + timedelta(hours=2),
        ),
        "TTL_TOO_LONG": signed_reload(keys, "v-ttl", ttl_s=7200),
    }
    config = keys.config.sign(make_command(UpdateConfigSpec(overrides={"max_new_tokens": 4})))
    good = signed_reload(keys, "v-signed", selector=Selector(worker_ids=["w1"], labels=TINY.labels))
    async with (
        running_agent(
            kafka,
            tmp_path,
            runner,
            trust_store=keys.store,
            max_ttl_s=3600,
            max_clock_skew_s=60,
        ),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, *attacks.values(), config, good)
        await acks.until(has_terminal(good.command_id))
    codes = {name: code_of(acks.items, command) for name, command in attacks.items()}
    assert codes == {name: name.split()[0] for name in attacks}
    (applied,) = terminal(acks.items, good.command_id)
    assert applied.state is AckState.SUCCEEDED and applied.weights_version == "v-signed"
    (configured,) = terminal(acks.items, config.command_id)
    assert configured.state is AckState.SUCCEEDED
    assert runner.applied == ["v-signed"] and runner.config["max_new_tokens"] == 4
    for name, command in attacks.items():  # signature and scope refusals are not remembered
        refused_before_checks = name.split()[0] in ("EXPIRED", "ISSUED_IN_FUTURE", "TTL_TOO_LONG")
        assert remembered(tmp_path, command.command_id) is refused_before_checks, name


async def test_a_forged_record_with_a_real_commands_id_does_not_block_it(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    """Unsigned, signed by a stranger, or the real signature over other content: each forgery
    under the real command's id is NACKed and never journaled; the real command then applies."""
    real = signed_reload(keys, "v2")
    evil = real.spec.model_copy(update={"version": "v-evil"})
    forged = [
        real.model_copy(update={"spec": evil, "signature": None}),
        keys.stranger.sign(real.model_copy(update={"spec": evil})),
        real.model_copy(update={"spec": evil}),
    ]
    runner = RecordingRunner()
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, runner, trust_store=keys.store):
            await publish(kafka, *forged)
            await acks.until(has_terminal(real.command_id, 3))
        assert not remembered(tmp_path, real.command_id)
        async with running_agent(kafka, tmp_path, runner, trust_store=keys.store):
            await publish(kafka, real)
            await acks.until(has_terminal(real.command_id, 4))
    mine = [a for a in acks.items if a.command_id == real.command_id]
    assert [a.error.code if a.error else a.state.value for a in mine] == [
        "SIGNATURE_MISSING",
        "KEY_UNKNOWN",
        "SIGNATURE_INVALID",
        "accepted",
        "running",
        "succeeded",
    ]
    assert runner.applied == ["v2"] and mine[-1].weights_version == "v2"
    # The refusals name no kind (as a NACK of an unreadable record): a reader of the log
    # shows them as anomalies, and the rollout as the real command went.
    assert [a.kind for a in mine[:3]] == [None, None, None]
    fleet = Fleet()  # the real command, as pinned to the worker that ran it
    fleet.observe_command(real.model_copy(update={"selector": Selector(worker_ids=["w1"])}))
    for ack in mine:
        fleet.observe_ack(ack)
    status = fleet.status(real.rollout_id, utcnow())
    assert status.phase is RolloutPhase.SUCCEEDED, (status.phase, status.message, status.counts)


async def test_a_replayed_signed_command_is_applied_once(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    """The same signed bytes again (an attacker replaying them, or a redelivery): the journal
    has its outcome, so it is not applied a second time."""
    first = signed_reload(keys, "v1")
    second = signed_reload(keys, "v2")
    marker = signed_reload(keys, "v3")
    runner = RecordingRunner()
    async with (
        running_agent(kafka, tmp_path, runner, trust_store=keys.store),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, first, second)
        await acks.until(has_terminal(second.command_id))
        await publish(kafka, encode(first), marker)
        await acks.until(has_terminal(marker.command_id))
    assert runner.applied == ["v1", "v2", "v3"]
    assert len(terminal(acks.items, first.command_id)) == 1
    assert runner.version == "v3"


async def test_duplicate_keys_in_a_signed_command_are_refused_first(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    """A signed command with a key written twice (readers differ on which value counts) is
    refused as DUPLICATE_KEY before its signature is looked at, and not remembered."""
    real = signed_reload(keys, "v2")
    data = encode(real)
    doubled = data.replace(b'"version":"v2"', b'"version":"v2","version":"v-evil"', 1)
    assert doubled != data
    runner = RecordingRunner()
    async with (
        running_agent(kafka, tmp_path, runner, trust_store=keys.store),
        acks_tail(kafka) as acks,
    ):
        await publish(kafka, doubled, real)
        await acks.until(has_terminal(real.command_id, 2))
    first, last = terminal(acks.items, real.command_id)
    assert first.error is not None and first.error.code == "DUPLICATE_KEY"
    assert last.state is AckState.SUCCEEDED and runner.applied == ["v2"]


async def test_the_start_up_log_says_whether_unsigned_commands_are_accepted(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent")
    async with running_agent(kafka, tmp_path, RecordingRunner()):
        pass
    async with running_agent(kafka, tmp_path, RecordingRunner(), trust_store=keys.store):
        pass
    lines = [(r.levelno, r.getMessage()) for r in caplog.records if "commands: " in r.getMessage()]
    assert len(lines) == 2, lines
    (unsigned_level, unsigned), (signed_level, signed) = lines
    assert unsigned_level == logging.WARNING and "UNSIGNED COMMANDS ACCEPTED" in unsigned
    assert signed_level == logging.INFO and "signed commands only" in signed
    assert f"{keys.store} (3 key(s), 1 revoked)" in signed


def test_an_unreadable_or_invalid_trust_store_stops_the_worker_before_kafka(
    tmp_path: Path,
) -> None:
    kafka = KafkaSettings(bootstrap_servers="127.0.0.1:1")
    bad = tmp_path / "bad.json"
    bad.write_text('{"keys": {"k": {"public_key": "not-base64!"}}}')
    runner: Any = RecordingRunner()
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(ControlPlaneError) as caught:
            Agent(agent_settings(kafka, tmp_path, trust_store=path), runner)
        assert caught.value.code is LocalCode.SETTINGS_INVALID
        assert str(path) in caught.value.message
