"""docs/signing.md's worked example is what the code computes: its canonical bytes, its
signature, and that the signed command verifies against the public key it shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

from controlplane.wire.protocol import decode_command
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    Verifier,
    canonical_json,
    load_private_key,
    public_key_text,
)

DOC = (Path(__file__).resolve().parents[2] / "docs" / "signing.md").read_text()
EXAMPLE = DOC.split("### A worked example", 1)[1].split("## Keys and trust stores", 1)[0]


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", EXAMPLE, re.DOTALL)


def test_the_worked_example_is_what_the_code_computes() -> None:
    pem, canonical, signature = blocks("text")
    (command_text,) = blocks("json")
    key = load_private_key(pem.encode(), source="docs")
    public = re.search(r"public key \(base64 of its 32 raw bytes\): `([^`]+)`", EXAMPLE)
    assert public is not None and public[1] == public_key_text(key.public_key())
    command = json.loads(command_text)
    assert canonical_json(command).decode() == canonical.strip()
    signed = Signer(key, "ci-2026").sign_object(command)
    assert signed["signature"]["value"] == signature.strip()
    data = json.dumps(signed).encode()
    store = TrustStore(keys={"ci-2026": TrustedKey(public_key=public[1], scope=KeyScope())})
    assert Verifier(store).verify(decode_command(data), json.loads(data)).key_id == "ci-2026"
