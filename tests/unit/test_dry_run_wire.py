"""``Command.dry_run`` on the wire (docs/wire.md, "Dry runs"): omitted when not set (so workers
built before it read every real command), written and signed when set, in the JSON Schema, and
refused SCHEMA_INVALID by a reader that does not know it (an older worker: never applied)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from jsonschema import Draft202012Validator

from controlplane.wire.errors import CommandRejected, ProtocolError, WireCode
from controlplane.wire.protocol import (
    Command,
    ReloadWeightsSpec,
    decode_command,
    encode,
    json_schemas,
)
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    Verifier,
    public_key_text,
    wire_object,
)
from tests.fleet import make_command


def reload(**kw: Any) -> Command:
    return make_command(ReloadWeightsSpec(path="/ckpts/v3", version="v3"), **kw)


def test_omitted_unless_set_and_read_back() -> None:
    plain = json.loads(encode(reload()))
    assert "dry_run" not in plain
    marked = encode(reload(dry_run=True))
    assert json.loads(marked)["dry_run"] is True
    assert decode_command(marked).dry_run is True
    assert decode_command(encode(reload())).dry_run is None
    Draft202012Validator(json_schemas()["command"]).validate(json.loads(marked))


def test_a_reader_without_the_field_refuses_a_dry_run() -> None:
    """What an older worker's decoder does with an unknown member: SCHEMA_INVALID, a NACK."""
    schema = json_schemas()["command"]
    older = {
        **schema,
        "properties": {k: v for k, v in schema["properties"].items() if k != "dry_run"},
    }
    assert older.get("additionalProperties") is False
    errors = list(Draft202012Validator(older).iter_errors(json.loads(encode(reload(dry_run=True)))))
    assert errors and "dry_run" in errors[0].message
    with pytest.raises(ProtocolError) as caught:
        decode_command(encode(reload(dry_run=True)).replace(b'"dry_run"', b'"dry_rum"'))
    assert caught.value.code is WireCode.SCHEMA_INVALID


def test_the_signature_covers_it() -> None:
    """A signed dry run turned into a real command (the member dropped) no longer verifies."""
    signer = Signer(Ed25519PrivateKey.generate(), "ci")
    verifier = Verifier(
        TrustStore(
            keys={
                "ci": TrustedKey(
                    public_key=public_key_text(signer.key.public_key()), scope=KeyScope()
                )
            }
        )
    )
    data = encode(signer.sign(reload(dry_run=True)))
    assert verifier.verify(decode_command(data), wire_object(data)).key_id == "ci"
    forged = json.loads(data)
    del forged["dry_run"]
    raw = json.dumps(forged).encode()
    with pytest.raises(CommandRejected) as caught:
        verifier.verify(decode_command(raw), wire_object(raw))
    assert caught.value.code is WireCode.SIGNATURE_INVALID


def test_the_docs_example_is_a_dry_run() -> None:
    text = (Path(__file__).parents[2] / "docs" / "wire.md").read_text()
    example = text.split("## Dry runs", 1)[1].split("```json", 1)[1].split("```", 1)[0]
    command = decode_command(example.encode())
    assert command.dry_run is True and isinstance(command.spec, ReloadWeightsSpec)
