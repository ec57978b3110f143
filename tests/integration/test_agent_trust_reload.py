"""The worker's trust store changes without a restart, and a restart re-checks what it re-applies,
against a real broker and a real agent: a key revoked in the file is refused at the next command
(the file's change, and SIGHUP); a broken file leaves the previous store in force; a restarted
worker does not re-apply weights whose key was since revoked, and says so in its heartbeats."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.kafka.settings import KafkaSettings
from controlplane.wire.protocol import AckState, Heartbeat, UpdateConfigSpec, WorkerStatus
from controlplane.wire.signing import Signer, public_key_text
from tests.factories import running_agent
from tests.fleet import (
    acks_tail,
    has_terminal,
    heartbeats_tail,
    latest,
    make_command,
    publish,
    settled,
    terminal,
    wait_for,
)
from tests.integration import test_agent_signed as signed
from tests.integration.conftest import RecordingRunner
from tests.integration.test_agent_signed import Keys, code_of, signed_reload
from workers.cli import install_signal_handlers

pytestmark = pytest.mark.kafka


#: The same store and keys as test_agent_signed's tests (its fixture).
keys = signed.keys


def rewrite(keys: Keys, *, revoke: tuple[str, ...] = (), add: Signer | None = None) -> None:
    """The store as ``Keys`` writes it, with more keys revoked and one more key (ci's scope)."""
    document: dict[str, Any] = keys.document()
    document["revoked"] += list(revoke)
    if add is not None:
        scope = document["keys"]["ci"]["scope"]
        entry = {"public_key": public_key_text(add.key.public_key()), "scope": scope}
        document["keys"][add.key_id] = entry
    keys.store.write_text(json.dumps(document))


async def test_a_key_revoked_in_the_file_is_refused_at_the_next_command_without_a_restart(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    runner = RecordingRunner()
    before, after = signed_reload(keys, "v1"), signed_reload(keys, "v2")
    async with (
        running_agent(kafka, tmp_path, runner, trust_store=keys.store, trust_store_check_s=0),
        acks_tail(kafka) as acks,
    ):
        await settled(kafka, acks, before)
        rewrite(keys, revoke=("ci",))
        await settled(kafka, acks, after)
    (applied,) = terminal(acks.items, before.command_id)
    assert applied.state is AckState.SUCCEEDED
    assert code_of(acks.items, after) == "KEY_REVOKED"
    assert runner.applied == ["v1"]


async def test_sighup_reads_the_trust_store_again(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys
) -> None:
    """The file's change is looked at once an hour here: SIGHUP is what makes the worker read
    it, and the key added to it signs the next command."""
    runner = RecordingRunner()
    new = Signer(Ed25519PrivateKey.generate(), "ci-2027")
    command = signed_reload(keys, "v-new", new)
    loop = asyncio.get_running_loop()
    async with (
        running_agent(
            kafka, tmp_path, runner, trust_store=keys.store, trust_store_check_s=3600
        ) as agent,
        acks_tail(kafka) as acks,
    ):
        install_signal_handlers(loop, agent)
        try:
            first = agent.trust_store_digest
            rewrite(keys, add=new)
            os.kill(os.getpid(), signal.SIGHUP)
            await wait_for(lambda: agent.trust_store_digest != first)
        finally:
            for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        await settled(kafka, acks, command)
    (applied,) = terminal(acks.items, command.command_id)
    assert applied.state is AckState.SUCCEEDED and runner.applied == ["v-new"]


async def test_a_broken_trust_store_file_leaves_the_previous_one_in_force(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Never no store, never a crash: the revoked key stays refused and ci's commands apply;
    one SETTINGS_INVALID line for the broken file, however many commands come; a repaired file
    is read again."""
    caplog.set_level(logging.INFO, logger="workers.agent")
    runner = RecordingRunner()
    revoked = signed_reload(keys, "v-old", keys.old)
    unsigned = make_command(UpdateConfigSpec(overrides={"max_new_tokens": 3}))
    good = signed_reload(keys, "v1")
    new = Signer(Ed25519PrivateKey.generate(), "ci-2027")
    repaired = signed_reload(keys, "v2", new)
    async with (
        running_agent(kafka, tmp_path, runner, trust_store=keys.store, trust_store_check_s=0),
        acks_tail(kafka) as acks,
    ):
        keys.store.write_text('{"keys": {"k": {"public_key": "not-base64!"}}}')
        await publish(kafka, revoked, unsigned, good)
        await acks.until(has_terminal(good.command_id))
        rewrite(keys, add=new)
        await settled(kafka, acks, repaired)
    assert code_of(acks.items, revoked) == "KEY_REVOKED"
    assert code_of(acks.items, unsigned) == "SIGNATURE_MISSING"
    assert runner.applied == ["v1", "v2"]
    refusals = [r.getMessage() for r in caplog.records if "SETTINGS_INVALID" in r.getMessage()]
    assert len(refusals) == 1, refusals
    assert "previous store stays in force" in refusals[0] and str(keys.store) in refusals[0]
    reloaded = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert len(reloaded) == 1 and "ci-2027" in reloaded[0], reloaded


def degraded_code(code: str) -> Any:
    def check(heartbeats: list[Heartbeat]) -> bool:
        beat = latest(heartbeats, "w1")
        return beat is not None and beat.degraded is not None and beat.degraded.code == code

    return check


async def test_a_restart_does_not_re_apply_weights_whose_key_was_revoked(
    kafka: KafkaSettings, tmp_path: Path, keys: Keys, caplog: pytest.LogCaptureFixture
) -> None:
    """Weights applied under ci, config under config-only; ci is revoked while the worker is
    down. The restarted worker keeps its initial weights, re-applies the config (its key is
    still trusted), reports KEY_REVOKED in its heartbeats, and takes a command signed by a
    trusted key, after which it is no longer degraded."""
    caplog.set_level(logging.INFO, logger="workers.agent")
    first = RecordingRunner()
    weights = signed_reload(keys, "v1")
    config = keys.config.sign(make_command(UpdateConfigSpec(overrides={"max_new_tokens": 4})))
    async with acks_tail(kafka) as acks:
        async with running_agent(kafka, tmp_path, first, trust_store=keys.store):
            await publish(kafka, weights, config)
            await acks.until(has_terminal(config.command_id))
        assert first.applied == ["v1"] and first.config["max_new_tokens"] == 4
        new = Signer(Ed25519PrivateKey.generate(), "ci-2027")
        rewrite(keys, revoke=("ci",), add=new)
        second = RecordingRunner()
        replacement = signed_reload(keys, "v2", new)
        async with (
            running_agent(kafka, tmp_path, second, trust_store=keys.store),
            heartbeats_tail(kafka) as beats,
        ):
            assert second.applied == [] and second.version == "init"
            assert second.config["max_new_tokens"] == 4
            await beats.until(degraded_code("KEY_REVOKED"))
            beat = latest(beats.items, "w1")
            assert beat is not None and beat.status is WorkerStatus.DEGRADED
            assert beat.degraded is not None and "weights v1" in beat.degraded.message
            await settled(kafka, acks, replacement)
            await beats.until(
                lambda items: (
                    (b := latest(items, "w1")) is not None
                    and b.degraded is None
                    and b.weights_version == "v2"
                )
            )
    (applied,) = terminal(acks.items, replacement.command_id)
    assert applied.state is AckState.SUCCEEDED and second.applied == ["v2"]
    lines = [r.getMessage() for r in caplog.records if "not re-applied" in r.getMessage()]
    assert len(lines) == 1 and "KEY_REVOKED" in lines[0], lines
