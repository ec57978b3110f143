"""The worker's trust gate reads its store again (a changed file, at most every few seconds, or
when asked), keeps the previous store when the new one is broken, and says which journaled keys
it no longer trusts; the journal remembers the key behind what it re-applies; SIGHUP is wired."""

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

from controlplane.wire.errors import CommandRejected, WireCode
from controlplane.wire.protocol import CommandKind, ReloadWeightsSpec, encode
from controlplane.wire.signing import Signer, public_key_text
from tests.fleet import make_command, wait_for
from workers.agent.journal import JOURNAL_NAME, WorkerState
from workers.agent.trust import TrustGate
from workers.cli import install_signal_handlers

CI = Signer(Ed25519PrivateKey.generate(), "ci")
NEW = Signer(Ed25519PrivateKey.generate(), "new")


def write_store(path: Path, *signers: Signer, revoked: tuple[str, ...] = ()) -> None:
    keys = {s.key_id: {"public_key": public_key_text(s.key.public_key())} for s in signers}
    path.write_text(json.dumps({"keys": keys, "revoked": list(revoked)}))


def admit(gate: TrustGate, signer: Signer) -> str | None:
    command = signer.sign(make_command(ReloadWeightsSpec(path="/m/x", version="v1")))
    return gate.admit(command, encode(command)).key_id


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_changed_file_is_read_again_at_most_every_check_interval(tmp_path: Path) -> None:
    store, clock = tmp_path / "trust.json", Clock()
    write_store(store, CI)
    gate = TrustGate.from_path(store, [tmp_path], check_every_s=2.0)
    gate._monotonic = clock  # the interval is counted from now on
    gate._checked = clock.now
    assert admit(gate, CI) == "ci"
    write_store(store, CI, revoked=("ci",))
    clock.now += 1.0
    assert gate.refresh() is False and admit(gate, CI) == "ci"  # not looked at yet
    clock.now += 1.0
    assert gate.refresh() is True
    with pytest.raises(CommandRejected) as caught:
        admit(gate, CI)
    assert caught.value.code is WireCode.KEY_REVOKED
    clock.now += 5.0
    assert gate.refresh() is False  # the same file: not read again


def test_reload_logs_what_changed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent")
    store = tmp_path / "trust.json"
    write_store(store, CI)
    gate = TrustGate.from_path(store, [tmp_path])
    before = gate.digest
    write_store(store, CI, NEW, revoked=("ci",))
    assert gate.reload() is True and gate.digest != before and admit(gate, NEW) == "new"
    (line,) = [r.getMessage() for r in caplog.records if "reloaded" in r.getMessage()]
    assert "keys +['new']" in line and "revoked +['ci']" in line
    assert "2 key(s), 1 revoked" in line and f"sha256 {gate.digest}" in line
    assert gate.reload() is False  # unchanged: said so, nothing swapped


@pytest.mark.parametrize("broken", ["{", '{"keys": {"k": {"public_key": "x"}}}', None])
def test_a_broken_store_keeps_the_previous_one_with_one_coded_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, broken: str | None
) -> None:
    caplog.set_level(logging.INFO, logger="workers.agent")
    store = tmp_path / "trust.json"
    write_store(store, CI, revoked=("old",))
    gate = TrustGate.from_path(store, [tmp_path], check_every_s=0)
    if broken is None:
        store.unlink()
    else:
        store.write_text(broken)
    assert gate.refresh() is False
    assert gate.refresh() is False  # the same broken file: not reported again
    assert gate.verifier is not None and admit(gate, CI) == "ci"
    lines = [r for r in caplog.records if "SETTINGS_INVALID" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    assert "previous store stays in force (1 key(s), 1 revoked" in lines[0].getMessage()


def test_without_a_store_nothing_is_read_or_distrusted(tmp_path: Path) -> None:
    gate = TrustGate.from_path(None, [tmp_path])
    assert gate.refresh() is False and gate.reload() is False and gate.digest is None
    assert gate.distrusts("anything", CommandKind.UPDATE_CONFIG) is None
    assert gate.distrusts(None, CommandKind.RELOAD_WEIGHTS, "/m/x") is None


def test_distrusts_says_why_a_journaled_key_is_no_longer_trusted(tmp_path: Path) -> None:
    store = tmp_path / "trust.json"
    write_store(store, CI, NEW, revoked=("new",))
    document = json.loads(store.read_text())
    document["keys"]["config"] = {
        "public_key": document["keys"]["ci"]["public_key"],
        "scope": {"kinds": ["update_config"]},
    }
    document["keys"]["narrow"] = {
        "public_key": document["keys"]["ci"]["public_key"],
        "scope": {"path_roots": [str(tmp_path / "narrow")]},
    }
    store.write_text(json.dumps(document))
    gate = TrustGate.from_path(store, [tmp_path])
    reload, config = CommandKind.RELOAD_WEIGHTS, CommandKind.UPDATE_CONFIG
    inside, outside = str(tmp_path / "narrow" / "m"), str(tmp_path / "wide" / "m")
    cases = {
        ("ci", reload, outside): None,
        ("config", config, None): None,
        ("narrow", reload, inside): None,
        ("narrow", reload, "/elsewhere/m"): None,  # not the worker's: PATH_NOT_ALLOWED's
        ("new", config, None): WireCode.KEY_REVOKED,
        ("gone", config, None): WireCode.KEY_UNKNOWN,
        (None, config, None): WireCode.SIGNATURE_MISSING,
        ("config", reload, inside): WireCode.SCOPE_DENIED,
        ("narrow", reload, outside): WireCode.SCOPE_DENIED,
    }
    for (key, kind, path), code in cases.items():
        refused = gate.distrusts(key, kind, path)
        assert (refused.code if refused else None) is code, (key, kind, path, refused)


def test_the_journal_remembers_which_key_admitted_what_it_re_applies(tmp_path: Path) -> None:
    state = WorkerState.open(tmp_path)
    state.set_weights(ReloadWeightsSpec(path="/m/x", version="v1"), "ci")
    state.add_config({"a": 1, "b": 2}, "cfg")
    state.add_config({"b": 3})
    state.sync()
    state.close()
    for compact in (False, True):
        state = WorkerState.open(tmp_path)
        try:
            assert state.weights_key == "ci"
            assert state.config_overrides == {"a": 1, "b": 3}
            assert state.config_keys == {"a": "cfg", "b": None}
            if compact:
                state.compact()
        finally:
            state.close()
    state = WorkerState.open(tmp_path)
    assert (state.weights_key, state.config_keys) == ("ci", {"a": "cfg", "b": None})
    state.close()
    lines = [json.loads(line) for line in (tmp_path / JOURNAL_NAME).read_text().splitlines()]
    unkeyed = [e for e in lines if e["t"] == "config" and "key" not in e]
    assert unkeyed == [{"t": "config", "overrides": {"b": 3}}]  # as written before keys


class StubAgent:
    def __init__(self) -> None:
        self.reloads = 0
        self.stops = 0

    def reload_trust_store(self) -> bool:
        self.reloads += 1
        return True

    def request_stop(self) -> None:
        self.stops += 1


async def test_sighup_asks_the_agent_to_read_its_trust_store_again() -> None:
    loop, agent = asyncio.get_running_loop(), StubAgent()
    stub: Any = agent
    install_signal_handlers(loop, stub)
    try:
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_for(lambda: agent.reloads > 0)  # the handler runs on the loop
    finally:
        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    assert (agent.reloads, agent.stops) == (1, 0)
