"""Signed commands without Kafka: the RFC 8785 canonical form, signing and verifying (any
serialization of the signed object verifies, any change of content does not), trust stores,
scopes and the order in which refusals are decided."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import rfc8785
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from controlplane.wire.errors import CommandRejected, ControlPlaneError, LocalCode, WireCode
from controlplane.wire.protocol import (
    Command,
    CommandKind,
    Selector,
    Signature,
    UpdateConfigSpec,
    decode_command,
    encode,
)
from controlplane.wire.signing import (
    KeyScope,
    Signer,
    TrustedKey,
    TrustStore,
    Verifier,
    canonical_json,
    command_object,
    fingerprint,
    load_private_key,
    narrower,
    parse_trust_store,
    private_key_pem,
    public_key_text,
    wire_object,
)
from tests.fleet import make_command
from tests.unit.strategies import commands, fuzz
from workers.agent.trust import scoped_roots

SIGNER = Signer(Ed25519PrivateKey.generate(), "ci")
OTHER = Signer(Ed25519PrivateKey.generate(), "ci")


def store(
    *signers: Signer, scope: KeyScope | None = None, revoked: tuple[str, ...] = ()
) -> Verifier:
    keys = {
        s.key_id: TrustedKey(
            public_key=public_key_text(s.key.public_key()), scope=scope or KeyScope()
        )
        for s in signers
    }
    return Verifier(TrustStore(keys=keys, revoked=list(revoked)))


def verify(verifier: Verifier, data: bytes) -> str:
    return verifier.verify(decode_command(data), wire_object(data)).key_id


def refusal(verifier: Verifier, data: bytes) -> WireCode:
    with pytest.raises(CommandRejected) as caught:
        verify(verifier, data)
    assert isinstance(caught.value.code, WireCode)
    return caught.value.code


def config(**kw: Any) -> Command:
    return make_command(UpdateConfigSpec(overrides={"max_new_tokens": 4}), **kw)


def test_the_canonical_form_is_rfc_8785s() -> None:
    """The example of RFC 8785 section 3.2.2 (numbers, escapes, member order), and without
    the signature member."""
    text = (
        '{"numbers":[333333333.33333329,1E30,4.50,2e-3,0.000000000000000000000000001],'
        '"string":"\\u20ac$\\u000F\\u000aA\'\\u0042\\u0022\\u005c\\\\\\"\\/",'
        '"literals":[null,true,false],"signature":{"alg":"ed25519"}}'
    )
    expected = (
        '{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],'
        '"string":"€$\\u000f\\nA\'B\\"\\\\\\\\\\"/"}'
    )
    assert canonical_json(json.loads(text)) == expected.encode()


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**60), max_value=2**60)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)


@fuzz(400)
@given(st.dictionaries(st.text().filter(lambda k: k != "signature"), JSON_VALUES, max_size=6))
def test_the_fast_canonical_form_is_the_libraries_byte_for_byte(value: dict[str, Any]) -> None:
    """canonical_json writes plain objects with the json module: the same bytes as rfc8785
    (astral keys, control characters, escapes, integer bounds), or the same refusal. (A top-level
    ``signature`` is left out of what is signed by design: tested on its own.)"""
    try:
        expected = rfc8785.dumps(value)
    except rfc8785.CanonicalizationError:
        with pytest.raises(CommandRejected):
            canonical_json(value)
    else:
        assert canonical_json(value) == expected


def test_the_signature_member_is_left_out_of_the_canonical_form() -> None:
    signed = {"a": 1, "signature": {"key_id": "k", "value": "x"}}
    assert canonical_json(signed) == rfc8785.dumps({"a": 1})


@pytest.mark.parametrize(
    "value",
    [
        {"\U0001f600": 1, "\ue000": 2, "a": 3},  # UTF-16 order differs from code points here
        {"s": '\x00\x1f\x7f\u2028"\\/\b\f\n\r\t\U0001f600'},
        {"n": [2**53 - 1, -(2**53 - 1), 0, -0.0, 1e21, 1e-7, 5e-324]},
    ],
)
def test_the_fast_canonical_form_agrees_on_the_edges(value: dict[str, Any]) -> None:
    assert canonical_json(value) == rfc8785.dumps(value)


def test_a_value_without_a_canonical_form_cannot_be_signed() -> None:
    command = make_command(UpdateConfigSpec(overrides={"big": 2**53}))
    with pytest.raises(CommandRejected) as caught:
        SIGNER.sign(command)
    assert caught.value.code is WireCode.SIGNATURE_INVALID


@fuzz(60)
@given(commands(), st.randoms(use_true_random=False))
def test_any_serialization_of_a_signed_command_verifies(
    command: Command, rnd: random.Random
) -> None:
    """What a producer writes (member order, whitespace, escapes) does not matter; what it
    says does: the signature covers the JSON values, without the signature member. (A command
    holding an integer past 2**53 has no canonical form: it cannot be signed.)"""
    try:
        rfc8785.dumps(command_object(command))
    except rfc8785.CanonicalizationError:
        with pytest.raises(CommandRejected) as caught:
            SIGNER.sign(command)
        assert caught.value.code is WireCode.SIGNATURE_INVALID
        return
    signed = SIGNER.sign(command)
    verifier = store(SIGNER)
    assert verify(verifier, encode(signed)) == "ci"
    members = list(json.loads(encode(signed)).items())
    rnd.shuffle(members)
    rewritten = json.dumps(
        dict(members), indent=rnd.choice([None, 2]), ensure_ascii=rnd.random() < 0.5
    )
    assert verify(verifier, rewritten.encode()) == "ci"
    changed = signed.model_copy(update={"issuer": signed.issuer + "x"})
    assert refusal(verifier, encode(changed)) is WireCode.SIGNATURE_INVALID
    assert refusal(store(OTHER), encode(signed)) is WireCode.SIGNATURE_INVALID


def test_sign_object_keeps_the_producers_members_and_replaces_a_signature() -> None:
    raw = {"issuer": "kcat", **command_object(config()), "signature": {"x": 1}}
    signed = SIGNER.sign_object(raw)
    assert list(signed)[-1] == "signature" and list(signed)[:-1] == [
        k for k in raw if k != "signature"
    ]
    assert verify(store(SIGNER), json.dumps(signed).encode()) == "ci"


def test_refusals_in_order_missing_revoked_unknown_invalid_scope() -> None:
    command = config(selector=Selector(labels={"model": "tiny"}))
    signed = encode(SIGNER.sign(command))
    assert refusal(store(SIGNER), encode(command)) is WireCode.SIGNATURE_MISSING
    assert refusal(store(SIGNER, revoked=("ci",)), signed) is WireCode.KEY_REVOKED
    assert refusal(store(Signer(OTHER.key, "other")), signed) is WireCode.KEY_UNKNOWN
    garbled = SIGNER.sign(command).model_copy(
        update={"signature": Signature(key_id="ci", value="not base64!")}
    )
    assert refusal(store(SIGNER), encode(garbled)) is WireCode.SIGNATURE_INVALID
    only_reloads = KeyScope(kinds=[CommandKind.RELOAD_WEIGHTS])
    assert refusal(store(SIGNER, scope=only_reloads), signed) is WireCode.SCOPE_DENIED
    llama = KeyScope(selectors=[Selector(labels={"model": "llama"})])
    assert refusal(store(SIGNER, scope=llama), signed) is WireCode.SCOPE_DENIED
    tiny = KeyScope(
        kinds=[CommandKind.UPDATE_CONFIG], selectors=[Selector(labels={"model": "tiny"})]
    )
    assert verify(store(SIGNER, scope=tiny), signed) == "ci"


@pytest.mark.parametrize(
    ("selector", "allowed", "ok"),
    [
        (Selector(), Selector(), True),
        (Selector(labels={"a": "1", "b": "2"}), Selector(labels={"a": "1"}), True),
        (Selector(labels={"a": "2"}), Selector(labels={"a": "1"}), False),
        (Selector(), Selector(labels={"a": "1"}), False),
        (Selector(worker_ids=["w1"]), Selector(worker_ids=["w1", "w2"]), True),
        (Selector(worker_ids=["w1", "w3"]), Selector(worker_ids=["w1", "w2"]), False),
        (Selector(labels={"a": "1"}), Selector(worker_ids=["w1"]), False),
    ],
)
def test_a_command_selector_must_be_narrower_than_an_allowed_one(
    selector: Selector, allowed: Selector, ok: bool
) -> None:
    assert narrower(selector, allowed) is ok


def test_trust_stores_and_keys_that_do_not_parse_are_settings_invalid() -> None:
    for text in (b"[]", b'{"keys": {"k": {"public_key": "AAAA"}}}', b'{"keyz": {}}'):
        with pytest.raises(ControlPlaneError) as caught:
            parse_trust_store(text, source="t.json")
        assert caught.value.code is LocalCode.SETTINGS_INVALID and "t.json" in caught.value.message
    with pytest.raises(ControlPlaneError) as caught:
        load_private_key(
            b"-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n", source="k"
        )
    assert caught.value.code is LocalCode.SETTINGS_INVALID


def test_a_private_key_round_trips_through_its_pem_and_has_a_stable_default_id() -> None:
    again = load_private_key(private_key_pem(SIGNER.key), source="k")
    assert public_key_text(again.public_key()) == public_key_text(SIGNER.key.public_key())
    assert fingerprint(again.public_key()) == fingerprint(SIGNER.key.public_key())
    assert fingerprint(again.public_key()).startswith("ed25519-")


def test_reload_roots_are_where_the_key_and_the_worker_both_allow(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    assert scoped_roots([a / "x"], [a]) == (a / "x",)
    assert scoped_roots([a], [a / "x", b]) == (a / "x",)
    assert scoped_roots([b / "y"], [a]) == ()
